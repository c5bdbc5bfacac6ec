// Copies and zero fills of large buffers that will not be read again soon (batch memory):
// above kStreamMin bytes they use non-temporal stores, which write whole cache lines to
// memory without first reading them (a plain memcpy into memory that is not in the cache
// reads every destination line before writing it: a third more memory traffic) and
// without evicting the data the other threads are working on. Below it, or on CPUs
// without SSE2, they are memcpy / memset. bench/bench_loader.sh measures the difference.
//
// Thread safety: pure functions. Never throw.
#pragma once

#include <cstddef>

namespace eaglekit {

// Copies of at least this many bytes bypass the cache.
constexpr std::size_t kStreamMin = 256 * 1024;

// memcpy(dst, src, n) for non-overlapping buffers.
void stream_copy(void* dst, const void* src, std::size_t n);
// memset(dst, 0, n).
void stream_zero(void* dst, std::size_t n);

}  // namespace eaglekit
