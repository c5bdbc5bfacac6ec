// The training loop of `eaglekit train` (docs/draft.md, docs/ttt.md): data -> TTT unroll ->
// AdamW with warmup and a cosine/linear/constant schedule, gradient clipping and gradient
// accumulation; metrics to OUT/metrics.jsonl, periodic evaluation, atomic checkpoints
// OUT/checkpoint-STEP/ with exact resume, and the final export OUT/final/.
//
// Gradient accumulation is exact: the micro-batches of one optimizer step are fetched
// first, their mask sums (per TTT step, over every micro-batch and every rank) form the
// loss normalizer, and each micro-batch's loss is ttt_loss(ce_sum, normalizer); the summed
// gradients are those of one big batch. Data and context parallelism plug in through a
// dist::Mesh: the loader deals samples to dp ranks and chunks rows over cp ranks, the
// unroll runs on a RingContext, gradients are summed over the world (GradientSync), and
// metrics are summed over the world before logging. Rank 0 alone writes logs,
// checkpoints and exports.
//
// Thread safety: run_training drives one loop on the calling thread (plus the loader's
// threads); it installs SIGINT/SIGTERM handlers for its duration and restores the old ones.
// Errors: UsageError for options that cannot work (also when detected against the data,
// e.g. a draft whose aux width is not the data's), TrainingError for a non-finite loss or
// gradient, and whatever loading data, base and draft throws.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "formats/error.h"
#include "trainer/ttt.h"

namespace eaglekit {
struct DataSelection;
struct SampleRef;
struct Dataset;
namespace dist {
class Mesh;
}  // namespace dist
}  // namespace eaglekit

namespace eaglekit::trainer {

class DraftModel;

// The run cannot go on: a non-finite loss or gradient norm.
class TrainingError : public Error {
 public:
  using Error::Error;
};

// --- learning-rate schedule ------------------------------------------------------------

enum class Schedule { kCosine, kLinear, kConstant };
std::string_view schedule_name(Schedule s);  // "cosine", "linear", "constant"
std::optional<Schedule> parse_schedule(std::string_view name);

// The learning rate of update number `step` (0-based): linear warmup from lr/warmup to lr
// over the first `warmup_steps` updates, then cosine or linear decay to 0 at
// `total_steps` (constant: lr). As Hugging Face's get_{cosine,linear,constant}_schedule_
// with_warmup, except that warmup starts at lr/warmup rather than 0 (an update at lr 0 is
// wasted).
double learning_rate(double lr, Schedule schedule, std::int64_t warmup_steps, std::int64_t total_steps,
                     std::int64_t step);

// --- optimizer -------------------------------------------------------------------------

// AdamW exactly as torch.optim.AdamW (decoupled weight decay p -= lr * wd * p, bias
// corrected moments, eps outside the square root). Weight decay applies to matrices only;
// 1-D parameters (the RMSNorm weights) are not decayed, as Hugging Face's Trainer does.
// Moments are float32 on the parameters' device.
class AdamW {
 public:
  struct Options {
    double beta1 = 0.9;
    double beta2 = 0.999;
    double eps = 1e-8;
    double weight_decay = 0.0;
  };
  // params: name -> leaf tensor (shares storage with the model).
  AdamW(std::vector<std::pair<std::string, at::Tensor>> params, Options options);

  // One update with the gradients in p.grad(); parameters without a gradient are skipped.
  void step(double lr);
  void zero_grad();
  std::int64_t steps() const { return steps_; }
  const Options& options() const { return options_; }

  // "exp_avg.NAME" and "exp_avg_sq.NAME" for every parameter (CPU float32 copies).
  std::vector<std::pair<std::string, at::Tensor>> state() const;
  // Restores moments saved by state() after `steps` updates. Throws FormatError (path
  // `where`) when a tensor is missing or has the wrong shape.
  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& tensors, std::int64_t steps,
                  const std::string& where);

 private:
  std::vector<std::pair<std::string, at::Tensor>> params_;
  std::vector<at::Tensor> exp_avg_, exp_avg_sq_;
  std::vector<bool> decay_;
  Options options_;
  std::int64_t steps_ = 0;
};

// Global L2 norm of the gradients (missing ones count as 0); when max_norm > 0 and the
// norm exceeds it, scales them by max_norm / (norm + 1e-6) as torch.nn.utils.clip_grad_norm_.
// Returns the norm before clipping (NaN/Inf pass through unclipped).
double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm);

// --- options ---------------------------------------------------------------------------

