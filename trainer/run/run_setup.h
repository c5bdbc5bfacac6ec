// What a run of the TTT unroll needs around it, shared by training and evaluation: the
// device and compute dtype named on the command line, the loader's Batch as the unroll's
// TttBatch, the loss normalizer of a batch known before its forward, the sequence context
// of a mesh (context parallelism), and small sums over a process group.
//
// Thread safety: free functions without state. Errors: UsageError for a device or dtype
// that cannot be used; c10::Error from LibTorch; dist errors from the group.
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
#include "trainer/run/options.h"
#include "trainer/run/semantic_check.h"
#include "trainer/unroll/dflash.h"
#include "trainer/unroll/ttt.h"

namespace eaglekit::dist {
class Group;
class Mesh;
}  // namespace eaglekit::dist

namespace eaglekit::trainer {

// "cpu", "cuda", "cuda:N". Throws UsageError for anything else, and, when `check_available`,
// when CUDA is asked for but this LibTorch has no usable CUDA device (a --dry-run plans a GPU
// job on a machine without one).
c10::Device parse_device(const std::string& name, bool check_available = true);
// kFloat32 -> nullopt (no autocast); kBFloat16 -> kBFloat16 (autocast).
std::optional<c10::ScalarType> autocast_type(ComputeDType dtype);

// How a run takes its records' norm forms (docs/data.md, pre- and post-norm dumps). A
// record's stated form (SampleRef::hidden_states_prenorm, from the index) always wins.
// --hidden-states-norm gives the form of the records that state none:
// - post / pre: that form, also over what a record's layout implies (SampleRef::layout_prenorm:
//   the format row's norm_fact); records that state the other form, and layouts that imply
//   it, are named in `warnings` (counts and an example id);
// - auto: each record's stated form, else the one its layout implies, else the form
//   `measure` finds (the validate --base check through the base's head on a sample of those
//   records: semantic_check.h measure_norm_form); a UsageError (exit 2) saying what to pass
//   when the measurement is unclear. `source` and `said` say which of these decided.
struct NormPlan {
  bool default_pre = false;  // TttOptions::prenorm_hidden_states: records whose form is not known
  bool any_pre = false;      // some record is taken as pre-norm: load the base's final norm
  bool layout_norm = true;   // CollateOptions::layout_norm: records take the form their layout implies
  std::int64_t stated_pre = 0, stated_post = 0;
  std::int64_t layout_pre = 0, layout_post = 0;  // state none; their layout implies the form
  std::int64_t unstated = 0;                      // neither
  // Which sources decided, in order: "stated" (the records), "format" (the layout's fact),
  // "measured" (through the base's head), "option" (--hidden-states-norm).
  std::vector<std::string> source;
  std::string measured;               // what the measurement found, in words ("" when none ran)
  std::string said;                   // one line for the user
  std::vector<std::string> warnings;  // contradictions between the option and stated forms
};
// What measuring found for the records whose form is not known; called only when there are
// some, and only under auto.
using NormMeasure = std::function<NormMeasurement()>;
NormPlan plan_hidden_states_norm(HiddenStatesNorm option, const std::vector<SampleRef>& samples,
                                 const NormMeasure& measure);

// The loader's batch as the unroll takes it (tensors shared, not copied).
TttBatch to_ttt_batch(const Batch& batch);

// The DFlash anchors of a loader batch (trainer/unroll/dflash.h): each row's (each document's,
// in pack mode) from `seed`, the batch's epoch and its conversation id, so that they do not
// depend on the batch, the rank, the thread count, a resume or the collate mode.
// most_valid > 0: the global batch's dflash_batch_most_valid (all-reduced max), which sets
// the block count (ModelOpt's min(anchors, max n - 1)) for every micro-batch and rank alike.
DFlashAnchors dflash_batch_anchors(const Batch& batch, const DraftConfig& config, std::int64_t num_anchors,
                                   std::uint64_t seed, std::int64_t most_valid = 0);
std::int64_t dflash_batch_most_valid(const Batch& batch, const DraftConfig& config);

// The sum over the batch, per TTT step s < steps, of the loss weights the unroll uses
// (the loss mask of the next token, from position s on; inside a document when packed):
// equal to TttResult::mask_sum, computed without running the model and without
// communication (a context-parallel chunk's share from its global positions), so that a
// step's loss normalizer is known before its first forward. float64 [steps] on the CPU.
at::Tensor loss_mask_sums(const Batch& batch, std::int64_t steps);

// The sequence layout of a mesh: nullptr when the mesh is single-rank (the unroll's own
// SingleRankContext), else a RingContext over the mesh's cp group whose normalizer group is
// the cp group as well (callers pass the global normalizer to ttt_loss themselves).
// Its pair kernel carries out `attention` (ring_pair_kernel).
std::unique_ptr<SequenceContext> make_sequence_context(const dist::Mesh& mesh, TttAttention attention);
// Hands the coming batch's global row length to a context that needs it (RingContext).
void prepare_context(SequenceContext* context, const Batch& batch);

// A small float64 CPU tensor summed over `group` (moved to `device` first for NCCL).
at::Tensor reduce_sum(const dist::Group& group, const at::Tensor& cpu, c10::Device device);

}  // namespace eaglekit::trainer
