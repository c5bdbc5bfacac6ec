#include "tests/torch_doctest.h"
#include <torch/version.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/cuda.h>

#include <string>
#include <vector>

#include "formats/error.h"
#include "tests/support.h"
#include "tests/trainer/trainer_fixtures.h"
#include "tests/trainer/ttt_inputs.h"
#include "trainer/attention/ttt_flash.h"
#include "trainer/attention/ttt_fused.h"
#include "trainer/unroll/ttt.h"

using namespace eaglekit;
using namespace eaglekit::trainer;
using namespace eaglekit::test_attention;

// On LibTorch >= 2.5 (scripts/setup --torch2, as CI builds it) every case checks the kernel;
// a build without the kernels (Debian's LibTorch 1.13) has only the cases that check what
// the user is told instead, so that no case passes by checking nothing.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5)
#define EAGLEKIT_TEST_FUSED 1
#endif

namespace {

}  // namespace

TEST_CASE("ttt fused: a build without the kernels says so and why; one with them says nothing") {
  std::string why;
  const bool available = ttt_fused_available(&why);
  MESSAGE("fused kernels " << (available ? "available" : "not available: " + why));
#ifdef EAGLEKIT_TEST_FUSED
  CHECK(available);
  CHECK(why.empty());
  CHECK_NOTHROW(check_ttt_attention(TttAttention::kFused));
#else
  CHECK_FALSE(available);
  CHECK(why.find("LibTorch >= 2.5") != std::string::npos);
  CHECK(why.find(TORCH_VERSION) != std::string::npos);
  const Inputs in = make_inputs({1, 4, 2, 6, 8}, 1, false, false);
  CHECK(test::message_of<UsageError>([&] { ttt_attention_fused({in.q, in.ks, in.vs, in.key_valid, 1, 0.3}); }) ==
        "TTT fused attention is not available: " + why);
  CHECK(test::message_of<UsageError>([&] { check_ttt_attention(TttAttention::kFused); }) ==
        "--ttt-attention fused is not available: " + why);
#endif
  CHECK_NOTHROW(check_ttt_attention(TttAttention::kTiled));
}

#ifndef EAGLEKIT_TEST_FUSED
TEST_CASE("ttt fused: without the kernels auto keeps its old rule") {
  SingleRankContext automatic(TttAttention::kAuto);
  CHECK(attention_node(automatic, 16).find("TttFused") == std::string::npos);
  CHECK(attention_node(automatic, kTttFlashMinLength).find("TttFlash") != std::string::npos);
}
#else

namespace {

// Padding as collation makes it: each row valid on a prefix (row r of length lengths[r]).
Inputs tail_padded(const Shape& sh, std::int64_t s, const std::vector<std::int64_t>& lengths) {
  Inputs in = make_inputs(sh, s, false, false);
  for (std::int64_t r = 0; r < sh.b; ++r)
    if (lengths[static_cast<std::size_t>(r)] < sh.l)
      in.key_valid[r].narrow(0, lengths[static_cast<std::size_t>(r)], sh.l - lengths[static_cast<std::size_t>(r)])
          .fill_(false);
  return in;
}

// Values within 1e-5 of the dense reference, keyless rows exactly 0, and every gradient
// finite and within 1e-5.
void check_against_dense(const Inputs& in, std::int64_t s, double scale) {
  const at::Tensor dense = ttt_attention_dense({in.q, in.ks, in.vs, in.key_valid, s, scale, in.docs});
  const at::Tensor fused = ttt_attention_fused({in.q, in.ks, in.vs, in.key_valid, s, scale, in.docs});
  REQUIRE(fused.sizes() == in.q.sizes());
  CHECK((fused.scalar_type() == in.q.scalar_type()));
  CHECK(max_rel(fused, dense) < 1e-5);
  const at::Tensor none = keyless_rows(in, s).unsqueeze(1).unsqueeze(-1).expand_as(fused);
  CHECK(at::equal(fused.masked_select(none), at::zeros({none.sum().item<std::int64_t>()})));
  const at::Tensor w = at::randn(dense.sizes());
  const auto inputs = in.all();
  const auto g_dense = torch::autograd::grad({(dense * w).sum()}, inputs);
  const auto g_fused = torch::autograd::grad({(fused * w).sum()}, inputs);
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    CAPTURE(i);  // 0: q, 1..s+1: k blocks, then the v blocks
    CHECK(at::isfinite(g_fused[i]).all().item<bool>());
    CHECK(max_rel(g_fused[i], g_dense[i]) < 1e-5);
  }
}

}  // namespace

