#include "trainer/model/eagle3.h"

#include <torch/torch.h>

#include "formats/error.h"
#include "trainer/model/cpu_kernels.h"
#include "trainer/model/draft_config.h"
#include "trainer/model/draft_net.h"
#include "trainer/model/net_parts.h"

// EAGLE-3's network (LibTorch); its row's other answers are in eagle3.cpp, which builds
// without LibTorch.

namespace eaglekit::trainer {

namespace {

using net_parts::linear;
using net_parts::MlpImpl;
using net_parts::RmsNormImpl;

struct AttentionImpl : torch::nn::Module {
  AttentionImpl(const DraftConfig& c, std::int64_t in) {
    q_proj = register_module("q_proj", linear(in, c.num_attention_heads * c.head_dim));
    k_proj = register_module("k_proj", linear(in, c.num_key_value_heads * c.head_dim));
    v_proj = register_module("v_proj", linear(in, c.num_key_value_heads * c.head_dim));
    o_proj = register_module("o_proj", linear(c.num_attention_heads * c.head_dim, c.hidden_size));
  }
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
};

// One decoder layer. The first (`first`) reads cat(input_layernorm(emb), hidden_norm(h)) with
// 2H-wide q/k/v; the others are plain Llama layers on H (no hidden_norm), docs/draft.md.
// Registration order is the export order.
struct DecoderLayerImpl : torch::nn::Module {
  DecoderLayerImpl(const DraftConfig& c, bool first) {
    input_layernorm = register_module("input_layernorm", std::make_shared<RmsNormImpl>(c.hidden_size, c.rms_norm_eps));
    if (first)
      hidden_norm = register_module("hidden_norm", std::make_shared<RmsNormImpl>(c.hidden_size, c.rms_norm_eps));
    self_attn = register_module("self_attn",
                                std::make_shared<AttentionImpl>(c, first ? 2 * c.hidden_size : c.hidden_size));
    post_attention_layernorm = register_module(
        "post_attention_layernorm", std::make_shared<RmsNormImpl>(c.hidden_size, c.rms_norm_eps));
    mlp = register_module("mlp", std::make_shared<MlpImpl>(c));
  }
  std::shared_ptr<RmsNormImpl> input_layernorm, hidden_norm, post_attention_layernorm;
  std::shared_ptr<AttentionImpl> self_attn;
  std::shared_ptr<MlpImpl> mlp;
};

// A one-layer draft names its layer "midlayer" (the name both engines load); deeper drafts
// use "layers.{i}" (vLLM's names; docs/export.md).
struct DraftModuleImpl : torch::nn::Module {
  explicit DraftModuleImpl(const DraftConfig& c) {
    // EAGLE 3.1's norms on the fc input (DraftConfig::norm_before_fc, fc_norm), vLLM's names.
    if (c.norm_before_fc)
      input_norm = register_module("input_norm", std::make_shared<RmsNormImpl>(c.aux_width(), c.rms_norm_eps));
    if (c.fc_norm) {
      torch::nn::ModuleList list;
      for (std::int64_t i = 0; i < c.num_aux_layers; ++i) {
        fc_norm.push_back(std::make_shared<RmsNormImpl>(c.target_hidden_size, c.rms_norm_eps));
        list->push_back(fc_norm.back());
      }
      register_module("fc_norm", list);
    }
    fc = register_module("fc", linear(c.aux_width(), c.hidden_size));
    for (std::int64_t i = 0; i < c.num_hidden_layers; ++i)
      layers.push_back(std::make_shared<DecoderLayerImpl>(c, i == 0));
    if (c.num_hidden_layers == 1) {
      register_module("midlayer", layers[0]);
    } else {
      torch::nn::ModuleList list;
      for (const auto& l : layers) list->push_back(l);
      register_module("layers", list);
    }
    norm = register_module("norm", std::make_shared<RmsNormImpl>(c.hidden_size, c.rms_norm_eps));
    lm_head = register_module("lm_head", linear(c.hidden_size, c.draft_vocab_size));
  }
  std::shared_ptr<RmsNormImpl> input_norm;
  std::vector<std::shared_ptr<RmsNormImpl>> fc_norm;
  torch::nn::Linear fc{nullptr};
  std::vector<std::shared_ptr<DecoderLayerImpl>> layers;
  std::shared_ptr<RmsNormImpl> norm;
  torch::nn::Linear lm_head{nullptr};
};

// The decoder layer `layer`, or UsageError.
const DecoderLayerImpl& layer_at(const DraftModuleImpl& m, std::int64_t layer) {
  if (layer < 0 || layer >= static_cast<std::int64_t>(m.layers.size()))
    throw UsageError("the draft has no decoder layer " + std::to_string(layer));
  return *m.layers[static_cast<std::size_t>(layer)];
}

class Eagle3Net final : public net_parts::ModuleNet<TttNet, DraftModuleImpl> {
 public:
  using ModuleNet::ModuleNet;
  at::Tensor fc(const at::Tensor& aux) const override;
  at::Tensor norm_embeddings(const at::Tensor& emb) const override {
    return module_->layers[0]->input_layernorm->forward(emb);
  }
  Qkv qkv(const at::Tensor& emb_normed, const at::Tensor& hidden, const RotaryTable& rope,
          std::int64_t layer) const override;
  at::Tensor finish_layer(const at::Tensor& hidden, const at::Tensor& attn, std::int64_t layer) const override;
  at::Tensor final_norm(const at::Tensor& layer_out) const override { return module_->norm->forward(layer_out); }
  const at::Tensor& lm_head_weight() const override { return module_->lm_head->weight; }
  bool norm_output() const override { return config_.norm_output; }
};

// fc over the aux hidden states, after EAGLE 3.1's norms: one over the whole input
// (norm_before_fc), then one per aux layer's slice (fc_norm), in vLLM's order.
at::Tensor Eagle3Net::fc(const at::Tensor& aux) const {
  at::Tensor x = aux;
  if (module_->input_norm) x = module_->input_norm->forward(x);
  if (!module_->fc_norm.empty()) {
    const std::int64_t w = config_.target_hidden_size;
    std::vector<at::Tensor> parts;
    parts.reserve(module_->fc_norm.size());
    for (std::size_t i = 0; i < module_->fc_norm.size(); ++i)
      parts.push_back(module_->fc_norm[i]->forward(x.narrow(-1, static_cast<std::int64_t>(i) * w, w).contiguous()));
    x = torch::cat(parts, -1);
  }
  return module_->fc(x);
}

// Layer 0: q/k/v of cat(emb_normed, hidden_norm(h)) (ModelOpt form:
// hidden_norm(input_layernorm(h))). Layer i > 0: q/k/v of input_layernorm(hidden), and
// emb_normed is not used.
Qkv Eagle3Net::qkv(const at::Tensor& emb_normed, const at::Tensor& hidden, const RotaryTable& rope,
                   std::int64_t layer) const {
  const auto& c = config_;
  const DecoderLayerImpl& l = layer_at(*module_, layer);
  at::Tensor x;
  if (layer == 0) {
    const at::Tensor h = c.modelopt_norm ? l.input_layernorm->forward(hidden) : hidden;
    x = torch::cat({emb_normed.to(h.scalar_type()), l.hidden_norm->forward(h)}, -1);
  } else {
    x = l.input_layernorm->forward(hidden);
  }
  const std::int64_t b = x.size(0), n = x.size(1);
  auto heads = [&](const at::Tensor& t, std::int64_t count) {
    return t.view({b, n, count, c.head_dim}).transpose(1, 2);
  };
  Qkv out;
  if (cpu_kernels::takes(x) && cpu_kernels::takes(l.self_attn->q_proj->weight)) {
    // The three projections as one matmul (trainer/model/cpu_kernels.h), split by views.
    const at::Tensor w = torch::cat({l.self_attn->q_proj->weight, l.self_attn->k_proj->weight,
                                     l.self_attn->v_proj->weight}, 0);
    const at::Tensor y = at::matmul(x, w.t());
    const std::int64_t nq = c.num_attention_heads * c.head_dim, nkv = c.num_key_value_heads * c.head_dim;
    out.q = apply_rope(heads(y.narrow(-1, 0, nq), c.num_attention_heads), rope);
    out.k = apply_rope(heads(y.narrow(-1, nq, nkv), c.num_key_value_heads), rope);
    out.v = heads(y.narrow(-1, nq + nkv, nkv), c.num_key_value_heads);
    return out;
  }
  out.q = apply_rope(heads(l.self_attn->q_proj(x), c.num_attention_heads), rope);
  out.k = apply_rope(heads(l.self_attn->k_proj(x), c.num_key_value_heads), rope);
  out.v = heads(l.self_attn->v_proj(x), c.num_key_value_heads);
  return out;
}

// o_proj(attn) + hidden, then the MLP block: the layer's output (the residual stream). With
// norm_before_residual the first layer's residual is hidden_norm(hidden) (vLLM's
// _norm_before_residual; recomputed here, as cheap as keeping it).
at::Tensor Eagle3Net::finish_layer(const at::Tensor& hidden, const at::Tensor& attn, std::int64_t layer) const {
  const DecoderLayerImpl& l = layer_at(*module_, layer);
  const std::int64_t b = attn.size(0), n = attn.size(2);
  const at::Tensor merged = attn.transpose(1, 2).reshape({b, n, attn.size(1) * attn.size(3)});
  const at::Tensor skip = layer == 0 && config_.norm_before_residual ? l.hidden_norm->forward(hidden) : hidden;
  const at::Tensor residual = skip + l.self_attn->o_proj(merged.to(hidden.scalar_type()));
  return residual + l.mlp->forward(l.post_attention_layernorm->forward(residual));
}

}  // namespace

std::shared_ptr<DraftNet> make_eagle3_net(const DraftConfig& config) { return std::make_shared<Eagle3Net>(config); }

std::shared_ptr<DraftNet> Eagle3Architecture::make_net(const DraftConfig& config) const {
  return make_eagle3_net(config);
}

}  // namespace eaglekit::trainer
