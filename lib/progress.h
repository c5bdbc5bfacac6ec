// A progress line on stderr for long work: count, rate and ETA. On a terminal it is redrawn
// at most ~10 times a second; in a log or pipe (stderr not a terminal) it is a plain line
// every EAGLEKIT_PROGRESS_EVERY seconds (default 60; 0: none), so that a batch job's log says
// the work is alive without filling up: nothing at all for work shorter than that.
//
// Thread safety: add() may be called from many threads at once. The constructor throws
// UsageError for an EAGLEKIT_PROGRESS_EVERY that is not a number of seconds >= 0.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>

namespace eaglekit {

class Progress {
 public:
  // total <= 0: unknown total (no ETA). enabled: -1 (default) the redrawn line on a terminal,
  // else the plain lines; 0 none; 1 the redrawn line even when stderr is no terminal.
  Progress(std::string label, std::int64_t total, int enabled = -1);
  ~Progress();  // finishes the line
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void add(std::int64_t n = 1, std::int64_t bytes = 0);
  void finish();
  std::int64_t count() const { return count_.load(); }
  double elapsed_s() const;

 private:
  void draw(bool final);
  std::string label_;
  std::int64_t total_;
  bool enabled_;
  bool plain_ = false;        // plain lines (a log), not a redrawn one
  double plain_every_s_ = 0;  // their interval
  bool plain_drawn_ = false;  // one was printed: finish() then prints the last
  std::atomic<std::int64_t> count_{0};
  std::atomic<std::int64_t> bytes_{0};
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_;
  std::mutex mu_;
  bool finished_ = false;
};

// Seconds between plain progress lines when stderr is not a terminal: EAGLEKIT_PROGRESS_EVERY,
// default 60, 0 for none. UsageError naming the variable for another value.
double progress_every_s();

// "1.5 GiB", "730 KiB", "12 B"
std::string human_bytes(double bytes);
// Parses "1GiB", "512MiB", "1G", "1000000", "2.5GB" into bytes. Throws UsageError.
std::int64_t parse_bytes(const std::string& text);

}  // namespace eaglekit
