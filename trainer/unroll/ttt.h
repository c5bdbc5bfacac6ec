// Training-time test (docs/ttt.md): the TTT attention mask, the S-step unroll of the
// draft with its rolls and kept keys/values, the soft cross-entropy against the base
// distribution mapped to the draft vocabulary, and the accuracy metrics.
//
// Everything that depends on how the sequence dimension is laid out (the rolls, the
// attention over the kept keys, sums over the sequence) goes through SequenceContext, so a
// context-parallel implementation (issue 8) replaces SingleRankContext without touching the
// unroll. Positions handed to a context are global; the loss is written position-wise
// (target at t+1 via shift_left) so chunked sequences need only the one boundary row.
//
// Thread safety: none (one training loop per TttUnroll). Shape mismatches throw UsageError;
// LibTorch errors propagate as c10::Error.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "trainer/unroll/losses.h"
#include "trainer/attention/inputs.h"
#include "trainer/attention/kind.h"
#include "trainer/model/base_model.h"
#include "trainer/model/draft_model.h"

namespace eaglekit::trainer {

namespace tiles {
struct HostKeys;  // trainer/attention/ttt_tiles.h
}

// --- the mask --------------------------------------------------------------------------

// docs/ttt.md, the mask: may query q (a position 0..L-1) at step s attend key j (a flattened
// index block * L + position over the s+1 kept blocks)?
//   j <= q - s (block 0), or j == i*L + q - (s - i) and j >= i*L for some i in 1..s.
bool ttt_allowed(std::int64_t length, std::int64_t step, std::int64_t q, std::int64_t j);
// bool [q_end - q_begin, k_end - k_begin]: the mask restricted to global query positions
// [q_begin, q_end) and flattened key indices [k_begin, k_end) (what one ring iteration of
// context-parallel attention needs).
at::Tensor ttt_mask(std::int64_t length, std::int64_t step, std::int64_t q_begin, std::int64_t q_end,
                    std::int64_t k_begin, std::int64_t k_end, c10::Device device = c10::kCPU);
// The full mask of step s: bool [L, L * (s + 1)].
at::Tensor ttt_mask(std::int64_t length, std::int64_t step, c10::Device device = c10::kCPU);

// Block-0 masks (j <= q - s, a shifted causal mask) built once per (L, step, device).
class TttMaskCache {
 public:
  const at::Tensor& block0(std::int64_t length, std::int64_t step, c10::Device device);
  std::size_t size() const { return masks_.size(); }

 private:
  std::map<std::tuple<std::int64_t, std::int64_t, int, int>, at::Tensor> masks_;
};

// --- attention primitives --------------------------------------------------------------

// Softmax attention of a query block against one key/value block, with the log-sum-exp
// that lets partial results over disjoint key sets be merged (ring attention).
struct AttentionPartial {
  at::Tensor out;  // [B, heads, Lq, head_dim] float32; 0 for rows with no allowed key
  at::Tensor lse;  // [B, heads, Lq] float32; -inf for rows with no allowed key
};
// q [B, heads, Lq, D], k/v [B, kv_heads, Lk, D] (GQA: query head h reads kv head
// h / (heads / kv_heads)), allowed: bool broadcastable to [B, Lq, Lk]. Never NaN, also when
// every key of a row is masked.
AttentionPartial attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& allowed, double scale);
// The exact softmax attention over the union of the two key sets.
AttentionPartial merge_partials(const AttentionPartial& a, const AttentionPartial& b);

// TTT attention of step s written directly from the mask of docs/ttt.md: the s+1 blocks are
// concatenated and ttt_mask() applied, plus key_valid [B, L] (bool, per position, the same
// for every block) and, for packed rows, document_ids [B, L] (a query sees only keys of its
// own document; undefined: one document per row). O(L^2 (s+1)); the reference the fast
// path is tested against. Returns q's dtype.
at::Tensor ttt_attention_dense(const TttAttentionInputs& in);
// The same result computed as block 0 (dense, shifted causal) plus one key per query in
// each block i >= 1 (the diagonal q - (s - i)): O(L^2 + L s), one fused softmax per chunk of
// query_chunk_rows query rows (0: ttt_query_chunk_rows(L)), each against only the block-0
// keys its rows can see, so about half of the L x L scores are never computed. Returns q's
// dtype.
at::Tensor ttt_attention_local(const TttAttentionInputs& in, TttMaskCache* cache = nullptr,
                               std::int64_t query_chunk_rows = 0);
// The query chunk ttt_attention_local uses for sequences of `length` rows: 1 to 8 chunks of
// at least 128 rows (one chunk up to 128).
std::int64_t ttt_query_chunk_rows(std::int64_t length);

// --- the sequence layout ---------------------------------------------------------------

