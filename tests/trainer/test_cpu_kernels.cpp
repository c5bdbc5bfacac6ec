// trainer/model/cpu_kernels.h: each fused CPU kernel against the textbook formula computed in
// float64 with ATen's own operators and autograd (forward and every gradient), on shapes
// that leave vector remainders and on values that reach exp's extremes; then the whole TTT
// unroll with the kernels on against the ATen composites, loss, metrics and every gradient.
#include "tests/torch_doctest.h"
#include <torch/csrc/autograd/autograd.h>

#include <cfloat>
#include <cstdint>
#include <string>
#include <vector>

#include "formats/error.h"
#include "tests/support.h"
#include "tests/tensor_compare.h"
#include "tests/trainer/trainer_fixtures.h"
#include "trainer/model/cpu_kernels.h"
#include "trainer/model/draft_model.h"
#include "trainer/unroll/ttt.h"

using namespace eaglekit;
using namespace eaglekit::trainer;

namespace {

// max |a - b| / max |b|: a relative error against the reference's scale.
double rel_err(const at::Tensor& a, const at::Tensor& b) { return test::tensor_rel_diff(a, b); }

// The float32 error bound of a result built from n roundings in sequence (a sum of n terms
// in any order: worst case about n * eps relative to the sum of magnitudes, Higham 2002), with
// a factor of 4 for the roundings around it. Another CPU (another vector width, FMA or not,
// another BLAS kernel) sums in another order; this bounds them all.
double f32_bound(std::int64_t n) { return 4.0 * static_cast<double>(n) * FLT_EPSILON; }

// Turns the kernels on for the scope and back to what they were.
struct KernelsOn {
  explicit KernelsOn(bool on) : before(cpu_kernels::enabled()) { cpu_kernels::set_enabled(on); }
  ~KernelsOn() { cpu_kernels::set_enabled(before); }
  bool before;
};

std::vector<at::Tensor> grads(const at::Tensor& out, const at::Tensor& dy, const std::vector<at::Tensor>& inputs) {
  return torch::autograd::grad({out}, inputs, {dy});
}

at::Tensor leaf(const at::Tensor& t) { return t.detach().clone().requires_grad_(); }

at::Tensor rotate_half(const at::Tensor& x) {
  const std::int64_t h = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
}

}  // namespace

TEST_CASE("cpu kernels: RMSNorm equals the float64 formula, forward and both gradients") {
  KernelsOn on(true);
  at::manual_seed(1);
  for (const std::int64_t h : {7, 64, 131}) {  // a remainder after every vector width
    CAPTURE(h);
    const at::Tensor x0 = at::randn({3, 5, h}) * 3.0, w0 = at::randn({h}), dy = at::randn({3, 5, h});
    const at::Tensor x = leaf(x0), w = leaf(w0);
    const at::Tensor y = cpu_kernels::rms_norm(x, w, 1e-5);
    const auto g = grads(y, dy, {x, w});
    const at::Tensor xd = leaf(x0.to(at::kDouble)), wd = leaf(w0.to(at::kDouble));
    const at::Tensor yd = wd * (xd * at::rsqrt(xd.pow(2).mean(-1, true) + 1e-5));
    const auto gd = grads(yd, dy.to(at::kDouble), {xd, wd});
    CHECK(rel_err(y, yd) < f32_bound(h));  // a sum over the h features
    CHECK(rel_err(g[0], gd[0]) < f32_bound(2 * h));  // two such sums
    CHECK(rel_err(g[1], gd[1]) < f32_bound(h + 15));  // and a sum over the 15 rows
  }
  // A transposed (non-contiguous) input is read by its values, not its memory order.
  const at::Tensor xt = at::randn({16, 4}).t();
  CHECK(rel_err(cpu_kernels::rms_norm(xt, at::ones({16}), 1e-6),
                xt * at::rsqrt(xt.pow(2).mean(-1, true) + 1e-6)) < 1e-6);
  CHECK_THROWS_AS(cpu_kernels::rms_norm(at::zeros({2, 4}), at::zeros({3}), 1e-5), UsageError);
  CHECK_THROWS_AS(cpu_kernels::rms_norm(at::zeros({2, 4}, at::kDouble), at::zeros({4}, at::kDouble), 1e-5), UsageError);
}

