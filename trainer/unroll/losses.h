// The per-position losses a TTT step can train on (train --loss), as speculators 0.9 defines
// them (losses/eager.py): each compares the draft's distribution q = softmax(logits) with the
// base's p = softmax(target_logits) at one position, over the draft vocabulary.
//
// - kl: forward KL(p || q), the default. Alone it is computed as the soft cross-entropy
//   -sum p log q, which has the same gradient and differs by the targets' entropy (the
//   fused and chunked kernels of trainer/model/soft_ce.h); in a mix it is the KL itself.
// - rkl: reverse KL(q || p).  js: Jensen-Shannon, 0.5 KL(p || m) + 0.5 KL(q || m), m = (p+q)/2.
// - tv: total variation 1 - sum min(p, q) (1 - the acceptance rate of that position).
// - nla: -log(max(sum min(p, q), 1e-5)), the negative log acceptance.
// - lk-hybrid: w KL(p || q) + (1 - w) TV with w = exp(-3 * sg(sum min(p, q))).
// - ce: the hard-label cross-entropy against argmax p.
// A spec is one name, or a weighted mix "tv:0.9,ce:0.1" (weights positive, names unique).
//
// Thread safety: pure functions. Errors: parse_loss_spec throws UsageError naming the part.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace eaglekit::trainer {

enum class TttLossKind { kKl, kReverseKl, kJs, kTv, kNla, kLkHybrid, kCe };

struct LossTerm {
  TttLossKind kind = TttLossKind::kKl;
  double weight = 1.0;
};

// "kl", "rkl", "js", "tv", "nla", "lk-hybrid", "ce".
const char* loss_kind_name(TttLossKind kind);
// The spec's terms; "" is "kl".
std::vector<LossTerm> parse_loss_spec(const std::string& spec);
// The canonical spec of `terms` ("kl", "tv:0.9,ce:0.1").
std::string loss_spec_text(const std::vector<LossTerm>& terms);
// True for the default, plain kl: the soft cross-entropy kernels compute it.
bool is_soft_ce(const std::vector<LossTerm>& terms);

// The weighted sum of the terms at every position: logits and target_logits [N, Vd] (float32),
// result [N] float32, differentiable in `logits`.
at::Tensor per_position_loss(const at::Tensor& logits, const at::Tensor& target_logits,
                             const std::vector<LossTerm>& terms);

}  // namespace eaglekit::trainer
