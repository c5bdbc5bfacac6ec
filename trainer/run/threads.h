// How many LibTorch threads a run uses: the default, said with its source, and with
// --adapt-threads a governor that runs fewer while other processes keep the cores busy and
// goes back up when they are free.
//
// Why a governor: LibTorch's intra-op threads meet at the end of every operator, and
// OpenBLAS's at every matmul. When another process keeps a core busy, the thread that shares
// it is behind at every meeting and the others wait for it: beside one busy loop per core a
// 2-thread step ran at about a fifth of its idle speed and a 1-thread step at about half
// (docs/benchmarks.md, "Under load"). The governor watches two things per step, how long this
// process's threads waited for a core (Linux's per-thread schedstat) and how many cores of the
// host sat idle (/proc/stat), and tries another count only when they say the cores changed
// hands. It keeps a count only when that count was measured faster (seconds per token, the
// median of a few steps each). A probe that loses waits twice as long before the next one.
//
// The thread count changes the order of ATen's and OpenBLAS's sums, so a run's float rounding
// follows it (equal losses at step 1, the 7th digit of the gradient norm after that): adapting
// is asked for, never the default, and a run that adapts is not bit-reproducible.
//
// Thread safety: ThreadGovernor is used by the training loop's thread only. The readers are
// free functions. Errors: none; a figure the system does not give is reported as unknown.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace eaglekit::trainer {

struct ThreadChoice {
  int threads = 1;
  std::string why;  // where the number came from, for the run plan's decisions
};

// --threads when `asked` > 0; else OMP_NUM_THREADS when it holds a positive number (LibTorch
// follows it too); else the cores this process may run on (its CPU affinity), shared among a
// launch's local ranks (LOCAL_WORLD_SIZE), at least 1. `libtorch_default` is what LibTorch
// would use by itself (at::get_num_threads() before any set): `why` names it where it differs.
ThreadChoice default_threads(int asked, int libtorch_default);

// The cores this process may run on (sched_getaffinity); hardware_concurrency elsewhere.
int usable_cores();

// Counters read once per step; the governor takes the difference of two readings.
struct CpuCounters {
  double run_s = 0;     // this process's threads on a core, summed (schedstat)
  double wait_s = 0;    // the same threads runnable but waiting for a core
  double idle_s = 0;    // the host's idle core-seconds (/proc/stat)
  double total_s = 0;   // the host's core-seconds
  bool has_wait = false, has_idle = false;
};
CpuCounters read_cpu_counters();

// What one step showed, from two readings around it: the share of this process's runnable
// time spent waiting for a core, and the host's idle cores; < 0 where unknown.
struct CpuLoad {
  double wait_share = -1;
  double idle_cores = -1;
};
CpuLoad cpu_load_between(const CpuCounters& before, const CpuCounters& after);

class ThreadGovernor {
 public:
  struct Step {
    double seconds = 0;  // the step's compute time (the loader wait left out)
    double tokens = 0;
    CpuLoad load;
  };
  // Starts at, and never goes above, `max_threads` (>= 1).
  explicit ThreadGovernor(int max_threads);

  // The count for the next step.
  int threads() const { return probe_ > 0 ? probe_ : settled_; }
  // One step's figures, run at threads(). Returns a sentence when a probe ends, kept or
  // dropped ("" otherwise), for the run to say.
  std::string observe(const Step& step);

  // Switches taken and probes dropped so far.
  int switches() const { return switches_; }
  int probes_dropped() const { return dropped_; }

  // The policy's figures (public for the tests and docs).
  static constexpr double kBusyShare = 0.25;    // waited this share of runnable time: cores are busy
  static constexpr double kIdleCores = 0.75;    // this many host cores idle: room to go up
  static constexpr int kTriggerSteps = 2;       // ... for this many steps in a row
  static constexpr int kMeasureSteps = 3;       // steps whose median cost a count is judged by
  static constexpr double kKeepBelow = 0.9;     // a probe is kept at under 0.9x the settled cost
  static constexpr std::int64_t kFirstBackoff = 16, kLastBackoff = 1024;  // steps; doubling

 private:
  static double median(std::vector<double> v);
  int max_, settled_, probe_ = 0;
  std::vector<double> settled_costs_, probe_costs_;  // seconds per token, the newest last
  int busy_streak_ = 0, idle_streak_ = 0;
  std::int64_t steps_settled_ = 0;                        // steps at the settled count
  std::int64_t backoff_down_ = kFirstBackoff, backoff_up_ = kFirstBackoff;
  std::int64_t wait_down_ = 0, wait_up_ = 0;              // steps before the next probe may start
  int switches_ = 0, dropped_ = 0;
};

}  // namespace eaglekit::trainer
