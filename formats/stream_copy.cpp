#include "formats/stream_copy.h"

#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace eaglekit {

#if defined(__SSE2__)

namespace {

constexpr std::size_t kLine = 64;

// Bytes up to the next 16-byte boundary of dst (non-temporal stores need aligned targets).
std::size_t head_bytes(const void* dst, std::size_t n) {
  const auto mis = reinterpret_cast<std::uintptr_t>(dst) & 15u;
  const std::size_t head = mis == 0 ? 0 : 16 - mis;
  return head < n ? head : n;
}

}  // namespace

void stream_copy(void* dst, const void* src, std::size_t n) {
  if (n == 0) return;
  if (n < kStreamMin) {
    std::memcpy(dst, src, n);
    return;
  }
  auto* d = static_cast<std::uint8_t*>(dst);
  const auto* s = static_cast<const std::uint8_t*>(src);
  const std::size_t head = head_bytes(d, n);
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  std::size_t i = 0;
  for (; i + kLine <= n; i += kLine) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  std::memcpy(d + i, s + i, n - i);
  // Non-temporal stores are weakly ordered: fence before another thread may read the bytes.
  _mm_sfence();
}

void stream_zero(void* dst, std::size_t n) {
  if (n == 0) return;
  if (n < kStreamMin) {
    std::memset(dst, 0, n);
    return;
  }
  auto* d = static_cast<std::uint8_t*>(dst);
  const std::size_t head = head_bytes(d, n);
  std::memset(d, 0, head);
  d += head;
  n -= head;
  const __m128i z = _mm_setzero_si128();
  std::size_t i = 0;
  for (; i + kLine <= n; i += kLine) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), z);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), z);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), z);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), z);
  }
  std::memset(d + i, 0, n - i);
  _mm_sfence();
}

#else

void stream_copy(void* dst, const void* src, std::size_t n) {
  if (n != 0) std::memcpy(dst, src, n);
}
void stream_zero(void* dst, std::size_t n) {
  if (n != 0) std::memset(dst, 0, n);
}

#endif

}  // namespace eaglekit
