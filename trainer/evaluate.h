// Offline evaluation of a draft (`eaglekit evaluate`, and the training loop's eval steps):
// the TTT unroll without gradients over a whole split, with the metrics pooled over every
// masked position (sums of cross-entropy, matches and mask over the split, divided at the
// end), so that they do not depend on the batch size or the number of ranks. Also the run
// setup that training shares: device and dtype parsing, Batch -> TttBatch, the sequence
// context of a mesh.
//
// Thread safety: one evaluation per TttUnroll at a time. Errors: UsageError for bad options
// or a draft that does not fit the base/data; what loading throws; c10::Error from LibTorch.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "lib/loader.h"
#include "trainer/ttt.h"

namespace eaglekit::dist {
class Mesh;
}  // namespace eaglekit::dist

namespace eaglekit::trainer {

// "cpu", "cuda", "cuda:N". Throws UsageError for anything else, and when CUDA is asked for
// but this LibTorch has no usable CUDA device.
c10::Device parse_device(const std::string& name);
// "float32"/"fp32" -> nullopt (no autocast); "bfloat16"/"bf16" -> kBFloat16 (autocast).
// Throws UsageError otherwise.
std::optional<c10::ScalarType> parse_autocast_dtype(const std::string& name);

// The loader's batch as the unroll takes it (tensors shared, not copied).
TttBatch to_ttt_batch(const Batch& batch);

// The sum over the batch, per TTT step s < steps, of the loss weights the unroll uses
// (the loss mask of the next token, from position s on; inside a document when packed):
// equal to TttResult::mask_sum, computed without running the model and without
// communication (a context-parallel chunk's share from its global positions), so that a
// step's loss normalizer is known before its first forward. float64 [steps] on the CPU.
at::Tensor loss_mask_sums(const Batch& batch, std::int64_t steps);

// The sequence layout of a mesh: nullptr when the mesh is single-rank (the unroll's own
// SingleRankContext), else a RingContext over the mesh's cp group whose normalizer group is
// the cp group as well (callers pass the global normalizer to ttt_loss themselves).
std::unique_ptr<SequenceContext> make_sequence_context(const dist::Mesh& mesh);
// Hands the coming batch's global row length to a context that needs it (RingContext).
void prepare_context(SequenceContext* context, const Batch& batch);

// Pooled statistics over the loader's next epoch (until next() says the epoch ended), or
// the first max_batches batches (< 0: all). No gradients; the unroll's draft is switched to
// eval mode and back. With a multi-rank mesh the result is summed over every rank (each
// rank must call this with its own loader of the same split). `on_batch` (optional) is
// called after each batch with the stats so far (progress).
TttStats evaluate_loader(TttUnroll& unroll, Loader& loader, const dist::Mesh* mesh = nullptr,
                         std::int64_t max_batches = -1,
                         const std::function<void(const TttStats&)>& on_batch = {});

struct EvaluateOptions {
  std::string base;   // Hugging Face base model folder
  std::string draft;  // exported draft or checkpoint folder
  std::string data, index, quarantine;
  std::string split = "eval";  // eval | train | all
  double eval_fraction = 0.05;
  std::int64_t ttt_steps = 3;
  double loss_decay = 0.9;
  std::int64_t max_length = 2048;
  std::int64_t batch_size = 8;
  std::string mode = "pad";
  std::int64_t max_batches = -1;
  std::string device = "cpu";
  std::string dtype = "float32";
  int jobs = 0;
  int threads = 0;
  int cp_size = 1;
  bool progress = true;  // a progress line when stderr is a terminal
};

struct EvaluateReport {
  TttStats stats;
  double loss_decay = 0.9;
  std::int64_t samples = 0;
  double seconds = 0;
  std::string summary;  // what matched
  std::string to_json() const;  // {"loss", "loss_per_step", "acc", "cond_acc", "est_ar", ...}
  std::string to_text() const;
};

// `eaglekit evaluate`. `mesh` null: a single process.
EvaluateReport run_evaluate(const EvaluateOptions& options, const dist::Mesh* mesh = nullptr);

// The metrics of pooled stats as a JSON object's members: "loss", "loss_per_step",
// "acc", "cond_acc", "est_ar", "est_ar_cond", "tokens" (shared by metrics.jsonl and
// evaluate --json). Returned as the text of a JSON object.
std::string stats_json(const TttStats& stats, double loss_decay);

}  // namespace eaglekit::trainer
