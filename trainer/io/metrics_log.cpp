#include "trainer/io/metrics_log.h"

#include <sys/resource.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "formats/atomic_file.h"
#include "formats/error.h"
#include "trainer/io/tensorboard.h"

namespace eaglekit::trainer {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace {

// JSON numbers cannot be NaN/Inf: those become null.
json number(double x) {
  if (!std::isfinite(x)) return nullptr;
  return x;
}

json numbers(const std::vector<double>& xs) {
  auto a = json::array();
  for (double x : xs) a.push_back(number(x));
  return a;
}

// Keeps the lines of metrics.jsonl up to `step`; a torn last line goes too.
void trim_metrics(const std::string& path, std::int64_t step) {
  std::ifstream in(path);
  if (!in) return;
  std::string kept, line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    try {
      const json j = json::parse(line);
      if (j.contains("step") && j["step"].is_number_integer() && j["step"].get<std::int64_t>() > step) continue;
    } catch (const nlohmann::json::exception&) {
      continue;
    }
    kept += line + "\n";
  }
  in.close();
  write_file_atomic(path, kept.data(), kept.size());  // a kill here must not lose the log
}

}  // namespace

struct MetricsLog::File {
  std::ofstream stream;
};

MetricsLog::MetricsLog(const Options& o)
    : file_(std::make_unique<File>()), on_line_(o.on_line), block_positions_(o.block_positions) {
  std::error_code ec;
  fs::create_directories(o.out, ec);
  if (ec) throw IoError(o.out + ": cannot create folder: " + ec.message());
  path_ = (fs::path(o.out) / "metrics.jsonl").string();
  if (o.resume_step >= 0) trim_metrics(path_, o.resume_step);
  file_->stream.open(path_, o.resume_step >= 0 ? std::ios::app : std::ios::trunc);
  if (!file_->stream) throw IoError(path_ + ": cannot open for writing");
  if (!o.no_tensorboard) {
    const std::string dir = o.tensorboard.empty() ? (fs::path(o.out) / "tensorboard").string() : o.tensorboard;
    if (o.resume_step < 0) {
      // A fresh run replaces metrics.jsonl above; an earlier run's event files would still
      // be read beside the new one's, as one run with two curves over the same steps.
      std::vector<fs::path> stale;
      for (const auto& e : fs::directory_iterator(dir, ec))
        if (e.is_regular_file(ec) && e.path().filename().string().rfind("events.out.tfevents.", 0) == 0)
          stale.push_back(e.path());
      std::sort(stale.begin(), stale.end());
      for (const auto& p : stale) {
        if (!fs::remove(p, ec) && ec) throw IoError(p.string() + ": cannot remove a stale event file: " + ec.message());
        if (o.say)
          o.say("removed " + p.string() + ", an event file of an earlier run into this folder (a fresh run starts " +
                "the TensorBoard log over, as metrics.jsonl; --resume continues both)");
      }
    }
    events_ = std::make_unique<EventFileWriter>(dir);
  }
}

MetricsLog::~MetricsLog() = default;

void MetricsLog::write(const std::string& line) {
  file_->stream << line << "\n";
  file_->stream.flush();
  if (!file_->stream) throw IoError(path_ + ": write failed");
  if (events_) {
    const json j = json::parse(line);
    const std::string prefix = j.value("split", "train") + "/";
    std::vector<std::pair<std::string, double>> scalars;
    for (const auto& [k, v] : j.items()) {
      if (k == "step" || k == "split") continue;
      if (v.is_number()) scalars.emplace_back(prefix + k, v.get<double>());
      if (v.is_array())
        for (std::size_t s = 0; s < v.size(); ++s)
          if (v[s].is_number())
            scalars.emplace_back(prefix + k + (block_positions_ ? "/position" + std::to_string(s + 1) : "/step" + std::to_string(s)),
                                 v[s].get<double>());
    }
    events_->add_scalars(j.value("step", std::int64_t{0}), scalars);
  }
  if (on_line_) on_line_(line);
}

void StepWindow::add(const TttStats& step_stats, double tokens, double seconds, double wait_seconds,
                     double cpu_seconds) {
  stats_ += step_stats;
  tokens_ += tokens;
  time_ += seconds;
  wait_ += wait_seconds;
  cpu_ += cpu_seconds;
  ++steps_;
}

std::string StepWindow::take_line(std::int64_t step, std::uint64_t epoch, double lr, double grad_norm,
                                  double loss_decay, double elapsed_s, int threads) {
  json j;
  j["step"] = step;
  j["epoch"] = epoch;
  j["lr"] = lr;
  j.update(stats_json(stats_, loss_decay));
  const double n = static_cast<double>(steps_ > 0 ? steps_ : 1);
  j["grad_norm"] = number(grad_norm);
  j["tokens_per_s"] = time_ > 0 ? tokens_ / time_ : 0.0;
  j["loader_wait_ms"] = 1000.0 * wait_ / n;
  j["data_wait_share"] = time_ > 0 ? wait_ / time_ : 0.0;
  j["step_ms"] = 1000.0 * time_ / n;
  j["cpu_ms"] = 1000.0 * cpu_ / n;
  j["elapsed_s"] = elapsed_s;
  j["peak_rss_mb"] = peak_rss_mb();
  if (threads > 0) j["threads"] = threads;
  *this = StepWindow(ttt_steps_);
  return j.dump();
}

std::string progress_line(std::int64_t step, std::int64_t total_steps, double loss, double acc0,
                          double tokens_per_s, double eta_s) {
  std::ostringstream line;
  line.precision(4);
  line << "\rtrain step " << step << "/" << total_steps << "  loss " << loss << "  acc0 " << acc0 << "  "
       << rate_text(tokens_per_s) << " tok/s  ETA " << format_duration(eta_s) << "   ";
  return line.str();
}

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const auto total = static_cast<std::int64_t>(s + 0.5);
  std::ostringstream os;
  if (total >= 3600) os << total / 3600 << "h" << (total % 3600) / 60 << "m";
  else if (total >= 60) os << total / 60 << "m" << total % 60 << "s";
  else os << total << "s";
  return os.str();
}

std::string rate_text(double x) {
  std::ostringstream os;
  os.precision(3);
  if (x >= 1e6) os << x / 1e6 << "M";
  else if (x >= 1e3) os << x / 1e3 << "k";
  else os << x;
  return os.str();
}

double peak_rss_mb() {
  rusage u{};
  return ::getrusage(RUSAGE_SELF, &u) == 0 ? static_cast<double>(u.ru_maxrss) / 1024.0 : 0.0;
}

double process_cpu_seconds() { return static_cast<double>(std::clock()) / CLOCKS_PER_SEC; }

json stats_json(const TttStats& stats, double loss_decay) {
  json j;
  j["loss"] = number(stats.loss(loss_decay));
  j["loss_per_step"] = numbers(stats.loss_per_step());
  j["acc"] = numbers(stats.acc());
  j["cond_acc"] = numbers(stats.cond_acc());
  j["est_ar"] = number(stats.est_ar());
  j["est_ar_cond"] = number(stats.est_ar_conditional());
  j["tokens"] = number(stats.tokens());
  return j;
}

}  // namespace eaglekit::trainer
