#include "formats/finite.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

namespace eaglekit {

namespace {

// Index of the first element whose exponent bits are all ones (NaN or Inf), row-major.
// Chunks without an early exit inside, so the compiler vectorizes the scan.
template <typename U>
std::optional<std::int64_t> first_all_ones(const std::uint8_t* p, std::int64_t n, U mask) {
  constexpr std::int64_t kChunk = 4096;
  for (std::int64_t c = 0; c < n; c += kChunk) {
    const std::int64_t m = std::min(kChunk, n - c);
    bool bad = false;
    for (std::int64_t i = 0; i < m; ++i) {
      U v;
      std::memcpy(&v, p + sizeof(U) * static_cast<std::size_t>(c + i), sizeof(U));
      bad |= (v & mask) == mask;
    }
    if (!bad) continue;
    for (std::int64_t i = 0; i < m; ++i) {
      U v;
      std::memcpy(&v, p + sizeof(U) * static_cast<std::size_t>(c + i), sizeof(U));
      if ((v & mask) == mask) return c + i;
    }
  }
  return std::nullopt;
}

}  // namespace

std::optional<std::int64_t> first_nonfinite(const HostTensor& t) {
  if (!is_floating(t.dtype) || t.numel() == 0) return std::nullopt;
  const HostTensor c = t.is_contiguous() ? t : t.contiguous();
  const std::int64_t n = c.numel();
  switch (c.dtype) {
    case DType::kBFloat16: return first_all_ones<std::uint16_t>(c.data, n, 0x7f80);
    case DType::kFloat16: return first_all_ones<std::uint16_t>(c.data, n, 0x7c00);
    case DType::kFloat32: return first_all_ones<std::uint32_t>(c.data, n, 0x7f800000u);
    case DType::kFloat64: return first_all_ones<std::uint64_t>(c.data, n, 0x7ff0000000000000ull);
    default: return std::nullopt;
  }
}

std::optional<std::string> first_nonfinite(const Record& r) {
  const std::pair<const char*, const HostTensor*> tensors[] = {
      {"hidden_states", &r.hidden_states}, {"aux_hidden_states", &r.aux_hidden_states}};
  for (const auto& [name, t] : tensors) {
    if (const auto i = first_nonfinite(*t)) {
      const std::int64_t cols = t->dim() == 2 ? t->shape[1] : 1;
      const double v = t->get(*i);
      return std::string(std::isnan(v) ? "NaN" : "Inf") + " in " + name + " at token " +
             std::to_string(*i / cols) + ", column " + std::to_string(*i % cols);
    }
  }
  return std::nullopt;
}

}  // namespace eaglekit
