// The run a RunPlan describes (trainer/run/plan.h), built for one rank of a mesh: the device,
// the base's embeddings and head, the draft, this rank's loader, the TTT unroll and, for
// training, the optimizer, the gradient sync and a resumed checkpoint's state restored. It
// decides nothing: every choice is the plan's. What it adds is I/O (the base's weights, a
// checkpoint, the d2t count of a fresh smaller vocabulary) and the mesh's rank (its device,
// its share of the data).
//
// Ownership: an OpenRun owns everything it holds; the unroll refers to its base and draft,
// so an OpenRun stays where open_run put it (heap, not movable). Thread safety: one thread
// drives it. Errors: UsageError for a device that cannot be used, IoError/FormatError from
// reading weights and checkpoints, c10::Error from LibTorch.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "lib/loader.h"
#include "trainer/model/base_model.h"
#include "trainer/model/draft_model.h"
#include "trainer/parallel/data_parallel.h"
#include "trainer/run/draft_setup.h"
#include "trainer/run/optim.h"
#include "trainer/unroll/dflash.h"
#include "trainer/unroll/ttt.h"

namespace eaglekit::dist {
class Mesh;
}  // namespace eaglekit::dist

namespace eaglekit::trainer {

struct RunPlan;

struct OpenRun {
  c10::Device device = c10::kCPU;  // --device; a CUDA run of several ranks: its local rank's
  BaseModel base;                  // on the device
  std::optional<DraftModel> draft;  // on the device, float32; in training mode when training
  LoaderOptions loader_options;     // of `loader` (evaluation loaders start from them)
  std::unique_ptr<Loader> loader;   // this rank's share of the plan's train split
  std::optional<TttUnroll> unroll;           // a TTT draft's (EAGLE-3, EAGLE 3.1)
  std::optional<DFlashUnroll> block_unroll;  // a block drafter's (DFlash): RunPlan::block()
  std::vector<std::pair<std::string, at::Tensor>> named_parameters;  // of the draft
  std::vector<at::Tensor> parameters;
  std::int64_t parameter_count = 0;
  std::optional<DraftOptimizer> optimizer;       // training only
  std::unique_ptr<GradientSync> sync;            // training on more than one rank
  std::unique_ptr<SequenceContext> context;      // training: the mesh's (null: single rank)
  // A resumed run: the checkpoint's step and tokens (its optimizer, random and sampler state
  // are restored); 0 for a fresh one.
  std::int64_t step = 0;
  double tokens = 0;

  OpenRun() = default;
  OpenRun(const OpenRun&) = delete;
  OpenRun& operator=(const OpenRun&) = delete;
};

// Builds the run `plan` describes on this rank of `mesh` (which must be the plan's: its
// world and cp sizes). `say` gets what the user is told while opening (rank 0 prints it).
std::unique_ptr<OpenRun> open_run(const RunPlan& plan, const dist::Mesh& mesh, const Say& say);

}  // namespace eaglekit::trainer
