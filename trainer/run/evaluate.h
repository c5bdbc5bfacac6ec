// Offline evaluation of a draft (`eaglekit evaluate`, and the training loop's eval steps):
// the TTT unroll without gradients over a whole split, with the metrics pooled over every
// masked position (sums of cross-entropy, matches and mask over the split, divided at the
// end), so that they do not depend on the batch size or the number of ranks. The run setup
// evaluation shares with training (device, dtype, Batch -> TttBatch) is trainer/run/run_setup.h.
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

#include "lib/data_options.h"
#include "lib/loader.h"
#include "trainer/run/options.h"
#include "trainer/run/run_setup.h"
#include "trainer/unroll/ttt.h"

namespace eaglekit::dist {
class Mesh;
}  // namespace eaglekit::dist

namespace eaglekit::trainer {

// Pooled statistics over the loader's next epoch (until next() says the epoch ended), or
// the first max_batches batches (< 0: all). No gradients; the unroll's draft is switched to
// eval mode and back. With a multi-rank mesh the result is summed over every rank (each
// rank must call this with its own loader of the same split). `on_batch` (optional) is
// called after each batch with the stats so far (progress).
TttStats evaluate_loader(TttUnroll& unroll, Loader& loader, const dist::Mesh* mesh = nullptr,
                         std::int64_t max_batches = -1,
                         const std::function<void(const TttStats&)>& on_batch = {});

// The same for a block drafter (DFlash): per block position, with the anchors every
// evaluation draws alike (seed 0, epoch 0, the conversation id), so two evaluations of a
// split score the same blocks.
TttStats evaluate_loader(DFlashUnroll& unroll, Loader& loader, const dist::Mesh* mesh = nullptr,
                         std::int64_t max_batches = -1,
                         const std::function<void(const TttStats&)>& on_batch = {});

// What `eaglekit evaluate` found: the pooled statistics and what matched.
struct EvaluateReport {
  TttStats stats;
  double loss_decay = 0.9;
  std::string loss_fn = "kl";  // the loss the figures are of (trainer/unroll/losses.h)
  std::int64_t samples = 0;
  double seconds = 0;
  std::string summary;  // what matched
  std::string to_json() const;  // {"loss", "loss_per_step", "acc", "cond_acc", "est_ar", ...}
  std::string to_text() const;
};

// `eaglekit evaluate`. `mesh` null: a single process.
EvaluateReport run_evaluate(const EvaluateOptions& options, const dist::Mesh* mesh = nullptr);

}  // namespace eaglekit::trainer
