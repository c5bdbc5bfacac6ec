#include "formats/codec.h"

#include <xxhash.h>
#include <zstd.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <array>
#include <cmath>
#include <cstring>
#include <limits>

#include "formats/error.h"

namespace eaglekit::codec {

namespace {

// One compression and one decompression context per thread: creating them costs more
// than compressing a small block, and they are not thread-safe.
struct ZstdContexts {
  ZSTD_CCtx* cctx = nullptr;
  ZSTD_DCtx* dctx = nullptr;
  ~ZstdContexts() {
    ZSTD_freeCCtx(cctx);
    ZSTD_freeDCtx(dctx);
  }
};

ZstdContexts& contexts() {
  thread_local ZstdContexts c;
  return c;
}

std::array<float, 256> make_e4m3_table() {
  std::array<float, 256> t{};
  for (int v = 0; v < 256; ++v) {
    const int exp = (v >> 3) & 0xf;
    const int man = v & 7;
    float mag;
    if (exp == 15 && man == 7) {
      mag = std::numeric_limits<float>::quiet_NaN();
    } else if (exp == 0) {
      mag = std::ldexp(static_cast<float>(man), -9);
    } else {
      mag = std::ldexp(static_cast<float>(8 + man), exp - 10);
    }
    t[static_cast<std::size_t>(v)] = (v & 0x80) ? -mag : mag;
  }
  return t;
}

const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> kTable = make_e4m3_table();
  return kTable;
}

inline float load_float(const std::uint8_t* p, DType t, std::size_t i) {
  switch (t) {
    case DType::kBFloat16: {
      std::uint16_t v;
      std::memcpy(&v, p + 2 * i, 2);
      return bf16_to_float(v);
    }
    case DType::kFloat16: {
      std::uint16_t v;
      std::memcpy(&v, p + 2 * i, 2);
      return fp16_to_float(v);
    }
    default: {
      float v;
      std::memcpy(&v, p + 4 * i, 4);
      return v;
    }
  }
}

}  // namespace

void split_byte_planes(const std::uint8_t* src, std::size_t n, std::size_t elem_size,
                       std::uint8_t* dst) {
  if (elem_size == 2) {
    std::uint8_t* hi = dst;
    std::uint8_t* lo = dst + n;
    std::size_t i = 0;
#if defined(__SSE2__)
    // 16 elements at a time: low bytes by masking, high bytes by shifting, then packed.
    const __m128i mask = _mm_set1_epi16(0x00ff);
    for (; i + 16 <= n; i += 16) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i + 16));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + i),
                       _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(b, 8)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + i),
                       _mm_packus_epi16(_mm_and_si128(a, mask), _mm_and_si128(b, mask)));
    }
#endif
    for (; i < n; ++i) {
      std::uint16_t v;
      std::memcpy(&v, src + 2 * i, 2);
      hi[i] = static_cast<std::uint8_t>(v >> 8);
      lo[i] = static_cast<std::uint8_t>(v);
    }
    return;
  }
  for (std::size_t b = 0; b < elem_size; ++b) {
    std::uint8_t* plane = dst + (elem_size - 1 - b) * n;
    for (std::size_t i = 0; i < n; ++i) plane[i] = src[i * elem_size + b];
  }
}

void merge_byte_planes(const std::uint8_t* src, std::size_t n, std::size_t elem_size,
                       std::uint8_t* dst) {
  if (elem_size == 2) {
    const std::uint8_t* hi = src;
    const std::uint8_t* lo = src + n;
    std::size_t i = 0;
#if defined(__SSE2__)
    // Interleaving 16 low bytes with 16 high bytes gives 16 little-endian elements.
    for (; i + 16 <= n; i += 16) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi + i));
      const __m128i l = _mm_loadu_si128(reinterpret_cast<const __m128i*>(lo + i));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i), _mm_unpacklo_epi8(l, h));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i + 16), _mm_unpackhi_epi8(l, h));
    }
#endif
    for (; i < n; ++i) {
      const auto v = static_cast<std::uint16_t>(lo[i] | (hi[i] << 8));
      std::memcpy(dst + 2 * i, &v, 2);
    }
    return;
  }
  for (std::size_t b = 0; b < elem_size; ++b) {
    const std::uint8_t* plane = src + (elem_size - 1 - b) * n;
    for (std::size_t i = 0; i < n; ++i) dst[i * elem_size + b] = plane[i];
  }
}

