// What a training run tells the user while it runs: OUT/metrics.jsonl (one JSON object per
// line), the same numbers as TensorBoard scalars (docs/tensorboard.md), the step window a
// metrics line averages over, and the progress line on a terminal.
//
// Only rank 0 writes. Thread safety: one thread per object. Errors: IoError when a file
// cannot be created or written.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "trainer/unroll/ttt.h"

namespace eaglekit::trainer {

class EventFileWriter;

// metrics.jsonl plus the event files. A resumed run first drops the lines past its
// checkpoint's step (a run that died after its last checkpoint logged steps that are
// trained again), then appends; it adds a new event file. A fresh run starts metrics.jsonl
// over and, likewise, deletes the event files (events.out.tfevents.*) an earlier run left in
// the event folder, saying each through `say`: TensorBoard would draw both runs' steps as
// one curve.
class MetricsLog {
 public:
  struct Options {
    std::string out;                    // the run folder: OUT/metrics.jsonl
    std::int64_t resume_step = -1;      // >= 0: a resumed run's checkpoint step
    std::string tensorboard;            // event file folder; "" OUT/tensorboard
    bool no_tensorboard = false;        // write none
    // A block drafter's run (DFlash): entry s of a list is block position s + 1, and its
    // TensorBoard scalar SPLIT/KEY/position{s+1} instead of SPLIT/KEY/step{s}.
    bool block_positions = false;
    std::function<void(const std::string& json_line)> on_line;  // optional, every line
    // Optional: what the log tells the user (a fresh run's removal of stale event files).
    std::function<void(const std::string& message)> say;
  };
  explicit MetricsLog(const Options& options);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;

  // One metrics line: a JSON object with "step" and optionally "split" ("train" when
  // absent). Every number becomes the scalar SPLIT/KEY, every list of numbers
  // SPLIT/KEY/stepS (SPLIT/KEY/positionP for a block drafter's, Options::block_positions).
  void write(const std::string& json_object);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  struct File;
  std::unique_ptr<File> file_;
  std::unique_ptr<EventFileWriter> events_;
  std::function<void(const std::string&)> on_line_;
  bool block_positions_ = false;
};

// The steps since the last metrics line: pooled TTT statistics, tokens, time, time spent
// waiting for data, CPU time.
class StepWindow {
 public:
  explicit StepWindow(std::int64_t ttt_steps) : stats_(ttt_steps), ttt_steps_(ttt_steps) {}
  void add(const TttStats& step_stats, double tokens, double seconds, double wait_seconds, double cpu_seconds);
  bool empty() const { return steps_ == 0; }
  // The metrics line of the window (keys as docs/tensorboard.md lists them), then a reset.
  // `threads` > 0 (--adapt-threads): the LibTorch threads of the window's last step.
  std::string take_line(std::int64_t step, std::uint64_t epoch, double lr, double grad_norm, double loss_decay,
                        double elapsed_s, int threads = 0);

 private:
  TttStats stats_;
  std::int64_t ttt_steps_;
  double tokens_ = 0, time_ = 0, wait_ = 0, cpu_ = 0;
  std::int64_t steps_ = 0;
};

// "\rtrain step 40/100  loss 3.2  acc0 0.41  12.3k tok/s  ETA 1m05s   " for stderr.
std::string progress_line(std::int64_t step, std::int64_t total_steps, double loss, double acc0,
                          double tokens_per_s, double eta_s);
// 75 -> "1m15s", 3700 -> "1h1m"; "?" for a negative or non-finite time.
std::string format_duration(double seconds);
// 12345 -> "12.3k".
std::string rate_text(double x);
// This process's peak resident memory in MiB (the host side).
double peak_rss_mb();
// CPU time of the whole process, every thread.
double process_cpu_seconds();

// The metrics of pooled stats as a JSON object's members: "loss", "loss_per_step",
// "acc", "cond_acc", "est_ar", "est_ar_cond", "tokens" (shared by metrics.jsonl and
// evaluate --json): a JSON object, non-finite numbers as null.
nlohmann::ordered_json stats_json(const TttStats& stats, double loss_decay);

}  // namespace eaglekit::trainer
