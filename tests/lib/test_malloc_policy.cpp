// lib/malloc_policy.h: with eaglekit's setting, memory a step frees is reused by the next step
// without page faults; glibc's defaults return it to the kernel and fault it in again. Counted
// in minor page faults (getrusage), which do not depend on the machine's load.
#include <doctest/doctest.h>

#include <sys/resource.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "lib/malloc_policy.h"

using namespace eaglekit;

namespace {

long minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

// One "step": 24 blocks of 4 MiB (a step's activations) allocated, written, freed in order.
// Returns the minor faults it took.
long step() {
  const long before = minor_faults();
  std::vector<char*> blocks;
  for (int i = 0; i < 24; ++i) {
    char* p = static_cast<char*>(std::malloc(4u << 20));
    REQUIRE(p != nullptr);
    std::memset(p, i, 4u << 20);
    blocks.push_back(p);
  }
  for (char* p : blocks) std::free(p);
  return minor_faults() - before;
}

}  // namespace

#if defined(__SANITIZE_ADDRESS__)
#define EAGLEKIT_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define EAGLEKIT_ASAN 1
#endif
#endif

TEST_CASE("malloc policy: freed memory is kept, so a repeated step takes no page faults") {
#if defined(EAGLEKIT_ASAN)
  // AddressSanitizer's allocator replaces glibc's: mallopt does not reach it (and returns 0,
  // which the plan reports as refused).
  CHECK_FALSE(keep_freed_memory());
  CHECK(current_malloc_policy().why.find("refused") != std::string::npos);
  MESSAGE("AddressSanitizer's allocator: glibc's settings do not apply");
#elif defined(__GLIBC__)
  const bool users = std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr || std::getenv("GLIBC_TUNABLES") != nullptr ||
                     std::getenv("EAGLEKIT_MALLOC") != nullptr;
  if (users) {
    MESSAGE("skipped: the environment chooses glibc's allocator settings");
    return;
  }
  // With glibc's dynamic thresholds a 96 MiB step is given back to the kernel after each step
  // (about 24,000 faults each time). Must fail: without keep_freed_memory() the later steps
  // fault as much as the first.
  REQUIRE(keep_freed_memory());
  step();  // the first step faults its pages in once
  long later = 0;
  for (int i = 0; i < 3; ++i) later += step();
  CHECK_MESSAGE(later < 1000, later << " minor faults in 3 repeated steps of 96 MiB (24,000 a step when returned)");
  const MallocPolicy p = current_malloc_policy();
  CHECK(p.value.rfind("freed blocks kept for reuse", 0) == 0);
  CHECK(p.why.rfind("eaglekit's default", 0) == 0);
#else
  MESSAGE("not glibc: eaglekit sets nothing");
#endif
}
