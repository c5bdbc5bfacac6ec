#include "lib/stats.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "formats/dtype.h"
#include "formats/error.h"
#include "formats/format.h"
#include "formats/registry.h"
#include "lib/conversation_text.h"
#include "lib/dataset.h"
#include "lib/index.h"
#include "lib/loss_masks.h"
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
  // Per file: the width of its records' stored distributions (0: they hold hidden states).
  std::unordered_map<std::uint32_t, std::int64_t> probs_width;
  std::map<std::int64_t, std::size_t> probs_counts;
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
    const FormatRow* row = format_row(e.format);
    auto [width, added] = probs_width.try_emplace(e.file, 0);
    if (added && row && row->states_facts) {
      // Only the file's facts (a manifest, an .eks index); one that no longer opens counts as
      // hidden states, as the index describes it.
      try {
        const auto facts = open_reader(std::string(index.file(e.file).path))->facts();
        if (facts.target_vocabulary) width->second = static_cast<std::int64_t>(facts.target_vocabulary->selected.size());
      } catch (const std::exception&) {
      }
    }
    ++probs_counts[width->second];
    if (row && row->records_beside) s.bytes_on_disk += e.byte_size;  // its shard's bytes, beside the file
    ++s.per_format[std::string(format_name(e.format))];
    ++dtypes[std::string(dtype_name(e.hidden_dtype))];
    ++s.per_codec[e.codec.empty() ? std::string("raw") : std::string(e.codec)];
    ++s.per_hidden_size[e.hidden_size];
    ++aux_counts[e.aux_width];
    s.joined_loss_masks += e.joined_loss_mask;
  }
  if (const auto& lm = index.loss_masks()) {
    s.loss_masks = lm->path;
    s.loss_masks_problem = LossMasks::joined_problem(*lm, index.path());
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
    s.target_probs_width = most(probs_counts);
    const std::int64_t state = s.target_probs_width > 0 ? s.target_probs_width : s.hidden_size;
    s.raw_bytes_per_token = 8.0 + static_cast<double>(state + s.aux_width) * elem;
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
            {"target_probs_width", s.target_probs_width},
            {"aux_width", s.aux_width},
            {"dtype", s.dtype},
            {"per_format", s.per_format},
            {"per_dtype", s.per_dtype},
            {"per_codec", s.per_codec},
            {"per_hidden_size", hidden}};
  j["padding"] = s.padding_scanned ? json::parse(padding_to_json(s.padding)) : json(nullptr);
  if (s.loss_masks.empty())
    j["loss_masks"] = nullptr;
  else
    j["loss_masks"] = {{"path", s.loss_masks},
                       {"joined", s.joined_loss_masks},
                       {"problem", s.loss_masks_problem.empty() ? json(nullptr) : json(s.loss_masks_problem)}};
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
    os << " (raw " << fixed(s.raw_bytes_per_token, 1) << " at "
       << (s.target_probs_width > 0 ? "target_probs " + std::to_string(s.target_probs_width)
                                    : "hidden " + std::to_string(s.hidden_size))
       << " + aux "
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
  if (!s.loss_masks.empty()) {
    os << "loss masks: " << s.joined_loss_masks << " of the " << s.records << " records take theirs from "
       << s.loss_masks << ", joined by `eaglekit index --loss-masks`\n";
    if (!s.loss_masks_problem.empty()) os << "warning: " << s.loss_masks_problem << "\n";
  }
  if (s.padding_scanned) os << padding_text(s.padding);
  if (s.has_plan) {
    os << "plan: " << s.plan_conversations << " conversations x " << fixed(s.plan_tokens, 1)
       << " tokens = " << human_bytes(s.plan_bytes_raw) << " raw, about "
       << human_bytes(s.plan_bytes_on_disk) << " at this dataset's bytes per token\n";
  }
  return os.str();
}

// --- stats --plan-dump ----------------------------------------------------------------

