#include "trainer/model/dflash.h"

#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "formats/error.h"
#include "trainer/model/draft_config.h"
#include "trainer/model/draft_net.h"
#include "trainer/model/net_parts.h"
#include "trainer/model/rotary.h"

// DFlash's network (LibTorch); its row's other answers are in dflash.cpp, which builds
// without LibTorch. The maths is ModelOpt 0.47's DFlashModule (modeling_dflash.py), which
// tests/trainer/test_dflash.cpp checks against through a fixture its own code wrote.

namespace eaglekit::trainer {

namespace {

using net_parts::linear;
using net_parts::MlpImpl;
using net_parts::RmsNormImpl;

// Registration order is the export order (DFlashArchitecture::parameters).
struct AttentionImpl : torch::nn::Module {
  explicit AttentionImpl(const DraftConfig& c) {
    q_proj = register_module("q_proj", linear(c.hidden_size, c.num_attention_heads * c.head_dim));
    k_proj = register_module("k_proj", linear(c.hidden_size, c.num_key_value_heads * c.head_dim));
    v_proj = register_module("v_proj", linear(c.hidden_size, c.num_key_value_heads * c.head_dim));
    o_proj = register_module("o_proj", linear(c.num_attention_heads * c.head_dim, c.hidden_size));
    q_norm = register_module("q_norm", std::make_shared<RmsNormImpl>(c.head_dim, c.rms_norm_eps));
    k_norm = register_module("k_norm", std::make_shared<RmsNormImpl>(c.head_dim, c.rms_norm_eps));
  }
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  std::shared_ptr<RmsNormImpl> q_norm, k_norm;
};

struct LayerImpl : torch::nn::Module {
  explicit LayerImpl(const DraftConfig& c) {
    self_attn = register_module("self_attn", std::make_shared<AttentionImpl>(c));
    mlp = register_module("mlp", std::make_shared<MlpImpl>(c));
    input_layernorm = register_module("input_layernorm", std::make_shared<RmsNormImpl>(c.hidden_size, c.rms_norm_eps));
    post_attention_layernorm =
        register_module("post_attention_layernorm", std::make_shared<RmsNormImpl>(c.hidden_size, c.rms_norm_eps));
  }
  std::shared_ptr<AttentionImpl> self_attn;
  std::shared_ptr<MlpImpl> mlp;
  std::shared_ptr<RmsNormImpl> input_layernorm, post_attention_layernorm;
};

struct ModuleImpl : torch::nn::Module {
  explicit ModuleImpl(const DraftConfig& c) {
    fc = register_module("fc", linear(c.aux_width(), c.hidden_size));
    hidden_norm = register_module("hidden_norm", std::make_shared<RmsNormImpl>(c.hidden_size, c.rms_norm_eps));
    torch::nn::ModuleList list;
    for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) {
      layers.push_back(std::make_shared<LayerImpl>(c));
      list->push_back(layers.back());
    }
    register_module("layers", list);
    norm = register_module("norm", std::make_shared<RmsNormImpl>(c.hidden_size, c.rms_norm_eps));
  }
  torch::nn::Linear fc{nullptr};
  std::shared_ptr<RmsNormImpl> hidden_norm;
  std::vector<std::shared_ptr<LayerImpl>> layers;
  std::shared_ptr<RmsNormImpl> norm;
};

class DFlashNet final : public net_parts::ModuleNet<BlockNet, ModuleImpl> {
 public:
  using ModuleNet::ModuleNet;

  at::Tensor context(const at::Tensor& aux) const override { return module_->hidden_norm->forward(module_->fc(aux)); }

  at::Tensor layer(const at::Tensor& x, const at::Tensor& context, const RotaryTable& rope_q, const RotaryTable& rope_ctx,
                   const at::Tensor& allowed, std::int64_t block_size, std::int64_t layer) const override;

