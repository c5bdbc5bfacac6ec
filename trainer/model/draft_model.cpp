#include "trainer/model/draft_model.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <cmath>
#include <map>

#include "formats/error.h"
#include "trainer/model/cpu_kernels.h"

namespace eaglekit::trainer {

namespace {

namespace F = torch::nn::functional;

// Llama's RMSNorm: normalize in float32, scale in the input dtype (as Hugging Face does).
struct RmsNormImpl : torch::nn::Module {
  RmsNormImpl(std::int64_t n, double eps) : eps(eps) {
    weight = register_parameter("weight", torch::ones({n}));
  }
  at::Tensor forward(const at::Tensor& x) const {
    if (cpu_kernels::takes(x) && cpu_kernels::takes(weight)) return cpu_kernels::rms_norm(x, weight, eps);
    const auto in_dtype = x.scalar_type();
    at::Tensor xf = x.to(at::kFloat);
    xf = xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
    return weight * xf.to(in_dtype);
  }
  at::Tensor weight;
  double eps;
};

torch::nn::Linear linear(std::int64_t in, std::int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}

struct AttentionImpl : torch::nn::Module {
  AttentionImpl(const DraftConfig& c, std::int64_t in) {
    q_proj = register_module("q_proj", linear(in, c.num_attention_heads * c.head_dim));
    k_proj = register_module("k_proj", linear(in, c.num_key_value_heads * c.head_dim));
    v_proj = register_module("v_proj", linear(in, c.num_key_value_heads * c.head_dim));
    o_proj = register_module("o_proj", linear(c.num_attention_heads * c.head_dim, c.hidden_size));
  }
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
};

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(const DraftConfig& c) {
    gate_proj = register_module("gate_proj", linear(c.hidden_size, c.intermediate_size));
    up_proj = register_module("up_proj", linear(c.hidden_size, c.intermediate_size));
    down_proj = register_module("down_proj", linear(c.intermediate_size, c.hidden_size));
  }
  at::Tensor forward(const at::Tensor& x) {
    if (cpu_kernels::takes(x) && cpu_kernels::takes(gate_proj->weight)) {
      // Both projections as one matmul, then silu(gate) * up in one pass.
      const at::Tensor w = torch::cat({gate_proj->weight, up_proj->weight}, 0);
      const at::Tensor gate_up = at::matmul(x, w.t());
      if (cpu_kernels::takes(gate_up)) return down_proj(cpu_kernels::swiglu(gate_up));
      // Under autocast the matmul ran in bf16: the composite on its two halves.
      const std::int64_t i = gate_proj->weight.size(0);
      return down_proj(F::silu(gate_up.narrow(-1, 0, i)) * gate_up.narrow(-1, i, i));
    }
    return down_proj(F::silu(gate_proj(x)) * up_proj(x));
  }
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
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
  torch::nn::Linear fc{nullptr};
  std::vector<std::shared_ptr<DecoderLayerImpl>> layers;
  std::shared_ptr<RmsNormImpl> norm;
  torch::nn::Linear lm_head{nullptr};
};

void check_d2t(const at::Tensor& d2t, const DraftConfig& c) {
  if (!d2t.defined() || d2t.dim() != 1 || d2t.size(0) != c.draft_vocab_size ||
      d2t.scalar_type() != at::kLong) {
    throw UsageError("d2t must be an int64 tensor [" + std::to_string(c.draft_vocab_size) +
                     "] (the draft vocabulary size)");
  }
  const at::Tensor target = d2t.cpu() + torch::arange(c.draft_vocab_size, torch::kLong);
  if (c.draft_vocab_size > 0 &&
      (target.min().item<std::int64_t>() < 0 || target.max().item<std::int64_t>() >= c.vocab_size)) {
    throw UsageError("d2t maps a draft token outside the target vocabulary [0, " +
                     std::to_string(c.vocab_size) + ")");
  }
  if (std::get<0>(at::_unique(target)).numel() != c.draft_vocab_size)
    throw UsageError("d2t maps two draft tokens to the same target token");
}

}  // namespace

struct DraftModel::Impl {
  DraftConfig config;
  std::shared_ptr<DraftModuleImpl> module;
  at::Tensor d2t;
};

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

DraftModel::DraftModel(const DraftConfig& config, const at::Tensor& d2t, const at::Tensor& base_lm_head,
                       std::uint64_t seed)
    : impl_(std::make_shared<Impl>()) {
  config.check();
  check_d2t(d2t, config);
  impl_->config = config;
  impl_->module = std::make_shared<DraftModuleImpl>(config);
  impl_->d2t = d2t.to(torch::kCPU).clone();
  torch::NoGradGuard no_grad;
  auto gen = at::detail::createCPUGenerator(seed);
  for (auto& p : impl_->module->named_parameters()) {
    if (p.key().size() > 7 && p.key().compare(p.key().size() - 7, 7, ".weight") == 0 && p.value().dim() == 2)
      p.value().normal_(0.0, 0.02, gen);
  }
  if (base_lm_head.defined()) {
    if (base_lm_head.dim() != 2 || base_lm_head.size(0) != config.vocab_size ||
        base_lm_head.size(1) != config.hidden_size) {
      throw UsageError("base lm_head has shape " + std::string(c10::str(base_lm_head.sizes())) +
                       ", expected [" + std::to_string(config.vocab_size) + ", " +
                       std::to_string(config.hidden_size) + "]");
    }
    impl_->module->lm_head->weight.copy_(
        base_lm_head.to(torch::kCPU).index_select(0, draft_to_target()).to(torch::kFloat));
  }
}