namespace {

// The few keys of a base's config.json a dump's size depends on, where transformers puts
// them: top level, or `text_config` for multimodal configs (Llama-4, Gemma-3). The trainer's
// load_base_config (trainer/model/config.h) reads the whole file; this side needs no LibTorch.
struct BaseShape {
  std::int64_t hidden_size = 0;
  std::int64_t num_hidden_layers = 0;
  std::string path;
};

BaseShape read_base_shape(const std::string& base) {
  namespace fs = std::filesystem;
  BaseShape b;
  std::error_code ec;
  b.path = fs::is_directory(base, ec) ? (fs::path(base) / "config.json").string() : base;
  std::ifstream in(b.path, std::ios::binary);
  if (!in) throw IoError::from_errno(b.path, "cannot open", errno);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(b.path, std::nullopt, "config.json", std::string("invalid JSON: ") + e.what());
  }
  if (!j.is_object()) throw FormatError(b.path, std::nullopt, "config.json", "expected a JSON object");
  auto find = [&](const char* key, std::string& where) -> const nlohmann::json* {
    if (j.contains(key)) {
      where = key;
      return &j[key];
    }
    if (j.contains("text_config") && j["text_config"].is_object() && j["text_config"].contains(key)) {
      where = std::string("text_config.") + key;
      return &j["text_config"][key];
    }
    return nullptr;
  };
  std::string where;
  const nlohmann::json* h = find("hidden_size", where);
  if (h == nullptr)
    throw FormatError(b.path, std::nullopt, "hidden_size", "missing (also under text_config)");
  if (!h->is_number_integer() || h->get<std::int64_t>() <= 0)
    throw FormatError(b.path, std::nullopt, where, "expected a positive integer, got " + h->dump());
  b.hidden_size = h->get<std::int64_t>();
  const nlohmann::json* n = find("num_hidden_layers", where);
  if (n != nullptr && n->is_number_integer() && n->get<std::int64_t>() > 0) b.num_hidden_layers = n->get<std::int64_t>();
  return b;
}

std::string fixed_text(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

// The lossless .eks ratio when no sample measures it: bench/bench_codec.sh's one run
// (docs/benchmarks.md, "Shard codecs"): about 30% smaller than the raw bf16 records.
constexpr double kEksZstdEstimate = 0.70;

}  // namespace