TEST_CASE("ttt fused: values and gradients equal the dense attention under the docs/ttt.md mask") {
  struct Case {
    const char* name;
    Shape shape;
    bool padded, packed;
  };
  const std::vector<Case> cases{
      {"plain rows", {2, 4, 2, 9, 8}, false, false},
      {"padding with holes, keyless queries, a row of padding (masked calls)", {3, 4, 2, 11, 8}, true, false},
      {"packed documents", {2, 4, 2, 10, 8}, false, true},
      {"packed and padded", {2, 4, 2, 11, 8}, true, true},
      {"GQA 4/1", {2, 4, 1, 9, 8}, true, true},
      {"MHA 4/4", {2, 4, 4, 9, 8}, true, false},
      {"one row, one head pair, L 1", {1, 2, 1, 1, 4}, false, false},
      {"longer rows", {2, 4, 2, 300, 8}, true, false},
  };
  at::manual_seed(121);
  for (const Case& c : cases) {
    for (std::int64_t s = 0; s <= 3; ++s) {
      CAPTURE(c.name);
      CAPTURE(s);
      check_against_dense(make_inputs(c.shape, s, c.padded, c.packed), s, 0.35);
    }
  }
  // Tail padding (no mask: a causal call on the valid keys, a plain one past them), rows of
  // different lengths, one of them empty and one shorter than the step.
  for (std::int64_t s = 0; s <= 4; ++s) {
    CAPTURE(s);
    check_against_dense(tail_padded({4, 4, 2, 13, 8}, s, {13, 7, 0, 2}), s, 0.3);
  }
  // Packed rows whose documents end in tail padding inside the row.
  for (std::int64_t s = 0; s <= 3; ++s) {
    CAPTURE(s);
    Inputs in = make_inputs({2, 4, 2, 12, 8}, s, false, true);
    in.key_valid[0].narrow(0, 4, 2).fill_(false);   // the end of document 0
    in.key_valid[1].narrow(0, 9, 3).fill_(false);   // the row's tail
    check_against_dense(in, s, 0.3);
  }
}

TEST_CASE("ttt fused: the comparison catches an off-by-one diagonal, a misplaced chain key, a wrong document rule") {
  at::manual_seed(122);
  const Shape sh{2, 4, 2, 10, 8};
  for (std::int64_t s = 0; s <= 3; ++s) {
    CAPTURE(s);
    for (const bool padded : {false, true}) {
      CAPTURE(padded);
      const Inputs in = make_inputs(sh, s, padded, true);
      const at::Tensor fused = ttt_attention_fused({in.q, in.ks, in.vs, in.key_valid, s, 0.5, in.docs});
      CHECK(max_rel(fused, masked_attention(in, s, 0.5, reference_mask(sh.l, s, 0, 0))) < 1e-5);
      CHECK(max_rel(fused, masked_attention(in, s, 0.5, reference_mask(sh.l, s, +1, 0))) > 1e-2);
      CHECK(max_rel(fused, masked_attention(in, s, 0.5, reference_mask(sh.l, s, -1, 0))) > 1e-2);
      if (s > 0) CHECK(max_rel(fused, masked_attention(in, s, 0.5, reference_mask(sh.l, s, 0, -1))) > 1e-2);
      Inputs one_doc = in;
      one_doc.docs = at::Tensor();
      CHECK(max_rel(fused, masked_attention(one_doc, s, 0.5, reference_mask(sh.l, s, 0, 0))) > 1e-2);
    }
  }
}

