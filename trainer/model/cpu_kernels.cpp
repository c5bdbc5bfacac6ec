#include "trainer/model/cpu_kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "formats/error.h"

// GCC builds each row kernel three times (AVX-512, AVX2 + FMA, plain x86-64) and picks one
// when the library loads; elsewhere the one build for the compile flags. This file is
// compiled with -O3 -fopenmp-simd (CMakeLists.txt) so that the loops below vectorize.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define EAGLEKIT_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define EAGLEKIT_CLONES
#endif
#define EAGLEKIT_INLINE inline __attribute__((always_inline))

namespace eaglekit::trainer::cpu_kernels {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::atomic<int> g_enabled{-1};

// exp(x) in float32 without libm, so that it vectorizes: x = n ln2 + r, |r| <= ln2 / 2,
// e^r by Cephes' expf polynomial (relative error ~1e-7), 2^n in the exponent bits. Below
// -88 it returns 0, above 88 e^88; NaN stays NaN.
EAGLEKIT_INLINE float exp_f(float x) {
  x = x < -88.0f ? -88.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const std::int32_t bits = (static_cast<std::int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

// Rows of at least this many values per task: below it the OpenMP wake-up costs more than
// the work.
std::int64_t grain_rows(std::int64_t cols) { return std::max<std::int64_t>(1, (std::int64_t{1} << 14) / std::max<std::int64_t>(cols, 1)); }

// --- RMSNorm ---

EAGLEKIT_CLONES void rms_forward_rows(const float* x, const float* w, float* y, float* rstd, std::int64_t r0,
                                      std::int64_t r1, std::int64_t h, float eps) {
  for (std::int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * h;
    float* yr = y + r * h;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (std::int64_t j = 0; j < h; ++j) ss += xr[j] * xr[j];
    const float rs = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
    rstd[r] = rs;
#pragma omp simd
    for (std::int64_t j = 0; j < h; ++j) yr[j] = w[j] * (xr[j] * rs);
  }
}

// dx = rstd (g - xhat mean(g xhat)) with g = dy w, xhat = x rstd; dw_part += dy xhat.
EAGLEKIT_CLONES void rms_backward_rows(const float* x, const float* w, const float* rstd, const float* dy, float* dx,
                                       float* dw_part, std::int64_t r0, std::int64_t r1, std::int64_t h) {
  for (std::int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * h;
    const float* dyr = dy + r * h;
    float* dxr = dx + r * h;
    const float rs = rstd[r];
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (std::int64_t j = 0; j < h; ++j) dot += dyr[j] * w[j] * xr[j];
    const float c = dot * rs / static_cast<float>(h);
#pragma omp simd
    for (std::int64_t j = 0; j < h; ++j) {
      const float xhat = xr[j] * rs;
      dxr[j] = rs * (dyr[j] * w[j] - xhat * c);
      dw_part[j] += dyr[j] * xhat;
    }
  }
}

struct RmsNormFunction : torch::autograd::Function<RmsNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x_in, const at::Tensor& weight, double eps) {
    const at::Tensor x = x_in.contiguous();
    const at::Tensor w = weight.contiguous();
    const std::int64_t h = x.size(-1), rows = h > 0 ? x.numel() / h : 0;
    at::Tensor y = at::empty_like(x);
    at::Tensor rstd = at::empty({rows}, x.options());
    const float* xp = x.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    float* rp = rstd.data_ptr<float>();
    at::parallel_for(0, rows, grain_rows(h), [&](std::int64_t r0, std::int64_t r1) {
      rms_forward_rows(xp, wp, yp, rp, r0, r1, h, static_cast<float>(eps));
    });
    ctx->save_for_backward({x, w, rstd});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1], &rstd = saved[2];
    const at::Tensor dy = grads[0].contiguous();
    const std::int64_t h = x.size(-1), rows = h > 0 ? x.numel() / h : 0;
    at::Tensor dx = at::empty_like(x);
    // Weight gradient: fixed blocks of rows, each into its own partial sum, whatever the
    // thread count (the same bits with 1 thread or 16).
    const std::int64_t blocks = std::min<std::int64_t>(std::max<std::int64_t>(rows, 1), 64);
    at::Tensor parts = at::zeros({blocks, h}, x.options());
    const float* xp = x.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    const float* rp = rstd.data_ptr<float>();
    const float* dyp = dy.data_ptr<float>();
    float* dxp = dx.data_ptr<float>();
    float* pp = parts.data_ptr<float>();
    // Threads only when there is enough work (grain_rows), as in the forward.
    const std::int64_t grain = rows < grain_rows(h) ? blocks : 1;
    at::parallel_for(0, blocks, grain, [&](std::int64_t b0, std::int64_t b1) {
      for (std::int64_t b = b0; b < b1; ++b)
        rms_backward_rows(xp, wp, rp, dyp, dxp, pp + b * h, rows * b / blocks, rows * (b + 1) / blocks, h);
    });
    return {dx, parts.sum(0), at::Tensor()};
  }
};

