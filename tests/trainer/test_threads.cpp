// The run's thread count: the default and its source, the CPU counters the governor reads,
// and the governor's policy on made-up step sequences (idle, busy cores where fewer threads
// win, busy cores where they lose, cores freed again, a system that gives no figures).
#include <doctest/doctest.h>

#include <time.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "trainer/run/threads.h"

using namespace eaglekit::trainer;

namespace {

// Sets an environment variable for a scope, then puts the old value back.
class EnvVar {
 public:
  EnvVar(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = std::string(old);
    if (value)
      ::setenv(name, value, 1);
    else
      ::unsetenv(name);
  }
  ~EnvVar() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// A machine as the governor sees it: `cost_at(n)` seconds per token at n threads, and the
// load figures each step reports at n threads.
struct Machine {
  double (*cost_at)(int);
  CpuLoad (*load_at)(int);
};

// Runs `steps` steps; returns the thread count of each.
std::vector<int> drive(ThreadGovernor& g, const Machine& m, int steps, std::vector<std::string>* said = nullptr) {
  std::vector<int> counts;
  for (int i = 0; i < steps; ++i) {
    const int n = g.threads();
    counts.push_back(n);
    ThreadGovernor::Step s;
    s.tokens = 1000;
    s.seconds = m.cost_at(n) * s.tokens;
    s.load = m.load_at(n);
    const std::string line = g.observe(s);
    if (said && !line.empty()) said->push_back(line);
  }
  return counts;
}

int count_of(const std::vector<int>& v, int n) { return static_cast<int>(std::count(v.begin(), v.end(), n)); }

}  // namespace

TEST_CASE("threads: the default names its source") {
  {
    const ThreadChoice c = default_threads(3, 1);
    CHECK(c.threads == 3);
    CHECK(c.why == "--threads");
  }
  {
    EnvVar omp("OMP_NUM_THREADS", "5");
    const ThreadChoice c = default_threads(0, 5);
    CHECK(c.threads == 5);
    CHECK(c.why.find("OMP_NUM_THREADS") != std::string::npos);
  }
  {
    EnvVar omp("OMP_NUM_THREADS", nullptr);
    EnvVar ranks("LOCAL_WORLD_SIZE", nullptr);
    const int cores = usable_cores();
    REQUIRE(cores >= 1);
    const ThreadChoice c = default_threads(0, cores + 7);
    CHECK(c.threads == cores);
    CHECK(c.why.find("core(s) this process may run on") != std::string::npos);
    CHECK(c.why.find("LibTorch's own default here is " + std::to_string(cores + 7)) != std::string::npos);
    // Matching LibTorch's own: nothing to point out.
    CHECK(default_threads(0, cores).why.find("LibTorch's own") == std::string::npos);
  }
  {
    EnvVar omp("OMP_NUM_THREADS", "not a number");  // ignored, as LibTorch would
    EnvVar ranks("LOCAL_WORLD_SIZE", "1000000");    // more ranks than cores: at least 1 each
    const ThreadChoice c = default_threads(0, 1);
    CHECK(c.threads == 1);
    CHECK(c.why.find("shared by the 1000000 local ranks") != std::string::npos);
  }
}

TEST_CASE("threads: the CPU counters move with this process's work") {
  const CpuCounters a = read_cpu_counters();
#ifdef __linux__
  REQUIRE(a.has_wait);
  REQUIRE(a.has_idle);
  // Spin until this thread has run 50 ms (its own CPU clock: a loaded machine stretches the wall time).
  auto thread_cpu_s = [] {
    timespec ts{};
    ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
  };
  const double c0 = thread_cpu_s();
  volatile double x = 0;
  while (thread_cpu_s() - c0 < 0.05) x = x + 1;
  const CpuCounters b = read_cpu_counters();
  CHECK(b.run_s - a.run_s >= 0.04);
  CHECK(b.total_s > a.total_s);
  const CpuLoad l = cpu_load_between(a, b);
  CHECK(l.wait_share >= 0);
  CHECK(l.wait_share <= 1);
  CHECK(l.idle_cores >= 0);
#else
  CHECK_FALSE(a.has_wait);
#endif
  // From made-up readings: 3 s run, 1 s waiting -> a quarter waited.
  CpuCounters p, q;
  p.has_wait = q.has_wait = true;
  p.run_s = 10, p.wait_s = 2;
  q.run_s = 13, q.wait_s = 3;
  CHECK(cpu_load_between(p, q).wait_share == doctest::Approx(0.25));
  CHECK(cpu_load_between(p, q).idle_cores < 0);  // no idle figures: unknown
  CHECK(cpu_load_between(CpuCounters{}, CpuCounters{}).wait_share < 0);
}

TEST_CASE("threads: an idle machine never probes") {
  ThreadGovernor g(4);
  const Machine idle{[](int n) { return 1.0 / n; }, [](int) { return CpuLoad{0.01, 0.2}; }};
  const auto counts = drive(g, idle, 500);
  CHECK(count_of(counts, 4) == 500);
  CHECK(g.switches() == 0);
  CHECK(g.probes_dropped() == 0);
}

TEST_CASE("threads: busy cores, and fewer threads run faster: it switches down and stays") {
  // Beside one busy loop per core (measured: 2 threads about 5x slower than idle, 1 thread 2x).
  ThreadGovernor g(2);
  const Machine busy{[](int n) { return n == 2 ? 0.005 : 0.002; },
                    [](int n) { return CpuLoad{n == 2 ? 0.65 : 0.5, 0.0}; }};
  std::vector<std::string> said;
  const auto counts = drive(g, busy, 300, &said);
  // 3 steps to measure 2 threads (the trigger needs 2 busy ones), then 3 probe steps at 1.
  CHECK(counts[0] == 2);
  CHECK(counts[2] == 2);
  CHECK(counts[3] == 1);
  CHECK(count_of(counts, 1) == 297);
  CHECK(g.switches() == 1);
  REQUIRE(said.size() == 1);
  CHECK(said[0].find("2 -> 1 threads") != std::string::npos);
  CHECK(said[0].find("500 tokens/s against 200 at 2") != std::string::npos);
}

TEST_CASE("threads: busy cores, but all threads still run faster: probes back off") {
  ThreadGovernor g(2);
  const Machine busy{[](int n) { return n == 2 ? 1.0 : 1.5; }, [](int) { return CpuLoad{0.4, 0.0}; }};
  std::vector<std::string> said;
  const auto counts = drive(g, busy, 400, &said);
  CHECK(g.switches() == 0);
  // Each dropped probe costs 3 steps at 1 thread; the waits double: 16, 32, 64, 128 steps.
  CHECK(g.probes_dropped() == 5);
  CHECK(count_of(counts, 1) == 3 * g.probes_dropped());
  CHECK(said.front().find("staying at 2") != std::string::npos);
  CHECK(said.front().find("next try in 16 steps") != std::string::npos);
  CHECK(said.back().find("next try in 256 steps") != std::string::npos);
}

TEST_CASE("threads: cores freed again: it goes back up") {
  ThreadGovernor g(2);
  static bool loaded;
  loaded = true;
  const Machine m{[](int n) { return loaded ? (n == 2 ? 5.0 : 2.0) : 1.0 / n; },
                  [](int n) { return loaded ? CpuLoad{0.6, 0.0} : CpuLoad{0.0, n == 1 ? 1.0 : 0.05}; }};
  auto counts = drive(g, m, 50);
  CHECK(counts.back() == 1);
  loaded = false;
  std::vector<std::string> said;
  counts = drive(g, m, 50, &said);
  CHECK(counts.back() == 2);
  CHECK(g.switches() == 2);
  REQUIRE(!said.empty());
  CHECK(said.back().find("1 -> 2 threads") != std::string::npos);
  CHECK(said.back().find("cores are free again") != std::string::npos);
}

TEST_CASE("threads: a system without figures never probes down, and tries up on a timer") {
  const Machine unknown{[](int n) { return 1.0 / n; }, [](int) { return CpuLoad{}; }};
  ThreadGovernor at_max(2);
  CHECK(count_of(drive(at_max, unknown, 200), 2) == 200);
  // Below the maximum (after a switch down that the figures could not have caused, as when a
  // busy spell ends with the figures gone): the timer takes it back up.
  ThreadGovernor g(2);
  const Machine busy{[](int n) { return n == 2 ? 5.0 : 2.0; }, [](int) { return CpuLoad{0.6, 0.0}; }};
  drive(g, busy, 10);
  REQUIRE(g.threads() == 1);
  const auto counts = drive(g, unknown, 40);
  CHECK(counts.back() == 2);
}

TEST_CASE("threads: many cores, half of them busy: it probes the share that ran") {
  ThreadGovernor g(16);
  const Machine half{[](int n) { return n > 8 ? 3.0 : 1.0; }, [](int n) { return CpuLoad{n > 8 ? 0.5 : 0.1, 0.0}; }};
  const auto counts = drive(g, half, 30);
  CHECK(counts[3] == 8);
  CHECK(counts.back() == 8);
}
