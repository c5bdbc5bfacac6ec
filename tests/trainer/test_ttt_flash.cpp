#include "tests/torch_doctest.h"
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/version.h>

#include <cmath>
#include <string>
#include <vector>

#include "formats/error.h"
#include "tests/support.h"
#include "tests/trainer/trainer_fixtures.h"
#include "tests/trainer/ttt_inputs.h"
#include "trainer/attention/ttt_flash.h"
#include "trainer/attention/ttt_fused.h"
#include "trainer/attention/ttt_tiles.h"
#include "trainer/run/cpu_memory.h"
#include "trainer/unroll/ttt.h"

using namespace eaglekit;
using namespace eaglekit::trainer;
using namespace eaglekit::test_attention;

namespace {

struct Case {
  const char* name;
  Shape shape;
  TttFlashTiles tiles;
  bool padded, packed;
};

}  // namespace

TEST_CASE("ttt flash: values and gradients equal the dense attention under the docs/ttt.md mask") {
  const std::vector<Case> cases{
      {"tiles smaller than L, L not a multiple of them", {2, 4, 2, 9, 8}, {4, 4}, false, false},
      {"one tile larger than L", {2, 4, 2, 9, 8}, {16, 16}, false, false},
      {"query and key tiles of different sizes", {2, 4, 2, 13, 8}, {3, 5}, false, false},
      {"one-row tiles", {1, 4, 2, 7, 4}, {1, 1}, false, false},
      {"padding: tails, holes, keyless queries, a row of padding", {3, 4, 2, 11, 8}, {4, 3}, true, false},
      {"packed documents", {2, 4, 2, 10, 8}, {4, 4}, false, true},
      {"packed and padded", {2, 4, 2, 11, 8}, {2, 5}, true, true},
      {"GQA 4/1", {2, 4, 1, 9, 8}, {4, 4}, true, true},
      {"MHA 4/4", {2, 4, 4, 9, 8}, {4, 4}, true, false},
      {"the default tiles, several of them", {2, 4, 2, 300, 8}, {}, true, false},
  };
  at::manual_seed(21);
  for (const Case& c : cases) {
    for (std::int64_t s = 0; s <= 3; ++s) {
      CAPTURE(c.name);
      CAPTURE(s);
      const Inputs in = make_inputs(c.shape, s, c.padded, c.packed);
      const double scale = 0.35;
      const at::Tensor dense = ttt_attention_dense({in.q, in.ks, in.vs, in.key_valid, s, scale, in.docs});
      const at::Tensor flash = ttt_attention_flash({in.q, in.ks, in.vs, in.key_valid, s, scale, in.docs}, c.tiles);
      REQUIRE(flash.sizes() == in.q.sizes());
      CHECK((flash.scalar_type() == at::kFloat));
      CHECK(max_rel(flash, dense) < 1e-5);
      // Keyless queries give exactly 0.
      const at::Tensor none = keyless_rows(in, s).unsqueeze(1).unsqueeze(-1).expand_as(flash);
      CHECK(at::equal(flash.masked_select(none), at::zeros({none.sum().item<std::int64_t>()})));
      if (c.padded) CHECK(none.any().item<bool>());

      const at::Tensor w = at::randn(dense.sizes());
      const auto inputs = in.all();
      const auto g_dense = torch::autograd::grad({(dense * w).sum()}, inputs);
      const auto g_flash = torch::autograd::grad({(flash * w).sum()}, inputs);
      for (std::size_t i = 0; i < inputs.size(); ++i) {
        CAPTURE(i);  // 0: q, 1..s+1: k blocks, then the v blocks
        CHECK(at::isfinite(g_flash[i]).all().item<bool>());
        CHECK(max_rel(g_flash[i], g_dense[i]) < 1e-5);
      }
    }
  }
}

TEST_CASE("ttt flash: the comparison catches an off-by-one diagonal, a misplaced chain key, a wrong document rule") {
  at::manual_seed(22);
  const Shape sh{2, 4, 2, 10, 8};
  for (std::int64_t s = 0; s <= 3; ++s) {
    CAPTURE(s);
    const Inputs in = make_inputs(sh, s, true, true);
    const at::Tensor flash = ttt_attention_flash({in.q, in.ks, in.vs, in.key_valid, s, 0.5, in.docs}, {4, 3});
    // The test's own mask agrees with flash when written right ...
    CHECK(max_rel(flash, masked_attention(in, s, 0.5, reference_mask(sh.l, s, 0, 0))) < 1e-5);
    // ... and the same comparison fails for each error.
    CHECK(max_rel(flash, masked_attention(in, s, 0.5, reference_mask(sh.l, s, +1, 0))) > 1e-2);
    CHECK(max_rel(flash, masked_attention(in, s, 0.5, reference_mask(sh.l, s, -1, 0))) > 1e-2);
    if (s > 0) CHECK(max_rel(flash, masked_attention(in, s, 0.5, reference_mask(sh.l, s, 0, -1))) > 1e-2);
    Inputs one_doc = in;
    one_doc.docs = at::Tensor();
    CHECK(max_rel(flash, masked_attention(one_doc, s, 0.5, reference_mask(sh.l, s, 0, 0))) > 1e-2);
  }
}

