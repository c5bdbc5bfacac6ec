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

// The last step of both paths: four 128-bit lanes (x0 oldest) into one, the remaining 16-byte
// blocks, then 128 -> 64 -> 32 bits.
__attribute__((target("pclmul,sse4.1"))) inline std::uint32_t finish(__m128i x0, __m128i x1, __m128i x2,
                                                                      __m128i x3, const std::uint8_t* p,
                                                                      std::size_t n) {
  auto load = [](const std::uint8_t* q) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)); };
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
  return finish(x0, x1, x2, x3, p, n);
}

// VPCLMULQDQ: the same folds on four 512-bit registers (16 lanes, 256 bytes a step), for
// CPUs with AVX-512 (the 128-bit path is bound by the multiplier's throughput, one 16-byte
// lane per instruction). k6/k7 fold 2048 bits ahead (x^2080, x^2016 reflected, as k1/k2 are
// x^544, x^480).
constexpr std::uint64_t kK6 = 0x011542778a, kK7 = 0x01322d1430;

__attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.1"))) inline __m512i fold512(__m512i x, __m512i k,
                                                                                  __m512i next) {
  const __m512i lo = _mm512_clmulepi64_epi128(x, k, 0x00);
  const __m512i hi = _mm512_clmulepi64_epi128(x, k, 0x11);
  return _mm512_ternarylogic_epi64(lo, hi, next, 0x96);  // lo ^ hi ^ next
}

// As fold_crc, n >= 256 and a multiple of 16.
__attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.1"))) std::uint32_t fold_crc_512(std::uint32_t crc,
                                                                                    const std::uint8_t* p,
                                                                                    std::size_t n) {
#define load(q) _mm512_loadu_si512(q)
  __m512i z0 = _mm512_xor_si512(load(p), _mm512_inserti32x4(_mm512_setzero_si512(),
                                                            _mm_cvtsi32_si128(static_cast<int>(crc)), 0));
  __m512i z1 = load(p + 64), z2 = load(p + 128), z3 = load(p + 192);
  p += 256;
  n -= 256;
  const __m512i k67 = _mm512_set4_epi64(static_cast<long long>(kK7), static_cast<long long>(kK6),
                                        static_cast<long long>(kK7), static_cast<long long>(kK6));
  while (n >= 256) {
    z0 = fold512(z0, k67, load(p));
    z1 = fold512(z1, k67, load(p + 64));
    z2 = fold512(z2, k67, load(p + 128));
    z3 = fold512(z3, k67, load(p + 192));
    p += 256;
    n -= 256;
  }
  const __m512i k12 = _mm512_set4_epi64(static_cast<long long>(kK2), static_cast<long long>(kK1),
                                        static_cast<long long>(kK2), static_cast<long long>(kK1));
  __m512i z = fold512(z0, k12, z1);
  z = fold512(z, k12, z2);
  z = fold512(z, k12, z3);
  while (n >= 64) {
    z = fold512(z, k12, load(p));
    p += 64;
    n -= 64;
  }
#undef load
  alignas(64) __m128i lanes[4];
  _mm512_store_si512(lanes, z);
  return finish(lanes[0], lanes[1], lanes[2], lanes[3], p, n);
}

bool has_clmul() {
  static const bool yes = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  return yes;
}

bool has_vpclmul() {
  static const bool yes = has_clmul() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq");
  return yes;
}

}  // namespace

bool crc32_accelerated() { return has_clmul(); }

std::uint32_t crc32_update_path(Crc32Path path, std::uint32_t crc, const void* data, std::size_t n) {
  const auto* p = static_cast<const std::uint8_t*>(data);
  if (path != Crc32Path::kPortable && n >= 64 && has_clmul()) {
    const std::size_t body = n & ~std::size_t{15};
    const bool wide = path == Crc32Path::kVpclmul && body >= 256 && has_vpclmul();
    crc = wide ? ~fold_crc_512(~crc, p, body) : ~fold_crc(~crc, p, body);
    p += body;
    n -= body;
  }
  return n == 0 ? crc : crc32_update_portable(crc, p, n);
}

std::uint32_t crc32_update(std::uint32_t crc, const void* data, std::size_t n) {
  return crc32_update_path(Crc32Path::kVpclmul, crc, data, n);
}

#else

bool crc32_accelerated() { return false; }

std::uint32_t crc32_update_path(Crc32Path, std::uint32_t crc, const void* data, std::size_t n) {
  return crc32_update_portable(crc, data, n);
}

std::uint32_t crc32_update(std::uint32_t crc, const void* data, std::size_t n) {
  return crc32_update_portable(crc, data, n);
}

#endif

}  // namespace eaglekit