// How the sequence dimension (dim 1 of every per-token tensor) is laid out. A rank holds the
// global rows [global_offset(), global_offset() + local_length).
class SequenceContext {
 public:
  virtual ~SequenceContext() = default;
  virtual std::int64_t global_offset() const = 0;
  virtual std::int64_t global_length(std::int64_t local_length) const = 0;
  // y[:, t] = x[:, t - 1], y[:, 0] = 0 (global t); differentiable.
  virtual at::Tensor shift_right(const at::Tensor& x) = 0;
  // y[:, t] = x[:, t + 1], y[:, L - 1] = 0 (global t); differentiable.
  virtual at::Tensor shift_left(const at::Tensor& x) = 0;
  // TTT attention of step s for the local query rows (trainer/attention/inputs.h): q
  // [B, heads, n, D]; k_blocks[i], v_blocks[i] [B, kv_heads, n, D] are the local rows of
  // block i = 0..s; key_valid [B, n] and document_ids [B, n] (packed rows) or undefined
  // likewise. Returns [B, heads, n, D].
  virtual at::Tensor attention(const TttAttentionInputs& in) = 0;
  // Sum of a small tensor (mask counts) over every rank whose tokens share one loss
  // normalizer; not differentiable. Identity on a single rank.
  virtual at::Tensor sum_across(const at::Tensor& x) = 0;
};

// The whole sequence on this rank. attention() with TttAttention::kAuto: on the CPU
// ttt_attention_local below kTttFlashMinLength positions and ttt_attention_flash
// (trainer/attention/ttt_flash.h) from there; on other devices always ttt_attention_local (docs/ttt.md,
// "Two implementations"). kLocal / kTiled: that one at every length and on every device.
// masks() holds the local path's block-0 masks.
class SingleRankContext final : public SequenceContext {
 public:
  explicit SingleRankContext(TttAttention kind = TttAttention::kAuto) : kind_(kind) {}
  TttAttention kind() const { return kind_; }
  std::int64_t global_offset() const override { return 0; }
  std::int64_t global_length(std::int64_t local_length) const override { return local_length; }
  at::Tensor shift_right(const at::Tensor& x) override;
  at::Tensor shift_left(const at::Tensor& x) override;
  at::Tensor attention(const TttAttentionInputs& in) override;
  at::Tensor sum_across(const at::Tensor& x) override { return x; }
  const TttMaskCache& masks() const { return masks_; }

 private:
  // key_valid and document_ids on the host for the tiled and fused kernels: read once per
  // batch (the first call with these tensors), not per step, layer or backward.
  std::shared_ptr<const tiles::HostKeys> host_keys(const at::Tensor& key_valid, const at::Tensor& document_ids);

  TttAttention kind_;
  TttMaskCache masks_;
  std::shared_ptr<const tiles::HostKeys> host_;
  at::Tensor host_valid_, host_docs_;
  std::uint32_t host_valid_version_ = 0, host_docs_version_ = 0;
};

// --- the unroll, loss and metrics ------------------------------------------------------

// A collated batch (lib/collate.h): [B, L] input_ids (int64), attention_mask, loss_mask
// (any numeric dtype, 0/1), hidden_states [B, L, H], aux_hidden_states [B, L, k*H].
// Packed rows (several documents per row) also carry document_ids and position_ids [B, L]
// (int64): attention stays inside a document, RoPE uses position_ids, and a position
// counts in step s only when its position_id >= s and the next token is of the same
// document. Left undefined, every row is one sequence at positions 0..L-1.
struct TttBatch {
  at::Tensor input_ids;
  at::Tensor attention_mask;
  at::Tensor loss_mask;
  at::Tensor hidden_states;
  at::Tensor aux_hidden_states;
  at::Tensor document_ids;
  at::Tensor position_ids;
  // Per token [B, L] (any integer dtype): 1 the hidden state is pre-norm, 0 post-norm, -1
  // not stated, which takes TttOptions::prenorm_hidden_states. Undefined: every token
  // takes it (lib/collate.h Batch::hidden_states_prenorm).
  at::Tensor hidden_states_prenorm;
  // A stored target distribution (lib/collate.h Batch::target_probs, NeMo's cache): [B, L, Vd]
  // (any floating dtype), row t the target p[t] itself. Defined: the unroll takes p from it
  // instead of softmax(target_head . hidden_states[t + 1]), hidden_states may be undefined,
  // and only the soft cross-entropy (TttOptions::loss_terms kl) trains (UsageError else).
  at::Tensor target_probs;
};

