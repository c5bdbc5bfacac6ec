#include "trainer/run/threads.h"

#include <dirent.h>
#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace eaglekit::trainer {

namespace {

// A positive integer from an environment variable, else 0.
int env_count(const char* name) {
  const char* text = std::getenv(name);
  if (!text || !*text) return 0;
  char* end = nullptr;
  const long v = std::strtol(text, &end, 10);
  return (*end == '\0' && v > 0 && v < 1 << 20) ? static_cast<int>(v) : 0;
}

}  // namespace

int usable_cores() {
#ifdef __linux__
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

ThreadChoice default_threads(int asked, int libtorch_default) {
  ThreadChoice c;
  if (asked > 0) {
    c.threads = asked;
    c.why = "--threads";
    return c;
  }
  if (const int omp = env_count("OMP_NUM_THREADS")) {
    c.threads = omp;
    c.why = "OMP_NUM_THREADS (LibTorch follows it too)";
    return c;
  }
  const int cores = usable_cores();
  const int ranks = std::max(1, env_count("LOCAL_WORLD_SIZE"));
  c.threads = std::max(1, cores / ranks);
  c.why = "the " + std::to_string(cores) + " core(s) this process may run on";
  if (ranks > 1) c.why += ", shared by the " + std::to_string(ranks) + " local ranks (LOCAL_WORLD_SIZE)";
  if (libtorch_default != c.threads)
    c.why += "; LibTorch's own default here is " + std::to_string(libtorch_default);
  c.why += "; --threads N to choose";
  return c;
}

CpuCounters read_cpu_counters() {
  CpuCounters c;
#ifdef __linux__
  // Per thread: "<ns on a core> <ns runnable, waiting> <timeslices>".
  if (DIR* dir = ::opendir("/proc/self/task")) {
    bool any = false;
    while (const dirent* e = ::readdir(dir)) {
      if (e->d_name[0] == '.') continue;
      std::ifstream f(std::string("/proc/self/task/") + e->d_name + "/schedstat");
      unsigned long long run = 0, wait = 0;
      if (f >> run >> wait) {
        c.run_s += static_cast<double>(run) * 1e-9;
        c.wait_s += static_cast<double>(wait) * 1e-9;
        any = true;
      }
    }
    ::closedir(dir);
    c.has_wait = any;
  }
  // The host's first line: "cpu user nice system idle iowait irq softirq steal ..." in ticks.
  std::ifstream stat("/proc/stat");
  std::string label;
  if (stat >> label && label == "cpu") {
    std::string line;
    std::getline(stat, line);
    std::istringstream fields(line);
    std::vector<double> v;
    double x = 0;
    while (fields >> x) v.push_back(x);
    if (v.size() >= 5) {
      const double tick = 1.0 / 100.0;  // USER_HZ; only ratios are used
      for (std::size_t i = 0; i < std::min<std::size_t>(v.size(), 8); ++i) c.total_s += v[i] * tick;
      c.idle_s = (v[3] + v[4]) * tick;
      c.has_idle = c.total_s > 0;
    }
  }
#endif
  return c;
}

CpuLoad cpu_load_between(const CpuCounters& a, const CpuCounters& b) {
  CpuLoad l;
  if (a.has_wait && b.has_wait) {
    // Threads that ended between the readings take their counts with them: clamp at 0.
    const double run = std::max(0.0, b.run_s - a.run_s), wait = std::max(0.0, b.wait_s - a.wait_s);
    if (run + wait > 0) l.wait_share = wait / (run + wait);
  }
  if (a.has_idle && b.has_idle) {
    const double total = b.total_s - a.total_s, idle = b.idle_s - a.idle_s;
    // total / host cores is the wall time the two readings span.
    const double cores = static_cast<double>(std::max(1u, std::thread::hardware_concurrency()));
    if (total > 0 && idle >= 0) l.idle_cores = cores * idle / total;
  }
  return l;
}

// --- the governor ----------------------------------------------------------------------

ThreadGovernor::ThreadGovernor(int max_threads) : max_(std::max(1, max_threads)), settled_(max_) {}

double ThreadGovernor::median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n == 0 ? 0.0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string ThreadGovernor::observe(const Step& s) {
  const double cost = s.seconds / std::max(1.0, s.tokens);
  auto rate = [](double c) { return c > 0 ? 1.0 / c : 0.0; };
  auto count = [](int n) { return std::to_string(n) + (n == 1 ? " thread" : " threads"); };

  if (probe_ > 0) {  // judging a probe
    probe_costs_.push_back(cost);
    if (static_cast<int>(probe_costs_.size()) < kMeasureSteps) return "";
    const double tried = median(probe_costs_), had = median(settled_costs_);
    const bool down = probe_ < settled_;
    char text[320];
    if (tried < kKeepBelow * had) {
      std::snprintf(text, sizeof text,
                    "--adapt-threads: %d -> %d threads: %s ran %.0f tokens/s against %.0f at %d (%s)", settled_,
                    probe_, count(probe_).c_str(), rate(tried), rate(had), settled_,
                    down ? "the cores are busy" : "cores are free again");
      settled_ = probe_;
      settled_costs_ = probe_costs_;
      steps_settled_ = 0;
      ++switches_;
      // Conditions changed: either direction may be tried again soon.
      backoff_down_ = backoff_up_ = kFirstBackoff;
      wait_down_ = wait_up_ = kFirstBackoff / 2;
    } else {
      std::int64_t& backoff = down ? backoff_down_ : backoff_up_;
      (down ? wait_down_ : wait_up_) = backoff;
      std::snprintf(text, sizeof text,
                    "--adapt-threads: staying at %d: %s ran %.0f tokens/s against %.0f; next try in %lld steps",
                    settled_, count(probe_).c_str(), rate(tried), rate(had), static_cast<long long>(backoff));
      backoff = std::min(kLastBackoff, backoff * 2);
      ++dropped_;
    }
    probe_ = 0;
    probe_costs_.clear();
    busy_streak_ = idle_streak_ = 0;
    return text;
  }

  settled_costs_.push_back(cost);
  if (static_cast<int>(settled_costs_.size()) > kMeasureSteps) settled_costs_.erase(settled_costs_.begin());
  ++steps_settled_;
  if (wait_down_ > 0) --wait_down_;
  if (wait_up_ > 0) --wait_up_;
  busy_streak_ = s.load.wait_share >= kBusyShare ? busy_streak_ + 1 : 0;
  idle_streak_ = s.load.idle_cores >= kIdleCores ? idle_streak_ + 1 : 0;
  if (static_cast<int>(settled_costs_.size()) < kMeasureSteps) return "";

  if (settled_ > 1 && wait_down_ == 0 && busy_streak_ >= kTriggerSteps) {
    // Keep the share of threads that ran: 2 threads that waited 60% of the time -> 1.
    const long keep = std::lround(settled_ * (1.0 - s.load.wait_share));
    probe_ = static_cast<int>(std::clamp<long>(keep, 1, settled_ - 1));
  } else if (settled_ < max_ && wait_up_ == 0) {
    if (idle_streak_ >= kTriggerSteps) {
      probe_ = std::min(max_, settled_ + std::max(1, static_cast<int>(std::lround(s.load.idle_cores))));
    } else if (s.load.idle_cores < 0 && steps_settled_ >= backoff_up_) {
      probe_ = max_;  // no idle figure on this system: try again on a timer
    }
  }
  if (probe_ > 0) probe_costs_.clear();
  return "";
}

}  // namespace eaglekit::trainer
