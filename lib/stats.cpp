#include "lib/stats.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_set>

#include "formats/dtype.h"
#include "formats/error.h"
#include "formats/format.h"
#include "lib/index.h"
#include "lib/progress.h"

namespace eaglekit {

namespace {

// Nearest rank: the smallest value with at least p% of the values at or below it.
std::int64_t percentile(const std::vector<std::int64_t>& sorted, double p) {
  if (sorted.empty()) return 0;
  const auto n = static_cast<double>(sorted.size());
  auto rank = static_cast<std::size_t>(std::ceil(p / 100.0 * n));
  rank = std::clamp<std::size_t>(rank, 1, sorted.size());
  return sorted[rank - 1];
}

// Bin of a token count: 0 -> [0, 0], 1 -> [1, 1], then [2^k, 2^(k+1) - 1].
int bin_of(std::int64_t t) {
  if (t <= 0) return 0;
  int b = 1;
  while (t > 1) {
    t >>= 1;
    ++b;
  }
  return b;
}

HistogramBin bin_bounds(int b) {
  if (b == 0) return {0, 0, 0};
  const std::int64_t lo = std::int64_t{1} << (b - 1);
  return {lo, 2 * lo - 1, 0};
}

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

}  // namespace

DatasetStats compute_stats(const DatasetIndex& index, const StatsOptions& opts) {
  if (opts.plan_conversations < 0) throw UsageError("stats: --plan-conversations must be >= 0");
  if (!(opts.plan_tokens >= 0)) throw UsageError("stats: --plan-tokens must be >= 0");
  DatasetStats s;
  std::vector<std::int64_t> tokens;
  tokens.reserve(index.size());
  std::unordered_set<std::uint32_t> files;
  std::map<std::int64_t, std::size_t> aux_counts;
  std::map<std::string, std::size_t>& dtypes = s.per_dtype;
  for (std::size_t i = 0; i < index.size(); ++i) {
    const IndexEntry e = index.entry(i);
    if (!e.ok) {
      ++s.bad_records;
      continue;
    }
    tokens.push_back(e.tokens);
    s.total_tokens += e.tokens;
    if (files.insert(e.file).second) s.bytes_on_disk += index.file(e.file).size;
    ++s.per_format[std::string(format_name(e.format))];
    ++dtypes[std::string(dtype_name(e.hidden_dtype))];
    ++s.per_codec[e.codec.empty() ? std::string("raw") : std::string(e.codec)];
    ++s.per_hidden_size[e.hidden_size];
    ++aux_counts[e.aux_width];
  }
  s.records = tokens.size();
  s.files = files.size();
  if (!opts.skip_padding) {
    std::vector<std::size_t> candidates;
    for (std::size_t i = 0; i < index.size(); ++i)
      if (padding_candidate(index.entry(i), false)) candidates.push_back(i);
    s.padding = scan_padding(
        index, candidates,
        [&](std::size_t i) {
          const std::string_view id = index.conversation_id(i);
          return id.empty() ? std::string(index.file_path(i)) : std::string(id);
        },
        opts.jobs);
    s.padding_scanned = true;
  }
  std::sort(tokens.begin(), tokens.end());
  if (!tokens.empty()) {
    s.min_tokens = tokens.front();
    s.max_tokens = tokens.back();
    s.median_tokens = percentile(tokens, 50);
    s.p90_tokens = percentile(tokens, 90);
    s.p99_tokens = percentile(tokens, 99);
    s.mean_tokens = static_cast<double>(s.total_tokens) / static_cast<double>(tokens.size());
    const int first = bin_of(s.min_tokens), last = bin_of(s.max_tokens);
    for (int b = first; b <= last; ++b) s.histogram.push_back(bin_bounds(b));
    for (std::int64_t t : tokens) ++s.histogram[static_cast<std::size_t>(bin_of(t) - first)].count;
  }
  if (s.total_tokens > 0)
    s.bytes_per_token = static_cast<double>(s.bytes_on_disk) / static_cast<double>(s.total_tokens);

  auto most = [](const auto& counts) {
    typename std::decay_t<decltype(counts)>::key_type best{};
    std::size_t n = 0;
    for (const auto& [k, c] : counts)
      if (c > n) {
        best = k;
        n = c;
      }
    return best;
  };
  if (s.records > 0) {
    s.hidden_size = most(s.per_hidden_size);
    s.aux_width = most(aux_counts);
    s.dtype = most(dtypes);
    const auto dt = parse_dtype(s.dtype);
    const double elem = dt ? static_cast<double>(dtype_size(*dt)) : 0.0;
    s.raw_bytes_per_token = 8.0 + static_cast<double>(s.hidden_size + s.aux_width) * elem;
  }

  if (opts.plan_conversations > 0 || opts.plan_tokens > 0) {
    s.has_plan = true;
    s.plan_conversations =
        opts.plan_conversations > 0 ? opts.plan_conversations : static_cast<std::int64_t>(s.records);
    s.plan_tokens = opts.plan_tokens > 0 ? opts.plan_tokens : s.mean_tokens;
    const double total = static_cast<double>(s.plan_conversations) * s.plan_tokens;
    s.plan_bytes_raw = total * s.raw_bytes_per_token;
    s.plan_bytes_on_disk = total * s.bytes_per_token;
  }
  return s;
}

std::string stats_to_json(const DatasetStats& s) {
  using nlohmann::json;
  json hist = json::array();
  for (const auto& b : s.histogram) hist.push_back({{"lo", b.lo}, {"hi", b.hi}, {"count", b.count}});
  json hidden = json::object();
  for (const auto& [h, n] : s.per_hidden_size) hidden[std::to_string(h)] = n;
  json j = {{"records", s.records},
            {"bad_records", s.bad_records},
            {"files", s.files},
            {"total_tokens", s.total_tokens},
            {"tokens",
             {{"min", s.min_tokens},
              {"median", s.median_tokens},
              {"p90", s.p90_tokens},
              {"p99", s.p99_tokens},
              {"max", s.max_tokens},
              {"mean", s.mean_tokens}}},
            {"histogram", hist},
            {"bytes_on_disk", s.bytes_on_disk},
            {"bytes_per_token", s.bytes_per_token},
            {"raw_bytes_per_token", s.raw_bytes_per_token},
            {"hidden_size", s.hidden_size},
            {"aux_width", s.aux_width},
            {"dtype", s.dtype},
            {"per_format", s.per_format},
            {"per_dtype", s.per_dtype},
            {"per_codec", s.per_codec},
            {"per_hidden_size", hidden}};
  j["padding"] = s.padding_scanned ? json::parse(padding_to_json(s.padding)) : json(nullptr);
  if (s.has_plan)
    j["plan"] = {{"conversations", s.plan_conversations},
                 {"tokens_per_conversation", s.plan_tokens},
                 {"bytes_raw", s.plan_bytes_raw},
                 {"bytes_on_disk", s.plan_bytes_on_disk}};
  return j.dump(2) + "\n";
}

std::string stats_to_text(const DatasetStats& s) {
  std::ostringstream os;
  os << "records: " << s.records << " in " << s.files << " files";
  if (s.bad_records > 0) os << " (+" << s.bad_records << " bad, not counted)";
  os << "\ntokens: " << s.total_tokens << " total; per record min " << s.min_tokens << ", median "
     << s.median_tokens << ", p90 " << s.p90_tokens << ", p99 " << s.p99_tokens << ", max "
     << s.max_tokens << ", mean " << fixed(s.mean_tokens, 1) << "\n";
  if (!s.histogram.empty()) {
    std::size_t peak = 1;
    for (const auto& b : s.histogram) peak = std::max(peak, b.count);
    constexpr std::size_t kWidth = 40;
    for (const auto& b : s.histogram) {
      char label[64];
      std::snprintf(label, sizeof label, "%8lld-%-8lld", static_cast<long long>(b.lo),
                    static_cast<long long>(b.hi));
      const std::size_t bar = (b.count * kWidth + peak - 1) / peak;
      os << "  " << label << " |" << std::string(bar, '#') << std::string(kWidth - bar, ' ') << "| "
         << b.count << "\n";
    }
  }
  os << "disk: " << human_bytes(static_cast<double>(s.bytes_on_disk)) << ", "
     << fixed(s.bytes_per_token, 1) << " bytes per token";
  if (s.raw_bytes_per_token > 0)
    os << " (raw " << fixed(s.raw_bytes_per_token, 1) << " at hidden " << s.hidden_size << " + aux "
       << s.aux_width << " " << s.dtype << ": " << fixed(s.raw_bytes_per_token > 0 ? s.bytes_per_token / s.raw_bytes_per_token : 0, 2)
       << "x)";
  os << "\n";
  auto counts = [&](const char* name, const auto& m) {
    os << name << ":";
    const char* sep = " ";
    for (const auto& [k, n] : m) {
      os << sep << k << " " << n;
      sep = "; ";
    }
    os << "\n";
  };
  if (s.records > 0) {
    counts("formats", s.per_format);
    counts("dtypes", s.per_dtype);
    counts("codecs", s.per_codec);
    counts("hidden sizes", s.per_hidden_size);
    if (s.per_hidden_size.size() > 1)
      os << "warning: mixed hidden sizes; `eaglekit validate` lists the odd records\n";
  }
  if (s.padding_scanned) os << padding_text(s.padding);
  if (s.has_plan) {
    os << "plan: " << s.plan_conversations << " conversations x " << fixed(s.plan_tokens, 1)
       << " tokens = " << human_bytes(s.plan_bytes_raw) << " raw, about "
       << human_bytes(s.plan_bytes_on_disk) << " at this dataset's bytes per token\n";
  }
  return os.str();
}

}  // namespace eaglekit
