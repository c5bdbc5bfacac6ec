// The per-position losses of train --loss (trainer/unroll/losses.h) against the definitions
// written out here in double precision, loop by loop (speculators 0.9's losses/eager.py is the
// e2e's oracle for the same figures); the spec parser's refusals; and the unroll training on
// each of them.
#include "tests/torch_doctest.h"
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "formats/error.h"
#include "tests/trainer/trainer_fixtures.h"
#include "trainer/unroll/losses.h"
#include "trainer/unroll/ttt.h"

using namespace eaglekit;
using namespace eaglekit::trainer;

namespace {

std::vector<double> softmax(const std::vector<double>& x) {
  const double m = *std::max_element(x.begin(), x.end());
  std::vector<double> e(x.size());
  double z = 0;
  for (std::size_t i = 0; i < x.size(); ++i) z += (e[i] = std::exp(x[i] - m));
  for (double& v : e) v /= z;
  return e;
}

// One position's loss from its definition.
double reference(TttLossKind kind, const std::vector<double>& logits, const std::vector<double>& target) {
  const std::vector<double> q = softmax(logits), p = softmax(target);
  double kl = 0, rkl = 0, js = 0, overlap = 0;
  for (std::size_t v = 0; v < q.size(); ++v) {
    kl += p[v] * std::log(p[v] / q[v]);
    rkl += q[v] * std::log(q[v] / p[v]);
    const double m = 0.5 * (p[v] + q[v]);
    js += 0.5 * (p[v] * std::log(p[v] / m) + q[v] * std::log(q[v] / m));
    overlap += std::min(p[v], q[v]);
  }
  const std::size_t arg = static_cast<std::size_t>(std::max_element(p.begin(), p.end()) - p.begin());
  switch (kind) {
    case TttLossKind::kKl: return kl;
    case TttLossKind::kReverseKl: return rkl;
    case TttLossKind::kJs: return js;
    case TttLossKind::kTv: return 1 - overlap;
    case TttLossKind::kNla: return -std::log(std::max(overlap, 1e-5));
    case TttLossKind::kLkHybrid: {
      const double w = std::exp(-3.0 * overlap);
      return w * kl + (1 - w) * (1 - overlap);
    }
    case TttLossKind::kCe: return -std::log(q[arg]);
  }
  return 0;
}

}  // namespace

TEST_CASE("losses: every loss equals its definition, alone and mixed, and has a gradient") {
  const std::int64_t n = 6, vocab = 11;
  const at::Tensor logits = at::randn({n, vocab}, at::TensorOptions().dtype(at::kFloat)).mul(2.0).requires_grad_();
  at::Tensor target = at::randn({n, vocab}).mul(2.0);
  target[2] = target[2] * 0.01;  // a near-uniform target: overlap and the entropy change a lot
  const TttLossKind kinds[] = {TttLossKind::kKl, TttLossKind::kReverseKl, TttLossKind::kJs, TttLossKind::kTv,
                               TttLossKind::kNla, TttLossKind::kLkHybrid, TttLossKind::kCe};
  auto row = [](const at::Tensor& t, std::int64_t i) {
    const at::Tensor r = t[i].to(at::kDouble).contiguous();
    return std::vector<double>(r.data_ptr<double>(), r.data_ptr<double>() + r.numel());
  };
  for (const TttLossKind kind : kinds) {
    CAPTURE(loss_kind_name(kind));
    const at::Tensor got = per_position_loss(logits, target, {LossTerm{kind, 1.0}});
    REQUIRE(got.sizes() == at::IntArrayRef({n}));
    for (std::int64_t i = 0; i < n; ++i) {
      const double want = reference(kind, row(logits.detach(), i), row(target, i));
      CHECK(got[i].item<double>() == doctest::Approx(want).epsilon(2e-5));
    }
    logits.grad().defined() ? logits.grad().zero_() : at::Tensor();
    got.sum().backward();
    CHECK(logits.grad().isfinite().all().item<bool>());
    CHECK(logits.grad().abs().sum().item<double>() > 0);
  }
  // A mix is the weighted sum of its terms.
  const auto mix = parse_loss_spec("tv:0.9,ce:0.1");
  const at::Tensor got = per_position_loss(logits, target, mix);
  for (std::int64_t i = 0; i < n; ++i) {
    const double want = 0.9 * reference(TttLossKind::kTv, row(logits.detach(), i), row(target, i)) +
                        0.1 * reference(TttLossKind::kCe, row(logits.detach(), i), row(target, i));
    CHECK(got[i].item<double>() == doctest::Approx(want).epsilon(2e-5));
  }
}

