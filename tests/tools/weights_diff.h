// Comparing two exported drafts (model.safetensors) in the CLI tests, without LibTorch.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "formats/safetensors_format.h"
#include "tests/compare.h"

namespace eaglekit::test {

// Largest |a - b| / max|b| over the tensors of two safetensors files, per tensor (the worst
// tensor wins); a NaN or an infinity on either side makes it +inf (worst_of). Both files must
// hold the same names and element counts.
inline double max_rel_diff(const std::string& a_path, const std::string& b_path) {
  const auto a = SafetensorsFile::open(a_path), b = SafetensorsFile::open(b_path);
  REQUIRE(a->entries().size() == b->entries().size());
  double worst = 0;
  for (const auto& e : a->entries()) {
    const auto x = a->get(e.name), y = b->get(e.name);
    REQUIRE_MESSAGE(y, e.name);
    REQUIRE(x->numel() == y->numel());
    double scale = 1e-12, diff = 0;
    for (std::int64_t i = 0; i < x->numel(); ++i) {
      scale = worst_of(scale, std::abs(y->get(i)));
      diff = worst_of(diff, std::abs(x->get(i) - y->get(i)));
    }
    worst = worst_of(worst, diff / scale);
  }
  return worst;
}

}  // namespace eaglekit::test