// --- RoPE ---

// x and out [rows, heads, d] (rows = B * L, batch-major), tables [table_rows, d]: row r reads
// table row r % table_rows (tables [L, D]: table_rows = L; per-row tables [B, L, D]: rows).
EAGLEKIT_CLONES void rope_rows(const float* x, const float* cos, const float* sin, float* out, std::int64_t r0,
                               std::int64_t r1, std::int64_t heads, std::int64_t d, std::int64_t table_rows,
                               bool backward) {
  const std::int64_t half = d / 2;
  for (std::int64_t r = r0; r < r1; ++r) {
    const float* c = cos + (r % table_rows) * d;
    const float* s = sin + (r % table_rows) * d;
    for (std::int64_t hh = 0; hh < heads; ++hh) {
      const float* xr = x + (r * heads + hh) * d;
      float* o = out + (r * heads + hh) * d;
      if (!backward) {
        // x c + rotate_half(x) s, rotate_half(x) = cat(-x2, x1)
#pragma omp simd
        for (std::int64_t j = 0; j < half; ++j) o[j] = xr[j] * c[j] + (-xr[j + half]) * s[j];
#pragma omp simd
        for (std::int64_t j = half; j < d; ++j) o[j] = xr[j] * c[j] + xr[j - half] * s[j];
      } else {
        // dx = dy c + rotate_half^T(dy s), rotate_half^T(v) = cat(v2, -v1)
#pragma omp simd
        for (std::int64_t j = 0; j < half; ++j) o[j] = xr[j] * c[j] + xr[j + half] * s[j + half];
#pragma omp simd
        for (std::int64_t j = half; j < d; ++j) o[j] = xr[j] * c[j] - xr[j - half] * s[j - half];
      }
    }
  }
}

// x [B, heads, L, D] in any layout -> the same, computed over the [B, L, heads, D] rows.
at::Tensor rope_apply(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward) {
  const std::int64_t b = x.size(0), heads = x.size(1), l = x.size(2), d = x.size(3);
  const at::Tensor xc = x.transpose(1, 2).contiguous();  // [B, L, heads, D]
  at::Tensor out = at::empty_like(xc);
  const std::int64_t rows = b * l;
  const std::int64_t table_rows = cos.dim() == 3 ? rows : l;
  const float* xp = xc.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(heads * d), [&](std::int64_t r0, std::int64_t r1) {
    rope_rows(xp, cp, sp, op, r0, r1, heads, d, table_rows, backward);
  });
  return out.transpose(1, 2);
}

struct RopeFunction : torch::autograd::Function<RopeFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    return rope_apply(x, cos, sin, false);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    return {rope_apply(grads[0], saved[0], saved[1], true), at::Tensor(), at::Tensor()};
  }
};

// --- SwiGLU ---

// gu [rows, 2 i] = cat(gate, up) per row; y [rows, i] = silu(gate) up.
EAGLEKIT_CLONES void swiglu_forward_rows(const float* gu, float* y, std::int64_t r0, std::int64_t r1, std::int64_t i) {
  for (std::int64_t r = r0; r < r1; ++r) {
    const float* g = gu + r * 2 * i;
    const float* u = g + i;
    float* yr = y + r * i;
#pragma omp simd
    for (std::int64_t j = 0; j < i; ++j) yr[j] = g[j] / (1.0f + exp_f(-g[j])) * u[j];
  }
}

EAGLEKIT_CLONES void swiglu_backward_rows(const float* gu, const float* dy, float* dgu, std::int64_t r0,
                                          std::int64_t r1, std::int64_t i) {
  for (std::int64_t r = r0; r < r1; ++r) {
    const float* g = gu + r * 2 * i;
    const float* u = g + i;
    const float* dyr = dy + r * i;
    float* dg = dgu + r * 2 * i;
    float* du = dg + i;
#pragma omp simd
    for (std::int64_t j = 0; j < i; ++j) {
      const float sig = 1.0f / (1.0f + exp_f(-g[j]));
      du[j] = dyr[j] * (g[j] * sig);
      dg[j] = dyr[j] * u[j] * (sig * (1.0f + g[j] * (1.0f - sig)));
    }
  }
}

