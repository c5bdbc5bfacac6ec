#include "lib/malloc_policy.h"

#include <cstdlib>
#include <cstring>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace eaglekit {

namespace {

enum class State { kNotAsked, kKept, kUsers, kOptedOut, kFailed, kNotGlibc };
State g_state = State::kNotAsked;
std::string g_users;  // the user's variable, as set

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

// The user's own choice, "NAME=value", or empty.
std::string users_choice() {
  for (const char* name : kMallocVariables)
    if (const char* v = env(name)) return std::string(name) + "=" + v;
  if (const char* t = env("GLIBC_TUNABLES"); t != nullptr && std::strstr(t, "glibc.malloc.") != nullptr)
    return std::string("GLIBC_TUNABLES=") + t;
  return "";
}

std::string mib(long bytes) { return std::to_string(bytes >> 20) + " MiB"; }

}  // namespace

bool keep_freed_memory() {
  if (const char* v = env(kMallocOptOut); v != nullptr && std::strcmp(v, "libc") == 0) {
    g_state = State::kOptedOut;
    return false;
  }
  g_users = users_choice();
  if (!g_users.empty()) {
    g_state = State::kUsers;
    return false;
  }
#if defined(__GLIBC__)
  // Both together: either alone turns off the dynamic thresholds (the header says why).
  const bool ok = mallopt(M_MMAP_THRESHOLD, static_cast<int>(kKeptMmapThreshold)) == 1 &&
                  mallopt(M_TRIM_THRESHOLD, static_cast<int>(kKeptTrimThreshold)) == 1;
  g_state = ok ? State::kKept : State::kFailed;
  return ok;
#else
  g_state = State::kNotGlibc;
  return false;
#endif
}

MallocPolicy current_malloc_policy() {
  MallocPolicy p;
  switch (g_state) {
    case State::kKept:
      p.value = "freed blocks kept for reuse (blocks up to " + mib(kKeptMmapThreshold) +
                " from the heap, its free top returned beyond " + mib(kKeptTrimThreshold) + ")";
      p.why = "eaglekit's default: every step reuses the last step's memory instead of faulting it in again "
              "(set MALLOC_TRIM_THRESHOLD_ or a GLIBC_TUNABLES glibc.malloc tunable to choose)";
      break;
    case State::kUsers:
      p.value = g_users;
      p.why = "the environment's (eaglekit sets nothing when a MALLOC_*_ variable or a GLIBC_TUNABLES glibc.malloc "
              "tunable is set)";
      break;
    case State::kOptedOut:
      p.value = "the C library's defaults";
      p.why = std::string(kMallocOptOut) + "=libc in the environment: freed memory goes back to the kernel as glibc "
              "decides";
      break;
    case State::kFailed:
      p.value = "the C library's defaults";
      p.why = "glibc refused eaglekit's setting (mallopt): freed memory goes back to the kernel between steps";
      break;
    case State::kNotGlibc:
      p.value = "the C library's defaults";
      p.why = "not glibc: eaglekit sets nothing";
      break;
    case State::kNotAsked:
      p.value = "the C library's defaults";
      p.why = "this program did not ask for eaglekit's setting (eaglekit and eaglekit-torch do)";
      break;
  }
  return p;
}

}  // namespace eaglekit
