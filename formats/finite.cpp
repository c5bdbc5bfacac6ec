#include "formats/finite.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define EAGLEKIT_FINITE_AVX2 1
#include <immintrin.h>
#endif

namespace eaglekit {

namespace {

#if defined(EAGLEKIT_FINITE_AVX2)
bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}

// Whether any of the n elements at q (n * sizeof(U) a multiple of 128) has every mask bit
// set: 128 bytes a step, compared lane-wise, with no early exit (about 6x the SWAR loop
// below on a Zen 5 core, where that loop reached 5 GB/s from the cache).
template <typename U>
__attribute__((target("avx2"))) inline __m256i lanes_all_ones(const std::uint8_t* at, __m256i m) {
  const __m256i v = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)), m);
  if constexpr (sizeof(U) == 2) return _mm256_cmpeq_epi16(v, m);
  else if constexpr (sizeof(U) == 4) return _mm256_cmpeq_epi32(v, m);
  else return _mm256_cmpeq_epi64(v, m);
}

template <typename U>
__attribute__((target("avx2"))) bool any_all_ones_avx2(const std::uint8_t* q, std::int64_t n, U mask) {
  __m256i m;
  if constexpr (sizeof(U) == 2) m = _mm256_set1_epi16(static_cast<short>(mask));
  else if constexpr (sizeof(U) == 4) m = _mm256_set1_epi32(static_cast<int>(mask));
  else m = _mm256_set1_epi64x(static_cast<long long>(mask));
  __m256i acc = _mm256_setzero_si256();
  const std::size_t bytes = static_cast<std::size_t>(n) * sizeof(U);
  for (std::size_t k = 0; k < bytes; k += 128) {
    const __m256i a = _mm256_or_si256(lanes_all_ones<U>(q + k, m), lanes_all_ones<U>(q + k + 32, m));
    const __m256i b = _mm256_or_si256(lanes_all_ones<U>(q + k + 64, m), lanes_all_ones<U>(q + k + 96, m));
    acc = _mm256_or_si256(acc, _mm256_or_si256(a, b));
  }
  return !_mm256_testz_si256(acc, acc);
}
#endif

// Index of the first element whose exponent bits are all ones (NaN or Inf), row-major.
// Elements of 2 or 4 bytes are tested several to a 64-bit word (SWAR): with v = (w & M) ^ M
// a lane of v is zero exactly when its element is not finite, and (v - L) & ~v & H is non-zero
// exactly when some lane is zero (no lane of v has its top bit set, so no borrow crosses
// lanes); with AVX2, 32 bytes are compared at a time instead. Chunks are scanned without an
// early exit; only a chunk that holds a hit is scanned again element by element.
template <typename U>
std::optional<std::int64_t> first_all_ones(const std::uint8_t* p, std::int64_t n, U mask) {
  constexpr std::int64_t kChunk = 4096;
  constexpr int kLanes = sizeof(U) < 8 ? static_cast<int>(8 / sizeof(U)) : 1;
  std::uint64_t m = 0, lo = 0, hi = 0;
  for (int i = 0; i < kLanes; ++i) {
    m |= static_cast<std::uint64_t>(mask) << (8 * sizeof(U) * i);
    lo |= std::uint64_t{1} << (8 * sizeof(U) * i);
    hi |= std::uint64_t{1} << (8 * sizeof(U) * i + 8 * sizeof(U) - 1);
  }
  for (std::int64_t c = 0; c < n; c += kChunk) {
    const std::int64_t count = std::min(kChunk, n - c);
    const std::uint8_t* q = p + sizeof(U) * static_cast<std::size_t>(c);
    bool bad = false;
    std::int64_t i = 0;
#if defined(EAGLEKIT_FINITE_AVX2)
    if (has_avx2()) {
      i = count - count % static_cast<std::int64_t>(128 / sizeof(U));
      bad = any_all_ones_avx2<U>(q, i, mask);
    }
#endif
    if (kLanes > 1) {
      std::uint64_t acc = 0;
      for (; i + kLanes <= count; i += kLanes) {
        std::uint64_t w;
        std::memcpy(&w, q + sizeof(U) * static_cast<std::size_t>(i), 8);
        const std::uint64_t v = (w & m) ^ m;
        acc |= (v - lo) & ~v & hi;
      }
      bad |= acc != 0;
    }
    for (; i < count; ++i) {
      U v;
      std::memcpy(&v, q + sizeof(U) * static_cast<std::size_t>(i), sizeof(U));
      bad |= (v & mask) == mask;
    }
    if (!bad) continue;
    for (std::int64_t k = 0; k < count; ++k) {
      U v;
      std::memcpy(&v, q + sizeof(U) * static_cast<std::size_t>(k), sizeof(U));
      if ((v & mask) == mask) return c + k;
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
  const HostTensor none;
  const std::pair<const char*, const HostTensor*> tensors[] = {
      {"hidden_states", &r.hidden_states},
      {"aux_hidden_states", &r.aux_hidden_states},
      {"target_probs", r.target_probs ? &*r.target_probs : &none}};
  for (const auto& [name, t] : tensors) {
    if (t->dim() == 0) continue;
    if (const auto i = first_nonfinite(*t)) {
      const std::int64_t cols = t->dim() == 2 ? t->shape[1] : 1;
      const double v = t->get(*i);
      return std::string(std::isnan(v) ? "NaN" : "Inf") + " in " + name + " at token " +
             std::to_string(*i / cols) + ", column " + std::to_string(*i % cols);
    }
  }
  return std::nullopt;
}

std::optional<std::string> first_bad_distribution(const Record& r) {
  if (!r.target_probs || r.target_probs->dim() != 2) return std::nullopt;
  const HostTensor& p = *r.target_probs;
  const std::int64_t rows = p.shape[0], cols = p.shape[1];
  // A stored softmax rounded to the dtype: each value within half an ulp, so the sum within
  // Vd half-ulps of 1 at worst; bf16 sums of real distributions land within a few 1e-3.
  const double tol = p.dtype == DType::kBFloat16 ? 2e-2 : p.dtype == DType::kFloat16 ? 5e-3 : 1e-4;
  for (std::int64_t t = 0; t < rows; ++t) {
    double sum = 0;
    for (std::int64_t j = 0; j < cols; ++j) {
      const double v = p.get(t * cols + j);
      if (!std::isfinite(v))
        return std::string(std::isnan(v) ? "NaN" : "Inf") + " in target_probs at token " + std::to_string(t) +
               ", column " + std::to_string(j);
      if (v < 0)
        return "target_probs at token " + std::to_string(t) + ", column " + std::to_string(j) + " is " +
               std::to_string(v) + " (a probability is not negative)";
      sum += v;
    }
    if (std::fabs(sum - 1.0) > tol)
      return "target_probs at token " + std::to_string(t) + " sums to " + std::to_string(sum) +
             " (a distribution sums to 1; tolerance " + std::to_string(tol) + " in " + std::string(dtype_name(p.dtype)) + ")";
  }
  return std::nullopt;
}

}  // namespace eaglekit
