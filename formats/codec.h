// The building blocks of the .eks codecs (formats/eks_format.h): byte-plane shuffling of
// multi-byte elements, fp8 e4m3 quantization with one fp32 scale per row, zstd frames and
// xxh3-64 checksums. Pure functions on caller-owned buffers; no file I/O.
//
// Thread safety: every function may be called from many threads at once (zstd contexts are
// per thread). Nothing here throws on bad data: decoders return false and fill an error
// text, so the caller can name the file and record it came from.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "formats/dtype.h"

namespace eaglekit::codec {

// Splits n elements of elem_size bytes (little-endian) into elem_size planes, most
// significant byte first: dst = [byte elem_size-1 of every element][...][byte 0 of every
// element]. For bf16 the first plane holds sign + 7 exponent bits, which compresses well;
// the second holds the noisy mantissa. dst must hold n * elem_size bytes.
void split_byte_planes(const std::uint8_t* src, std::size_t n, std::size_t elem_size,
                       std::uint8_t* dst);
// The inverse of split_byte_planes.
void merge_byte_planes(const std::uint8_t* src, std::size_t n, std::size_t elem_size,
                       std::uint8_t* dst);

// OCP fp8 e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, 0x7f/0xff
// are NaN, the largest finite value is 448. Rounds to nearest even and saturates at +-448.
std::uint8_t float_to_e4m3(float f);
float e4m3_to_float(std::uint8_t v);
constexpr float kE4m3Max = 448.0f;

// Per-row scaled fp8 of a [rows, cols] float tensor (bf16, fp16 or fp32, contiguous):
// scale[r] = max |finite x| of row r / 448 (0 for an all-zero row), code = e4m3(x / scale).
// +-inf saturate to +-448 * scale, NaN stays NaN.
bool fp8_supported(DType t);
void fp8_quantize_rows(const void* src, DType dtype, std::size_t rows, std::size_t cols,
                       float* scales, std::uint8_t* codes);
// code * scale, rounded to dtype (nearest even). dst holds rows * cols elements.
void fp8_dequantize_rows(const float* scales, const std::uint8_t* codes, std::size_t rows,
                         std::size_t cols, DType dtype, void* dst);

// How one payload is compressed.
struct ZstdSettings {
  int level = 3;
  // Sizes of consecutive parts of the input (summing to its size; empty: one part). Each
  // part ends a zstd block, so every byte plane gets literal tables of its own instead of
  // sharing one with its neighbour (the exponent plane and the mantissa plane of bf16
  // have nothing in common).
  std::vector<std::size_t> parts;
  // Noise-like bytes (float byte planes, fp8 codes): chance repeats of 4-6 bytes there
  // cost more to code as matches than as Huffman literals, so matches shorter than 7 bytes
  // are not looked for. On bf16 hidden states at level 3 this gives ~5% smaller output
  // and twice the decode speed.
  bool noisy = false;
};
// Appends one zstd frame (content size recorded in the frame header) of src to out;
// returns its size. Throws Error only if zstd itself fails (out of memory, bad level).
std::size_t zstd_compress_append(const void* src, std::size_t n, const ZstdSettings& settings,
                                 std::vector<std::uint8_t>& out);
// Decodes one frame that must decode to exactly dst_n bytes. On failure returns false and
// sets *error ("zstd: Data corruption detected", "frame holds 10 bytes, expected 12", ...).
bool zstd_decompress_exact(const void* src, std::size_t src_n, void* dst, std::size_t dst_n,
                           std::string* error);
// Valid zstd levels (1 .. 22; negative "fast" levels included).
int zstd_min_level();
int zstd_max_level();

// XXH3_64bits (seed 0) of n bytes.
std::uint64_t xxh3_64(const void* data, std::size_t n);

}  // namespace eaglekit::codec
