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
#include "lib/data_options.h"
#include "trainer/parallel/distributed.h"
#include "trainer/run/options.h"
#include "trainer/unroll/ttt.h"

namespace eaglekit {
struct SampleRef;
struct Dataset;
}  // namespace eaglekit

namespace eaglekit::trainer {

class DraftModel;

// The run cannot go on: a non-finite loss or gradient norm.
class TrainingError : public Error {
 public:
  using Error::Error;
};

// --- running ---------------------------------------------------------------------------

// Test and embedding hooks; all optional.
struct TrainHooks {
  // After every optimizer step (on every rank): return false to stop as SIGTERM does (a
  // checkpoint at this step, then a clean return with interrupted = true).
  std::function<bool(std::int64_t step, DraftModel& draft)> after_step;
  // Every metrics line (rank 0), as written to metrics.jsonl.
  std::function<void(const std::string& json_line)> on_metrics;
  // A fault to inject, for the tests' must-fails only: the factor each step's loss
  // normalizer is multiplied by (a gradient-scale bug AdamW's update and clipping hide from
  // the weights; test_train shows grad_norm catches it). Unset: the normalizer as computed.
  std::function<double(std::int64_t step)> normalizer_scale;
};

// The exit code of a `train` stopped by SIGINT or SIGTERM after saving its checkpoint
// (--resume continues), so that `train ... && export ...` does not export a half-trained
// draft; 0 ok, 1 error and 2 bad usage are the other codes of every command. `launch`
// passes it on without stopping the other ranks, which stop at the same step on their own.
constexpr int kExitInterrupted = dist::kExitInterrupted;

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
  std::string best_dir;            // --keep-best: OUT/best ("" none)
  std::int64_t best_step = -1;     // its step and eval est_ar
  double best_est_ar = 0;
  double seconds = 0;              // wall time of the loop
  double tokens_per_s = 0;         // real tokens of all ranks per second of the loop
  double data_wait_share = 0;      // share of the loop's time spent waiting for batches (rank 0)
  std::string summary;             // what matched, for the user
};

// Runs the whole job. `mesh` null: a single process (dist::Mesh::single()). Every rank of a
// mesh calls it with the same options.
TrainResult run_training(const TrainOptions& options, const dist::Mesh* mesh = nullptr,
                         const TrainHooks& hooks = {});

}  // namespace eaglekit::trainer
