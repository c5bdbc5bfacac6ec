#include "trainer/model/vocab.h"

#include <ATen/ATen.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <tbb/blocked_range.h>
#include <tbb/combinable.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>
#include <numeric>

#include "formats/atomic_file.h"
#include "formats/error.h"
#include "formats/format.h"
#include "formats/pt_format.h"
#include "lib/clock.h"
#include "lib/dataset.h"
#include "lib/loader.h"
#include "trainer/model/config.h"

namespace eaglekit::trainer {

TokenCounts::TokenCounts(std::int64_t vocab_size) {
  if (vocab_size <= 0) throw UsageError("vocabulary size must be positive");
  counts_.assign(static_cast<std::size_t>(vocab_size), 0);
}

void TokenCounts::add(const std::int64_t* ids, std::size_t n, const std::string& where) {
  const std::int64_t v = vocab_size();
  for (std::size_t i = 0; i < n; ++i) {
    const std::int64_t id = ids[i];
    if (id < 0 || id >= v) {
      throw FormatError(where, std::nullopt, "input_ids",
                        "token " + std::to_string(i) + " is " + std::to_string(id) +
                            ", outside the vocabulary [0, " + std::to_string(v) + ")");
    }
    ++counts_[static_cast<std::size_t>(id)];
  }
  total_ += static_cast<std::int64_t>(n);
}

void TokenCounts::add(const HostTensor& ids, const std::string& where) {
  if (ids.dim() != 1 || (ids.dtype != DType::kInt64 && ids.dtype != DType::kInt32)) {
    throw FormatError(where, std::nullopt, "input_ids",
                      "expected a [T] int64/int32 tensor, got " + std::string(dtype_name(ids.dtype)) +
                          " " + ids.shape_string());
  }
  std::vector<std::int64_t> buf(static_cast<std::size_t>(ids.numel()));
  if (ids.dtype == DType::kInt64 && ids.is_contiguous()) {
    if (!buf.empty()) std::memcpy(buf.data(), ids.data, buf.size() * sizeof(std::int64_t));
  } else {
    for (std::int64_t i = 0; i < ids.numel(); ++i) buf[static_cast<std::size_t>(i)] = static_cast<std::int64_t>(ids.get(i));
  }
  add(buf.data(), buf.size(), where);
}

void TokenCounts::merge(const TokenCounts& other) {
  if (other.vocab_size() != vocab_size()) throw UsageError("cannot merge token counts of different vocabularies");
  for (std::size_t i = 0; i < counts_.size(); ++i) counts_[i] += other.counts_[i];
  total_ += other.total_;
}

at::Tensor identity_d2t(std::int64_t vocab_size) { return at::zeros({vocab_size}, at::kLong); }

at::Tensor d2t_from_counts(const std::vector<std::int64_t>& counts, std::int64_t draft_vocab_size) {
  const auto v = static_cast<std::int64_t>(counts.size());
  if (draft_vocab_size <= 0 || draft_vocab_size > v) {
    throw UsageError("draft vocabulary size " + std::to_string(draft_vocab_size) + " must be in [1, " +
                     std::to_string(v) + "]");
  }
  if (draft_vocab_size == v) return identity_d2t(v);
  std::vector<std::int64_t> order(counts.size());
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + draft_vocab_size, order.end(),
                    [&](std::int64_t a, std::int64_t b) {
                      const auto ca = counts[static_cast<std::size_t>(a)], cb = counts[static_cast<std::size_t>(b)];
                      return ca != cb ? ca > cb : a < b;
                    });
  at::Tensor d2t = at::empty({draft_vocab_size}, at::kLong);
  auto* p = d2t.data_ptr<std::int64_t>();
  for (std::int64_t i = 0; i < draft_vocab_size; ++i) p[i] = order[static_cast<std::size_t>(i)] - i;
  return d2t;
}

void save_d2t(const std::string& path, const at::Tensor& d2t) {
  if (!d2t.defined() || d2t.dim() != 1 || d2t.scalar_type() != at::kLong)
    throw UsageError("d2t must be a 1-D int64 tensor");
  const std::vector<char> bytes = torch::jit::pickle_save(d2t.cpu().contiguous());
  // The temp files of a save of the same file that was killed before its rename
  // (docs/crash-consistency.md).
  const std::filesystem::path target(path);
  const std::string name = target.filename().string();
  remove_stale_temp_files(target.has_parent_path() ? target.parent_path().string() : ".",
                          [&](const std::string& n) { return n == name; });
  write_file_atomic(path, bytes.data(), bytes.size());
}

at::Tensor load_d2t(const std::string& path) {
  const PtContents contents = read_pt(path);
  const HostTensor* t = contents.tensor("");
  if (t == nullptr) t = contents.tensor("d2t");
  if (t == nullptr || t->dim() != 1 || !is_integral(t->dtype)) {
    throw FormatError(path, std::nullopt, "d2t",
                      "expected a 1-D integer tensor (bare, or under the key \"d2t\")");
  }
  at::Tensor out = at::empty({t->numel()}, at::kLong);
  auto* p = out.data_ptr<std::int64_t>();
  for (std::int64_t i = 0; i < t->numel(); ++i) p[i] = static_cast<std::int64_t>(t->get(i));
  return out;
}

