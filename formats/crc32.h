// CRC-32 of the zip and gzip formats (polynomial 0xEDB88320, reflected), the value zlib's
// crc32() computes, at memory speed: on x86-64 CPUs with PCLMULQDQ it folds 64 bytes per
// step with carry-less multiplies (Intel's "Fast CRC Computation for Generic Polynomials
// Using PCLMULQDQ", 2009), and with AVX-512's VPCLMULQDQ 256 bytes per step; elsewhere it is
// zlib's. On one core of a loaded Zen 5: 17 GB/s where zlib 1.2.13 made 1.6 GB/s (idle:
// 4 GB/s; the 128-bit path 11 GB/s). A .pt record read whole is checked against its zip
// CRC-32s on every read, so this sits on the loader's path (docs/benchmarks.md, "The
// loader").
//
// Thread safety: pure functions. Never throw.
#pragma once

#include <cstddef>
#include <cstdint>

namespace eaglekit {

// zlib's crc32(crc, data, n): the CRC-32 of the bytes so far (`crc`; 0 to start) extended
// by n more bytes. Any length, any alignment.
std::uint32_t crc32_update(std::uint32_t crc, const void* data, std::size_t n);

// The table-driven answer (zlib's crc32), for tests and benchmarks to compare against.
std::uint32_t crc32_update_portable(std::uint32_t crc, const void* data, std::size_t n);

// Whether crc32_update uses the carry-less multiply path on this CPU.
bool crc32_accelerated();

// The paths crc32_update chooses from, for tests and benchmarks to run each one: zlib's
// table, 128-bit PCLMULQDQ folds, 512-bit VPCLMULQDQ folds. A path this CPU lacks runs the
// next simpler one.
enum class Crc32Path { kPortable, kClmul, kVpclmul };
std::uint32_t crc32_update_path(Crc32Path path, std::uint32_t crc, const void* data, std::size_t n);

}  // namespace eaglekit
