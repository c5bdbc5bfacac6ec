#include "trainer/run/cpu_memory.h"

#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <algorithm>
#include <atomic>

namespace eaglekit::trainer {

namespace {

// c10 calls reportMemoryUsage(ptr, +bytes) on allocation and (ptr, -bytes) on free while
// memoryProfilingEnabled() is true for the calling thread's PROFILER_STATE debug info.
struct Reporter final : c10::MemoryReportingInfoBase {
  std::atomic<std::int64_t> live{0};
  std::atomic<std::int64_t> peak{0};

  void count(std::int64_t bytes) {
    const std::int64_t now = live.fetch_add(bytes) + bytes;
    std::int64_t p = peak.load();
    while (now > p && !peak.compare_exchange_weak(p, now)) {
    }
  }
  // The totals' type changed from int64_t (LibTorch 1.x) to size_t (2.x); defining both
  // overrides whichever one the installed c10 declares.
  void reportMemoryUsage(void* /*ptr*/, int64_t alloc_size, int64_t /*total_allocated*/,
                         int64_t /*total_reserved*/, c10::Device /*device*/) {
    count(alloc_size);
  }
  void reportMemoryUsage(void* /*ptr*/, int64_t alloc_size, size_t /*total_allocated*/,
                         size_t /*total_reserved*/, c10::Device /*device*/) {
    count(alloc_size);
  }
  bool memoryProfilingEnabled() const override { return true; }
};

}  // namespace

struct CpuAllocationProbe::Impl {
  std::shared_ptr<Reporter> reporter = std::make_shared<Reporter>();
  c10::DebugInfoGuard guard{c10::DebugInfoKind::PROFILER_STATE, reporter};
};

CpuAllocationProbe::CpuAllocationProbe() : impl_(std::make_unique<Impl>()) {}
CpuAllocationProbe::~CpuAllocationProbe() = default;

std::int64_t CpuAllocationProbe::live_bytes() const { return impl_->reporter->live.load(); }
std::int64_t CpuAllocationProbe::peak_bytes() const { return impl_->reporter->peak.load(); }
void CpuAllocationProbe::reset_peak() { impl_->reporter->peak.store(impl_->reporter->live.load()); }

}  // namespace eaglekit::trainer