TEST_CASE("cpu kernels: RoPE equals x cos + rotate_half(x) sin for [L, D] and per-row [B, L, D] tables") {
  KernelsOn on(true);
  at::manual_seed(2);
  const std::int64_t b = 2, heads = 3, l = 7, d = 20;
  for (const bool per_row : {false, true}) {
    CAPTURE(per_row);
    const at::Tensor angles = per_row ? at::rand({b, l, d}) * 6.0 : at::rand({l, d}) * 6.0;
    const at::Tensor cos = angles.cos(), sin = angles.sin();
    // q as the draft makes it: [B, L, heads, D] memory seen as [B, heads, L, D].
    const at::Tensor x0 = at::randn({b, l, heads, d}).transpose(1, 2), dy = at::randn({b, heads, l, d});
    const at::Tensor x = leaf(x0);
    const at::Tensor y = cpu_kernels::rope(x, cos, sin);
    const auto g = grads(y, dy, {x});
    const at::Tensor c = (per_row ? cos.unsqueeze(1) : cos).to(at::kDouble);
    const at::Tensor s = (per_row ? sin.unsqueeze(1) : sin).to(at::kDouble);
    const at::Tensor xd = leaf(x0.to(at::kDouble));
    const at::Tensor yd = xd * c + rotate_half(xd) * s;
    const auto gd = grads(yd, dy.to(at::kDouble), {xd});
    CHECK(y.sizes() == x0.sizes());
    CHECK(rel_err(y, yd) < f32_bound(3));  // two products and a sum per value
    CHECK(rel_err(g[0], gd[0]) < f32_bound(3));
  }
  CHECK_THROWS_AS(cpu_kernels::rope(at::zeros({1, 2, 3, 5}), at::zeros({3, 5}), at::zeros({3, 5})), UsageError);
}

TEST_CASE("cpu kernels: SwiGLU equals silu(gate) * up, forward and gradients, over exp's whole range") {
  KernelsOn on(true);
  at::manual_seed(3);
  const std::int64_t i = 37;
  // Gates from -100 to 100: silu's exp underflows, saturates and everything between.
  at::Tensor gu0 = at::randn({4, 9, 2 * i}) * 4.0;
  gu0.narrow(-1, 0, i).select(0, 0).copy_(at::linspace(-100, 100, 9 * i).view({9, i}));
  const at::Tensor dy = at::randn({4, 9, i});
  const at::Tensor gu = leaf(gu0);
  const at::Tensor y = cpu_kernels::swiglu(gu);
  const auto g = grads(y, dy, {gu});
  const at::Tensor gud = leaf(gu0.to(at::kDouble));
  const at::Tensor gate = gud.narrow(-1, 0, i), up = gud.narrow(-1, i, i);
  const at::Tensor yd = gate * at::sigmoid(gate) * up;
  const auto gd = grads(yd, dy.to(at::kDouble), {gud});
  CHECK(y.sizes() == yd.sizes());
  CHECK(rel_err(y, yd) < f32_bound(8));  // exp (a few ulps), a division, two products
  // The gate's gradient has g (1 - sigmoid(g)), which loses |g| ulps where sigmoid(g) is
  // near 1; |g| up to about 17 matters (beyond, sigmoid rounds to 1 and the term is 0).
  CHECK(rel_err(g[0], gd[0]) < f32_bound(8 + 17));
  CHECK_FALSE(at::isnan(g[0]).any().item<bool>());
  CHECK_THROWS_AS(cpu_kernels::swiglu(at::zeros({2, 5})), UsageError);
}