TEST_CASE("ttt flash: bf16 inputs give the float32 result of their upcast, in bf16") {
  at::manual_seed(23);
  const Shape sh{2, 4, 2, 11, 8};
  for (std::int64_t s = 0; s <= 3; ++s) {
    CAPTURE(s);
    const Inputs in = make_inputs(sh, s, true, true, at::kBFloat16);
    Inputs up = in;  // the same values in float32
    up.q = in.q.detach().to(at::kFloat).requires_grad_();
    for (std::size_t i = 0; i < in.ks.size(); ++i) {
      up.ks[i] = in.ks[i].detach().to(at::kFloat).requires_grad_();
      up.vs[i] = in.vs[i].detach().to(at::kFloat).requires_grad_();
    }
    const at::Tensor flash = ttt_attention_flash({in.q, in.ks, in.vs, in.key_valid, s, 0.35, in.docs}, {4, 4});
    const at::Tensor dense = ttt_attention_dense({up.q, up.ks, up.vs, up.key_valid, s, 0.35, up.docs});
    CHECK((flash.scalar_type() == at::kBFloat16));
    // bf16 keeps 8 significant bits: one rounding of the output, relative 2^-8 of the
    // largest value; the gradients are likewise float32 results rounded once.
    const double tol = 1e-2;
    CHECK(max_rel(flash, dense) < tol);
    const at::Tensor w = at::randn(dense.sizes());
    const auto g_flash = torch::autograd::grad({(flash.to(at::kFloat) * w).sum()}, in.all());
    const auto g_dense = torch::autograd::grad({(dense * w).sum()}, up.all());
    for (std::size_t i = 0; i < g_flash.size(); ++i) {
      CAPTURE(i);
      CHECK((g_flash[i].scalar_type() == at::kBFloat16));
      CHECK(max_rel(g_flash[i], g_dense[i]) < tol);
    }
  }
}


TEST_CASE("ttt flash: under CPU autocast it still computes in float32 (the local path does not)") {
  at::manual_seed(24);
  const Inputs in = make_inputs({2, 4, 2, 12, 16}, 2, true, false);
  const at::Tensor plain = ttt_attention_flash({in.q, in.ks, in.vs, in.key_valid, 2, 0.25, {}}, {4, 4});
  const at::Tensor local_plain = ttt_attention_local({in.q, in.ks, in.vs, in.key_valid, 2, 0.25});
  at::Tensor flash, local;
  {
    CpuAutocast autocast;
    flash = ttt_attention_flash({in.q, in.ks, in.vs, in.key_valid, 2, 0.25, {}}, {4, 4});
    local = ttt_attention_local({in.q, in.ks, in.vs, in.key_valid, 2, 0.25});
  }
  CHECK((flash.scalar_type() == at::kFloat));
  CHECK(at::equal(flash, plain));
  // The twin: autocast does reach the local path's matmuls (bf16), so the check can fail.
  CHECK(max_rel(local, local_plain) > 1e-4);
  const auto g = torch::autograd::grad({flash.sum()}, in.all());
  for (const auto& t : g) CHECK(at::isfinite(t).all().item<bool>());
}


TEST_CASE("ttt flash: autograd keeps O(L) bytes where the local path keeps O(L^2)") {
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  auto flash = [](const Inputs& in) {
    return ttt_attention_flash({in.q, in.ks, in.vs, in.key_valid, 2, 0.25, {}}, {64, 64});
  };
  auto local = [](const Inputs& in) { return ttt_attention_local({in.q, in.ks, in.vs, in.key_valid, 2, 0.25}); };
  std::vector<Footprint> f, o;
  const std::vector<std::int64_t> lengths{256, 512, 1024};
  for (const std::int64_t l : lengths) {
    f.push_back(footprint(l, flash));
    o.push_back(footprint(l, local));
    CAPTURE(l);
    // Exactly the float32 output [B, heads, L, D] (also the returned tensor) and the
    // log-sum-exp [B, heads, L]: 4 bytes x 4 heads x L x (16 + 1).
    CHECK(f.back().kept == 4 * 4 * l * 17);
    MESSAGE("L=" << l << " kept: flash " << f.back().kept << " B, local " << o.back().kept << " B; peak: flash "
                 << f.back().peak << " B, local " << o.back().peak << " B");
  }
  at::set_num_threads(threads);
  // Four times the length: the flash node keeps 4x, its peak (tiles of fixed size plus O(L)
  // inputs, gradients and temporaries) grows at most ~4x. The local path keeps the block-0
  // probabilities of its query chunks, (n + 1) / 2n of L x L for n chunks: 12x here (3/4 of
  // L^2 at 2 chunks, 9/16 at 8), never near the 4x of a linear footprint.
  CHECK(f[2].kept == 4 * f[0].kept);
  CHECK(f[2].peak < 5 * f[0].peak);
  CHECK(o[2].kept > 8 * o[0].kept);
  CHECK(o[2].kept > 20 * f[2].kept);
}

