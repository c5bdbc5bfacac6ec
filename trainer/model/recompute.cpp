#include "trainer/model/recompute.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <utility>

namespace eaglekit::trainer {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The function travels to backward inside the autograd context.
struct RecomputeState : torch::CustomClassHolder {
  explicit RecomputeState(RecomputeFn f) : fn(std::move(f)) {}
  RecomputeFn fn;
};

// Keeps the autocast weight cache off for the guard's lifetime (see the header).
class NoAutocastCache {
 public:
  NoAutocastCache() : prev_(at::autocast::is_autocast_cache_enabled()) {
    at::autocast::set_autocast_cache_enabled(false);
  }
  ~NoAutocastCache() { at::autocast::set_autocast_cache_enabled(prev_); }
  NoAutocastCache(const NoAutocastCache&) = delete;
  NoAutocastCache& operator=(const NoAutocastCache&) = delete;

 private:
  bool prev_;
};

std::vector<at::Tensor> run(const RecomputeState& state, const std::vector<at::Tensor>& activations) {
  NoAutocastCache no_cache;
  return state.fn(activations);
}

// Arguments: the state (not a tensor), the activations, the parameters. The backward
// returns one gradient per argument element, in that order.
struct RecomputeFunction : torch::autograd::Function<RecomputeFunction> {
  static variable_list forward(AutogradContext* ctx, const c10::intrusive_ptr<RecomputeState>& state,
                               at::TensorList activations, at::TensorList parameters) {
    // Autograd is off here (Function::forward), so nothing fn computes is kept.
    std::vector<at::Tensor> outputs = run(*state, activations.vec());
    ctx->save_for_backward(activations.vec());
    ctx->saved_data["state"] = at::IValue::make_capsule(state);
    ctx->saved_data["parameters"] = parameters.vec();
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const auto state =
        c10::static_intrusive_pointer_cast<RecomputeState>(ctx->saved_data["state"].toCapsule());
    const std::vector<at::Tensor> parameters = ctx->saved_data["parameters"].toTensorVector();

    // Leaves standing for the saved activations, so the rerun's graph ends at them.
    std::vector<at::Tensor> inputs;
    inputs.reserve(saved.size());
    for (const at::Tensor& a : saved) {
      at::Tensor leaf = a.detach();
      if (a.requires_grad()) leaf.requires_grad_(true);
      inputs.push_back(std::move(leaf));
    }
    std::vector<at::Tensor> outputs;
    {
      at::AutoGradMode grad_on(true);
      outputs = run(*state, inputs);
    }
    if (outputs.size() != grads.size())
      throw std::logic_error("recompute: the function returned " + std::to_string(outputs.size()) +
                             " tensors in backward, " + std::to_string(grads.size()) + " in forward");

    variable_list roots, root_grads;
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      if (!grads[i].defined() || !outputs[i].requires_grad()) continue;
      roots.push_back(outputs[i]);
      root_grads.push_back(grads[i]);
    }
    variable_list wrt;
    std::vector<std::size_t> slot;  // result position of wrt[j]
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      if (!inputs[i].requires_grad()) continue;
      wrt.push_back(inputs[i]);
      slot.push_back(1 + i);
    }
    for (std::size_t i = 0; i < parameters.size(); ++i) {
      if (!parameters[i].requires_grad()) continue;
      wrt.push_back(parameters[i]);
      slot.push_back(1 + inputs.size() + i);
    }
    variable_list result(1 + inputs.size() + parameters.size());
    if (roots.empty() || wrt.empty()) return result;
    const variable_list g = torch::autograd::grad(roots, wrt, root_grads, /*retain_graph=*/false,
                                                  /*create_graph=*/false, /*allow_unused=*/true);
    for (std::size_t j = 0; j < wrt.size(); ++j) result[slot[j]] = g[j];
    return result;
  }
};

}  // namespace

std::vector<at::Tensor> recompute(RecomputeFn fn, const std::vector<at::Tensor>& activations,
                                  const std::vector<at::Tensor>& parameters) {
  bool any = false;
  if (at::GradMode::is_enabled()) {
    for (const at::Tensor& t : activations) any = any || (t.defined() && t.requires_grad());
    for (const at::Tensor& t : parameters) any = any || (t.defined() && t.requires_grad());
  }
  if (!any) return fn(activations);
  const auto state = c10::make_intrusive<RecomputeState>(std::move(fn));
  // As TensorList, not std::vector: Function::apply counts only those (and single tensors)
  // as differentiable inputs.
  return RecomputeFunction::apply(state, at::TensorList(activations), at::TensorList(parameters));
}

}  // namespace eaglekit::trainer