TEST_CASE("ttt fused: bf16 inputs run the kernel in bf16 and stay within bf16 rounding of float32") {
  at::manual_seed(123);
  const Shape sh{2, 4, 2, 11, 8};
  for (std::int64_t s = 0; s <= 3; ++s) {
    CAPTURE(s);
    const Inputs in = make_inputs(sh, s, true, true, at::kBFloat16);
    Inputs up = in;
    up.q = in.q.detach().to(at::kFloat).requires_grad_();
    for (std::size_t i = 0; i < in.ks.size(); ++i) {
      up.ks[i] = in.ks[i].detach().to(at::kFloat).requires_grad_();
      up.vs[i] = in.vs[i].detach().to(at::kFloat).requires_grad_();
    }
    const at::Tensor fused = ttt_attention_fused({in.q, in.ks, in.vs, in.key_valid, s, 0.35, in.docs});
    const at::Tensor dense = ttt_attention_dense({up.q, up.ks, up.vs, up.key_valid, s, 0.35, up.docs});
    CHECK((fused.scalar_type() == at::kBFloat16));
    // bf16 keeps 8 significant bits; the kernel's probabilities are rounded to bf16 before
    // P V, so a few roundings of the output: 2e-2 of the largest value.
    const double tol = 2e-2;
    CHECK(max_rel(fused, dense) < tol);
    const at::Tensor w = at::randn(dense.sizes());
    const auto g_fused = torch::autograd::grad({(fused.to(at::kFloat) * w).sum()}, in.all());
    const auto g_dense = torch::autograd::grad({(dense * w).sum()}, up.all());
    for (std::size_t i = 0; i < g_fused.size(); ++i) {
      CAPTURE(i);
      CHECK((g_fused[i].scalar_type() == at::kBFloat16));
      CHECK(max_rel(g_fused[i], g_dense[i]) < tol);
    }
  }
}

TEST_CASE("ttt fused: autograd keeps O(L) bytes, as the tiles do") {
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  auto fused = [](const Inputs& in) { return ttt_attention_fused({in.q, in.ks, in.vs, in.key_valid, 2, 0.25}); };
  std::vector<Footprint> f;
  // From L = 1024 on: below 768 positions the CPU kernel picks smaller blocks (a fixed
  // per-thread buffer of query block x key block scores that grows with them), above it
  // its blocks are fixed.
  for (const std::int64_t l : {1024, 2048, 4096}) {
    f.push_back(footprint(l, fused));
    CAPTURE(l);
    // The float32 output [B, heads, L, D] (also the returned tensor) and the log-sum-exp
    // [B, heads, L]: 4 bytes x 4 heads x L x (16 + 1), exactly what the tiled node keeps.
    CHECK(f.back().kept == 4 * 4 * l * 17);
    MESSAGE("L=" << l << " kept " << f.back().kept << " B, peak " << f.back().peak << " B");
  }
  at::set_num_threads(threads);
  CHECK(f[2].kept == 4 * f[0].kept);
  CHECK(f[2].peak < 5 * f[0].peak);
}

TEST_CASE("ttt fused: shape errors say what is wrong") {
  const at::Tensor q = at::zeros({1, 4, 5, 8});
  const at::Tensor k = at::zeros({1, 2, 5, 8});
  CHECK(test::message_of<UsageError>([&] { ttt_attention_fused({q, {k}, {k}, at::ones({1, 5}, at::kBool), 1, 1.0}); }) ==
        "TTT fused attention: step 1 needs 2 key/value blocks, got 1/1");
  CHECK(test::message_of<UsageError>([&] { ttt_attention_fused({q, {k}, {k}, at::ones({1, 4}, at::kBool), 0, 1.0}); }) ==
        "TTT fused attention: key_valid must be [B, L] = [1, 5]");
}

