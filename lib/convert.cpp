#include "lib/convert.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <memory>
#include <mutex>
#include <set>

#include "formats/atomic_file.h"
#include "formats/error.h"
#include "formats/registry.h"
#include "lib/clock.h"
#include "lib/loss_masks.h"
#include "lib/progress.h"

namespace eaglekit {

namespace fs = std::filesystem;

std::optional<Format> format_from_extension(const std::string& path) {
  std::string ext = fs::path(path).extension().string();
  for (auto& c : ext) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const FormatRow& row : format_rows())
    for (std::string_view e : row.extensions)
      if (ext == e) return row.format;
  return std::nullopt;
}

bool convert_writes(const FormatRow& row) {
  return row.convert_output && row.create && !row.extensions.empty();
}

namespace {

// A file name for a conversation id: ids may hold characters a path cannot.
std::string file_stem(const std::string& id) {
  std::string s = id;
  for (auto& c : s)
    if (c == '/' || c == '\\' || c == '\0') c = '_';
  if (s.empty() || s == "." || s == "..") s = "_" + s;
  return s;
}

// One unit of work: every record of a file, or one record of an already open reader.
struct Unit {
  std::string path;
  std::shared_ptr<const RecordReader> reader;  // null: open `path` when processed
  std::optional<std::size_t> record;           // null: all records
  std::shared_ptr<const FileFacts> facts;      // the reader's, when it is open already
};

struct UnitRecords {
  std::vector<Record> records;
  std::shared_ptr<const FileFacts> facts;  // what the unit's file states
};

UnitRecords read_unit(const Unit& u, const LossMasks* masks) {
  std::shared_ptr<const RecordReader> reader = u.reader;
  if (!reader) reader = open_reader(u.path);
  UnitRecords out;
  out.facts = u.facts ? u.facts : std::make_shared<const FileFacts>(reader->facts());
  if (u.record) {
    out.records.push_back(reader->read(*u.record));
  } else {
    for (std::size_t i = 0; i < reader->size(); ++i) out.records.push_back(reader->read(i));
  }
  // The form the source's layout implies is stated in the output, whose layout implies none.
  for (Record& r : out.records) {
    r.hidden_states_prenorm = r.known_prenorm();
    if (masks) masks->apply(r, u.path);
  }
  return out;
}

std::string convert_ids_text(const std::vector<std::int64_t>& ids, const char* separator = ", ") {
  std::string s;
  for (std::size_t i = 0; i < ids.size(); ++i) s += (i ? separator : "") + std::to_string(ids[i]);
  return s;
}

std::string vocabulary_text(const std::optional<TargetVocabulary>& v) {
  if (!v) return "no target vocabulary";
  return "a target vocabulary of " + std::to_string(v->selected.size()) + " draft tokens of " +
         std::to_string(v->target_vocab_size) +
         (v->topk ? " (top " + std::to_string(v->topk) + " kept)" : std::string(" (full distribution)"));
}

// How two files' facts differ, for a person; "" when they agree.
std::string facts_difference(const FileFacts& a, const FileFacts& b) {
  if (a.aux_layer_ids != b.aux_layer_ids) {
    const auto text = [](const std::vector<std::int64_t>& ids) {
      return ids.empty() ? std::string("none stated") : "[" + convert_ids_text(ids) + "]";
    };
    return "aux layer ids " + text(a.aux_layer_ids) + " against " + text(b.aux_layer_ids);
  }
  const auto& va = a.target_vocabulary;
  const auto& vb = b.target_vocabulary;
  if (!va && !vb) return "";
  if (!va || !vb || va->selected.size() != vb->selected.size() || va->target_vocab_size != vb->target_vocab_size ||
      va->topk != vb->topk)
    return vocabulary_text(va) + " against " + vocabulary_text(vb);
  for (std::size_t i = 0; i < va->selected.size(); ++i)
    if (va->selected[i] != vb->selected[i])
      return "target vocabularies whose draft id " + std::to_string(i) + " is target id " +
             std::to_string(va->selected[i]) + " against " + std::to_string(vb->selected[i]);
  return "";
}

// The aux layer ids sources stated that the output cannot keep, each list once.
struct DroppedFacts {
  std::mutex mu;
  std::vector<std::pair<std::vector<std::int64_t>, std::string>> aux;  // ids, the first source stating them
};

// Gives a writer its source's facts: a target vocabulary it cannot keep is refused, aux
// layer ids it cannot keep are noted. Returns the facts it keeps.
FileFacts give_facts(RecordWriter& w, const FileFacts& facts, const std::string& source, const std::string& format_ext,
                     DroppedFacts& dropped) {
  if (facts.empty()) return {};
  const std::vector<std::string> lost = w.set_facts(facts);
  const auto has = [&](const char* fact) { return std::find(lost.begin(), lost.end(), fact) != lost.end(); };
  if (has(kFactTargetVocabulary))
    throw UnsupportedError(source, std::nullopt, "target vocabulary",
                           "its records store the target's distribution over a draft vocabulary of " +
                               std::to_string(facts.target_vocabulary->selected.size()) +
                               " tokens instead of a last hidden state (NeMo AutoModel's EAGLE-3 cache), and the " +
                               format_ext + " format has no field for the distribution or its vocabulary; convert "
                               "to .eks (DST ending in .eks, or --format eks), which keeps both and trains as the "
                               "cache does");
  FileFacts kept = facts;
  if (has(kFactAuxLayerIds)) {
    kept.aux_layer_ids.clear();
    std::lock_guard<std::mutex> lock(dropped.mu);
    const bool known = std::any_of(dropped.aux.begin(), dropped.aux.end(),
                                   [&](const auto& d) { return d.first == facts.aux_layer_ids; });
    if (!known) dropped.aux.emplace_back(facts.aux_layer_ids, source);
  }
  return kept;
}

std::int64_t file_size_or_zero(const std::string& p) {
  std::error_code ec;
  const auto n = fs::file_size(p, ec);
  return ec ? 0 : static_cast<std::int64_t>(n);
}

}  // namespace

