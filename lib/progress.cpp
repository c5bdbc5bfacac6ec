#include "lib/progress.h"

#include <unistd.h>

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "formats/error.h"
#include "lib/clock.h"

namespace eaglekit {

double progress_every_s() {
  const char* v = std::getenv("EAGLEKIT_PROGRESS_EVERY");
  if (v == nullptr || *v == '\0') return 60;
  char* end = nullptr;
  const double s = std::strtod(v, &end);
  if (end == v || *end != '\0' || !(s >= 0) || !std::isfinite(s))
    throw UsageError(std::string("EAGLEKIT_PROGRESS_EVERY must be a number of seconds, 0 or more (0: no progress "
                                 "lines in logs), not '") + v + "'");
  return s;
}

Progress::Progress(std::string label, std::int64_t total, int enabled)
    : label_(std::move(label)),
      total_(total),
      enabled_(enabled != 0),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {
  if (enabled < 0 && ::isatty(2) != 1) {
    plain_every_s_ = progress_every_s();
    plain_ = true;
    enabled_ = plain_every_s_ > 0;
  }
}

Progress::~Progress() { finish(); }

double Progress::elapsed_s() const {
  return seconds_since(start_);
}

void Progress::add(std::int64_t n, std::int64_t bytes) {
  count_ += n;
  bytes_ += bytes;
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  if (plain_ ? std::chrono::duration<double>(now - last_draw_).count() < plain_every_s_
             : now - last_draw_ < std::chrono::milliseconds(100))
    return;
  std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
  if (!lock.owns_lock() || finished_) return;
  last_draw_ = now;
  draw(false);
}

void Progress::finish() {
  if (!enabled_) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_) return;
  finished_ = true;
  if (plain_ && !plain_drawn_) return;  // short work: the log stays as it was
  draw(true);
}

void Progress::draw(bool final) {
  const double secs = std::max(elapsed_s(), 1e-9);
  const std::int64_t c = count_.load();
  const double rate = static_cast<double>(c) / secs;
  char buf[256];
  int n = std::snprintf(buf, sizeof buf, "\r%s: %lld", label_.c_str(), static_cast<long long>(c));
  if (total_ > 0) {
    const double pct = 100.0 * static_cast<double>(c) / static_cast<double>(total_);
    n += std::snprintf(buf + n, sizeof buf - n, "/%lld (%.0f%%)", static_cast<long long>(total_), pct);
  }
  n += std::snprintf(buf + n, sizeof buf - n, " %.1f/s", rate);
  const std::int64_t b = bytes_.load();
  if (b > 0) n += std::snprintf(buf + n, sizeof buf - n, " %s/s", human_bytes(b / secs).c_str());
  if (total_ > 0 && !final && rate > 0) {
    const double eta = static_cast<double>(total_ - c) / rate;
    n += std::snprintf(buf + n, sizeof buf - n, " ETA %.0fs", eta);
  }
  if (plain_) {
    plain_drawn_ = true;
    std::fprintf(stderr, "%s%s\n", buf + 1, final ? " (done)" : "");  // without the '\r'
  } else {
    std::fprintf(stderr, "%s\033[K%s", buf, final ? "\n" : "");
  }
  std::fflush(stderr);
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (std::fabs(b) >= 1024.0 && u < 5) {
    b /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", b, units[u]);
  return buf;
}

std::int64_t parse_bytes(const std::string& text) {
  std::size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(text, &pos);
  } catch (...) {
    throw UsageError("not a size: '" + text + "' (use e.g. 1GiB, 512MiB, 1000000)");
  }
  std::string unit = text.substr(pos);
  for (auto& ch : unit) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  double mul = 1;
  if (unit.empty() || unit == "b") mul = 1;
  else if (unit == "k" || unit == "kib") mul = 1024.0;
  else if (unit == "m" || unit == "mib") mul = 1024.0 * 1024;
  else if (unit == "g" || unit == "gib") mul = 1024.0 * 1024 * 1024;
  else if (unit == "t" || unit == "tib") mul = 1024.0 * 1024 * 1024 * 1024;
  else if (unit == "kb") mul = 1e3;
  else if (unit == "mb") mul = 1e6;
  else if (unit == "gb") mul = 1e9;
  else if (unit == "tb") mul = 1e12;
  else throw UsageError("unknown size unit in '" + text + "' (use B, KiB, MiB, GiB, TiB, KB, MB, GB)");
  if (v < 0) throw UsageError("size must not be negative: '" + text + "'");
  return static_cast<std::int64_t>(v * mul);
}

}  // namespace eaglekit
