// Element types that records and weights use, named as torch names them
// ("bfloat16", not "bf16"). Conversions between 16-bit floats and float live here too.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace eaglekit {

enum class DType : std::uint8_t {
  kBool,
  kUInt8,
  kInt8,
  kInt16,
  kInt32,
  kInt64,
  kFloat16,
  kBFloat16,
  kFloat32,
  kFloat64,
};

// Bytes per element.
std::size_t dtype_size(DType t);
// torch spelling without "torch.": "int64", "bfloat16", "float16", "float32", "bool", ...
std::string_view dtype_name(DType t);
// Accepts torch names and common aliases (bf16, fp16, half, float, long, ...).
std::optional<DType> parse_dtype(std::string_view name);
bool is_floating(DType t);
bool is_integral(DType t);  // bool excluded

inline float bf16_to_float(std::uint16_t v) {
  std::uint32_t bits = static_cast<std::uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
// Round to nearest even, NaN preserved (as torch does).
inline std::uint16_t float_to_bf16(float f) {
  std::uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>(bits >> 16);
}
float fp16_to_float(std::uint16_t v);
std::uint16_t float_to_fp16(float f);

// Reads element i of a buffer of dtype t as double (for statistics and tests).
double load_as_double(const void* base, DType t, std::int64_t i);

}  // namespace eaglekit
