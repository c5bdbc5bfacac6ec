// Helpers shared by the libFuzzer harnesses: the input as a ByteSource, and reading every
// byte a parser hands out, so that a view past the end of its source is an ASan report
// here rather than a silent wrong answer later.
//
// Harness contract: a parser may throw eaglekit::Error (and its subclasses) on bad input;
// the harness catches exactly that. Anything else escaping (std::bad_alloc, out_of_range,
// a JSON library exception) reaches libFuzzer as a crash, as do ASan/UBSan reports, leaks,
// timeouts and allocations over -rss_limit_mb / -malloc_limit_mb.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "formats/byte_source.h"
#include "formats/host_tensor.h"

namespace eaglekit::fuzz {

// An owning source of exactly the input bytes (ASan catches a read one past its end).
inline std::shared_ptr<const ByteSource> source_of(const std::uint8_t* data, std::size_t size,
                                                   const std::string& name) {
  return ByteSource::from_bytes(std::vector<std::uint8_t>(data, data + size), name);
}

// Reads every element of a tensor through its strides (at most max_elements of them).
inline std::uint64_t touch(const HostTensor& t, std::int64_t max_elements = 1 << 20) {
  const std::int64_t n = t.numel();
  if (n <= 0 || n > max_elements) return 0;
  std::uint64_t acc = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const double v = t.get(i);
    std::uint64_t bits;
    static_assert(sizeof bits == sizeof v);
    __builtin_memcpy(&bits, &v, sizeof v);
    acc += bits;
  }
  return acc;
}

inline std::uint64_t touch(const std::uint8_t* p, std::uint64_t n) {
  std::uint64_t acc = 0;
  for (std::uint64_t i = 0; i < n; ++i) acc += p[i];
  return acc;
}

// Keeps results alive so the reads above are not optimized away.
inline volatile std::uint64_t g_sink = 0;

}  // namespace eaglekit::fuzz