DumpPlan plan_dump(const DumpPlanOptions& o, const DatasetIndex* sample) {
  if (o.conversations.empty()) throw UsageError("stats --plan-dump: --data CONVERSATIONS is required");
  if (o.base.empty()) throw UsageError("stats --plan-dump: --base DIR (the base's folder or its config.json) is required");
  if (o.aux_layers < 1) throw UsageError("stats --plan-dump: --aux-layers must be >= 1");
  if (!(o.text_bytes_per_token >= 0)) throw UsageError("stats --plan-dump: --text-bytes-per-token must be > 0");
  if (!(o.disk_bytes >= 0)) throw UsageError("stats --plan-dump: --disk must be >= 0");
  if (o.text_bytes_per_token == 0 && sample == nullptr && o.counted_tokens <= 0)
    throw UsageError(
        "stats --plan-dump: the tokens need the base's tokenizer or a ratio of text to tokens: give a --base "
        "folder that holds its tokenizer.json (counted with transformers, tools/python/eaglekit_dump.py "
        "--count-tokens), or pass --index SAMPLE (an index of some of these conversations already dumped, to "
        "measure it) or --text-bytes-per-token X");
  DumpPlan p;
  const BaseShape base = read_base_shape(o.base);
  p.base_config = base.path;
  p.hidden_size = base.hidden_size;
  p.num_hidden_layers = base.num_hidden_layers;
  p.aux_layers = o.aux_layers;
  const std::vector<ConversationText> texts = conversation_text_bytes(o.conversations);
  p.conversations = texts.size();
  for (const auto& t : texts) p.text_bytes += t.text_bytes;

  DatasetStats sample_stats;
  if (o.text_bytes_per_token > 0) {
    p.text_bytes_per_token = o.text_bytes_per_token;
    p.tokens_basis = "given (--text-bytes-per-token)";
  } else if (sample == nullptr) {
    p.text_bytes_per_token = static_cast<double>(p.text_bytes) / static_cast<double>(o.counted_tokens);
    p.tokens_basis = o.counted_basis;
  }
  if (sample != nullptr) {
    StatsOptions so;
    so.skip_padding = true;
    sample_stats = compute_stats(*sample, so);
    if (o.text_bytes_per_token == 0) {
      std::vector<Conversation> conv(texts.size());
      std::unordered_map<std::string, std::uint64_t> bytes_of;
      for (std::size_t i = 0; i < texts.size(); ++i) {
        conv[i].id = texts[i].id;
        bytes_of.emplace(texts[i].id, texts[i].text_bytes);
      }
      const Dataset d = match_records(conv, *sample, {}, MatchBy::kAuto);
      std::uint64_t text = 0;
      std::int64_t tokens = 0;
      for (const SampleRef& r : d.samples) {
        const auto it = bytes_of.find(r.conversation_id);
        if (it == bytes_of.end()) continue;
        text += it->second;
        tokens += r.tokens;
      }
      if (tokens == 0 || d.samples.empty())
        throw UsageError("stats --plan-dump: the sample index matches none of the conversations of " +
                         o.conversations + " (by id or by row), so it cannot measure their tokens; "
                         "pass --text-bytes-per-token X instead");
      p.text_bytes_per_token = static_cast<double>(text) / static_cast<double>(tokens);
      p.tokens_basis = "measured on " + std::to_string(d.samples.size()) + " conversations of the sample (" +
                       std::to_string(tokens) + " tokens, matched by " + d.matched_by + ")";
    }
  }
  p.tokens = o.text_bytes_per_token == 0 && sample == nullptr ? static_cast<double>(o.counted_tokens)
                                                              : static_cast<double>(p.text_bytes) / p.text_bytes_per_token;

  const double values = static_cast<double>(o.aux_layers + 1) * static_cast<double>(p.hidden_size);
  const double raw = 8.0 + 2.0 * values;  // int64 id + bf16 hidden and aux
  const std::string shape =
      "(" + std::to_string(o.aux_layers) + " + 1) x " + std::to_string(p.hidden_size);  // aux layers + the last
  DumpPlanFormat r{"raw-bf16", true, raw, 0,
                   "8 (int64 id) + 2 x " + shape + " (bf16 aux and last hidden states) bytes: what a dumper "
                   "writes (.pt, .safetensors, ...), before its container's few bytes"};
  // A sample of one codec measures it: its bytes on disk per token over its raw bytes per
  // token, applied to this base's raw figure.
  const bool one_codec = sample_stats.records > 0 && sample_stats.per_codec.size() == 1 &&
                         sample_stats.raw_bytes_per_token > 0;
  const std::string codec = one_codec ? sample_stats.per_codec.begin()->first : "";
  const double sample_ratio = one_codec ? sample_stats.bytes_per_token / sample_stats.raw_bytes_per_token : 0;
  DumpPlanFormat z{"eks-zstd", true, raw * kEksZstdEstimate, 0,
                   "an estimate: 0.70 of raw, the ratio bench/bench_codec.sh measured once on synthetic bf16 "
                   "records (docs/benchmarks.md, Shard codecs); pack and index a sample for your dump's"};
  if (codec == "zstd") {
    z.bytes_per_token = raw * sample_ratio;
    z.measured = true;
    z.basis = "measured: the sample's .eks zstd records take " + fixed_text(sample_ratio, 3) + " of their raw bytes";
  }
  const double fp8 = 8.0 + values + 2.0 * 4.0;  // id + e4m3 codes + an f32 scale per token per tensor
  DumpPlanFormat f{"eks-fp8", false, fp8, 0,
                   "at most 8 (id) + " + shape + " (e4m3 codes) + 2 x 4 (f32 scales, one per token for hidden "
                   "and aux) bytes, before zstd; lossy (docs/formats.md bounds it)"};
  if (codec == "fp8") {
    f.bytes_per_token = raw * sample_ratio;
    f.measured = true;
    f.basis = "measured: the sample's .eks fp8 records take " + fixed_text(sample_ratio, 3) +
              " of their raw bytes; lossy (docs/formats.md bounds it)";
  }
  p.formats = {r, z, f};
  for (auto& x : p.formats) x.bytes = x.bytes_per_token * p.tokens;

  const DumpPlanFormat& zs = p.formats[1];
  const DumpPlanFormat& fs8 = p.formats[2];
  if (o.disk_bytes <= 0) {
    p.suggestion = zs.name;
    p.suggestion_why = "lossless, and index and train read it as they read the raw dump; fp8 takes less "
                       "but rounds the hidden states (--disk SIZE chooses by the room you have)";
  } else if (zs.bytes <= o.disk_bytes) {
    p.suggestion = zs.name;
    p.suggestion_why = "lossless, and it fits in " + human_bytes(o.disk_bytes) + " (" + human_bytes(zs.bytes) + ")";
  } else if (fs8.bytes <= o.disk_bytes) {
    p.suggestion = fs8.name;
    p.suggestion_why = "the lossless .eks (" + human_bytes(zs.bytes) + ") does not fit in " + human_bytes(o.disk_bytes) +
                       "; fp8 (" + human_bytes(fs8.bytes) + ") does, at the cost of e4m3 rounding of the hidden states";
  } else {
    p.suggestion_why = "none fits in " + human_bytes(o.disk_bytes) + ": fp8 needs " + human_bytes(fs8.bytes) +
                       "; dump fewer conversations or find more disk";
  }
  return p;
}