struct SwigluFunction : torch::autograd::Function<SwigluFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate_up) {
    const at::Tensor gu = gate_up.contiguous();
    const std::int64_t i = gu.size(-1) / 2, rows = i > 0 ? gu.numel() / (2 * i) : 0;
    std::vector<std::int64_t> shape = gu.sizes().vec();
    shape.back() = i;
    at::Tensor y = at::empty(shape, gu.options());
    const float* gp = gu.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, rows, grain_rows(2 * i),
                     [&](std::int64_t r0, std::int64_t r1) { swiglu_forward_rows(gp, yp, r0, r1, i); });
    ctx->save_for_backward({gu});
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor gu = ctx->get_saved_variables()[0];
    const std::int64_t i = gu.size(-1) / 2, rows = i > 0 ? gu.numel() / (2 * i) : 0;
    const at::Tensor dy = grads[0].contiguous();
    at::Tensor dgu = at::empty_like(gu);
    const float* gp = gu.data_ptr<float>();
    const float* dyp = dy.data_ptr<float>();
    float* dp = dgu.data_ptr<float>();
    at::parallel_for(0, rows, grain_rows(2 * i),
                     [&](std::int64_t r0, std::int64_t r1) { swiglu_backward_rows(gp, dyp, dp, r0, r1, i); });
    return {dgu};
  }
};

// --- lm_head + soft cross-entropy ---

// Per row of z [rows, v] (the logits, replaced by softmax(z)): argmax, psum = sum p and
// ce = w (lse psum - p.z), as w (log(sum e^(z - m)) psum - p.(z - m)) with m the row's max.
EAGLEKIT_CLONES void soft_ce_forward_rows(float* z, const float* p, const float* w, float* ce, float* psum,
                                          std::int64_t* argmax, std::int64_t r0, std::int64_t r1, std::int64_t v) {
  for (std::int64_t r = r0; r < r1; ++r) {
    float* zr = z + r * v;
    const float* pr = p + r * v;
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (std::int64_t j = 0; j < v; ++j) m = zr[j] > m ? zr[j] : m;
    std::int64_t am = 0;
    for (std::int64_t j = 0; j < v; ++j)
      if (zr[j] == m) {
        am = j;
        break;
      }
    float s = 0.0f, dot = 0.0f, ps = 0.0f;
#pragma omp simd reduction(+ : s, dot, ps)
    for (std::int64_t j = 0; j < v; ++j) {
      const float d = zr[j] - m;
      const float e = exp_f(d);
      zr[j] = e;
      s += e;
      dot += pr[j] * d;
      ps += pr[j];
    }
    const float inv = 1.0f / s;
#pragma omp simd
    for (std::int64_t j = 0; j < v; ++j) zr[j] *= inv;
    argmax[r] = am;
    psum[r] = ps;
    ce[r] = w[r] * (std::log(s) * ps - dot);
  }
}

// dz = g w (softmax psum - p)
EAGLEKIT_CLONES void soft_ce_backward_rows(const float* prob, const float* p, const float* w, const float* psum, float g,
                                           float* dz, std::int64_t r0, std::int64_t r1, std::int64_t v) {
  for (std::int64_t r = r0; r < r1; ++r) {
    const float* sr = prob + r * v;
    const float* pr = p + r * v;
    float* dr = dz + r * v;
    const float gw = g * w[r];
    const float ps = psum[r];
#pragma omp simd
    for (std::int64_t j = 0; j < v; ++j) dr[j] = gw * (sr[j] * ps - pr[j]);
  }
}