struct TrainOptions {
  // data
  std::string data;        // conversations (docs/data.md)
  std::string index;       // dataset index (eaglekit index)
  std::string quarantine;  // ids to leave out; "" none
  double eval_fraction = 0.05;
  std::string mode = "pad";  // collation: pad (the reference), longest, pack
  bool shuffle = true;       // seeded per-epoch permutation (false: reference order)
  // model
  std::string base;        // Hugging Face base model folder
  std::string init_draft;  // start from an exported draft folder ("" fresh)
  std::int64_t draft_vocab_size = 0;  // 0: the base vocabulary
  std::string d2t;                    // d2t.pt (eaglekit vocab); "" count over the train split
  std::vector<std::int64_t> aux_layer_ids;  // as dumped (HF hidden_states indices)
  bool modelopt_norm = false;
  bool allow_unservable = false;  // train (and write final/ for) a draft no engine computes
  // TTT
  std::int64_t ttt_steps = 3;
  double loss_decay = 0.9;
  std::int64_t max_length = 2048;
  // optimization
  std::int64_t batch_size = 8;  // rows per micro-batch per data-parallel rank
  std::int64_t grad_accum = 1;
  double lr = 1e-4;
  std::int64_t warmup_steps = 0;
  std::string schedule = "cosine";
  double weight_decay = 0.0;
  double grad_clip = 1.0;  // <= 0: off
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.999;
  double adam_eps = 1e-8;
  std::int64_t epochs = 0;     // 0: 1, unless max_steps is set (then unbounded)
  std::int64_t max_steps = 0;  // optimizer steps; 0: no limit
  std::uint64_t seed = 0;      // draft init and shuffling
  // runtime
  std::string dtype = "float32";  // float32, or bfloat16 (autocast; weights stay float32)
  std::string device = "cpu";     // cpu, cuda, cuda:N
  std::string out;
  std::int64_t eval_every = 0;   // > 0: every N steps and at the end; 0: at the end; < 0: never
  std::int64_t save_every = 0;   // > 0: every N steps; a checkpoint is always saved at the end
  std::int64_t log_every = 10;
  bool resume = false;
  std::string resume_from;       // checkpoint folder or output folder; "" = out
  std::string export_dtype;      // OUT/final dtype: "" the base's torch_dtype
  std::string tensorboard;       // TensorBoard event files: "" OUT/tensorboard
  bool no_tensorboard = false;   // write none
  int jobs = 0;                  // loader threads; 0: all cores
  int threads = 0;               // LibTorch intra-op threads; 0: its default
  int prefetch = 4;
  int cp_size = 1;               // context-parallel size (world / cp = data-parallel size)
  bool progress = true;          // a progress line with ETA when stderr is a terminal

  // Canonical JSON (every field, keys as above). apply_json reads a subset: keys may use
  // '_' or '-' ("max_length", "max-length"); an unknown key or a mistyped value throws
  // UsageError naming the key and `where`.
  std::string to_json() const;
  void apply_json(const std::string& json_text, const std::string& where);
  // Throws UsageError naming the first option that cannot work.
  void check() const;
};

// --- running ---------------------------------------------------------------------------

// Test and embedding hooks; all optional.
struct TrainHooks {
  // After every optimizer step (on every rank): return false to stop as SIGTERM does (a
  // checkpoint at this step, then a clean return with interrupted = true).
  std::function<bool(std::int64_t step, DraftModel& draft)> after_step;
  // Every metrics line (rank 0), as written to metrics.jsonl.
  std::function<void(const std::string& json_line)> on_metrics;
};

struct TrainResult {
  std::int64_t steps = 0;          // optimizer steps done, counting those before a resume
  std::int64_t start_step = 0;     // where this run began (the resumed checkpoint's step)
  std::uint64_t epoch = 0;         // the sampler's epoch at the end
  bool interrupted = false;        // stopped by SIGINT/SIGTERM or a hook
  std::string resumed_from;        // checkpoint folder, "" when fresh
  std::string last_checkpoint;     // the newest checkpoint written ("" none)
  std::string final_dir;           // OUT/final, "" when interrupted
  TttStats train_stats;            // pooled over this run's steps
  std::optional<TttStats> eval_stats;  // the last evaluation
  double seconds = 0;              // wall time of the loop
  double tokens_per_s = 0;         // real tokens of all ranks per second of the loop
  double data_wait_share = 0;      // share of the loop's time spent waiting for batches (rank 0)
  std::string summary;             // what matched, for the user
};

// Runs the whole job. `mesh` null: a single process (dist::Mesh::single()). Every rank of a
// mesh calls it with the same options.
TrainResult run_training(const TrainOptions& options, const dist::Mesh* mesh = nullptr,
                         const TrainHooks& hooks = {});

// --- vocabulary ------------------------------------------------------------------------

// Token frequencies over the input_ids of `samples` (full records, not truncated), read on
// `jobs` threads (0: all cores), one file open per file; hidden states are never copied
// (views into mapped files for .pt/safetensors). Throws FormatError for an id outside
// [0, vocab_size) naming the record.
std::vector<std::int64_t> count_tokens(const Dataset& dataset, const std::vector<SampleRef>& samples,
                                       std::int64_t vocab_size, int jobs = 0);

struct VocabOptions {
  std::string data, index, quarantine;
  std::string split = "train";  // train | eval | all
  double eval_fraction = 0.05;
  std::string base;                 // config.json gives the vocabulary size...
  std::int64_t vocab_size = 0;      // ... unless given here
  std::int64_t draft_vocab_size = 0;
  std::string out;                  // d2t.pt
  int jobs = 0;
};
struct VocabReport {
  std::int64_t vocab_size = 0;
  std::int64_t draft_vocab_size = 0;
  std::int64_t samples = 0;
  std::int64_t tokens = 0;
  std::int64_t distinct = 0;  // tokens seen at least once
  double coverage = 0;        // share of token occurrences inside the draft vocabulary
  double seconds = 0;
  std::string summary;
  std::string to_json() const;
};
// `eaglekit vocab`: counts, d2t_from_counts, save_d2t to options.out.
VocabReport build_vocab(const VocabOptions& options);

}  // namespace eaglekit::trainer