  at::Tensor final_norm(const at::Tensor& x) const override { return module_->norm->forward(x); }
};

at::Tensor DFlashNet::layer(const at::Tensor& x, const at::Tensor& context, const RotaryTable& rope_q,
                            const RotaryTable& rope_ctx, const at::Tensor& allowed, std::int64_t block_size,
                            std::int64_t index) const {
  if (index < 0 || index >= static_cast<std::int64_t>(module_->layers.size()))
    throw UsageError("the draft has no decoder layer " + std::to_string(index));
  const DraftConfig& c = config_;
  LayerImpl& l = *module_->layers[static_cast<std::size_t>(index)];
  AttentionImpl& a = *l.self_attn;
  const std::int64_t b = x.size(0), q_len = x.size(1), ctx_len = context.size(1), bs = block_size;
  const std::int64_t heads = c.num_attention_heads, kv_heads = c.num_key_value_heads, d = c.head_dim;
  if (bs < 1 || q_len % bs != 0) throw UsageError("DFlash layer: the queries are not whole blocks");
  const std::int64_t blocks = q_len / bs;

  const at::Tensor h = l.input_layernorm->forward(x);
  // Queries from the block only; keys and values from the context and the block, q and k
  // normed per head before RoPE (Qwen3's q_norm/k_norm); the context is not layer-normed.
  at::Tensor q = a.q_norm->forward(a.q_proj(h).view({b, q_len, heads, d})).transpose(1, 2);
  const at::Tensor ctx = context.to(h.scalar_type());
  at::Tensor k_ctx = a.k_norm->forward(a.k_proj(ctx).view({b, ctx_len, kv_heads, d})).transpose(1, 2);
  at::Tensor k_blk = a.k_norm->forward(a.k_proj(h).view({b, q_len, kv_heads, d})).transpose(1, 2);
  at::Tensor v_ctx = a.v_proj(ctx).view({b, ctx_len, kv_heads, d}).transpose(1, 2);
  at::Tensor v_blk = a.v_proj(h).view({b, q_len, kv_heads, d}).transpose(1, 2);
  q = apply_rope(q, rope_q);
  k_ctx = apply_rope(k_ctx, rope_ctx);
  k_blk = apply_rope(k_blk, rope_q);  // a block's keys sit at its queries' positions
  if (kv_heads != heads) {  // GQA: query head i reads kv head i / (heads / kv_heads)
    k_ctx = k_ctx.repeat_interleave(heads / kv_heads, 1);
    v_ctx = v_ctx.repeat_interleave(heads / kv_heads, 1);
    k_blk = k_blk.repeat_interleave(heads / kv_heads, 1);
    v_blk = v_blk.repeat_interleave(heads / kv_heads, 1);
  }
  // Scores in float32: [Q, C] against the context and, per block, [bs, bs] against its own
  // tokens (the other blocks' keys, always masked, are never computed); one softmax over both.
  // A row that may see nothing (a block with no anchor) gets every key at the same lowest
  // score, as ModelOpt's additive finfo.min mask gives it: finite, never read by the loss
  // (its weight is 0).
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const at::Tensor qf = q.to(at::kFloat);
  const at::Tensor s_ctx = at::matmul(qf, k_ctx.to(at::kFloat).transpose(-2, -1));  // [B, heads, Q, C]
  const at::Tensor s_blk = at::matmul(qf.reshape({b, heads, blocks, bs, d}),
                                      k_blk.to(at::kFloat).reshape({b, heads, blocks, bs, d}).transpose(-2, -1))
                               .reshape({b, heads, q_len, bs});
  at::Tensor scores = at::cat({s_ctx, s_blk}, -1) * scale;
  scores = scores.masked_fill(allowed.logical_not().unsqueeze(1), -std::numeric_limits<float>::max());
  const at::Tensor p = at::softmax(scores, -1);
  const at::Tensor o_blk = at::matmul(p.narrow(-1, ctx_len, bs).reshape({b, heads, blocks, bs, bs}),
                                      v_blk.to(at::kFloat).reshape({b, heads, blocks, bs, d}))
                               .reshape({b, heads, q_len, d});
  const at::Tensor attn = (at::matmul(p.narrow(-1, 0, ctx_len), v_ctx.to(at::kFloat)) + o_blk).to(h.scalar_type());
  const at::Tensor merged = attn.transpose(1, 2).reshape({b, q_len, heads * d});
  const at::Tensor residual = x + a.o_proj(merged).to(x.scalar_type());
  return residual + l.mlp->forward(l.post_attention_layernorm->forward(residual));
}

}  // namespace

std::shared_ptr<DraftNet> DFlashArchitecture::make_net(const DraftConfig& config) const {
  return std::make_shared<DFlashNet>(config);
}

}  // namespace eaglekit::trainer