struct SoftCeFunction : torch::autograd::Function<SoftCeFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& p,
                               const at::Tensor& w) {
    const std::int64_t rows = x.size(0), v = weight.size(0);
    at::Tensor z = at::mm(x, weight.t()).contiguous();
    at::Tensor ce = at::empty({rows}, x.options());
    at::Tensor psum = at::empty({rows}, x.options());
    at::Tensor argmax = at::empty({rows}, x.options().dtype(at::kLong));
    float* zp = z.data_ptr<float>();
    const float* pp = p.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    float* cp = ce.data_ptr<float>();
    float* sp = psum.data_ptr<float>();
    std::int64_t* ap = argmax.data_ptr<std::int64_t>();
    at::parallel_for(0, rows, grain_rows(v), [&](std::int64_t r0, std::int64_t r1) {
      soft_ce_forward_rows(zp, pp, wp, cp, sp, ap, r0, r1, v);
    });
    double total = 0;
    for (std::int64_t r = 0; r < rows; ++r) total += cp[r];
    ctx->save_for_backward({x, weight, p, w, z, psum});
    ctx->mark_non_differentiable({argmax});
    return {at::full({}, total, x.options()), argmax};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &p = saved[2], &w = saved[3], &prob = saved[4],
                     &psum = saved[5];
    const std::int64_t rows = x.size(0), v = weight.size(0);
    const float g = grads[0].defined() ? grads[0].item<float>() : 0.0f;
    at::Tensor dz = at::empty({rows, v}, x.options());
    const float* sp = prob.data_ptr<float>();
    const float* pp = p.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    const float* psp = psum.data_ptr<float>();
    float* dp = dz.data_ptr<float>();
    at::parallel_for(0, rows, grain_rows(v), [&](std::int64_t r0, std::int64_t r1) {
      soft_ce_backward_rows(sp, pp, wp, psp, g, dp, r0, r1, v);
    });
    return {at::mm(dz, weight), at::mm(dz.t(), x), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

bool cpu_has_vector_clones() {
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool enabled() {
  int e = g_enabled.load(std::memory_order_relaxed);
  if (e < 0) {
    const char* env = std::getenv("EAGLEKIT_CPU_KERNELS");
    const std::string v = env != nullptr ? env : "";
    e = v == "0" ? 0 : v == "1" ? 1 : cpu_has_vector_clones() ? 1 : 0;
    g_enabled.store(e, std::memory_order_relaxed);
  }
  return e == 1;
}

void set_enabled(bool on) { g_enabled.store(on ? 1 : 0, std::memory_order_relaxed); }

bool takes(const at::Tensor& x) {
  return x.defined() && x.device().is_cpu() && x.scalar_type() == at::kFloat && x.layout() == at::kStrided &&
         enabled();
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (!takes(x) || !takes(weight) || weight.dim() != 1 || x.dim() < 1 || x.size(-1) != weight.size(0))
    throw UsageError("cpu_kernels::rms_norm: x " + c10::str(x.sizes()) + " and weight " + c10::str(weight.sizes()) +
                     " must be float32 CPU tensors [..., H] and [H]");
  return RmsNormFunction::apply(x, weight, eps);
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const bool tables_ok = cos.dim() == sin.dim() && cos.sizes() == sin.sizes() && (cos.dim() == 2 || cos.dim() == 3) &&
                         x.dim() == 4 && cos.size(-1) == x.size(3) && cos.size(-2) == x.size(2) &&
                         (cos.dim() == 2 || cos.size(0) == x.size(0)) && x.size(3) % 2 == 0;
  if (!takes(x) || !takes(cos) || !takes(sin) || !tables_ok)
    throw UsageError("cpu_kernels::rope: x " + c10::str(x.sizes()) + ", cos " + c10::str(cos.sizes()) +
                     " must be float32 CPU tensors [B, heads, L, D] and [L, D] or [B, L, D], D even");
  return RopeFunction::apply(x, cos.contiguous(), sin.contiguous());
}

at::Tensor swiglu(const at::Tensor& gate_up) {
  if (!takes(gate_up) || gate_up.dim() < 1 || gate_up.size(-1) % 2 != 0)
    throw UsageError("cpu_kernels::swiglu: gate_up " + c10::str(gate_up.sizes()) +
                     " must be a float32 CPU tensor [..., 2 I]");
  return SwigluFunction::apply(gate_up);
}

SoftCeResult soft_ce(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& p, const at::Tensor& w) {
  if (!takes(x) || !takes(weight) || !takes(p) || !takes(w))
    throw UsageError("cpu_kernels::soft_ce: x, lm_head, targets and weights must be float32 CPU tensors");
  check_soft_ce_shapes("cpu_kernels::soft_ce", x, weight, p, w);
  const variable_list out = SoftCeFunction::apply(x, weight, p.contiguous(), w.contiguous());
  return {out[0], out[1]};
}

}  // namespace eaglekit::trainer::cpu_kernels