DraftModel::~DraftModel() = default;
DraftModel::DraftModel(const DraftModel&) = default;
DraftModel& DraftModel::operator=(const DraftModel&) = default;

const DraftConfig& DraftModel::config() const { return impl_->config; }
const at::Tensor& DraftModel::d2t() const { return impl_->d2t; }

at::Tensor DraftModel::draft_to_target() const {
  return impl_->d2t + torch::arange(impl_->d2t.size(0), impl_->d2t.options());
}

at::Tensor DraftModel::t2d() const {
  at::Tensor t2d = torch::zeros({impl_->config.vocab_size}, impl_->d2t.options().dtype(torch::kBool));
  t2d.index_fill_(0, draft_to_target(), true);
  return t2d;
}

std::vector<std::pair<std::string, at::Tensor>> DraftModel::named_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : impl_->module->named_parameters()) out.emplace_back(p.key(), p.value());
  return out;
}

std::vector<at::Tensor> DraftModel::parameters() const { return impl_->module->parameters(); }

torch::nn::Module& DraftModel::module() { return *impl_->module; }

void DraftModel::load_parameter(const std::string& name, const at::Tensor& value) {
  // named_parameters() returns a dict by value: keep it alive while `p` points into it.
  auto params = impl_->module->named_parameters();
  at::Tensor* p = params.find(name);
  if (p == nullptr) throw UsageError("the draft has no parameter '" + name + "'");
  if (p->sizes() != value.sizes()) {
    throw UsageError("parameter '" + name + "' has shape " + c10::str(p->sizes()) + ", got " +
                     c10::str(value.sizes()));
  }
  torch::NoGradGuard no_grad;
  p->copy_(value);
}

void DraftModel::set_d2t(const at::Tensor& d2t) {
  check_d2t(d2t, impl_->config);
  impl_->d2t = d2t.to(impl_->d2t.device()).clone();
}

void DraftModel::to(c10::Device device, c10::ScalarType dtype) {
  impl_->module->to(device, dtype);
  impl_->d2t = impl_->d2t.to(device);
}

c10::Device DraftModel::device() const { return impl_->module->fc->weight.device(); }
c10::ScalarType DraftModel::dtype() const { return impl_->module->fc->weight.scalar_type(); }
void DraftModel::train(bool on) { impl_->module->train(on); }

at::Tensor DraftModel::fc(const at::Tensor& aux) const { return impl_->module->fc(aux); }

std::int64_t DraftModel::num_layers() const { return impl_->config.num_hidden_layers; }

at::Tensor DraftModel::norm_embeddings(const at::Tensor& emb) const {
  return impl_->module->layers[0]->input_layernorm->forward(emb);
}

namespace {
const DecoderLayerImpl& layer_at(const DraftModuleImpl& m, std::int64_t layer) {
  if (layer < 0 || layer >= static_cast<std::int64_t>(m.layers.size()))
    throw UsageError("the draft has no decoder layer " + std::to_string(layer));
  return *m.layers[static_cast<std::size_t>(layer)];
}
}  // namespace

Qkv DraftModel::qkv(const at::Tensor& emb_normed, const at::Tensor& hidden, const RotaryTable& rope,
                    std::int64_t layer) const {
  const auto& c = impl_->config;
  const DecoderLayerImpl& l = layer_at(*impl_->module, layer);
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

at::Tensor DraftModel::finish_layer(const at::Tensor& hidden, const at::Tensor& attn, std::int64_t layer) const {
  const DecoderLayerImpl& l = layer_at(*impl_->module, layer);
  const std::int64_t b = attn.size(0), n = attn.size(2);
  const at::Tensor merged = attn.transpose(1, 2).reshape({b, n, attn.size(1) * attn.size(3)});
  const at::Tensor residual = hidden + l.self_attn->o_proj(merged.to(hidden.scalar_type()));
  return residual + l.mlp->forward(l.post_attention_layernorm->forward(residual));
}

at::Tensor DraftModel::final_norm(const at::Tensor& layer_out) const { return impl_->module->norm->forward(layer_out); }

const at::Tensor& DraftModel::lm_head_weight() const { return impl_->module->lm_head->weight; }

at::Tensor DraftModel::logits(const at::Tensor& layer_out) const {
  return impl_->module->lm_head(impl_->module->norm->forward(layer_out));
}

}  // namespace eaglekit::trainer
