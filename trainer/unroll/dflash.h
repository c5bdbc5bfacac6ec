// The block-parallel unroll (docs/dflash.md) that trains a DFlash draft
// (trainer/model/dflash.h) against the frozen base: anchors drawn per sequence inside the
// loss mask, one block of block_size tokens per anchor (the anchor's token, then
// mask_token_id), a draft forward in which each block sees the target's context features
// strictly before its anchor and its whole block (no causal mask), the base's lm_head over
// the whole vocabulary, and the loss at block positions 1..block_size-1 weighted per
// position (D-PACE or an exponential decay) as ModelOpt 0.47's HFDFlashModel computes it
// (tests/trainer/test_dflash.cpp holds it to a fixture ModelOpt's code wrote).
//
// Thread safety: none (one training loop per unroll). Bad shapes or options throw
// UsageError; LibTorch errors propagate as c10::Error.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "trainer/model/base_model.h"
#include "trainer/model/draft_model.h"
#include "trainer/unroll/ttt.h"

namespace eaglekit::trainer {

// How the loss weighs block positions 1..block_size-1 (ModelOpt's dflash_loss_objective).
enum class DFlashWeighting {
  kDpace,  // D-PACE (arXiv:2605.18810): suffix sums of smoothed cumulative confidences, detached
  kDecay,  // exp(-(k - 1) / gamma) at block position k (gamma 0: every position 1)
};

struct DFlashOptions {
  std::int64_t num_anchors = 512;  // at most this many blocks per sequence
  DFlashWeighting weighting = DFlashWeighting::kDpace;
  double dpace_alpha = 0.5;   // D-PACE's smoothing, (0, 1]
  double decay_gamma = 0.0;   // kDecay's gamma, >= 0
  // The loss at a position: the soft cross-entropy against the base's distribution for that
  // token (self-logit distillation, ModelOpt's default), else the cross-entropy of the
  // dumped token.
  bool self_distillation = true;
  // As TttOptions: the hidden states were taken before the base's final norm (the teacher's
  // logits apply it first); tokens whose record states a form follow that.
  bool prenorm_hidden_states = false;
  std::optional<c10::ScalarType> autocast;
};

// Anchor positions per row: [B, N] int64 ascending (0 where unused) and keep [B, N] bool.
struct DFlashAnchors {
  at::Tensor positions;
  at::Tensor keep;
};

// Draws the anchors of a batch (CPU): row r draws min(n_r, N) distinct positions uniformly
// from the n_r positions p <= L - block_size whose loss_mask is set, with its own generator
// seeded by row_seeds[r] (so a row's anchors do not depend on the batch it is in, the rank
// or the thread count). N = min(num_anchors, max_r n_r - 1), ModelOpt's count; no row with
// n_r >= 2 draws none. loss_mask: [B, L], any numeric dtype.
DFlashAnchors dflash_anchors(const at::Tensor& loss_mask, std::int64_t block_size, std::int64_t num_anchors,
                             const std::vector<std::uint64_t>& row_seeds);
// The same for rows that hold several documents (pack mode, docs/dflash.md): document_ids
// [B, L] (0, 1, ... per document of a row, -1 on padding) and position_ids [B, L] (a token's
// position in its document); document_seeds[r][d] seeds document d of row r. Each document
// draws as the row of its own it is in pad mode: among its positions p <= L - block_size
// (positions in the document) whose loss_mask is set, with its own seed, up to
// min(num_anchors, max_d n_d - 1) over the batch's documents. A row's blocks are its
// documents' (row columns, ascending), N the most of any row. So a packed batch draws for
// each document what the padded batch of the same documents draws for that row.
// most_valid > 0: the most of any document of the global batch (every micro-batch of every
// rank, dflash_most_valid), which sets the count in place of this batch's own, so that a row
// draws the same blocks whatever batch, micro-batch or rank it lands in; most_out (when
// given) receives this batch's own.
DFlashAnchors dflash_anchors(const at::Tensor& loss_mask, const at::Tensor& document_ids, const at::Tensor& position_ids,
                             std::int64_t block_size, std::int64_t num_anchors,
                             const std::vector<std::vector<std::uint64_t>>& document_seeds, std::int64_t most_valid = 0,
                             std::int64_t* most_out = nullptr);
// max_d n_d of a batch: the most anchor positions any of its documents (rows) has.
std::int64_t dflash_most_valid(const at::Tensor& loss_mask, const at::Tensor& document_ids, const at::Tensor& position_ids,
                               std::int64_t block_size);
// The seed of a row's anchors (of a document's, in a packed row): of the run's seed, the
// epoch and the conversation id.
std::uint64_t dflash_row_seed(std::uint64_t seed, std::uint64_t epoch, const std::string& conversation_id);

// D-PACE's position weights (detached) from confidences [..., P] (exp(-CE) at positions
// 1..P) and valid [..., P] (0/1): smoothed q~ = alpha + (1 - alpha) q (1 where invalid),
// C_j = prod_{i<=j} q~_i (0 where invalid), w_j = sum_{m>=j} C_m.
at::Tensor dpace_weights(const at::Tensor& confidences, double alpha, const at::Tensor& valid);

struct DFlashResult {
  at::Tensor weighted_loss;  // scalar float32, differentiable: sum of weight * loss
  double weight_sum = 0;     // sum of the weights (the loss normalizer of this batch)
  // Per block position k = 1..block_size-1 (index k-1), over the positions that count (a
  // kept block, inside the sequence and the loss mask): unweighted loss sums, counts,
  // argmax == the dumped token, and the same among positions whose block was right at
  // every earlier position (est_ar_conditional: the expected tokens per draft block).
  TttStats stats;
};

// loss = weighted_loss / (weight_sum + 1e-6), ModelOpt's; weight_sum is the normalizer of
// every micro-batch on every rank whose gradients are summed (the global batch), so that a
// data-parallel run equals one rank with the global batch. A normalizer <= 1 (nothing to
// learn) gives a zero loss, as ModelOpt's.
at::Tensor dflash_loss(const at::Tensor& weighted_loss, double weight_sum);

class DFlashUnroll {
 public:
  // Holds the base's embed_tokens and lm_head (and final norm) on the draft's device: move
  // the draft first. UsageError when the draft is not a block drafter or its vocabulary is
  // not the base's.
  DFlashUnroll(const BaseModel& base, DraftModel draft, DFlashOptions options = {});
  ~DFlashUnroll();
  DFlashUnroll(DFlashUnroll&&) noexcept;
  DFlashUnroll& operator=(DFlashUnroll&&) noexcept;

  // One forward over `batch` with `anchors` from dflash_anchors. A packed batch (document_ids
  // and position_ids defined) gives each document what it gives as a padded row of its own
  // with the same anchors: a block sees its own document's context before its anchor, at
  // RoPE positions within the document, and counts no position past the document's end.
  // Call dflash_loss(...).backward() to train; under at::NoGradGuard it evaluates.
  DFlashResult forward(const TttBatch& batch, const DFlashAnchors& anchors);

  DraftModel& draft();
  const DFlashOptions& options() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace eaglekit::trainer
