// The LibTorch side of tests/compare.h: the largest relative difference of two tensors, where
// a NaN on either side (or infinities that differ) counts as infinitely different. Tensor
// max() propagates a NaN, and worst_of turns it into +inf, so no bound passes it.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "tests/compare.h"

namespace eaglekit::test {

// max |a - b| / max |b| in float64 (max |b| floored at 1e-30); +inf when either holds a NaN.
inline double tensor_rel_diff(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor x = a.to(at::kDouble), y = b.to(at::kDouble);
  const double scale = y.abs().max().item<double>();
  if (std::isnan(scale)) return INFINITY;
  return worst_of(0, (x - y).abs().max().item<double>() / std::max(scale, 1e-30));
}

}  // namespace eaglekit::test
