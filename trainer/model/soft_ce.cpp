#include "trainer/model/soft_ce.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <string>

#include "formats/error.h"

namespace eaglekit::trainer {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr std::int64_t kAutoLogits = std::int64_t{1} << 26;

// Forward and backward of docs/ttt.md's soft cross-entropy, chunk by chunk. With
// P = softmax(z) and q = sum_v p: d/dz [w (lse q - p.z)] = w (P q - p).
struct SoftCeFunction : torch::autograd::Function<SoftCeFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& p, const at::Tensor& w, std::int64_t chunk, std::int64_t compute) {
    const auto dtype = static_cast<c10::ScalarType>(compute);
    const std::int64_t rows = x.size(0);
    const at::Tensor wc = weight.to(dtype);
    const auto f32 = x.options().dtype(at::kFloat);
    at::Tensor lse = at::empty({rows}, f32), psum = at::empty({rows}, f32), dot = at::empty({rows}, f32);
    at::Tensor argmax = at::empty({rows}, x.options().dtype(at::kLong));
    for (std::int64_t r0 = 0; r0 < rows; r0 += chunk) {
      const std::int64_t n = std::min(chunk, rows - r0);
      const at::Tensor z = at::matmul(x.narrow(0, r0, n).to(dtype), wc.t()).to(at::kFloat);
      const at::Tensor pc = p.narrow(0, r0, n);
      lse.narrow(0, r0, n).copy_(at::logsumexp(z, -1));
      psum.narrow(0, r0, n).copy_(pc.sum(-1));
      // Row dot products p . z as one batched product, no [n, Vd] temporary.
      dot.narrow(0, r0, n).copy_(at::bmm(pc.unsqueeze(1), z.unsqueeze(2)).view({n}));
      argmax.narrow(0, r0, n).copy_(z.argmax(-1));
    }
    const at::Tensor total = (w * (lse * psum - dot)).sum();
    ctx->save_for_backward({x, weight, p, w, lse, psum});
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["compute"] = compute;
    ctx->mark_non_differentiable({argmax});
    return {total, argmax};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &p = saved[2], &w = saved[3], &lse = saved[4], &psum = saved[5];
    const std::int64_t chunk = ctx->saved_data["chunk"].toInt();
    const auto dtype = static_cast<c10::ScalarType>(ctx->saved_data["compute"].toInt());
    const at::Tensor g = grads[0].defined() ? grads[0].to(at::kFloat) : at::zeros({}, x.options().dtype(at::kFloat));
    const std::int64_t rows = x.size(0);
    const at::Tensor wc = weight.to(dtype);
    const at::Tensor gw = g * w;  // [rows]
    at::Tensor dx = at::empty_like(x);
    at::Tensor dweight = at::zeros(weight.sizes(), weight.options().dtype(at::kFloat));
    for (std::int64_t r0 = 0; r0 < rows; r0 += chunk) {
      const std::int64_t n = std::min(chunk, rows - r0);
      const at::Tensor xc = x.narrow(0, r0, n).to(dtype);
      // dz = g w (softmax(z) psum - p), computed in place on the recomputed logits.
      at::Tensor dz = at::matmul(xc, wc.t()).to(at::kFloat);
      dz.sub_(lse.narrow(0, r0, n).unsqueeze(-1)).exp_().mul_(psum.narrow(0, r0, n).unsqueeze(-1));
      dz.sub_(p.narrow(0, r0, n)).mul_(gw.narrow(0, r0, n).unsqueeze(-1));
      const at::Tensor dzc = dz.to(dtype);
      dx.narrow(0, r0, n).copy_(at::matmul(dzc, wc));
      dweight.add_(at::matmul(dzc.t(), xc).to(at::kFloat));
    }
    return {dx, dweight.to(weight.scalar_type()), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

SoftCeResult chunked_soft_ce(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& p, const at::Tensor& w,
                             std::int64_t chunk, c10::ScalarType compute) {
  if (chunk < 1) throw UsageError("the loss chunk must be at least 1 row, got " + std::to_string(chunk));
  check_soft_ce_shapes("chunked soft cross-entropy", x, weight, p, w);
  const variable_list out = SoftCeFunction::apply(x, weight, p.to(at::kFloat).contiguous(), w.to(at::kFloat).contiguous(),
                                                  chunk, static_cast<std::int64_t>(compute));
  return {out[0], out[1]};
}

void check_soft_ce_shapes(const char* what, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& p,
                          const at::Tensor& w) {
  if (x.dim() != 2 || weight.dim() != 2 || x.size(1) != weight.size(1) || p.dim() != 2 || p.size(0) != x.size(0) ||
      p.size(1) != weight.size(0) || w.dim() != 1 || w.size(0) != x.size(0)) {
    throw UsageError(std::string(what) + ": x " + c10::str(x.sizes()) + ", lm_head " + c10::str(weight.sizes()) +
                     ", targets " + c10::str(p.sizes()) + ", weights " + c10::str(w.sizes()) +
                     " (expected [N, H], [Vd, H], [N, Vd], [N])");
  }
}

std::int64_t auto_loss_chunk_rows(std::int64_t rows, std::int64_t vocab) {
  if (vocab <= 0 || rows * vocab <= kAutoLogits) return 0;
  return std::max<std::int64_t>(1, kAutoLogits / vocab);
}

}  // namespace eaglekit::trainer
