// Exact accounting of LibTorch's CPU allocations on the calling thread, for tests and
// benchmarks that must show how much memory an operation keeps (docs/benchmarks.md, TTT
// attention memory): while a CpuAllocationProbe lives, every allocation and free of a CPU
// tensor buffer made through c10's default CPU allocator on this thread (and on threads that
// inherit its LibTorch thread-local state, such as the autograd engine's) is counted.
//
// It uses c10's memory-reporting hook, the one LibTorch's profiler uses for profile_memory:
// do not run it inside a profiler session (the inner one hides the outer). Work that ATen's
// intra-op worker threads allocate is not seen; run measured code with at::set_num_threads(1)
// when every byte matters. Buffers allocated before the probe existed are not counted when
// freed (c10 knows their size only when reporting was on at allocation).
//
// Thread safety: create and destroy a probe on one thread; nest none. The readers may be
// called from any thread.
#pragma once

#include <cstdint>
#include <memory>

namespace eaglekit::trainer {

class CpuAllocationProbe {
 public:
  CpuAllocationProbe();
  ~CpuAllocationProbe();
  CpuAllocationProbe(const CpuAllocationProbe&) = delete;
  CpuAllocationProbe& operator=(const CpuAllocationProbe&) = delete;

  // Bytes allocated since construction and not yet freed.
  std::int64_t live_bytes() const;
  // The highest live_bytes() since construction or the last reset_peak().
  std::int64_t peak_bytes() const;
  void reset_peak();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace eaglekit::trainer
