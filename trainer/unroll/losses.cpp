#include "trainer/unroll/losses.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <set>

#include "formats/error.h"

namespace eaglekit::trainer {

namespace {

constexpr std::pair<TttLossKind, const char*> kNames[] = {
    {TttLossKind::kKl, "kl"},   {TttLossKind::kReverseKl, "rkl"},        {TttLossKind::kJs, "js"},
    {TttLossKind::kTv, "tv"},   {TttLossKind::kNla, "nla"},              {TttLossKind::kLkHybrid, "lk-hybrid"},
    {TttLossKind::kCe, "ce"}};
constexpr double kNlaEps = 1e-5;   // speculators' _NLA_EPS
constexpr double kLkEta = 3.0;     // speculators' lk_hybrid_loss default (the paper's best)

std::string known() {
  std::string out;
  for (const auto& [k, n] : kNames) out += (out.empty() ? "" : ", ") + std::string(n);
  return out;
}

// sum over the vocabulary of p * (logp - logq): KL(p || q) per row.
at::Tensor kl(const at::Tensor& p, const at::Tensor& logp, const at::Tensor& logq) {
  return (p * (logp - logq)).sum(-1);
}

}  // namespace

const char* loss_kind_name(TttLossKind kind) {
  for (const auto& [k, n] : kNames)
    if (k == kind) return n;
  return "?";
}

std::vector<LossTerm> parse_loss_spec(const std::string& spec) {
  if (spec.empty()) return {LossTerm{}};
  std::vector<LossTerm> out;
  std::set<TttLossKind> seen;
  std::size_t at = 0;
  while (at <= spec.size()) {
    const std::size_t comma = spec.find(',', at);
    const std::string part = spec.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    const std::size_t colon = part.find(':');
    const std::string name = part.substr(0, colon);
    LossTerm t;
    bool found = false;
    for (const auto& [k, n] : kNames)
      if (name == n) {
        t.kind = k;
        found = true;
      }
    if (!found) throw UsageError("--loss: unknown loss '" + name + "' (known: " + known() + ")");
    if (colon != std::string::npos) {
      const std::string w = part.substr(colon + 1);
      char* end = nullptr;
      t.weight = std::strtod(w.c_str(), &end);
      if (w.empty() || end != w.c_str() + w.size() || !std::isfinite(t.weight) || t.weight <= 0)
        throw UsageError("--loss: the weight of '" + name + "' must be a positive number, got '" + w + "'");
    } else if (comma != std::string::npos || at > 0) {
      throw UsageError("--loss: in a mix every loss has a weight (name:weight,...), '" + name + "' has none");
    }
    if (!seen.insert(t.kind).second) throw UsageError("--loss: '" + name + "' appears twice");
    out.push_back(t);
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return out;
}

std::string loss_spec_text(const std::vector<LossTerm>& terms) {
  if (terms.size() == 1 && terms[0].weight == 1.0) return loss_kind_name(terms[0].kind);
  std::string out;
  for (const LossTerm& t : terms) {
    char w[32];
    std::snprintf(w, sizeof w, "%g", t.weight);
    out += (out.empty() ? "" : ",") + std::string(loss_kind_name(t.kind)) + ":" + w;
  }
  return out;
}

bool is_soft_ce(const std::vector<LossTerm>& terms) {
  return terms.empty() || (terms.size() == 1 && terms[0].kind == TttLossKind::kKl && terms[0].weight == 1.0);
}

at::Tensor per_position_loss(const at::Tensor& logits, const at::Tensor& target_logits,
                             const std::vector<LossTerm>& terms) {
  const at::Tensor logq = at::log_softmax(logits.to(at::kFloat), -1);
  const at::Tensor q = logq.exp();
  at::Tensor logp, p;
  {
    at::NoGradGuard no_grad;
    logp = at::log_softmax(target_logits.to(at::kFloat), -1);
    p = logp.exp();
  }
  at::Tensor overlap;  // sum min(p, q): the acceptance rate of each position
  auto get_overlap = [&] {
    if (!overlap.defined()) overlap = at::minimum(p, q).sum(-1);
    return overlap;
  };
  at::Tensor total = at::zeros({logits.size(0)}, logq.options());
  for (const LossTerm& t : terms) {
    at::Tensor e;
    switch (t.kind) {
      case TttLossKind::kKl:
        e = kl(p, logp, logq);
        break;
      case TttLossKind::kReverseKl:
        e = kl(q, logq, logp);
        break;
      case TttLossKind::kJs: {
        const at::Tensor logm = at::logaddexp(logq, logp) - std::log(2.0);
        e = 0.5 * (kl(p, logp, logm) + kl(q, logq, logm));
        break;
      }
      case TttLossKind::kTv:
        e = 1.0 - get_overlap();
        break;
      case TttLossKind::kNla:
        e = -at::log(get_overlap().clamp_min(kNlaEps));
        break;
      case TttLossKind::kLkHybrid: {
        const at::Tensor a = get_overlap();
        const at::Tensor w = at::exp(-kLkEta * a.detach());
        e = w * kl(p, logp, logq) + (1.0 - w) * (1.0 - a);
        break;
      }
      case TttLossKind::kCe:
        e = -logq.gather(-1, p.argmax(-1, /*keepdim=*/true)).squeeze(-1);
        break;
    }
    total = total + t.weight * e;
  }
  return total;
}

}  // namespace eaglekit::trainer
