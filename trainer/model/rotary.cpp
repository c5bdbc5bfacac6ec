#include "trainer/model/rotary.h"

#include <torch/torch.h>

#include "trainer/model/cpu_kernels.h"

namespace eaglekit::trainer {

at::Tensor rope_inv_freq(const DraftConfig& c) {
  const RopeFrequencies f = rope_frequencies(c.rope_theta, c.rope_scaling, c.head_dim, c.max_position_embeddings);
  return torch::tensor(f.inv_freq, torch::TensorOptions().dtype(torch::kDouble));
}

RotaryTable rope_table(const DraftConfig& c, const at::Tensor& positions) {
  const RopeFrequencies f = rope_frequencies(c.rope_theta, c.rope_scaling, c.head_dim, c.max_position_embeddings);
  const at::Tensor inv = torch::tensor(f.inv_freq, torch::TensorOptions().dtype(torch::kDouble)).to(positions.device());
  const at::Tensor angles = positions.to(torch::kDouble).unsqueeze(-1) * inv;
  const at::Tensor emb = torch::cat({angles, angles}, -1);
  // YaRN and LongRoPE scale cos and sin (and so q.k by the square), as the engines do.
  if (f.attention_factor != 1.0)
    return {(emb.cos() * f.attention_factor).to(torch::kFloat), (emb.sin() * f.attention_factor).to(torch::kFloat)};
  return {emb.cos().to(torch::kFloat), emb.sin().to(torch::kFloat)};
}

at::Tensor apply_rope(const at::Tensor& x, const RotaryTable& t) {
  if (x.dim() == 4 && cpu_kernels::takes(x) && cpu_kernels::takes(t.cos) && cpu_kernels::takes(t.sin))
    return cpu_kernels::rope(x, t.cos, t.sin);
  const std::int64_t half = x.size(-1) / 2;
  const at::Tensor xf = x.to(torch::kFloat);
  const at::Tensor rotated = torch::cat({-xf.narrow(-1, half, half), xf.narrow(-1, 0, half)}, -1);
  // Per-row tables [B, L, D] broadcast over the heads dimension.
  const at::Tensor cos = t.cos.dim() == 3 ? t.cos.unsqueeze(1) : t.cos;
  const at::Tensor sin = t.sin.dim() == 3 ? t.sin.unsqueeze(1) : t.sin;
  return (xf * cos + rotated * sin).to(x.scalar_type());
}

}  // namespace eaglekit::trainer
