// A progress line on stderr for long work: count, rate and ETA, redrawn at most ~10 times
// a second, and only when stderr is a terminal (never in logs or pipes).
//
// Thread safety: add() may be called from many threads at once.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>

namespace eaglekit {

class Progress {
 public:
  // total <= 0: unknown total (no ETA). enabled: defaults to "stderr is a TTY".
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
  std::atomic<std::int64_t> count_{0};
  std::atomic<std::int64_t> bytes_{0};
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_;
  std::mutex mu_;
  bool finished_ = false;
};

// "1.5 GiB", "730 KiB", "12 B"
std::string human_bytes(double bytes);
// Parses "1GiB", "512MiB", "1G", "1000000", "2.5GB" into bytes. Throws UsageError.
std::int64_t parse_bytes(const std::string& text);

}  // namespace eaglekit
