// Hand-made autograd nodes (ring attention's and cp_shift's backward, the DP hooks' gradient
// accumulators) across LibTorch versions. Up to 2.11 torch holds a Node by std::shared_ptr
// (made with torch::autograd::deleteNode, which frees long chains without deep recursion); from
// 2.13 by c10::intrusive_ptr, and set_history and grad_accumulator take and return that. NodePtr
// is whichever this LibTorch uses (read off grad_accumulator's type, not guessed from a
// version); make_node<N>() makes a node of type N held that way.
//
// Private to trainer/parallel/*.cpp: includes LibTorch's autograd headers.
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/version.h>

#include <memory>
#include <type_traits>
#include <utility>

namespace eaglekit::trainer {

using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

namespace detail {
template <class N, class Ptr>
struct NodeMaker;
template <class N>
struct NodeMaker<N, std::shared_ptr<torch::autograd::Node>> {
  static std::shared_ptr<N> make() {
#if TORCH_VERSION_MAJOR < 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR <= 11)
    return std::shared_ptr<N>(new N(), torch::autograd::deleteNode);
#else
    return std::make_shared<N>();
#endif
  }
};
template <class N>
struct NodeMaker<N, c10::intrusive_ptr<torch::autograd::Node>> {
  static c10::intrusive_ptr<N> make() { return c10::make_intrusive<N>(); }
};
}  // namespace detail

template <class N>
auto make_node() {
  return detail::NodeMaker<N, NodePtr>::make();
}

}  // namespace eaglekit::trainer
