// Fused float32 CPU kernels for the elementwise chains of a draft training step
// (docs/benchmarks.md, "Training on the CPU"). Each replaces a chain of ATen operators that
// reads and writes the same rows several times (and, on a shared machine, wakes the OpenMP
// team once per operator) with one pass per direction, as one autograd node: RMSNorm, RoPE,
// SwiGLU and the lm_head's soft cross-entropy. The draft's projections that read one input
// (q, k, v; gate, up) then run as one matmul each on this path (trainer/model/draft_model.cpp).
// The maths is the composite's, in float32; results agree with it to float rounding
// (tests/trainer/test_cpu_kernels.cpp).
//
// They take float32 CPU tensors only (`takes`); every other device, dtype or autocast
// dtype keeps the ATen composite.
//
// Vectorized for x86-64-v3 (AVX2 + FMA) and x86-64-v4 (AVX-512) where GCC builds function
// clones, picked at load time by the CPU. They are on by default only there: the plain
// x86-64 build of the loops (SSE2) measured 0.95x the composites on an AVX-512 CPU, whose
// ATen kernels are vectorized for it. EAGLEKIT_CPU_KERNELS=1 / 0 in the environment (read
// once) forces them on / off; set_enabled does the same in-process (bench_train_step
// --cpu-kernels, the tests).
#pragma once

#include <ATen/core/Tensor.h>

#include "trainer/model/soft_ce.h"

namespace eaglekit::trainer::cpu_kernels {

// On: EAGLEKIT_CPU_KERNELS, else whether this CPU runs the AVX2 or AVX-512 clones.
bool enabled();
void set_enabled(bool on);
// Whether this CPU runs a vectorized clone (x86-64 with AVX2 and FMA, GCC builds).
bool cpu_has_vector_clones();

// Enabled, and `x` is a float32 tensor on the CPU.
bool takes(const at::Tensor& x);

// Llama's RMSNorm over the last dimension: weight * (x * rsqrt(mean(x^2) + eps)).
// Differentiable in x and weight.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// Rotary embedding of x [B, heads, L, D] (any strides): x * cos + rotate_half(x) * sin with
// tables [L, D] or [B, L, D] (float32, not differentiated). Differentiable in x.
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// silu(gate) * up from gate_up [..., 2 I] = cat(gate, up) (one matmul for both
// projections): [..., I]. Differentiable.
at::Tensor swiglu(const at::Tensor& gate_up);

// The TTT step's lm_head and soft cross-entropy (soft_ce.h's contract, unchunked): logits
// x weight^T by one matmul, then per row one pass for max, argmax, log-sum-exp and the
// target sums, keeping softmax(logits) for backward instead of the log-probabilities and
// their product with the targets. x [rows, H] and weight [Vd, H] differentiable; p [rows, Vd]
// and w [rows] float32, not.
SoftCeResult soft_ce(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& p, const at::Tensor& w);

}  // namespace eaglekit::trainer::cpu_kernels
