// How the OpenMP threads under LibTorch and OpenBLAS wait for work: eaglekit's default is
// passive (they sleep), unless the user chose otherwise in the environment.
//
// Why: libgomp's threads spin for up to 300,000 iterations before they sleep. On a host where
// other processes want the cores (a shared training box, CI, `ctest -j2`), the spinning threads
// take those cores from the thread that has the work: the same 20-step training ran 4.4-4.8x
// slower spinning than passive beside a busy loop (docs/benchmarks.md, "Waiting threads").
// Idle, passive costs nothing measurable there (the same page).
//
// libgomp reads OMP_WAIT_POLICY once, when it is loaded, before main() runs, and has no call to
// change it afterwards: a process that links LibTorch must have the variable in its environment
// from the start. So `eaglekit` (which links no LibTorch) sets it before it execs eaglekit-torch,
// and a program that links LibTorch and was started without it (eaglekit-torch run directly,
// the test binaries) execs itself once with it set.
//
// Header-only, so that every binary's main() (the test binaries' too, whatever they link) can
// call it. Thread safety: call these from main() before any thread starts (they change the
// environment). Errors: none thrown; a failed re-exec is reported on stderr and the process
// goes on spinning.
#pragma once

#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace eaglekit {

// The variables through which a user chooses how OpenMP threads wait: when any is set, eaglekit
// sets nothing. OMP_WAIT_POLICY (every OpenMP runtime), GOMP_SPINCOUNT (libgomp's spin count,
// which overrides the policy there), KMP_BLOCKTIME (LLVM's and Intel's runtimes).
inline constexpr const char* kWaitPolicyVariables[] = {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"};

// Set in the environment, beside OMP_WAIT_POLICY=passive, when eaglekit chose it, so that the
// processes it starts (ranks, eaglekit-torch) can say where the policy came from.
inline constexpr const char* kWaitPolicyMarker = "EAGLEKIT_OMP_WAIT_POLICY";

namespace wait_policy_detail {
inline const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}
// The environment this process was started with (/proc/self/environ: what the OpenMP runtime
// read when it loaded, whatever setenv did since); the current one where that is unreadable.
inline std::string initial_env(const char* name) {
  if (std::FILE* f = std::fopen("/proc/self/environ", "rb")) {
    std::string all;
    char buf[4096];
    for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) all.append(buf, n);
    std::fclose(f);
    const std::string key = std::string(name) + "=";
    for (std::size_t at = 0; at < all.size();) {
      const std::size_t end = all.find('\0', at);
      const std::size_t stop = end == std::string::npos ? all.size() : end;
      if (all.compare(at, key.size(), key) == 0) return all.substr(at + key.size(), stop - at - key.size());
      at = stop + 1;
    }
    return "";
  }
  const char* v = env(name);
  return v != nullptr ? v : "";
}
}  // namespace wait_policy_detail

// Sets OMP_WAIT_POLICY=passive and the marker when none of kWaitPolicyVariables is set.
// Returns true when it changed the environment.
inline bool default_passive_wait() {
  for (const char* name : kWaitPolicyVariables)
    if (wait_policy_detail::env(name) != nullptr) return false;
  ::setenv("OMP_WAIT_POLICY", "passive", 1);
  ::setenv(kWaitPolicyMarker, "default", 1);
  return true;
}

// default_passive_wait(), and when that changed the environment, replaces this process with a
// new run of the same executable and arguments (execv of /proc/self/exe), whose OpenMP runtime
// then starts passive. Returns when nothing needed changing, or when the exec failed (said once
// on stderr).
inline void reexec_with_passive_wait(char** argv) {
  if (!default_passive_wait()) return;
  ::execv("/proc/self/exe", argv);
  const int err = errno;
  std::fprintf(stderr,
               "eaglekit: could not restart with OMP_WAIT_POLICY=passive (%s); OpenMP threads will spin while "
               "they wait: set OMP_WAIT_POLICY yourself\n",
               std::strerror(err));
}

// The policy that applies to this process, read from the environment it started with (what its
// OpenMP runtime saw), for the run plan.
struct WaitPolicy {
  std::string value;  // "passive", "active", or the variable as set ("GOMP_SPINCOUNT=10000")
  std::string why;    // where it came from, in words
};
inline WaitPolicy current_wait_policy() {
  const std::string marker_s = wait_policy_detail::initial_env(kWaitPolicyMarker);
  const std::string policy_s = wait_policy_detail::initial_env("OMP_WAIT_POLICY");
  const std::string spin_s = wait_policy_detail::initial_env("GOMP_SPINCOUNT");
  const std::string block_s = wait_policy_detail::initial_env("KMP_BLOCKTIME");
  auto or_null = [](const std::string& v) { return v.empty() ? nullptr : v.c_str(); };
  const char* marker = or_null(marker_s);
  const char* policy = or_null(policy_s);
  const char* spin = or_null(spin_s);
  const char* block = or_null(block_s);
  WaitPolicy w;
  // The marker is inherited by every process a run starts; it speaks only while the policy is
  // still the one it set.
  if (policy != nullptr && std::strcmp(policy, "passive") == 0 && marker != nullptr &&
      std::strcmp(marker, "default") == 0 && spin == nullptr && block == nullptr) {
    w.value = "passive";
    w.why = "eaglekit's default: waiting OpenMP threads sleep instead of spinning, which keeps the cores for the "
            "work on a shared host (set OMP_WAIT_POLICY=active to spin)";
    return w;
  }
  if (spin != nullptr) {
    w.value = std::string("GOMP_SPINCOUNT=") + spin;
    w.why = "GOMP_SPINCOUNT in the environment (libgomp's spin count; it overrides OMP_WAIT_POLICY)";
  } else if (policy != nullptr) {
    w.value = policy;
    for (char& c : w.value) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    w.why = "OMP_WAIT_POLICY in the environment";
  } else if (block != nullptr) {
    w.value = std::string("KMP_BLOCKTIME=") + block;
    w.why = "KMP_BLOCKTIME in the environment (LLVM's and Intel's OpenMP runtimes)";
  } else {
    w.value = "the OpenMP runtime's (spins, then sleeps)";
    w.why = "nothing set it: this process was started without eaglekit's launcher; set OMP_WAIT_POLICY";
  }
  if (block != nullptr && spin == nullptr && policy != nullptr)
    w.why += "; KMP_BLOCKTIME=" + std::string(block) + " also set";
  return w;
}

}  // namespace eaglekit