std::string dump_plan_to_json(const DumpPlan& p) {
  using json = nlohmann::ordered_json;
  json formats = json::array();
  for (const auto& f : p.formats)
    formats.push_back({{"name", f.name},
                       {"lossless", f.lossless},
                       {"bytes_per_token", f.bytes_per_token},
                       {"bytes", f.bytes},
                       {"measured", f.measured},
                       {"basis", f.basis}});
  json j = {{"conversations", p.conversations},
            {"text_bytes", p.text_bytes},
            {"text_bytes_per_token", p.text_bytes_per_token},
            {"tokens_basis", p.tokens_basis},
            {"tokens", p.tokens},
            {"base_config", p.base_config},
            {"hidden_size", p.hidden_size},
            {"num_hidden_layers", p.num_hidden_layers == 0 ? json(nullptr) : json(p.num_hidden_layers)},
            {"aux_layers", p.aux_layers},
            {"formats", formats},
            {"suggestion", p.suggestion.empty() ? json(nullptr) : json(p.suggestion)},
            {"suggestion_why", p.suggestion_why}};
  return j.dump(2) + "\n";
}

std::string dump_plan_to_text(const DumpPlan& p) {
  std::ostringstream os;
  os << "conversations: " << p.conversations << ", " << human_bytes(static_cast<double>(p.text_bytes)) << " of text\n"
     << "tokens: about " << static_cast<std::int64_t>(p.tokens + 0.5) << " (" << fixed_text(p.text_bytes_per_token, 2)
     << " text bytes per token, " << p.tokens_basis << ")\n"
     << "base: hidden " << p.hidden_size;
  if (p.num_hidden_layers > 0) os << ", " << p.num_hidden_layers << " layers";
  os << " (" << p.base_config << "); " << p.aux_layers << " aux layers + the last per token\n";
  for (const auto& f : p.formats)
    os << "  " << f.name << (f.lossless ? " (lossless)" : " (lossy)") << ": " << fixed_text(f.bytes_per_token, 0)
       << " bytes per token, " << human_bytes(f.bytes) << " -- " << f.basis << "\n";
  os << "suggest: " << (p.suggestion.empty() ? std::string("none") : p.suggestion) << ": " << p.suggestion_why << "\n";
  return os.str();
}

}  // namespace eaglekit