TEST_CASE("ttt flash: shape errors say what is wrong") {
  const at::Tensor q = at::zeros({1, 4, 5, 8});
  const at::Tensor k = at::zeros({1, 2, 5, 8});
  const at::Tensor valid = at::ones({1, 5}, at::kBool);
  CHECK(test::message_of<UsageError>([&] { ttt_attention_flash({q, {k}, {k}, valid, 1, 1.0}); }) ==
        "TTT flash attention: step 1 needs 2 key/value blocks, got 1/1");
  CHECK(test::message_of<UsageError>([&] { ttt_attention_flash({q, {at::zeros({1, 3, 5, 8})}, {k}, valid, 0, 1.0}); }) ==
        "TTT flash attention: key/value block shape [1, 3, 5, 8] does not fit q [1, 4, 5, 8]");
  CHECK(test::message_of<UsageError>([&] { ttt_attention_flash({q, {k}, {k}, at::ones({1, 4}, at::kBool), 0, 1.0}); }) ==
        "TTT flash attention: key_valid must be [B, L] = [1, 5]");
  CHECK(test::message_of<UsageError>([&] { ttt_attention_flash({q, {k}, {k}, valid, 0, 1.0, at::zeros({5})}); }) ==
        "TTT flash attention: document_ids must be [B, L] = [1, 5]");
}

namespace {

// The single-rank layout with the local attention at every length: the unroll as it ran
// before ttt_attention_flash existed.
class LocalAttentionContext final : public SequenceContext {
 public:
  std::int64_t global_offset() const override { return 0; }
  std::int64_t global_length(std::int64_t n) const override { return n; }
  at::Tensor shift_right(const at::Tensor& x) override { return single_.shift_right(x); }
  at::Tensor shift_left(const at::Tensor& x) override { return single_.shift_left(x); }
  at::Tensor attention(const TttAttentionInputs& in) override { return ttt_attention_local(in, &masks_); }
  at::Tensor sum_across(const at::Tensor& x) override { return x; }

 private:
  SingleRankContext single_;
  TttMaskCache masks_;
};

// Each parameter's gradient of `a` within 1e-5 (relative) of `b`'s, where `b` has one; returns
// how many were compared.
std::int64_t check_same_grads(TttUnroll& a, TttUnroll& b) {
  const auto pa = a.draft().named_parameters();
  const auto pb = b.draft().named_parameters();
  REQUIRE(pa.size() == pb.size());
  std::int64_t compared = 0;
  for (std::size_t i = 0; i < pa.size(); ++i) {
    CAPTURE(pa[i].first);
    if (!pb[i].second.grad().defined()) continue;
    CHECK(max_rel(pa[i].second.grad(), pb[i].second.grad()) < 1e-5);
    ++compared;
  }
  return compared;
}

}  // namespace

TEST_CASE("ttt flash: SingleRankContext uses it from kTttFlashMinLength on, and the unroll trains the same") {
  SingleRankContext single(TttAttention::kAuto);
  if (ttt_fused_available()) {
    // auto is the fused kernels where built (test_ttt_fused.cpp); the tiles' rule is then
    // the one of a build without them, which this context still follows when asked.
    CHECK(attention_node(single, kTttFlashMinLength).find("TttFused") != std::string::npos);
    single = SingleRankContext(TttAttention::kTiled);
  } else {
    CHECK(attention_node(single, kTttFlashMinLength - 1).find("TttFlash") == std::string::npos);
  }
  CHECK(attention_node(single, kTttFlashMinLength).find("TttFlash") != std::string::npos);

  const DraftConfig c = fixtures::tiny_config();
  const BaseModel base = fixtures::random_base(c, 31);
  // Two rows, one padded, at the length where the flash path starts.
  const TttBatch batch = fixtures::random_batch(c, 2, kTttFlashMinLength, {kTttFlashMinLength, 301}, 32);
  TttUnroll flash(base, DraftModel(c, fixtures::spread_d2t(c), base.lm_head, 33), TttOptions{3, 0.9, std::nullopt});
  TttUnroll local(base, DraftModel(c, fixtures::spread_d2t(c), base.lm_head, 33), TttOptions{3, 0.9, std::nullopt});
  LocalAttentionContext local_context;
  const TttResult a = flash.forward(batch, &single);
  const TttResult b = local.forward(batch, &local_context);
  CHECK(max_rel(a.ce_sum, b.ce_sum) < 1e-5);
  a.loss.backward();
  b.loss.backward();
  check_same_grads(flash, local);
}