std::uint8_t float_to_e4m3(float f) {
  std::uint32_t x;
  std::memcpy(&x, &f, 4);
  const auto sign = static_cast<std::uint8_t>((x >> 24) & 0x80u);
  const std::uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<std::uint8_t>(sign | 0x7fu);  // NaN
  // 448 (0x43e00000) and above, infinity included, saturate to the largest finite code.
  if (a >= 0x43e00000u) return static_cast<std::uint8_t>(sign | 0x7eu);
  const int exp = static_cast<int>(a >> 23) - 127;
  if (exp < -6) {
    // Subnormal range: multiples of 2^-9. The product is exact; nearbyint rounds to even.
    const float q = std::nearbyint(std::fabs(f) * 512.0f);  // 0..8; 8 is the first normal
    return static_cast<std::uint8_t>(sign | static_cast<std::uint8_t>(q));
  }
  const std::uint32_t man = a & 0x7fffffu;
  std::uint32_t code = (static_cast<std::uint32_t>(exp + 7) << 3) | (man >> 20);
  const std::uint32_t rem = man & 0xfffffu;
  if (rem > 0x80000u || (rem == 0x80000u && (code & 1u))) ++code;  // may carry into exponent
  if (code > 0x7eu) code = 0x7eu;
  return static_cast<std::uint8_t>(sign | code);
}

float e4m3_to_float(std::uint8_t v) { return e4m3_table()[v]; }

bool fp8_supported(DType t) {
  return t == DType::kBFloat16 || t == DType::kFloat16 || t == DType::kFloat32;
}

void fp8_quantize_rows(const void* src, DType dtype, std::size_t rows, std::size_t cols,
                       float* scales, std::uint8_t* codes) {
  if (!fp8_supported(dtype))
    throw Error("fp8: cannot quantize " + std::string(dtype_name(dtype)));
  const auto* p = static_cast<const std::uint8_t*>(src);
  std::vector<float> row(cols);
  for (std::size_t r = 0; r < rows; ++r) {
    float amax = 0.0f;
    for (std::size_t c = 0; c < cols; ++c) {
      const float v = load_float(p, dtype, r * cols + c);
      row[c] = v;
      const float m = std::fabs(v);
      if (std::isfinite(m) && m > amax) amax = m;
    }
    const float scale = amax / kE4m3Max;
    scales[r] = scale;
    std::uint8_t* out = codes + r * cols;
    if (scale == 0.0f) {
      // All zeros (or nothing finite): NaN stays NaN, everything else decodes to 0.
      for (std::size_t c = 0; c < cols; ++c) out[c] = std::isnan(row[c]) ? 0x7f : 0x00;
      continue;
    }
    const float inv = 1.0f / scale;
    if (std::isfinite(inv)) {
      for (std::size_t c = 0; c < cols; ++c) out[c] = float_to_e4m3(row[c] * inv);
    } else {
      for (std::size_t c = 0; c < cols; ++c) out[c] = float_to_e4m3(row[c] / scale);
    }
  }
}

void fp8_dequantize_rows(const float* scales, const std::uint8_t* codes, std::size_t rows,
                         std::size_t cols, DType dtype, void* dst) {
  const auto& table = e4m3_table();
  auto* out = static_cast<std::uint8_t*>(dst);
  if (dtype == DType::kBFloat16 || dtype == DType::kFloat16) {
    // One scale per row: the 256 possible outputs of a row cost less to compute up front
    // than one conversion per element (rows are thousands wide).
    std::uint16_t lut[256];
    for (std::size_t r = 0; r < rows; ++r) {
      const float s = scales[r];
      for (int c = 0; c < 256; ++c)
        lut[c] = dtype == DType::kBFloat16 ? float_to_bf16(table[static_cast<std::size_t>(c)] * s)
                                           : float_to_fp16(table[static_cast<std::size_t>(c)] * s);
      const std::uint8_t* in = codes + r * cols;
      std::uint8_t* o = out + 2 * r * cols;
      for (std::size_t c = 0; c < cols; ++c) std::memcpy(o + 2 * c, &lut[in[c]], 2);
    }
    return;
  }
  for (std::size_t r = 0; r < rows; ++r) {
    const float s = scales[r];
    const std::uint8_t* in = codes + r * cols;
    switch (dtype) {
      case DType::kBFloat16:
        for (std::size_t c = 0; c < cols; ++c) {
          const std::uint16_t v = float_to_bf16(table[in[c]] * s);
          std::memcpy(out + 2 * (r * cols + c), &v, 2);
        }
        break;
      case DType::kFloat16:
        for (std::size_t c = 0; c < cols; ++c) {
          const std::uint16_t v = float_to_fp16(table[in[c]] * s);
          std::memcpy(out + 2 * (r * cols + c), &v, 2);
        }
        break;
      case DType::kFloat32:
        for (std::size_t c = 0; c < cols; ++c) {
          const float v = table[in[c]] * s;
          std::memcpy(out + 4 * (r * cols + c), &v, 4);
        }
        break;
      default:
        throw Error("fp8: cannot dequantize to " + std::string(dtype_name(dtype)));
    }
  }
}

