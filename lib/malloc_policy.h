// How the C library's allocator hands freed memory back: eaglekit's LibTorch commands keep
// freed blocks for reuse instead of returning them to the kernel after every step, unless the
// user chose the allocator's settings in the environment.
//
// Why: a training step frees and allocates the same few hundred megabytes of tensors every
// step. glibc's malloc returns the freed top of its heap to the kernel once it exceeds twice the
// largest block it has seen mmap'd (its dynamic trim threshold), so the next step takes every
// page again as a fresh, zeroed page fault: on the e2e's DFlash training that was 482,000 minor
// faults in 20 steps, 1.9 s of kernel time, against 105,000 and 0.9 s with the blocks kept,
// and 10-15% of the step's wall time (docs/benchmarks.md, "Freed memory kept"). The peak
// resident memory is the same (the kept blocks are the step's own peak).
//
// The setting: blocks up to 32 MiB (glibc's largest M_MMAP_THRESHOLD on 64-bit) come from the
// heap, and the heap's free top is returned only beyond 1 GiB (M_TRIM_THRESHOLD). Setting
// either turns off glibc's dynamic thresholds, so both are set together (the trim threshold
// alone sends every block over 128 KiB to mmap: 2.7 million faults on the same run).
//
// EAGLEKIT_MALLOC=libc keeps the C library's own behaviour (bench/bench_malloc.sh compares
// the two; a host that wants the memory back between steps).
//
// mallopt() applies at run time, so no restart is needed (unlike lib/wait_policy.h). On a C
// library other than glibc nothing is set and the plan says so.
//
// Thread safety: call keep_freed_memory() from main() before any thread starts. Errors: none
// thrown.
#pragma once

#include <string>

namespace eaglekit {

// The environment variables through which a user chooses glibc's allocator settings: when any
// is set (GLIBC_TUNABLES only when it names a glibc.malloc tunable), eaglekit sets nothing.
inline constexpr const char* kMallocVariables[] = {"MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_",
                                                   "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_", "MALLOC_ARENA_MAX"};

inline constexpr long kKeptMmapThreshold = 32L << 20;  // bytes
inline constexpr long kKeptTrimThreshold = 1L << 30;   // bytes

// Set to "libc": eaglekit leaves the allocator as the C library starts it.
inline constexpr const char* kMallocOptOut = "EAGLEKIT_MALLOC";

// Applies eaglekit's setting (above) unless the user chose, and records what applies for
// current_malloc_policy(). Returns true when it changed the allocator's settings.
bool keep_freed_memory();

// What applies to this process, for the run plan.
struct MallocPolicy {
  std::string value;  // "freed blocks kept (...)", "the C library's defaults", "MALLOC_TRIM_THRESHOLD_=..."
  std::string why;    // where it came from, in words
};
MallocPolicy current_malloc_policy();

}  // namespace eaglekit