TEST_CASE("ttt flash: TttOptions::attention picks the kernel at every length, and local and tiled train the same") {
  // The grad_fn names the kernel that ran: tiled below kTttFlashMinLength, local above it.
  SingleRankContext tiled(TttAttention::kTiled), local(TttAttention::kLocal), automatic(TttAttention::kAuto);
  CHECK(attention_node(tiled, 16).find("TttFlash") != std::string::npos);
  CHECK(attention_node(local, kTttFlashMinLength).find("TttFlash") == std::string::npos);
  if (ttt_fused_available()) {
    CHECK(attention_node(automatic, 16).find("TttFused") != std::string::npos);
  } else {
    CHECK(attention_node(automatic, 16).find("TttFlash") == std::string::npos);
    CHECK(attention_node(automatic, kTttFlashMinLength).find("TttFlash") != std::string::npos);
  }

  // Through the unroll's own context (forward without one), at a length where auto is local.
  const DraftConfig c = fixtures::tiny_config();
  const BaseModel base = fixtures::random_base(c, 41);
  const TttBatch batch = fixtures::random_batch(c, 2, 40, {40, 23}, 42);
  TttOptions to{3, 0.9, std::nullopt};
  to.attention = TttAttention::kTiled;
  TttUnroll a(base, DraftModel(c, fixtures::spread_d2t(c), base.lm_head, 43), to);
  to.attention = TttAttention::kLocal;
  TttUnroll b(base, DraftModel(c, fixtures::spread_d2t(c), base.lm_head, 43), to);
  CHECK(a.options().attention == TttAttention::kTiled);
  const TttResult ra = a.forward(batch);
  const TttResult rb = b.forward(batch);
  CHECK(max_rel(ra.ce_sum, rb.ce_sum) < 1e-5);
  ra.loss.backward();
  rb.loss.backward();
  CHECK(check_same_grads(a, b) >= 8);
}

TEST_CASE("ttt attention: SingleRankContext reads key_valid and document ids on the host once per batch, not per step, layer or backward") {
  std::vector<TttAttention> kinds{TttAttention::kTiled};
  if (ttt_fused_available()) kinds.push_back(TttAttention::kFused);
  for (const TttAttention kind : kinds) {
    const std::string name(ttt_attention_name(kind));
    CAPTURE(name);
    SingleRankContext cx(kind);
    const Shape sh;
    const std::int64_t steps = 3;
    const double scale = 1.0 / std::sqrt(static_cast<double>(sh.d));
    const Inputs in = make_inputs(sh, steps - 1, true, true);
    const std::int64_t reads = tiles::host_keys_reads();
    // What the unroll does: every step, two layers, the same key_valid and document ids.
    at::Tensor loss = at::zeros({});
    for (std::int64_t s = 0; s < steps; ++s) {
      const std::vector<at::Tensor> ks(in.ks.begin(), in.ks.begin() + s + 1), vs(in.vs.begin(), in.vs.begin() + s + 1);
      for (int layer = 0; layer < 2; ++layer)
        loss = loss + cx.attention({in.q, ks, vs, in.key_valid, s, scale, in.docs}).pow(2).sum();
    }
    loss.backward();
    CHECK(tiles::host_keys_reads() - reads == 1);

    // Another batch is read once more; so is the same tensor changed in place, and the result
    // follows the change (a stale host copy would keep the old padding).
    Inputs next = make_inputs(sh, 1, true, true);
    const std::vector<at::Tensor> ks(next.ks.begin(), next.ks.begin() + 2), vs(next.vs.begin(), next.vs.begin() + 2);
    cx.attention({next.q, ks, vs, next.key_valid, 1, scale, next.docs});
    CHECK(tiles::host_keys_reads() - reads == 2);
    next.key_valid[0].narrow(0, 1, 3).fill_(false);
    const at::Tensor got = cx.attention({next.q, ks, vs, next.key_valid, 1, scale, next.docs});
    CHECK(tiles::host_keys_reads() - reads == 3);
    CHECK(max_rel(got, ttt_attention_dense({next.q, ks, vs, next.key_valid, 1, scale, next.docs})) < 1e-5);
  }
}