std::size_t zstd_compress_append(const void* src, std::size_t n, const ZstdSettings& settings,
                                 std::vector<std::uint8_t>& out) {
  auto& ctx = contexts();
  if (ctx.cctx == nullptr) ctx.cctx = ZSTD_createCCtx();
  if (ctx.cctx == nullptr) throw Error("zstd: cannot create a compression context");
  ZSTD_CCtx* c = ctx.cctx;
  auto check = [](std::size_t r) {
    if (ZSTD_isError(r)) throw Error(std::string("zstd: compression failed: ") + ZSTD_getErrorName(r));
    return r;
  };
  check(ZSTD_CCtx_reset(c, ZSTD_reset_session_and_parameters));
  check(ZSTD_CCtx_setParameter(c, ZSTD_c_compressionLevel, settings.level));
  if (settings.noisy) check(ZSTD_CCtx_setParameter(c, ZSTD_c_minMatch, 7));
  check(ZSTD_CCtx_setPledgedSrcSize(c, n));

  std::vector<std::size_t> parts = settings.parts;
  if (parts.empty()) parts.push_back(n);
  std::size_t total = 0;
  for (auto p : parts) total += p;
  if (total != n) throw Error("zstd: parts do not add up to the input size");

  const std::size_t old = out.size();
  // A flush adds a block header and may end a block early: a little slack per part.
  out.resize(old + ZSTD_compressBound(n) + 64 * parts.size());
  ZSTD_outBuffer o{out.data() + old, out.size() - old, 0};
  const auto* p = static_cast<const std::uint8_t*>(src);
  for (std::size_t k = 0; k < parts.size(); ++k) {
    ZSTD_inBuffer in{p, parts[k], 0};
    const ZSTD_EndDirective mode = k + 1 == parts.size() ? ZSTD_e_end : ZSTD_e_flush;
    for (;;) {
      const std::size_t left = check(ZSTD_compressStream2(c, &o, &in, mode));
      if (left == 0 && in.pos == in.size) break;
      if (o.pos == o.size) {  // never expected with the bound above; grow and go on
        const std::size_t used = o.pos;
        out.resize(out.size() + ZSTD_compressBound(n));
        o = ZSTD_outBuffer{out.data() + old, out.size() - old, used};
      }
    }
    p += parts[k];
  }
  out.resize(old + o.pos);
  return o.pos;
}

bool zstd_decompress_exact(const void* src, std::size_t src_n, void* dst, std::size_t dst_n,
                           std::string* error) {
  const unsigned long long content = ZSTD_getFrameContentSize(src, src_n);
  if (content == ZSTD_CONTENTSIZE_ERROR) {
    *error = "not a zstd frame (bad frame header)";
    return false;
  }
  if (content != ZSTD_CONTENTSIZE_UNKNOWN && content != dst_n) {
    *error = "zstd frame holds " + std::to_string(content) + " bytes, the index says " +
             std::to_string(dst_n);
    return false;
  }
  auto& ctx = contexts();
  if (ctx.dctx == nullptr) ctx.dctx = ZSTD_createDCtx();
  if (ctx.dctx == nullptr) throw Error("zstd: cannot create a decompression context");
  const std::size_t r = ZSTD_decompressDCtx(ctx.dctx, dst, dst_n, src, src_n);
  if (ZSTD_isError(r)) {
    *error = std::string("zstd frame does not decode: ") + ZSTD_getErrorName(r);
    return false;
  }
  if (r != dst_n) {
    *error = "zstd frame decoded to " + std::to_string(r) + " bytes, the index says " +
             std::to_string(dst_n);
    return false;
  }
  return true;
}

int zstd_min_level() { return ZSTD_minCLevel(); }
int zstd_max_level() { return ZSTD_maxCLevel(); }

std::uint64_t xxh3_64(const void* data, std::size_t n) { return XXH3_64bits(data, n); }

}  // namespace eaglekit::codec