struct TttOptions {
  std::int64_t steps = 3;     // S
  double loss_decay = 0.9;    // total = sum_s decay^s * loss_s
  // Mixed precision: run the forward under autocast to this dtype (bf16) on the draft's
  // device. Parameters, softmaxes and the loss stay float32.
  std::optional<c10::ScalarType> autocast;
  // The batch's hidden_states were taken before the base's final norm: the targets apply
  // that RMSNorm (BaseModel::final_norm, eps rms_norm_eps) before lm_head. The base must
  // hold the norm's weight. Tokens whose TttBatch::hidden_states_prenorm is 0 or 1 follow
  // that instead; a batch with a pre-norm token needs the weight too (UsageError).
  bool prenorm_hidden_states = false;
  // Rows of a step's lm_head + soft cross-entropy computed at a time (trainer/model/soft_ce.h):
  // -1 auto (auto_loss_chunk_rows), 0 all at once (the logits of the step kept whole).
  std::int64_t loss_chunk_rows = -1;
  // Activation recomputation (docs/ttt.md, "Recomputation"; trainer/model/recompute.h): each
  // decoder layer's q/k/v projections and its o_proj + MLP block keep only their inputs and
  // outputs and run again in backward. The attention keeps what it keeps anyway. The same
  // results; less memory, about one more forward of those pieces per step.
  bool recompute = false;
  // The attention kernel of the unroll's own SingleRankContext (forward with context null,
  // as on every rank of a --cp 1 run; --cp > 1 runs the ring's pair attention). --ttt-attention.
  TttAttention attention = TttAttention::kAuto;
  // The loss of each step (trainer/unroll/losses.h, train --loss); empty: kl, computed as the
  // soft cross-entropy. Other losses take each step's whole logits (no chunking).
  std::vector<LossTerm> loss_terms{};
};

// Poolable sums over the masked positions of one or many batches; add them up over a split
// or all-reduce to_tensor() across ranks, then read the metrics. Per step s:
struct TttStats {
  std::vector<double> ce_sum;        // sum of m * the loss (the soft cross-entropy unless --loss)
  std::vector<double> mask_sum;      // sum of m
  std::vector<double> correct;       // masked positions with argmax(draft) == argmax(target)
  std::vector<double> cond_correct;  // ... among positions whose chain was right at steps < s
  std::vector<double> cond_total;    // masked positions whose chain was right at steps < s

  explicit TttStats(std::int64_t steps = 0);
  std::int64_t steps() const { return static_cast<std::int64_t>(ce_sum.size()); }
  TttStats& operator+=(const TttStats& o);  // throws UsageError on a step-count mismatch

  std::vector<double> loss_per_step() const;  // ce_sum / mask_sum (0 where nothing counted)
  // sum_s decay^s * loss_per_step[s]; decay 0: the mean over every counted position,
  // sum ce_sum / sum mask_sum (what the block unroll reports, trainer/unroll/dflash.h).
  double loss(double decay) const;
  std::vector<double> acc() const;
  std::vector<double> cond_acc() const;
  double est_ar() const;              // 1 + sum_s prod_{j<=s} acc_j
  double est_ar_conditional() const;  // 1 + sum_s prod_{j<=s} cond_acc_j
  double tokens() const { return mask_sum.empty() ? 0.0 : mask_sum[0]; }

  at::Tensor to_tensor() const;  // [5, S] float64, rows in the order above
  static TttStats from_tensor(const at::Tensor& t);
};

struct TttResult {
  at::Tensor loss;      // scalar float32: sum_s decay^s ce_sum[s] / (normalizer[s] + 1e-5)
  at::Tensor ce_sum;    // [S] float32, differentiable, this rank's tokens only
  at::Tensor mask_sum;  // [S] float32, this rank's tokens only
  TttStats stats;       // detached copies of this rank's sums (no cross-rank reduction)
};

// loss = sum_s decay^s ce_sum[s] / (normalizer[s] + 1e-5): the per-batch loss of docs/ttt.md when
// normalizer is the batch's mask sum. For gradient accumulation or data parallelism pass the
// mask sum of the whole global batch, and sum (not average) the gradients.
at::Tensor ttt_loss(const at::Tensor& ce_sum, const at::Tensor& normalizer, double decay);

// Drives the draft through S TTT steps against the frozen base. Holds the base's
// embed_tokens and the base lm_head rows of the draft vocabulary (computed once from the
// draft's d2t at construction: rebuild after changing d2t) on the draft's device, so move
// the draft (DraftModel::to) before constructing this.
class TttUnroll {
 public:
  TttUnroll(const BaseModel& base, DraftModel draft, TttOptions options = {});
  ~TttUnroll();
  TttUnroll(TttUnroll&&) noexcept;
  TttUnroll& operator=(TttUnroll&&) noexcept;

  // One forward pass; call result.loss.backward() to train (gradients land in the draft's
  // parameters). Under at::NoGradGuard it evaluates. The batch is moved to the draft's
  // device. `context` null: the whole sequence on this rank. The loss normalizer is
  // context->sum_across(mask_sum).
  TttResult forward(const TttBatch& batch, SequenceContext* context = nullptr);

  DraftModel& draft();
  const TttOptions& options() const;
  // Base lm_head rows of the draft vocabulary, [Vd, H] (the target head).
  const at::Tensor& target_head() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace eaglekit::trainer
