#include "formats/crc32.h"

#include <zlib.h>

#include <algorithm>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define EAGLEKIT_CRC32_CLMUL 1
#include <immintrin.h>
#endif

namespace eaglekit {

std::uint32_t crc32_update_portable(std::uint32_t crc, const void* data, std::size_t n) {
  const auto* p = static_cast<const Bytef*>(data);
  while (n > 0) {  // zlib's crc32 takes a 32-bit length
    const std::size_t k = std::min<std::size_t>(n, 1u << 30);
    crc = static_cast<std::uint32_t>(::crc32(crc, p, static_cast<uInt>(k)));
    p += k;
    n -= k;
  }
  return crc;
}

#if defined(EAGLEKIT_CRC32_CLMUL)

namespace {

// Folding constants of the reflected polynomial (x^k mod P(x), bit-reflected, shifted left
// by one), from the paper's appendix: k1/k2 fold 512 bits ahead (four lanes of 128 bits),
// k3/k4 fold 128 bits ahead, k5 folds 64 bits; mu and P' for the final Barrett reduction.
constexpr std::uint64_t kK1 = 0x0154442bd4, kK2 = 0x01c6e41596;
constexpr std::uint64_t kK3 = 0x01751997d0, kK4 = 0x00ccaa009e;
constexpr std::uint64_t kK5 = 0x0163cd6124;
constexpr std::uint64_t kP = 0x01db710641, kMu = 0x01f7011641;

// One fold: x times the constants (low half by the low constant, high half by the high),
// xored into the next 128 bits of data.
__attribute__((target("pclmul,sse4.1"))) inline __m128i fold(__m128i x, __m128i k, __m128i next) {
  const __m128i lo = _mm_clmulepi64_si128(x, k, 0x00);
  const __m128i hi = _mm_clmulepi64_si128(x, k, 0x11);
  return _mm_xor_si128(_mm_xor_si128(lo, hi), next);
}

// The CRC register (not inverted: the caller inverts before and after) extended by n bytes,
// n >= 64 and a multiple of 16.
__attribute__((target("pclmul,sse4.1"))) std::uint32_t fold_crc(std::uint32_t crc,
                                                                  const std::uint8_t* p,
                                                                  std::size_t n) {
  auto load = [](const std::uint8_t* q) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)); };
  __m128i x0 = _mm_xor_si128(load(p), _mm_cvtsi32_si128(static_cast<int>(crc)));
  __m128i x1 = load(p + 16), x2 = load(p + 32), x3 = load(p + 48);
  p += 64;
  n -= 64;
  const __m128i k12 = _mm_set_epi64x(static_cast<long long>(kK2), static_cast<long long>(kK1));
  while (n >= 64) {
    x0 = fold(x0, k12, load(p));
    x1 = fold(x1, k12, load(p + 16));
    x2 = fold(x2, k12, load(p + 32));
    x3 = fold(x3, k12, load(p + 48));
    p += 64;
    n -= 64;
  }
  // Four lanes into one, then the remaining 16-byte blocks.
  const __m128i k34 = _mm_set_epi64x(static_cast<long long>(kK4), static_cast<long long>(kK3));
  __m128i x = fold(x0, k34, x1);
  x = fold(x, k34, x2);
  x = fold(x, k34, x3);
  while (n >= 16) {
    x = fold(x, k34, load(p));
    p += 16;
    n -= 16;
  }
  // 128 bits -> 64 bits.
  const __m128i mask32 = _mm_setr_epi32(-1, 0, -1, 0);
  x = _mm_xor_si128(_mm_srli_si128(x, 8), _mm_clmulepi64_si128(x, k34, 0x10));
  const __m128i k5 = _mm_set_epi64x(0, static_cast<long long>(kK5));
  x = _mm_xor_si128(_mm_srli_si128(x, 4), _mm_clmulepi64_si128(_mm_and_si128(x, mask32), k5, 0x00));
  // Barrett reduction to 32 bits.
  const __m128i pmu = _mm_set_epi64x(static_cast<long long>(kMu), static_cast<long long>(kP));
  __m128i t = _mm_clmulepi64_si128(_mm_and_si128(x, mask32), pmu, 0x10);
  t = _mm_clmulepi64_si128(_mm_and_si128(t, mask32), pmu, 0x00);
  x = _mm_xor_si128(x, t);
  return static_cast<std::uint32_t>(_mm_extract_epi32(x, 1));
}

bool has_clmul() {
  static const bool yes = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  return yes;
}

}  // namespace

bool crc32_accelerated() { return has_clmul(); }

std::uint32_t crc32_update(std::uint32_t crc, const void* data, std::size_t n) {
  const auto* p = static_cast<const std::uint8_t*>(data);
  if (n >= 64 && has_clmul()) {
    const std::size_t body = n & ~std::size_t{15};
    crc = ~fold_crc(~crc, p, body);
    p += body;
    n -= body;
  }
  return n == 0 ? crc : crc32_update_portable(crc, p, n);
}

#else

bool crc32_accelerated() { return false; }

std::uint32_t crc32_update(std::uint32_t crc, const void* data, std::size_t n) {
  return crc32_update_portable(crc, data, n);
}

#endif

}  // namespace eaglekit
