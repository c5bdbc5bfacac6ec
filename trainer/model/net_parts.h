// The pieces the draft networks are built from (Llama/Qwen3's RMSNorm, bias-free linear
// layers, the SwiGLU MLP), with the CPU kernels where they apply. Private to the networks'
// .cpp files (eagle3_net.cpp, dflash_net.cpp): it includes torch/torch.h, so no header may
// include it.
//
// Thread safety: as torch modules. Errors: shape errors throw c10::Error.
#pragma once

#include <torch/torch.h>

#include "trainer/model/cpu_kernels.h"
#include "trainer/model/draft_config.h"
#include "trainer/model/draft_net.h"

namespace eaglekit::trainer::net_parts {

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

inline torch::nn::Linear linear(std::int64_t in, std::int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}

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

// What a network built on one torch module (Module, constructed from the config) answers
// for every DraftNet: its parameters in registration order, device and dtype, train mode,
// depth. Base: TttNet or BlockNet.
template <typename Base, typename Module>
class ModuleNet : public Base {
 public:
  explicit ModuleNet(const DraftConfig& c) : config_(c), module_(std::make_shared<Module>(c)) {}

  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const override {
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (const auto& p : module_->named_parameters()) out.emplace_back(p.key(), p.value());
    return out;
  }
  void to(c10::Device device, c10::ScalarType dtype) override { module_->to(device, dtype); }
  void train(bool on) override { module_->train(on); }
  std::int64_t num_layers() const override { return config_.num_hidden_layers; }

 protected:
  DraftConfig config_;
  std::shared_ptr<Module> module_;
};

}  // namespace eaglekit::trainer::net_parts
