// Activation recomputation (docs/ttt.md, "Recomputation"): run a piece of the forward pass
// without keeping its intermediate tensors, and run it again with autograd in backward to
// get its gradients. Memory kept per piece: its inputs and outputs, whatever it computes in
// between; time: one more forward of the piece.
//
// The piece must be a deterministic function of its `activations` and of `parameters`
// (tensors it reads directly, such as a module's weights), with floating-point outputs: no
// randomness (the draft has no dropout), no in-place change of an input. It runs with the
// calling thread's autocast state; pass that state back in through the function when it
// matters, as the recomputation in backward runs outside the forward's autocast region
// (the TTT unroll does). The autocast weight cache is off while the piece runs, so a cast
// made without autograd is never reused by a later differentiable op.
//
// Under at::NoGradGuard (or when nothing requires a gradient) it just calls fn. Not twice
// differentiable. Thread safety: as the function passed. Errors from fn propagate, in
// forward and in backward.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace eaglekit::trainer {

using RecomputeFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& activations)>;

// fn(activations), differentiable in the activations and in `parameters` (every parameter
// fn may read; ones it does not read get no gradient from it).
std::vector<at::Tensor> recompute(RecomputeFn fn, const std::vector<at::Tensor>& activations,
                                  const std::vector<at::Tensor>& parameters);

}  // namespace eaglekit::trainer