TEST_CASE("ttt fused: auto picks it where built; the unroll trains the same as local, 1- and 2-layer drafts") {
  SingleRankContext automatic(TttAttention::kAuto);
  SingleRankContext fused(TttAttention::kFused);
  CHECK(attention_node(fused, 16).find("TttFused") != std::string::npos);
  CHECK(attention_node(automatic, 16).find("TttFused") != std::string::npos);
  CHECK(attention_node(automatic, kTttFlashMinLength).find("TttFused") != std::string::npos);

  for (const std::int64_t layers : {1, 2}) {
    for (const bool packed : {false, true}) {
      CAPTURE(layers);
      CAPTURE(packed);
      DraftConfig c = fixtures::tiny_config();
      c.num_hidden_layers = layers;
      const BaseModel base = fixtures::random_base(c, 141);
      TttBatch batch = fixtures::random_batch(c, 2, 40, {40, 23}, 142);
      // Row 0 holds two documents (positions 0..16 and 17..39); row 1 one, then padding.
      if (packed) fixtures::pack_first_row(batch, 17);
      TttOptions to{3, 0.9, std::nullopt};
      to.attention = TttAttention::kFused;
      TttUnroll a(base, DraftModel(c, fixtures::spread_d2t(c), base.lm_head, 143), to);
      to.attention = TttAttention::kLocal;
      TttUnroll b(base, DraftModel(c, fixtures::spread_d2t(c), base.lm_head, 143), to);
      const TttResult ra = a.forward(batch);
      const TttResult rb = b.forward(batch);
      CHECK(max_rel(ra.ce_sum, rb.ce_sum) < 1e-5);
      ra.loss.backward();
      rb.loss.backward();
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
      CHECK(compared >= 8 * layers);
    }
  }
}
namespace {
// Decided once, when the cases register: doctest then reports the case as skipped.
const bool kNoCudaDevice = !torch::cuda::is_available();
}  // namespace

// The CUDA kernels (flash for bf16, memory-efficient for float32; holes in the padding go to
// the tiles) against the dense reference computed on the CPU from the same values. Skipped,
// and counted as skipped, where no CUDA device is visible (here and in CI: scripts/gpu_check
// runs it on a GPU machine).
TEST_CASE("ttt fused: on a CUDA device (skipped without one) it equals the dense attention" *
          doctest::skip(kNoCudaDevice)) {
  at::manual_seed(151);
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (std::int64_t s = 0; s <= 3; ++s) {
      for (int variant = 0; variant < 3; ++variant) {  // tail padding, packed, holes
        CAPTURE(s);
        CAPTURE(variant);
        const Inputs cpu = variant == 0   ? tail_padded({3, 8, 2, 64, 64}, s, {64, 40, 3})
                           : variant == 1 ? make_inputs({2, 8, 2, 64, 64}, s, false, true)
                                          : make_inputs({3, 8, 2, 64, 64}, s, true, false);
        auto on_cuda = [&](const at::Tensor& t) { return t.detach().to(at::kCUDA, dtype).requires_grad_(); };
        Inputs gpu = cpu;
        gpu.q = on_cuda(cpu.q);
        for (std::size_t i = 0; i < cpu.ks.size(); ++i) {
          gpu.ks[i] = on_cuda(cpu.ks[i]);
          gpu.vs[i] = on_cuda(cpu.vs[i]);
        }
        gpu.key_valid = cpu.key_valid.to(at::kCUDA);
        if (cpu.docs.defined()) gpu.docs = cpu.docs.to(at::kCUDA);
        const at::Tensor fused = ttt_attention_fused({gpu.q, gpu.ks, gpu.vs, gpu.key_valid, s, 0.125, gpu.docs});
        const at::Tensor dense = ttt_attention_dense({cpu.q, cpu.ks, cpu.vs, cpu.key_valid, s, 0.125, cpu.docs});
        const double tol = dtype == at::kFloat ? 1e-4 : 2e-2;  // TF32-free fp32 kernels; bf16 roundings
        CHECK(max_rel(fused.cpu(), dense) < tol);
        const at::Tensor w = at::randn(dense.sizes());
        const auto g_fused = torch::autograd::grad({(fused.to(at::kFloat) * w.to(at::kCUDA)).sum()}, gpu.all());
        const auto g_dense = torch::autograd::grad({(dense * w).sum()}, cpu.all());
        for (std::size_t i = 0; i < g_fused.size(); ++i) {
          CAPTURE(i);
          CHECK(max_rel(g_fused[i].cpu(), g_dense[i]) < tol);
        }
      }
    }
  }
}

#endif  // EAGLEKIT_TEST_FUSED
