// Inputs and independent checks shared by the tests of the TTT attention kernels
// (test_ttt_flash.cpp: the tiles; test_ttt_fused.cpp: LibTorch's fused kernels): random
// q / k / v blocks with padding and packed documents, the TTT mask written out once more
// (with deliberate errors for the must-fail checks), and the allocation footprint of one
// forward + backward.
#pragma once

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "tests/tensor_compare.h"
#include "trainer/run/cpu_memory.h"
#include "trainer/unroll/ttt.h"

namespace eaglekit::test_attention {

using trainer::attend;
using trainer::CpuAllocationProbe;
using trainer::ttt_mask;

using test::tensor_rel_diff;
inline double max_rel(const at::Tensor& a, const at::Tensor& b) { return tensor_rel_diff(a, b); }

struct Inputs {
  at::Tensor q;
  std::vector<at::Tensor> ks, vs;
  at::Tensor key_valid, docs;
  std::vector<at::Tensor> all() const {
    std::vector<at::Tensor> x{q};
    x.insert(x.end(), ks.begin(), ks.end());
    x.insert(x.end(), vs.begin(), vs.end());
    return x;
  }
};

struct Shape {
  std::int64_t b = 2, heads = 4, kv_heads = 2, l = 9, d = 8;
};

// Random q/k/v for step s; padding: row 1 has a hole at position 3 and padding after
// position 6, and its key 0 is invalid (query 0 sees no key at step 0, nor at step 1 where
// its only key is position 0 of block 1); row 2 (when b > 2) is all padding. Packed: row 0
// holds two documents split at l / 2, row 1 a third one and a padding "document" -1.
inline Inputs make_inputs(const Shape& sh, std::int64_t s, bool padded, bool packed, at::ScalarType dtype = at::kFloat) {
  Inputs in;
  in.q = at::randn({sh.b, sh.heads, sh.l, sh.d}).to(dtype).requires_grad_();
  for (std::int64_t i = 0; i <= s; ++i) {
    in.ks.push_back(at::randn({sh.b, sh.kv_heads, sh.l, sh.d}).to(dtype).requires_grad_());
    in.vs.push_back(at::randn({sh.b, sh.kv_heads, sh.l, sh.d}).to(dtype).requires_grad_());
  }
  in.key_valid = at::ones({sh.b, sh.l}, at::kBool);
  if (padded && sh.b > 1) {
    if (sh.l > 6) in.key_valid[1].narrow(0, 6, sh.l - 6).fill_(false);
    if (sh.l > 3) in.key_valid[1][3] = false;
    in.key_valid[1][0] = false;
    if (sh.b > 2) in.key_valid[2].fill_(false);
  }
  if (packed) {
    in.docs = at::zeros({sh.b, sh.l}, at::kLong);
    in.docs[0].narrow(0, sh.l / 2, sh.l - sh.l / 2).fill_(1);
    if (sh.b > 1) {
      in.docs[1].fill_(2);
      if (sh.l > 6) in.docs[1].narrow(0, 6, sh.l - 6).fill_(-1);
    }
  }
  return in;
}

// The TTT mask written out once more, here with deliberate errors for the must-fail checks:
// block 0 sees j <= q - s + diagonal_error, block i the key of position q - (s - i) + chain_error.
inline at::Tensor reference_mask(std::int64_t l, std::int64_t s, std::int64_t diagonal_error, std::int64_t chain_error) {
  at::Tensor m = at::zeros({l, l * (s + 1)}, at::kBool);
  for (std::int64_t q = 0; q < l; ++q) {
    for (std::int64_t j = 0; j <= q - s + diagonal_error && j < l; ++j) m[q][j] = true;
    for (std::int64_t i = 1; i <= s; ++i) {
      const std::int64_t p = q - (s - i) + chain_error;
      if (p >= 0 && p < l) m[q][i * l + p] = true;
    }
  }
  return m;
}

inline at::Tensor masked_attention(const Inputs& in, std::int64_t s, double scale, const at::Tensor& mask) {
  at::Tensor allowed = mask.unsqueeze(0) & in.key_valid.repeat({1, s + 1}).unsqueeze(1);
  if (in.docs.defined()) allowed = allowed & (in.docs.unsqueeze(2) == in.docs.repeat({1, s + 1}).unsqueeze(1));
  return attend(in.q, at::cat(in.ks, 2), at::cat(in.vs, 2), allowed, scale).out.to(in.q.scalar_type());
}

// Rows (b, q) with no visible key: [B, L] bool.
inline at::Tensor keyless_rows(const Inputs& in, std::int64_t s) {
  const std::int64_t l = in.q.size(2);
  at::Tensor allowed = ttt_mask(l, s).unsqueeze(0) & in.key_valid.repeat({1, s + 1}).unsqueeze(1);
  if (in.docs.defined()) allowed = allowed & (in.docs.unsqueeze(2) == in.docs.repeat({1, s + 1}).unsqueeze(1));
  return allowed.any(-1).logical_not();
}

// CPU autocast to bf16 for the guard's lifetime (the API moved in LibTorch 2.4).
struct CpuAutocast {
  CpuAutocast() {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
    at::autocast::set_autocast_enabled(c10::DeviceType::CPU, true);
    at::autocast::set_autocast_dtype(c10::DeviceType::CPU, at::kBFloat16);
#else
    at::autocast::set_cpu_enabled(true);
    at::autocast::set_autocast_cpu_dtype(at::kBFloat16);
#endif
  }
  ~CpuAutocast() {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
    at::autocast::set_autocast_enabled(c10::DeviceType::CPU, false);
#else
    at::autocast::set_cpu_enabled(false);
#endif
    at::autocast::clear_cache();
  }
};

// Bytes that stay allocated after the forward pass (what autograd keeps for backward, plus
// the output), and the peak of one forward + backward, on one thread so that every
// allocation is seen.
struct Footprint {
  std::int64_t kept = 0, peak = 0;
};

template <typename F>
Footprint footprint(std::int64_t l, F&& attention) {
  at::manual_seed(25);
  const Inputs in = make_inputs({1, 4, 2, l, 16}, 2, false, false);
  Footprint f;
  CpuAllocationProbe probe;
  {
    at::Tensor out = attention(in);
    f.kept = probe.live_bytes();
    const auto g = torch::autograd::grad({out.sum()}, in.all());
  }
  f.peak = probe.peak_bytes();
  return f;
}


// The name of the autograd node that SingleRankContext's attention ends in at length l (which
// path it took: dense, tiled or fused).
inline std::string attention_node(trainer::SingleRankContext& context, std::int64_t l) {
  const Inputs in = make_inputs({1, 4, 2, l, 8}, 1, false, false);
  return context.attention({in.q, in.ks, in.vs, in.key_valid, 1, 0.3}).grad_fn()->name();
}

}  // namespace eaglekit::test_attention
