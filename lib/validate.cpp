#include "lib/validate.h"


#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

#include <sys/stat.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include "formats/byte_source.h"
#include "formats/eks_format.h"
#include "formats/error.h"
#include "formats/finite.h"
#include "formats/format.h"
#include "formats/record.h"
#include "formats/zip.h"
#include "lib/dataset.h"
#include "lib/index.h"
#include "lib/loss_masks.h"
#include "lib/progress.h"

namespace eaglekit {

namespace {

constexpr std::size_t kShow = 5;  // problems listed per category in the text form

// "PATH", "PATH#KEY" or "PATH#RECORD" for an entry.
std::string location(const DatasetIndex& index, const IndexEntry& e) {
  const IndexFile f = index.file(e.file);
  std::string loc(f.path);
  if (!e.key.empty()) loc += "#" + std::string(e.key);
  else if (f.entry_count > 1) loc += "#" + std::to_string(e.record);
  return loc;
}

template <class T>
T majority(const std::map<T, std::size_t>& counts, T fallback) {
  T best = fallback;
  std::size_t n = 0;
  for (const auto& [v, c] : counts)
    if (c > n) {
      best = v;
      n = c;
    }
  return best;
}

// torch.save zips carry a CRC-32 per entry; a record's storages are checked when it is read
// whole, and --deep checks every entry, the ones no record uses included.
void verify_zip_crcs(const std::string& path) {
  const ZipArchive zip(ByteSource::open_file(path));
  for (const ZipEntry& e : zip.entries()) zip.verify_crc(e);
}

std::unique_ptr<RecordReader> open_for_deep(const std::string& path, Format f) {
  if (f == Format::kPt) verify_zip_crcs(path);
  if (f == Format::kEks) {
    EksReadOptions o;
    o.verify_checksums = true;
    return EksReader::open(path, o);
  }
  return open_reader(path);
}

enum class DeepOutcome : std::uint8_t { kOk, kUnreadable, kShape, kNonfinite };
struct DeepResult {
  DeepOutcome outcome = DeepOutcome::kOk;
  std::string detail;
};

// `masks`: the index's loss-mask file, for a record that takes its mask from it (the row is
// applied as the loader applies it, the token ids checked); null otherwise.
DeepResult deep_check(const RecordReader& reader, const IndexEntry& e, const std::string& where,
                      const LossMasks* masks, const std::string& path) {
  Record r;
  try {
    r = reader.read(e.record);
  } catch (const std::exception& ex) {
    return {classify_error(ex) == EntryError::kShape ? DeepOutcome::kShape : DeepOutcome::kUnreadable,
            ex.what()};
  }
  try {
    r.check(where);
  } catch (const FormatError& ex) {
    return {DeepOutcome::kShape, ex.what()};
  }
  if (r.tokens() != e.tokens || r.hidden_size() != e.hidden_size || r.aux_width() != e.aux_width ||
      r.stored_dtype() != e.hidden_dtype)
    return {DeepOutcome::kShape,
            where + ": the index says " + std::to_string(e.tokens) + " tokens, hidden " +
                std::to_string(e.hidden_size) + ", aux " + std::to_string(e.aux_width) + ", " +
                std::string(dtype_name(e.hidden_dtype)) + " but the record has " +
                std::to_string(r.tokens()) + ", " + std::to_string(r.hidden_size()) + ", " +
                std::to_string(r.aux_width()) + ", " +
                std::string(dtype_name(r.stored_dtype())) +
                " (the file changed since indexing: run `eaglekit index` again)"};
  if (auto where_bad = first_nonfinite(r)) return {DeepOutcome::kNonfinite, std::move(*where_bad)};
  if (masks != nullptr) {
    try {
      masks->apply(r, path);
    } catch (const Error& ex) {
      return {DeepOutcome::kUnreadable, ex.what()};
    }
  }
  // A stored target distribution (NeMo's cache) stands in for the last hidden state: each
  // row must be one (non-negative, summing to 1).
  if (auto bad = first_bad_distribution(r)) return {DeepOutcome::kNonfinite, where + ": " + *bad};
  return {};
}

}  // namespace

bool padding_candidate(const IndexEntry& e, bool all_formats) {
  return e.ok && e.has_loss_mask && e.tokens > 0 &&
         (all_formats || e.format == Format::kPt || e.format == Format::kPtGzip);
}

PaddingReport scan_padding(const DatasetIndex& index, const std::vector<std::size_t>& entries,
                           const std::function<std::string(std::size_t)>& name, int jobs) {
  struct One {
    std::int64_t tokens = 0, padding = 0;
    std::string error;
  };
  std::vector<One> got(entries.size());
  tbb::task_arena arena(jobs > 0 ? jobs : tbb::task_arena::automatic);
  arena.execute([&] {
    tbb::parallel_for(std::size_t{0}, entries.size(), [&](std::size_t k) {
      const IndexEntry e = index.entry(entries[k]);
      try {
        const Record r = open_reader(std::string(index.file(e.file).path))->read(e.record);
        got[k].tokens = r.tokens();
        if (!r.loss_mask) return;
        std::int64_t t = r.tokens();
        while (t > 0 && r.input_ids.get(t - 1) == 0 && r.loss_mask->get(t - 1) == 0) --t;
        got[k].padding = r.tokens() - t;
      } catch (const std::exception& ex) {
        got[k].error = ex.what();
      }
    });
  });
  PaddingReport p;
  for (std::size_t k = 0; k < entries.size(); ++k) {
    if (!got[k].error.empty()) {
      p.unreadable.push_back(got[k].error);
      continue;
    }
    ++p.scanned;
    p.scanned_tokens += got[k].tokens;
    if (got[k].padding == 0) continue;
    p.padding_tokens += got[k].padding;
    p.padded.push_back({name(entries[k]), got[k].tokens, got[k].padding});
  }
  return p;
}

std::string padding_text(const PaddingReport& p) {
  if (p.padded.empty()) return "";
  std::ostringstream os;
  char pct[32];
  std::snprintf(pct, sizeof pct, "%.1f%%",
                p.scanned_tokens > 0 ? 100.0 * static_cast<double>(p.padding_tokens) / static_cast<double>(p.scanned_tokens)
                                     : 0.0);
  os << "padded: " << p.padded.size() << " of " << p.scanned << " records read end in padding (input_ids 0 with "
     << "loss_mask 0, as SpecForge pads a dump batch to its longest sample): " << p.padding_tokens
     << " padding tokens, " << pct << " of their " << p.scanned_tokens << "\n";
  for (std::size_t i = 0; i < p.padded.size() && i < kShow; ++i)
    os << "  " << p.padded[i].id << ": " << p.padded[i].padding << " of " << p.padded[i].tokens << " tokens\n";
  if (p.padded.size() > kShow) os << "  ... " << p.padded.size() - kShow << " more (--json lists all)\n";
  os << "  hint: they train correctly (loss_mask keeps the padding out of the loss) but the padding costs "
        "compute; `eaglekit convert` does not remove it\n";
  return os.str();
}

static nlohmann::json padding_json(const PaddingReport& p) {
  nlohmann::json padded = nlohmann::json::array();
  for (const auto& r : p.padded) padded.push_back({{"id", r.id}, {"tokens", r.tokens}, {"padding", r.padding}});
  return {{"scanned", p.scanned},
          {"scanned_tokens", p.scanned_tokens},
          {"padded_records", p.padded.size()},
          {"padding_tokens", p.padding_tokens},
          {"records", padded},
          {"unreadable", p.unreadable}};
}

std::string padding_to_json(const PaddingReport& p) { return padding_json(p).dump(); }

void write_validate_quarantine(ValidateReport& rep, const std::string& path) {
  write_quarantine(path, rep.quarantine_groups);
  std::unordered_set<std::string> ids;
  for (const auto& g : rep.quarantine_groups) ids.insert(g.second.begin(), g.second.end());
  rep.quarantine_path = path;
  rep.quarantined = ids.size();
}

ValidateReport validate_dataset(const ValidateOptions& o) {
  if (o.index.empty()) throw UsageError("validate: --index INDEX is required");
  if (o.max_length < 0) throw UsageError("validate: --max-length must be >= 0");
  if (o.jobs < 0) throw UsageError("validate: --jobs must be >= 0");

  ValidateReport rep;
  const bool has_data = !o.data.empty();
  // Every conversation that cannot be read is listed (train would stop at the first).
  const std::vector<Conversation> convs =
      has_data ? load_conversations(o.data, &rep.bad_conversations) : std::vector<Conversation>{};
  const DatasetIndex index = DatasetIndex::load(o.index);
  // An existing quarantine file: its ids are left out, as the loader leaves them out.
  std::set<std::string> excluded;
  {
    std::error_code ec;
    if (!o.quarantine.empty() && std::filesystem::exists(o.quarantine, ec)) excluded = load_quarantine(o.quarantine);
  }
  rep.quarantine_read = excluded.size();
  rep.conversations = convs.size();
  rep.records = index.size();
  rep.deep = o.deep;
  rep.max_length = o.max_length;

  // The samples train would take: matched to the conversations (by id or row, as
  // match_records decides), or without --data every usable record of the index.
  Dataset d;
  if (has_data) {
    d = match_records(convs, index, excluded, o.match_by);
  } else {
    try {
      d = index_dataset(index, excluded);
    } catch (const Error&) {
      d.matched_by = "index";  // nothing usable: said below
    }
  }
  rep.matched_by = d.matched_by;
  const bool by_row = d.matched_by == "row";
  rep.matched = d.samples.size();
  rep.no_loss_mask = no_loss_mask_line(d.samples, o.max_length);
  rep.joined_loss_masks = joined_loss_mask_line(d.loss_masks, d.samples);
  // The loader opens the loss-mask file when a sample joins it, and refuses one moved or
  // changed since indexing: so is it fatal here.
  std::string masks_problem;
  std::unique_ptr<const LossMasks> masks;
  if (!rep.joined_loss_masks.empty() && index.loss_masks()) {
    masks_problem = LossMasks::joined_problem(*index.loss_masks(), index.path());
    if (masks_problem.empty() && o.deep) {
      try {
        masks = std::make_unique<const LossMasks>(LossMasks::open(index.loss_masks()->path));
      } catch (const Error& e) {
        masks_problem = e.what();
      }
    }
  }
  // Matched entries by (file path, record): ids alone do not say which entry a row matched.
  std::set<std::pair<std::string, std::uint32_t>> matched_at;
  for (const auto& s : d.samples) {
    matched_at.emplace(d.files.at(s.file), s.record);
    rep.matched_tokens += s.tokens;
    if (o.max_length > 0 && s.tokens > o.max_length) {
      ++rep.truncated_records;
      rep.truncated_tokens += s.tokens - o.max_length;
    }
  }
  std::vector<bool> matched_entry(index.size(), false);
  for (std::size_t i = 0; i < index.size(); ++i)
    matched_entry[i] = matched_at.count({std::string(index.file_path(i)), index.entry(i).record}) != 0;

  // Files that moved, vanished or changed since indexing: the index no longer describes
  // them and the loader would fail on them, so they are named here, with the fix (a dump
  // folder moved away from its index used to pass and then fail in train with "none of the
  // first 64 samples could be opened"). One stat per matched file, in parallel.
  std::vector<std::string> stale(index.file_count());
  {
    std::vector<char> used(index.file_count(), 0);
    for (std::size_t i = 0; i < index.size(); ++i)
      if (matched_entry[i]) used[index.entry(i).file] = 1;
    tbb::task_arena arena(o.jobs > 0 ? o.jobs : tbb::task_arena::automatic);
    arena.execute([&] {
      tbb::parallel_for(std::size_t{0}, used.size(), [&](std::size_t f) {
        if (!used[f]) return;
        const IndexFile file = index.file(f);
        const std::string path(file.path);
        struct stat st {};
        if (::stat(path.c_str(), &st) != 0) {
          stale[f] = std::string(IoError::from_errno(path, "cannot stat", errno).what()) +
                     " (moved or deleted since indexing? re-run `eaglekit index`)";
          return;
        }
        const std::int64_t mtime =
            static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1000000000LL + static_cast<std::int64_t>(st.st_mtim.tv_nsec);
        if (static_cast<std::uint64_t>(st.st_size) != file.size || mtime != file.mtime_ns)
          stale[f] = path + ": changed since indexing (" + std::to_string(file.size) + " bytes then, " +
                     std::to_string(st.st_size) + " now, or a newer modification time): re-run `eaglekit index`";
      });
    });
  }

  // The key an entry and a conversation meet on: the id, or with row matching the row
  // (record data_12 is conversation 12). Without --data the records are the conversations.
  std::vector<std::string> entry_key(index.size());
  for (std::size_t i = 0; i < index.size(); ++i) {
    const std::string_view id = index.conversation_id(i);
    if (!by_row) entry_key[i] = std::string(id);
    else if (const auto row = row_of(id)) entry_key[i] = std::to_string(*row);
  }
  std::vector<std::string> conv_key(convs.size());
  for (std::size_t c = 0; c < convs.size(); ++c) conv_key[c] = by_row ? std::to_string(c) : convs[c].id;
  std::unordered_map<std::string, std::size_t> conv_count, entry_count;
  std::unordered_map<std::string, std::size_t> conv_of_key;  // key -> first conversation
  conv_count.reserve(convs.size());
  for (std::size_t c = 0; c < convs.size(); ++c) {
    ++conv_count[conv_key[c]];
    conv_of_key.emplace(conv_key[c], c);
  }
  for (std::size_t i = 0; i < index.size(); ++i)
    if (!entry_key[i].empty()) ++entry_count[entry_key[i]];
  // The id the loader knows an entry's sample by (what a quarantine file must name): the
  // record's id, or with row matching its conversation's.
  auto sample_id = [&](std::size_t i) -> std::string {
    if (by_row) {
      const auto it = conv_of_key.find(entry_key[i]);
      if (it != conv_of_key.end()) return convs[it->second].id;
    }
    return std::string(index.conversation_id(i));
  };

  // Conversations without any record, each id once, in conversation order.
  {
    std::unordered_set<std::string> listed;
    for (std::size_t c = 0; c < convs.size(); ++c)
      if (entry_count.count(conv_key[c]) == 0 && !excluded.count(convs[c].id) && listed.insert(convs[c].id).second)
        rep.missing.push_back(convs[c].id);
  }
  {
    std::set<std::string> dups;
    for (std::size_t c = 0; c < convs.size(); ++c)
      if (conv_count[conv_key[c]] > 1) dups.emplace(convs[c].id);
    for (std::size_t i = 0; i < index.size(); ++i)
      if (!entry_key[i].empty() && entry_count[entry_key[i]] > 1) dups.emplace(sample_id(i));
    for (const auto& id : excluded) dups.erase(id);
    rep.duplicate_ids.assign(dups.begin(), dups.end());
  }

  // The dataset's shape: the most common among records the loader would use.
  std::map<std::int64_t, std::size_t> hidden_counts, aux_counts;
  std::map<DType, std::size_t> dtype_counts;
  auto tally = [&](bool matched_only) {
    for (std::size_t i = 0; i < index.size(); ++i) {
      const IndexEntry e = index.entry(i);
      if (!e.ok || (matched_only && !matched_entry[i])) continue;
      ++hidden_counts[e.hidden_size];
      ++aux_counts[e.aux_width];
      ++dtype_counts[e.hidden_dtype];
    }
  };
  tally(true);
  if (hidden_counts.empty()) tally(false);
  rep.hidden_size = majority<std::int64_t>(hidden_counts, 0);
  rep.aux_width = majority<std::int64_t>(aux_counts, 0);
  rep.dtype = majority<DType>(dtype_counts, DType::kBFloat16);

  // Ids to quarantine, by category.
  std::vector<std::string> q_unreadable, q_shape, q_dtype, q_nonfinite, q_short;
  std::size_t fatal_shape = 0, fatal_dtype = 0, fatal_nonfinite = 0, fatal_unreadable = 0, fatal_stale = 0;
  std::vector<std::size_t> deep_entries;

  for (std::size_t i = 0; i < index.size(); ++i) {
    const IndexEntry e = index.entry(i);
    const std::string id = sample_id(i);
    if (!id.empty() && excluded.count(id)) continue;  // quarantined already
    const std::string name = id.empty() ? location(index, e) : id;
    const bool matched = matched_entry[i];
    if (!e.ok) {
      if (e.error_kind == EntryError::kShape) {
        rep.shape_mismatch.push_back({name, std::string(e.error)});
        if (!id.empty()) q_shape.push_back(id);
      } else {
        rep.unreadable.push_back({location(index, e), std::string(e.error), id});
        if (!id.empty()) q_unreadable.push_back(id);
      }
      continue;
    }
    if (matched && !stale[e.file].empty()) {
      rep.unreadable.push_back({location(index, e), stale[e.file], id});
      if (!id.empty()) q_unreadable.push_back(id);
      ++fatal_stale;
      continue;
    }
    if (has_data && (entry_key[i].empty() || conv_count.count(entry_key[i]) == 0)) rep.orphans.push_back(name);

    std::string shape;
    if (e.hidden_size <= 0 || e.aux_width <= 0 || e.aux_width % e.hidden_size != 0)
      shape = "aux width " + std::to_string(e.aux_width) + " is not a positive multiple of hidden size " +
              std::to_string(e.hidden_size);
    else if (e.hidden_size != rep.hidden_size)
      shape = "hidden size " + std::to_string(e.hidden_size) + ", the dataset's is " +
              std::to_string(rep.hidden_size);
    else if (e.aux_width != rep.aux_width)
      shape = "aux width " + std::to_string(e.aux_width) + " (" +
              std::to_string(e.aux_width / e.hidden_size) + " layers), the dataset's is " +
              std::to_string(rep.aux_width) + " (" + std::to_string(rep.aux_width / rep.hidden_size) +
              " layers)";
    if (!shape.empty()) {
      rep.shape_mismatch.push_back({name, shape});
      if (!id.empty()) q_shape.push_back(id);
      if (matched) ++fatal_shape;
    }
    if (e.hidden_dtype != rep.dtype) {
      rep.dtype_mismatch.push_back({name, "dtype " + std::string(dtype_name(e.hidden_dtype)) +
                                              ", the dataset's is " + std::string(dtype_name(rep.dtype))});
      if (!id.empty()) q_dtype.push_back(id);
      if (matched) ++fatal_dtype;
    }
    if (e.tokens < 2) {
      rep.too_short.push_back({name, std::to_string(e.tokens) + " tokens"});
      if (!id.empty()) q_short.push_back(id);
    }
    if (o.deep && matched && shape.empty()) deep_entries.push_back(i);
  }

  if (o.deep) {
    // Group by file: one reader per file, records of a shard read in parallel.
    std::map<std::uint32_t, std::vector<std::size_t>> by_file;
    for (std::size_t i : deep_entries) by_file[index.entry(i).file].push_back(i);
    std::vector<std::pair<std::uint32_t, std::vector<std::size_t>>> groups(by_file.begin(), by_file.end());
    std::vector<DeepResult> results(index.size());
    Progress progress("reading records", static_cast<std::int64_t>(deep_entries.size()), o.progress);
    tbb::task_arena arena(o.jobs > 0 ? o.jobs : tbb::task_arena::automatic);
    arena.execute([&] {
      tbb::parallel_for(tbb::blocked_range<std::size_t>(0, groups.size(), 1),
                        [&](const tbb::blocked_range<std::size_t>& gr) {
        for (std::size_t g = gr.begin(); g != gr.end(); ++g) {
          const IndexFile f = index.file(groups[g].first);
          const auto& entries = groups[g].second;
          std::unique_ptr<RecordReader> reader;
          try {
            reader = open_for_deep(std::string(f.path), f.format);
          } catch (const std::exception& ex) {
            const DeepOutcome out = classify_error(ex) == EntryError::kShape ? DeepOutcome::kShape
                                                                             : DeepOutcome::kUnreadable;
            for (std::size_t i : entries) results[i] = {out, ex.what()};
            progress.add(static_cast<std::int64_t>(entries.size()));
            continue;
          }
          tbb::parallel_for(tbb::blocked_range<std::size_t>(0, entries.size(), 1),
                            [&](const tbb::blocked_range<std::size_t>& er) {
            for (std::size_t k = er.begin(); k != er.end(); ++k) {
              const std::size_t i = entries[k];
              const IndexEntry e = index.entry(i);
              results[i] = deep_check(*reader, e, location(index, e), e.joined_loss_mask ? masks.get() : nullptr,
                                      std::string(f.path));
              progress.add(1);
            }
          });
        }
      });
    });
    progress.finish();
    rep.deep_records = deep_entries.size();
    for (std::size_t i : deep_entries) {
      const DeepResult& r = results[i];
      if (r.outcome == DeepOutcome::kOk) continue;
      const IndexEntry e = index.entry(i);
      const std::string id = sample_id(i);
      switch (r.outcome) {
        case DeepOutcome::kUnreadable:
          rep.unreadable.push_back({location(index, e), r.detail, id});
          q_unreadable.push_back(id);
          ++fatal_unreadable;
          break;
        case DeepOutcome::kShape:
          rep.shape_mismatch.push_back({id, r.detail});
          q_shape.push_back(id);
          ++fatal_shape;
          break;
        case DeepOutcome::kNonfinite:
          rep.nonfinite.push_back({id, r.detail});
          q_nonfinite.push_back(id);
          ++fatal_nonfinite;
          break;
        case DeepOutcome::kOk:
          break;
      }
    }
  }

  {
    std::vector<std::size_t> candidates;
    for (std::size_t i = 0; i < index.size(); ++i)
      if (matched_entry[i] && padding_candidate(index.entry(i), o.deep)) candidates.push_back(i);
    rep.padding = scan_padding(index, candidates, sample_id, o.jobs);
  }

  if (!rep.bad_conversations.empty())
    rep.fatal.push_back(std::to_string(rep.bad_conversations.size()) +
                        " conversations of --data cannot be read (train stops at the first): fix or remove those lines");
  if (rep.matched == 0) {
    try {
      if (has_data) match_dataset(convs, index, excluded, o.match_by);
      else index_dataset(index, excluded);
    } catch (const Error& e) {
      rep.fatal.push_back(e.what());
    }
    if (rep.fatal.empty())
      rep.fatal.push_back(has_data ? "no conversation matched a usable record" : "the index holds no usable record");
  }
  if (fatal_shape > 0)
    rep.fatal.push_back(std::to_string(fatal_shape) + " matched records do not have the dataset's shape (hidden size " +
                        std::to_string(rep.hidden_size) + ", aux width " + std::to_string(rep.aux_width) +
                        ", tensors agreeing on the token count)");
  if (fatal_dtype > 0)
    rep.fatal.push_back(std::to_string(fatal_dtype) + " matched records are not " +
                        std::string(dtype_name(rep.dtype)) + " like the rest");
  if (fatal_nonfinite > 0)
    rep.fatal.push_back(std::to_string(fatal_nonfinite) + " matched records hold NaN or Inf");
  if (fatal_unreadable > 0)
    rep.fatal.push_back(std::to_string(fatal_unreadable) +
                        " matched records could not be read in full (the index lists them as ok)");
  if (fatal_stale > 0)
    rep.fatal.push_back(std::to_string(fatal_stale) +
                        " matched records are in files that moved, vanished or changed since the index was built: "
                        "re-run `eaglekit index` (an index moved together with its dumps still finds them)");
  if (!masks_problem.empty()) {
    rep.fatal.push_back(masks_problem);
    rep.loss_masks_fatal = true;
  }
  rep.ok = rep.fatal.empty();

  rep.quarantine_groups = {
      {"quarantined before (" + o.quarantine + ")", std::vector<std::string>(excluded.begin(), excluded.end())},
      {"duplicate_ids", rep.duplicate_ids}, {"unreadable", q_unreadable},
      {"shape_mismatch", q_shape},          {"dtype_mismatch", q_dtype},
      {"nonfinite", q_nonfinite},           {"too_short", q_short},
  };
  if (!o.quarantine.empty()) write_validate_quarantine(rep, o.quarantine);
  return rep;
}

std::string validate_report_to_json(const ValidateReport& r) {
  using nlohmann::json;
  auto ids = [](const std::vector<Problem>& ps) {
    json a = json::array();
    for (const auto& p : ps) a.push_back(p.id);
    return a;
  };
  json unreadable = json::array();
  for (const auto& u : r.unreadable) unreadable.push_back({{"path", u.path}, {"error", u.error}});
  json j = {{"ok", r.ok},
            {"conversations", r.conversations},
            {"records", r.records},
            {"matched", r.matched},
            {"missing", r.missing},
            {"orphans", r.orphans},
            {"duplicate_ids", r.duplicate_ids},
            {"unreadable", unreadable},
            {"shape_mismatch", ids(r.shape_mismatch)},
            {"dtype_mismatch", ids(r.dtype_mismatch)},
            {"nonfinite", ids(r.nonfinite)},
            {"too_short", ids(r.too_short)},
            {"fatal", r.fatal}};
  json bad = json::array();
  for (const auto& b : r.bad_conversations) bad.push_back({{"line", b.source}, {"error", b.error}});
  j["bad_conversations"] = bad;
  j["quarantine_read"] = r.quarantine_read;
  j["matched_by"] = r.matched_by;
  j["padding"] = padding_json(r.padding);
  j["no_loss_mask"] = r.no_loss_mask.empty() ? json(nullptr) : json(r.no_loss_mask);
  j["joined_loss_masks"] = r.joined_loss_masks.empty() ? json(nullptr) : json(r.joined_loss_masks);
  if (r.max_length > 0)
    j["truncation"] = {{"max_length", r.max_length},
                       {"records", r.truncated_records},
                       {"tokens", r.truncated_tokens}};
  if (!r.quarantine_path.empty())
    j["quarantine"] = {{"path", r.quarantine_path}, {"ids", r.quarantined}};
  return j.dump(2) + "\n";
}

std::string validate_report_to_text(const ValidateReport& r) {
  std::ostringstream os;
  if (r.matched_by == "index")
    os << "records: " << r.records << ", usable: " << r.matched
       << " (trainable samples; no --data: every usable record of the index)\n";
  else
    os << "conversations: " << r.conversations << ", records: " << r.records << ", matched: " << r.matched
       << " (trainable samples, matched by " << r.matched_by << ")\n";
  if (r.hidden_size > 0)
    os << "dataset: hidden size " << r.hidden_size << ", aux width " << r.aux_width << " ("
       << r.aux_width / r.hidden_size << " layers), " << dtype_name(r.dtype) << "\n";
  if (r.deep) os << "deep: read " << r.deep_records << " matched records in full\n";
  if (!r.no_loss_mask.empty()) os << r.no_loss_mask << "\n";
  if (!r.joined_loss_masks.empty()) os << r.joined_loss_masks << "\n";

  std::size_t warnings = 0;
  auto section = [&](const char* name, std::size_t n, const std::string& what,
                     const std::vector<std::string>& lines, const std::string& hint) {
    if (n == 0) return;
    ++warnings;
    os << "\n" << name << ": " << n << " " << what << "\n";
    for (std::size_t i = 0; i < lines.size() && i < kShow; ++i) os << "  " << lines[i] << "\n";
    if (lines.size() > kShow) os << "  ... " << lines.size() - kShow << " more (--json lists all)\n";
    os << "  hint: " << hint << "\n";
  };
  auto lines_of = [](const std::vector<Problem>& ps) {
    std::vector<std::string> out;
    for (const auto& p : ps) out.push_back(p.id + ": " + p.detail);
    return out;
  };
  {
    std::vector<std::string> lines;
    for (const auto& b : r.bad_conversations) lines.push_back(b.source + ": " + b.error);
    section("bad_conversations", r.bad_conversations.size(), "conversations of --data cannot be read", lines,
            "train stops at the first of them: give each an id (\"conversation_id\", \"uuid\" or \"id\") or "
            "remove the line");
  }
  if (r.quarantine_read > 0)
    os << "\nquarantined before: " << r.quarantine_read << " ids of " << r.quarantine_path
       << " left out, as training leaves them out (delete the file to check them again)\n";
  section("missing", r.missing.size(), "conversations have no record", r.missing,
          "the loader skips them; dump their hidden states if they should train");
  section("orphans", r.orphans.size(), "records match no conversation", r.orphans,
          "harmless, unless --data is not the file the dump was made from");
  section("duplicate_ids", r.duplicate_ids.size(),
          "ids appear twice in the conversations or in the records", r.duplicate_ids,
          "the loader leaves them out rather than pick one; delete the extra record (or "
          "conversation) and re-run `eaglekit index`");
  {
    std::vector<std::string> lines;
    for (const auto& u : r.unreadable) lines.push_back(u.error);
    section("unreadable", r.unreadable.size(), "records cannot be read", lines,
            "re-dump them and re-run `eaglekit index`; the loader skips those the index marks bad");
  }
  section("shape_mismatch", r.shape_mismatch.size(), "records do not have the dataset's shape",
          lines_of(r.shape_mismatch),
          "records from another model or a broken dump: re-dump them, or exclude them with "
          "--quarantine FILE");
  section("dtype_mismatch", r.dtype_mismatch.size(), "records have another dtype",
          lines_of(r.dtype_mismatch),
          "mixed dumps: re-dump them in the dataset's dtype, or exclude them with --quarantine FILE");
  section("nonfinite", r.nonfinite.size(), "records hold NaN or Inf", lines_of(r.nonfinite),
          "they would turn the loss into NaN: re-dump them, or exclude them with --quarantine FILE");
  section("too_short", r.too_short.size(), "records have fewer than 2 tokens",
          lines_of(r.too_short), "nothing to predict in them; the loader skips them");
  if (!r.padding.padded.empty()) {
    ++warnings;
    os << "\n" << padding_text(r.padding);
  }
  if (r.max_length > 0) {
    os << "\ntruncation: --max-length " << r.max_length << " cuts " << r.truncated_records
       << " of " << r.matched << " matched records, dropping " << r.truncated_tokens << " of "
       << r.matched_tokens << " tokens";
    if (r.matched_tokens > 0) {
      char pct[32];
      std::snprintf(pct, sizeof pct, " (%.1f%%)",
                    100.0 * static_cast<double>(r.truncated_tokens) / static_cast<double>(r.matched_tokens));
      os << pct;
    }
    os << "\n";
  }
  if (!r.deep)
    os << "\n(shallow check from the index; --deep also reads every value for NaN/Inf and "
          "verifies checksums)\n";
  if (!r.quarantine_path.empty())
    os << "\nquarantine: wrote " << r.quarantined << " ids to " << r.quarantine_path
       << "; pass it to training with --quarantine " << r.quarantine_path << "\n";
  if (r.ok) {
    os << "\nresult: trainable as is";
    if (warnings > 0) os << " (" << warnings << " kinds of warnings above; the loader skips those records)";
    os << "\n";
  } else {
    os << "\nresult: NOT trainable as is:\n";
    for (const auto& f : r.fatal) os << "  - " << f << "\n";
    if (r.matched > 0 && r.quarantine_path.empty() && r.fatal.size() > (r.loss_masks_fatal ? 1u : 0u))
      os << "  run again with --quarantine FILE and pass FILE to training to leave these records out\n";
  }
  return os.str();
}

}  // namespace eaglekit