// --- counting over a dataset, and `eaglekit vocab` -------------------------------------

namespace {
using json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;
}  // namespace

std::vector<std::int64_t> count_tokens(const Dataset& dataset, const std::vector<SampleRef>& samples,
                                       std::int64_t vocab_size, int jobs) {
  if (vocab_size <= 0) throw UsageError("vocabulary size must be positive");
  std::map<std::uint32_t, std::vector<const SampleRef*>> by_file;
  for (const auto& s : samples) by_file[s.file].push_back(&s);
  std::vector<std::pair<std::uint32_t, std::vector<const SampleRef*>>> groups(by_file.begin(), by_file.end());
  tbb::combinable<TokenCounts> partial([&] { return TokenCounts(vocab_size); });
  tbb::task_arena arena(jobs > 0 ? jobs : tbb::task_arena::automatic);
  arena.execute([&] {
    tbb::parallel_for(tbb::blocked_range<std::size_t>(0, groups.size(), 1),
                      [&](const tbb::blocked_range<std::size_t>& range) {
                        TokenCounts& counts = partial.local();
                        for (std::size_t g = range.begin(); g != range.end(); ++g) {
                          const std::string& path = dataset.files.at(groups[g].first);
                          const auto reader = open_reader(path);
                          for (const SampleRef* s : groups[g].second) {
                            // Views into the mapping for .pt/safetensors: only the ids' pages are touched.
                            const Record r = reader->read(s->record);
                            counts.add(r.input_ids, path + "#" + s->conversation_id);
                          }
                        }
                      });
  });
  TokenCounts total(vocab_size);
  partial.combine_each([&](const TokenCounts& c) { total.merge(c); });
  return total.counts();
}

std::string VocabReport::to_json() const {
  json j;
  j["vocab_size"] = vocab_size;
  j["draft_vocab_size"] = draft_vocab_size;
  j["samples"] = samples;
  j["tokens"] = tokens;
  j["distinct"] = distinct;
  j["coverage"] = coverage;
  j["seconds"] = seconds;
  return j.dump();
}

opt::Groups VocabOptions::groups() {
  opt::Group own{"Vocabulary",
                 {opt::field("base", "DIR", base, "Base model folder (its config.json gives vocab_size)"),
                  opt::note(opt::at_least(opt::field("vocab_size", "N", vocab_size, "Target vocabulary size, instead of --base"), 0),
                            "the base's"),
                  opt::refusal(opt::positive(opt::field("draft_vocab_size", "N", draft_vocab_size,
                                                        "Draft vocabulary size Vd")),
                               "is required and must be positive"),
                  opt::field("out", "FILE", out, "d2t file to write (e.g. d2t.pt)"),
                  opt::at_least(opt::field("jobs", "N", jobs, "Threads (0: all cores)"), 0)}};
  return {split_data_options(*this), own};
}

void VocabOptions::check() const {
  if (index.empty()) throw UsageError("--index is required (build one with eaglekit index)");
  if (out.empty()) throw UsageError("--out is required (the d2t.pt to write)");
  opt::check_bounds(const_cast<VocabOptions&>(*this).groups());  // reads only
}

VocabReport build_vocab(const VocabOptions& o) {
  const auto t0 = Clock::now();
  o.check();
  std::int64_t v = o.vocab_size;
  if (v <= 0) {
    if (o.base.empty()) throw UsageError("give --base (its config.json has vocab_size) or --vocab-size");
    std::error_code ec;
    if (!std::filesystem::exists(o.base, ec))
      throw UsageError("--base " + o.base + ": no such folder (the base model folder, whose config.json has "
                       "vocab_size; or give --vocab-size)");
    v = load_base_config(o.base).vocab_size;
  }
  if (o.draft_vocab_size > v) {
    throw UsageError("--draft-vocab-size " + std::to_string(o.draft_vocab_size) +
                     " exceeds the vocabulary size " + std::to_string(v));
  }
  const SelectedData data = select_data(o);
  const auto counts = count_tokens(data.dataset, data.samples, v, o.jobs);
  const at::Tensor d2t = d2t_from_counts(counts, o.draft_vocab_size);
  save_d2t(o.out, d2t);

  VocabReport r;
  r.vocab_size = v;
  r.draft_vocab_size = o.draft_vocab_size;
  r.samples = static_cast<std::int64_t>(data.samples.size());
  for (std::int64_t c : counts) {
    r.tokens += c;
    r.distinct += c > 0;
  }
  const auto ids = (d2t + at::arange(o.draft_vocab_size, at::kLong)).contiguous();
  const std::int64_t* p = ids.data_ptr<std::int64_t>();
  std::int64_t covered = 0;
  for (std::int64_t i = 0; i < o.draft_vocab_size; ++i) covered += counts[static_cast<std::size_t>(p[i])];
  r.coverage = r.tokens > 0 ? static_cast<double>(covered) / static_cast<double>(r.tokens) : 0.0;
  r.summary = data.summary;
  r.seconds = seconds_since(t0);
  return r;
}

}  // namespace eaglekit::trainer