TEST_CASE("losses: a spec names known losses, weights a mix, and is written back the same") {
  CHECK(is_soft_ce(parse_loss_spec("")));
  CHECK(is_soft_ce(parse_loss_spec("kl")));
  CHECK_FALSE(is_soft_ce(parse_loss_spec("kl:0.5,tv:0.5")));
  CHECK(loss_spec_text(parse_loss_spec("lk-hybrid")) == "lk-hybrid");
  CHECK(loss_spec_text(parse_loss_spec("tv:0.9,ce:0.1")) == "tv:0.9,ce:0.1");
  CHECK_THROWS_WITH_AS(parse_loss_spec("kld"), doctest::Contains("unknown loss 'kld' (known: kl, rkl"), UsageError);
  CHECK_THROWS_WITH_AS(parse_loss_spec("tv:0"), doctest::Contains("must be a positive number"), UsageError);
  CHECK_THROWS_WITH_AS(parse_loss_spec("tv:x"), doctest::Contains("must be a positive number"), UsageError);
  CHECK_THROWS_WITH_AS(parse_loss_spec("tv,ce:1"), doctest::Contains("every loss has a weight"), UsageError);
  CHECK_THROWS_WITH_AS(parse_loss_spec("tv:1,tv:2"), doctest::Contains("appears twice"), UsageError);
}

TEST_CASE("losses: the unroll trains on each loss; kl alone is the soft cross-entropy kernels' loss") {
  const DraftConfig c = fixtures::tiny_config();
  const BaseModel base = fixtures::random_base(c, 40);
  const TttBatch batch = fixtures::random_batch(c, 2, 10, {10, 8}, 41);
  DraftModel d(c, fixtures::spread_d2t(c), base.lm_head, 42);
  TttOptions soft{3, 0.8, std::nullopt};
  TttOptions kl_mixed = soft;
  kl_mixed.loss_terms = parse_loss_spec("kl:1,ce:1e-30");  // the general path, kl as KL itself
  const TttResult a = TttUnroll(base, d, soft).forward(batch);
  const TttResult b = TttUnroll(base, d, kl_mixed).forward(batch);
  // CE = KL + H(p) per position: the soft CE is larger by the targets' entropy, the accuracies equal.
  for (std::int64_t s = 0; s < 3; ++s) {
    CHECK(a.ce_sum[s].item<double>() > b.ce_sum[s].item<double>());
    CHECK(a.stats.correct[static_cast<std::size_t>(s)] == b.stats.correct[static_cast<std::size_t>(s)]);
  }
  for (const char* spec : {"rkl", "js", "tv", "nla", "lk-hybrid", "ce", "tv:0.9,ce:0.1"}) {
    CAPTURE(spec);
    TttOptions o = soft;
    o.loss_terms = parse_loss_spec(spec);
    DraftModel e(c, fixtures::spread_d2t(c), base.lm_head, 42);
    TttUnroll u(base, e, o);
    const TttResult r = u.forward(batch);
    r.loss.backward();
    CHECK(std::isfinite(r.loss.item<double>()));
    CHECK(e.named_parameters()[0].second.grad().abs().sum().item<double>() > 0);
  }
}