TEST_CASE("cpu kernels: lm_head + soft cross-entropy equals the float64 loss, argmax and gradients") {
  KernelsOn on(true);
  at::manual_seed(4);
  const std::int64_t rows = 37, h = 16, v = 53;
  for (const double scale : {1.0, 40.0}) {  // 40: logits in the hundreds, exp only after the max
    CAPTURE(scale);
    const at::Tensor x0 = at::randn({rows, h}) * scale, w0 = at::randn({v, h}), dy = at::full({}, 0.7);
    const at::Tensor p = at::softmax(at::randn({rows, v}) * 2.0, -1);
    at::Tensor wt = at::rand({rows});
    wt.narrow(0, 0, 5).zero_();  // rows that do not count: no loss, no gradient
    const at::Tensor x = leaf(x0), w = leaf(w0);
    const SoftCeResult r = cpu_kernels::soft_ce(x, w, p, wt);
    const auto g = grads(r.ce_sum, dy, {x, w});
    const at::Tensor xd = leaf(x0.to(at::kDouble)), wd = leaf(w0.to(at::kDouble));
    const at::Tensor logits = at::matmul(xd, wd.t());
    const at::Tensor ced = -(wt.to(at::kDouble) * (p.to(at::kDouble) * at::log_softmax(logits, -1)).sum(-1)).sum();
    const auto gd = grads(ced, dy.to(at::kDouble), {xd, wd});
    // Logits: sums over h; the loss: sums over v per row and over the rows.
    const double tol = f32_bound(h + v + rows);
    CHECK(std::abs(r.ce_sum.item<double>() - ced.item<double>()) <= tol * std::abs(ced.item<double>()));
    // The argmax wherever the float64 logits' best beats the second by more than float32
    // rounding of the logits can move them (a near-tie may go either way on another CPU);
    // almost every row qualifies, so the check is not empty.
    const auto top2 = at::topk(logits, 2, -1);
    const at::Tensor margin = (std::get<0>(top2).select(-1, 0) - std::get<0>(top2).select(-1, 1)) /
                              logits.abs().amax(-1).clamp_min(1e-30);
    const at::Tensor clear = margin > f32_bound(2 * h);
    CHECK(clear.sum().item<std::int64_t>() >= rows - 2);
    CHECK(r.argmax.masked_select(clear).equal(std::get<1>(top2).select(-1, 0).masked_select(clear)));
    CHECK(rel_err(g[0], gd[0]) < tol);
    CHECK(rel_err(g[1], gd[1]) < tol);
    CHECK(g[0].narrow(0, 0, 5).abs().max().item<double>() == 0.0);
  }
  CHECK_THROWS_AS(cpu_kernels::soft_ce(at::zeros({2, 4}), at::zeros({3, 5}), at::zeros({2, 3}), at::zeros({2})),
                  UsageError);
}

TEST_CASE("cpu kernels: off, or on a tensor they do not take, every kernel is refused and the composites run") {
  KernelsOn off(false);
  CHECK_FALSE(cpu_kernels::takes(at::zeros({2})));
  CHECK_THROWS_AS(cpu_kernels::rms_norm(at::zeros({2, 4}), at::ones({4}), 1e-5), UsageError);
  cpu_kernels::set_enabled(true);
  CHECK(cpu_kernels::takes(at::zeros({2})));
  CHECK_FALSE(cpu_kernels::takes(at::zeros({2}, at::kBFloat16)));
  CHECK_FALSE(cpu_kernels::takes(at::zeros({2}, at::kDouble)));
}

TEST_CASE("cpu kernels: the TTT unroll with the kernels equals the ATen composites (loss, metrics, every gradient)") {
  // One- and two-layer drafts (the second layer takes input_layernorm, not the first's
  // concat), unpacked and packed rows (per-row RoPE tables), 3 TTT steps.
  for (const std::int64_t layers : {1, 2}) {
    for (const bool packed : {false, true}) {
      CAPTURE(layers);
      CAPTURE(packed);
      DraftConfig c = fixtures::tiny_config();
      c.num_hidden_layers = layers;
      const BaseModel base = fixtures::random_base(c, 51);
      TttBatch batch = fixtures::random_batch(c, 3, 12, {12, 9, 7}, 52);
      if (packed) fixtures::pack_first_row(batch, 5);
      auto run = [&](bool kernels) {
        KernelsOn k(kernels);
        TttUnroll unroll(base, DraftModel(c, fixtures::spread_d2t(c), base.lm_head, 53), TttOptions{3, 0.8, std::nullopt});
        TttResult r = unroll.forward(batch);
        r.loss.backward();
        std::vector<std::pair<std::string, at::Tensor>> g;
        for (const auto& [name, p] : unroll.draft().named_parameters()) g.emplace_back(name, p.grad().clone());
        return std::make_pair(r, g);
      };
      const auto ref = run(false), got = run(true);
      CHECK(std::abs(got.first.loss.item<double>() - ref.first.loss.item<double>()) <=
            1e-5 * std::abs(ref.first.loss.item<double>()));
      CHECK(got.first.stats.mask_sum == ref.first.stats.mask_sum);
      for (std::size_t s = 0; s < ref.first.stats.correct.size(); ++s)
        CHECK(std::abs(got.first.stats.correct[s] - ref.first.stats.correct[s]) <= 1);  // a near-tie may flip
      REQUIRE(got.second.size() == ref.second.size());
      for (std::size_t i = 0; i < ref.second.size(); ++i) {
        CAPTURE(ref.second[i].first);
        CHECK(rel_err(got.second[i].second, ref.second[i].second) < 1e-4);
      }
    }
  }
}