ConvertResult convert_records(const std::string& src, const std::string& dst,
                              const ConvertOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  std::error_code ec;
  if (dst.empty()) throw UsageError("DST is empty");
  const bool dst_is_dir = fs::is_directory(dst, ec) || dst.back() == '/';

  // Sources.
  std::vector<Unit> units;
  bool src_single_record = false;
  if (fs::is_directory(src, ec)) {
    for (auto& f : find_record_files(src)) {
      if (fs::exists(dst, ec) && fs::equivalent(f, dst, ec))
        throw UsageError("DST " + dst + " is one of the source files; write elsewhere");
      units.push_back({f, nullptr, std::nullopt, nullptr});
    }
    if (units.empty()) throw Error(src + ": no record files found below this folder");
  } else {
    const RecordSpec rs = parse_record_spec(src);
    std::shared_ptr<const RecordReader> reader = open_reader(rs.path);
    if (rs.conversation_id) {
      const auto i = reader->find(*rs.conversation_id);
      if (!i)
        throw Error(rs.path + ": no record with conversation id '" + *rs.conversation_id + "' (" +
                    std::to_string(reader->size()) + " records in the file)");
      units.push_back({rs.path, reader, *i, nullptr});
      src_single_record = true;
    } else {
      for (std::size_t i = 0; i < reader->size(); ++i) units.push_back({rs.path, reader, i, nullptr});
      src_single_record = reader->size() == 1;
      if (units.empty()) throw Error(rs.path + ": holds no records");
    }
    if (fs::exists(dst, ec) && fs::equivalent(rs.path, dst, ec))
      throw UsageError("DST " + dst + " is the source file; write elsewhere");
  }

  // A file's facts, read once for all of its records' units.
  if (!units.empty() && units.front().reader) {
    const auto facts = std::make_shared<const FileFacts>(units.front().reader->facts());
    for (Unit& u : units) u.facts = facts;
  }

  ConvertResult res;
  res.output = dst;
  res.format = options.format ? *options.format
                              : (dst_is_dir ? Format::kPt
                                            : format_from_extension(dst).value_or(Format::kPt));
  const FormatRow* row = format_row(res.format);
  if (!row || !convert_writes(*row))
    throw UsageError("cannot write format " + std::string(format_name(res.format)) + " (" +
                     format_list(&FormatRow::name, convert_writes, ", ", " or ") + ")");
  const bool shard = !row->one_record;
  if (shard && dst_is_dir)
    throw UsageError("DST " + dst + " is a folder, but " + std::string(format_name(res.format)) +
                     " writes one shard file; name a file");
  res.folder_output = !shard && !(src_single_record && !dst_is_dir);
  const std::string ext(row->extensions.front());  // a folder output's file names end so
  WriterOptions wo = options.writer;
  wo.format = res.format;

  // A killed earlier run of this conversion leaves writers' temp files beside the outputs
  // (ignored by every reader); they are removed once their process is gone.
  // A folder output is created when its first file is written, so that a conversion refused
  // before (a source's facts the format cannot keep) leaves no empty folder behind.
  std::once_flag folder_made;
  const auto make_folder = [&] {
    std::call_once(folder_made, [&] {
      std::error_code e;
      fs::create_directories(dst, e);
      if (e) throw IoError::from_errno(dst, "cannot create folder", e.value());
    });
  };
  if (res.folder_output) {
    if (fs::is_directory(dst, ec))
      remove_stale_temp_files(dst, [&](const std::string& name) {
        return name.size() > ext.size() && name.compare(name.size() - ext.size(), ext.size(), ext) == 0;
      });
  } else {
    const auto parent = fs::path(dst).parent_path();
    if (!parent.empty()) {
      fs::create_directories(parent, ec);
      if (ec) throw IoError::from_errno(parent.string(), "cannot create folder", ec.value());
    }
    const std::string file = fs::path(dst).filename().string();
    remove_stale_temp_files(parent.empty() ? "." : parent.string(),
                            [&](const std::string& name) { return name == file; });
  }

  // Opened (and checked whole) before any output is written.
  std::unique_ptr<const LossMasks> masks;
  if (!options.loss_masks.empty())
    masks = std::make_unique<const LossMasks>(LossMasks::open(options.loss_masks));

  Progress progress("convert", static_cast<std::int64_t>(units.size()), options.progress ? -1 : 0);
  tbb::task_arena arena(options.jobs > 0 ? options.jobs : tbb::task_arena::automatic);
  std::atomic<std::int64_t> records{0}, files{0}, bytes{0};
  const std::string format_ext(row->extensions.front());
  DroppedFacts dropped;

  if (res.folder_output) {
    std::mutex mu;
    std::set<std::string> names;  // output file names taken (duplicate ids collide)
    arena.execute([&] {
      tbb::parallel_for(tbb::blocked_range<std::size_t>(0, units.size(), 1),
                        [&](const tbb::blocked_range<std::size_t>& range) {
        for (std::size_t u = range.begin(); u != range.end(); ++u) {
          const UnitRecords got = read_unit(units[u], masks.get());
          for (const Record& r : got.records) {
            const std::string name = file_stem(r.conversation_id) + ext;
            {
              std::lock_guard<std::mutex> lock(mu);
              if (!names.insert(name).second)
                throw Error("two records have conversation id '" + r.conversation_id +
                            "' (the second in " + units[u].path + "); a folder output names "
                            "files by id, so ids must be unique");
            }
            const std::string out = (fs::path(dst) / name).string();
            // The one-record writers (pt, safetensors) touch no file before finish(): the
            // folder is made once the facts are known to fit.
            auto w = create_writer(out, wo);
            give_facts(*w, *got.facts, units[u].path, format_ext, dropped);
            make_folder();
            w->add(r);
            w->finish();
            ++records;
            ++files;
            bytes += file_size_or_zero(out);
          }
          progress.add(1);
        }
      });
    });
  } else {
    auto w = create_writer(dst, wo);
    std::shared_ptr<const FileFacts> shard_facts;
    // Read a batch in parallel (decoding may be the costly part), then add in order.
    const std::size_t batch = static_cast<std::size_t>(4 * std::max(1, arena.max_concurrency()));
    for (std::size_t b = 0; b < units.size(); b += batch) {
      const std::size_t e = std::min(units.size(), b + batch);
      std::vector<UnitRecords> got(e - b);
      arena.execute([&] {
        tbb::parallel_for(tbb::blocked_range<std::size_t>(b, e, 1),
                          [&](const tbb::blocked_range<std::size_t>& range) {
          for (std::size_t u = range.begin(); u != range.end(); ++u) got[u - b] = read_unit(units[u], masks.get());
        });
      });
      for (std::size_t u = b; u < e; ++u) {
        // One shard states one set of facts: its first source's, which every other must state too.
        const std::shared_ptr<const FileFacts>& facts = got[u - b].facts;
        if (u == 0) {
          shard_facts = facts;
          res.facts = give_facts(*w, *facts, units[u].path, format_ext, dropped);
        } else if (facts != shard_facts) {
          const std::string diff = facts_difference(*shard_facts, *facts);
          if (!diff.empty())
            throw UsageError(units[0].path + " and " + units[u].path + " would go into one shard (" + dst +
                             ") but state different file facts: " + diff +
                             "; a shard states one set for all its records, so convert them to two shards");
        }
        for (const Record& r : got[u - b].records) {
          w->add(r);
          ++records;
        }
        progress.add(1);
      }
    }
    w->finish();
    files = 1;
    bytes = file_size_or_zero(dst);
  }
  progress.finish();
  res.records = records.load();
  if (masks) res.loss_masks_joined = res.records;
  res.files_written = files.load();
  res.bytes_written = bytes.load();
  for (const auto& [ids, source] : dropped.aux) {
    res.dropped_aux_layer_ids.push_back(ids);
    res.notes.push_back("the " + format_ext + " format has no field for the aux layer ids [" + convert_ids_text(ids) + "] " +
                        source + " states; pass --aux-layer-ids " + convert_ids_text(ids, ",") + " when training");
  }
  res.seconds = seconds_since(start);
  return res;
}

}  // namespace eaglekit
