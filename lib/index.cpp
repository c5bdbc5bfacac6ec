// Building the dataset index (its file format: formats/index_format.h).
#include "lib/index.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <unordered_map>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include "formats/error.h"
#include "formats/file_walk.h"
#include "formats/registry.h"
#include "lib/clock.h"
#include "lib/loss_masks.h"
#include "lib/progress.h"

namespace eaglekit {

namespace fs = std::filesystem;

namespace {

bool single_record_format(Format f) {
  const FormatRow* row = format_row(f);
  return row && row->one_record;
}

std::int64_t mtime_ns_of(const struct stat& st) {
  return static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1000000000LL +
         static_cast<std::int64_t>(st.st_mtim.tv_nsec);
}

std::string absolute_path(const std::string& p) {
  std::error_code ec;
  fs::path a = fs::absolute(p, ec);
  if (ec) return p;
  return a.lexically_normal().string();
}

}  // namespace

EntryError classify_error(const std::exception& e) {
  if (dynamic_cast<const IoError*>(&e)) return EntryError::kIo;
  if (dynamic_cast<const ChecksumError*>(&e)) return EntryError::kChecksum;
  if (dynamic_cast<const UnsupportedError*>(&e)) return EntryError::kUnsupported;
  if (const auto* f = dynamic_cast<const FormatError*>(&e)) {
    const std::string& field = f->field();
    if (!f->offset() && (field == "input_ids" || field == "hidden_states" ||
                         field == "aux_hidden_states" || field == "loss_mask"))
      return EntryError::kShape;
    return EntryError::kFormat;
  }
  return EntryError::kOther;
}

std::string file_stem_id(const std::string& path) {
  std::string name = fs::path(path).filename().string();
  std::size_t longest = 0;  // the longest record-format extension it ends with (".ckpt.gz")
  for (const FormatRow& row : format_rows())
    for (std::string_view ext : row.extensions)
      if (name.size() > ext.size() && ext.size() > longest &&
          std::string_view(name).substr(name.size() - ext.size()) == ext)
        longest = ext.size();
  if (longest > 0) return name.substr(0, name.size() - longest);
  const auto dot = name.rfind('.');
  if (dot != std::string::npos && dot > 0) name.resize(dot);
  return name;
}

// ---------------------------------------------------------------------------------------
// Building

namespace {

// vLLM's connector's companion lock file: FILE.lock (see IndexReport::lock_files).
bool is_lock_companion(const std::string& path) {
  constexpr std::string_view kLock = ".lock";
  const std::string name = fs::path(path).filename().string();
  return name.size() > kLock.size() && std::string_view(name).substr(name.size() - kLock.size()) == kLock;
}

// Whether another process holds an exclusive flock on it (the writer of its record).
bool lock_is_held(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool held = ::flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK;
  ::close(fd);  // releases the shared lock when it was taken
  return held;
}


// Reads one file's metadata. Never throws for a bad file: errors become bad entries.
// `format` is what detection said (kUnknown when the head could not be read).
IndexedFile index_one_file(const std::string& path, std::uint64_t size, std::int64_t mtime_ns,
                           Format format) {
  IndexedFile f;
  f.path = path;
  f.size = size;
  f.mtime_ns = mtime_ns;
  f.format = format;
  try {
    const auto reader = open_reader(path);
    f.format = reader->format();
    const std::size_t n = reader->size();
    if (n > std::numeric_limits<std::uint32_t>::max())
      throw FormatError(path, std::nullopt, "record count",
                        std::to_string(n) + " records exceed the index's 2^32 - 1 per file");
    f.records.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      IndexedRecord& r = f.records[i];
      r.record = static_cast<std::uint32_t>(i);
      try {
        r.info = reader->info(i);
      } catch (const std::exception& e) {
        // A record that cannot be described stays in the index as bad, with its error.
        r.info = RecordInfo{};
        r.error = e.what();
        r.error_kind = classify_error(e);
        if (r.error.empty()) r.error = "unreadable record";
        continue;
      }
      constexpr std::int64_t kMax = std::numeric_limits<std::uint32_t>::max();
      const RecordInfo& info = r.info;
      if (info.tokens < 0 || info.hidden_size < 0 || info.hidden_size > kMax ||
          info.aux_width < 0 || info.aux_width > kMax) {
        r.error = FormatError(path, std::nullopt, "record " + std::to_string(i),
                              "metadata out of range: tokens " + std::to_string(info.tokens) +
                                  ", hidden size " + std::to_string(info.hidden_size) +
                                  ", aux width " + std::to_string(info.aux_width))
                      .what();
        r.error_kind = EntryError::kFormat;
        const std::string id = info.conversation_id;
        r.info = RecordInfo{};
        r.info.conversation_id = id;
      }
    }
  } catch (const std::exception& e) {
    // Recorded as a bad entry (validate reports it); the run goes on.
    f.error = e.what();
    if (f.error.empty()) f.error = "unreadable file";
    f.records.assign(1, IndexedRecord{});
    f.records[0].error = f.error;
    f.records[0].error_kind = classify_error(e);
  }
  if (single_record_format(f.format) && f.records.size() == 1 &&
      f.records[0].info.conversation_id.empty()) {
    f.records[0].info.conversation_id = file_stem_id(path);
    f.records[0].id_from_file_name = true;
  }
  return f;
}

IndexedFile reuse_file(const DatasetIndex& prev, std::size_t fi, const std::string& path) {
  const IndexFile pf = prev.file(fi);
  IndexedFile f;
  f.path = path;
  f.size = pf.size;
  f.mtime_ns = pf.mtime_ns;
  f.format = pf.format;
  f.records.resize(pf.entry_count);
  for (std::uint32_t k = 0; k < pf.entry_count; ++k) {
    const IndexEntry e = prev.entry(pf.first_entry + k);
    IndexedRecord& r = f.records[k];
    r.record = e.record;
    r.id_from_file_name = e.id_from_file_name;
    r.info.conversation_id = std::string(e.conversation_id);
    r.info.key = std::string(e.key);
    r.info.codec = std::string(e.codec);
    r.info.tokens = e.tokens;
    r.info.hidden_size = e.hidden_size;
    r.info.aux_width = e.aux_width;
    r.info.ids_dtype = e.ids_dtype;
    r.info.hidden_dtype = e.hidden_dtype;
    r.info.has_loss_mask = e.has_loss_mask;
    r.info.hidden_states_prenorm = e.hidden_states_prenorm;
    r.info.layout_prenorm = e.layout_prenorm;
    r.info.byte_offset = e.byte_offset;
    r.info.byte_size = e.byte_size;
  }
  return f;
}

// A previous file is reused only when it is unchanged and was read cleanly: errors may
// have been transient (permissions, a file still being written).
bool reusable(const DatasetIndex& prev, std::size_t fi, std::uint64_t size, std::int64_t mtime) {
  const IndexFile pf = prev.file(fi);
  if (pf.size != size || pf.mtime_ns != mtime || !pf.error.empty()) return false;
  for (std::uint32_t k = 0; k < pf.entry_count; ++k)
    if (!prev.entry(pf.first_entry + k).ok) return false;
  return true;
}

// Flags every readable record whose row of `masks` holds its token count; nothing is
// flagged, and the first record's error thrown with the count, when some record has none.
void join_loss_masks(const LossMasks& masks, std::vector<IndexedFile>& files, IndexReport& report) {
  std::vector<char> used(static_cast<std::size_t>(masks.rows()), 0);
  std::size_t records = 0, misfits = 0;
  std::optional<std::string> first;
  bool first_usage = false;
  for (IndexedFile& f : files) {
    for (IndexedRecord& r : f.records) {
      if (!r.error.empty()) {
        ++report.loss_masks_bad_records;
        continue;
      }
      ++records;
      try {
        used[static_cast<std::size_t>(masks.check_length(r.info.conversation_id, f.path, r.info.tokens))] = 1;
        r.joined_loss_mask = true;
      } catch (const Error& e) {
        if (!first) {
          first = e.what();
          first_usage = dynamic_cast<const UsageError*>(&e) != nullptr;
        }
        ++misfits;
      }
    }
  }
  if (first) {
    const std::string msg = *first + " (" + std::to_string(misfits) + " of the " + std::to_string(records) +
                            " readable records do not fit " + masks.path() +
                            ", so the index was not written: a record without its mask would train every token)";
    if (first_usage) throw UsageError(msg);
    throw Error(msg);
  }
  report.loss_masks_joined = records;
  report.loss_masks_unused_rows = static_cast<std::size_t>(std::count(used.begin(), used.end(), 0));
}

}  // namespace

IndexReport build_index(const IndexOptions& opts) {
  if (opts.roots.empty()) throw UsageError("index: give at least one folder to index");
  if (opts.out.empty()) throw UsageError("index: --out INDEX is required");
  if (opts.jobs < 0) throw UsageError("index: --jobs must be >= 0");
  const auto start = std::chrono::steady_clock::now();
  IndexReport report;

  std::vector<std::string> roots;
  std::vector<std::string> paths;
  for (const auto& root : opts.roots) {
    roots.push_back(absolute_path(root));
    // Listed without reading a byte; format detection happens later, in parallel, and only
    // for files the previous index does not already know unchanged.
    for (auto& p : list_files_below(root)) paths.push_back(absolute_path(p));
  }
  // Overlapping roots name a file twice; it is one file.
  std::sort(paths.begin(), paths.end());
  paths.erase(std::unique(paths.begin(), paths.end()), paths.end());
  const std::string out_abs = absolute_path(opts.out);
  paths.erase(std::remove(paths.begin(), paths.end(), out_abs), paths.end());

  std::optional<DatasetIndex> prev;
  std::error_code ec;
  if (opts.incremental && fs::exists(opts.out, ec)) {
    try {
      prev = DatasetIndex::load(opts.out);
      report.had_previous = true;
    } catch (const Error& e) {
      report.previous_error = e.what();
    }
  }

  // The loss-mask file: opened and checked whole before any record is read, as convert does.
  std::optional<LossMasks> masks;
  std::optional<IndexLossMasks> masks_state;
  {
    std::string path = opts.loss_masks;
    if (path.empty() && prev && prev->loss_masks()) {
      path = prev->loss_masks()->path;
      report.loss_masks_kept = true;
      const std::string change = index_loss_masks_change(*prev->loss_masks());
      if (change.rfind("is not there", 0) == 0)
        throw Error(opts.out + " joins the loss masks of " + path + ", which " + change +
                    ": pass --loss-masks FILE with its new place, or --full to index without it");
    }
    if (!path.empty()) {
      masks_state = index_loss_masks_of(path);  // stat'ed before it is read
      masks.emplace(LossMasks::open(path));
      report.loss_masks = masks_state->path;
      report.loss_masks_rows = static_cast<std::size_t>(masks->rows());
      report.loss_masks_by_id = masks->by_conversation_id();
    }
  }

  std::unordered_map<std::string_view, std::size_t> prev_files;
  if (prev) {
    prev_files.reserve(prev->file_count());
    for (std::size_t i = 0; i < prev->file_count(); ++i) prev_files.emplace(prev->file(i).path, i);
  }

  // One parallel pass per file: stat, then reuse the previous entries (unchanged files are
  // not even opened), or detect the format by magic bytes (skipping files that are not
  // records, as find_record_files does) and read every record's metadata.
  enum class Origin : std::uint8_t { kNew, kChanged, kUnchanged, kNotRecord, kLock, kHeldLock };
  std::vector<IndexedFile> files(paths.size());
  std::vector<Origin> origin(paths.size(), Origin::kNew);
  {
    Progress progress("indexing files", static_cast<std::int64_t>(paths.size()), opts.progress);
    tbb::task_arena arena(opts.jobs > 0 ? opts.jobs : tbb::task_arena::automatic);
    arena.execute([&] {
      tbb::parallel_for(tbb::blocked_range<std::size_t>(0, paths.size(), 8),
                        [&](const tbb::blocked_range<std::size_t>& range) {
        for (std::size_t i = range.begin(); i != range.end(); ++i) {
          const std::string& path = paths[i];
          // Stat before reading: a file that changes while it is read gets a newer
          // mtime than the one recorded, so the next run reads it again.
          struct stat st {};
          const auto it = prev ? prev_files.find(path) : prev_files.end();
          const bool known = it != prev_files.end();
          if (::stat(path.c_str(), &st) != 0) {
            files[i].path = path;
            files[i].error = IoError::from_errno(path, "cannot stat", errno).what();
            files[i].records.assign(1, IndexedRecord{});
            files[i].records[0].error = files[i].error;
            files[i].records[0].error_kind = EntryError::kIo;
            origin[i] = known ? Origin::kChanged : Origin::kNew;
          } else {
            const auto size = static_cast<std::uint64_t>(st.st_size);
            const std::int64_t mtime = mtime_ns_of(st);
            if (known && reusable(*prev, it->second, size, mtime)) {
              files[i] = reuse_file(*prev, it->second, path);
              origin[i] = Origin::kUnchanged;
            } else if (const auto format = record_file_format(path)) {
              files[i] = index_one_file(path, size, mtime, *format);
              origin[i] = known ? Origin::kChanged : Origin::kNew;
            } else if (is_lock_companion(path)) {
              origin[i] = lock_is_held(path) ? Origin::kHeldLock : Origin::kLock;
            } else {
              origin[i] = Origin::kNotRecord;
            }
          }
          progress.add(1, 0);
        }
      });
    });
  }
  {
    std::size_t kept = 0;
    for (std::size_t i = 0; i < paths.size(); ++i) {
      if (origin[i] == Origin::kLock || origin[i] == Origin::kHeldLock) {
        ++report.lock_files;
        if (origin[i] == Origin::kHeldLock) report.held_locks.push_back(paths[i]);
      }
      if (origin[i] == Origin::kNotRecord || origin[i] == Origin::kLock || origin[i] == Origin::kHeldLock) continue;
      if (kept != i) {
        files[kept] = std::move(files[i]);
        origin[kept] = origin[i];
        paths[kept] = std::move(paths[i]);
      }
      ++kept;
    }
    files.resize(kept);
    origin.resize(kept);
    paths.resize(kept);
  }

  for (Origin o : origin) {
    if (o == Origin::kNew) ++report.new_files;
    else if (o == Origin::kChanged) ++report.changed_files;
    else if (o == Origin::kUnchanged) ++report.unchanged_files;
  }
  if (prev) {
    std::unordered_map<std::string_view, bool> now;
    now.reserve(paths.size());
    for (const auto& p : paths) now.emplace(p, true);
    for (std::size_t i = 0; i < prev->file_count(); ++i)
      if (now.find(prev->file(i).path) == now.end()) ++report.gone_files;
  }

  if (masks) join_loss_masks(*masks, files, report);
  write_index(opts.out, roots, files, masks_state ? &*masks_state : nullptr);

  std::unordered_map<std::string_view, std::size_t> id_count;
  for (const auto& f : files) {
    for (const auto& r : f.records) {
      ++report.records;
      if (!r.info.conversation_id.empty()) ++id_count[r.info.conversation_id];
      if (!r.error.empty()) {
        ++report.bad_records;
        std::string where = f.path;
        if (f.records.size() > 1) where += "#" + std::to_string(r.record);
        report.bad.push_back(r.error.compare(0, f.path.size(), f.path) == 0
                                 ? r.error
                                 : where + ": " + r.error);
      }
    }
  }
  for (const auto& [id, n] : id_count)
    if (n > 1) report.duplicate_ids.emplace_back(id);
  std::sort(report.duplicate_ids.begin(), report.duplicate_ids.end());
  report.files = files.size();
  report.seconds = seconds_since(start);
  return report;
}

// ---------------------------------------------------------------------------------------
// Printing

namespace {

std::string location(const DatasetIndex& index, const IndexEntry& e) {
  std::string loc(index.file(e.file).path);
  if (!e.key.empty()) loc += "#" + std::string(e.key);
  else if (index.file(e.file).entry_count > 1) loc += "#" + std::to_string(e.record);
  return loc;
}

}  // namespace

std::string index_to_text(const DatasetIndex& index) {
  std::ostringstream os;
  os << "index " << index.path() << ": version " << index.version() << ", "
     << index.size() << " records (" << index.bad_count() << " bad) in " << index.file_count()
     << " files\n";
  for (const auto& r : index.roots()) os << "root " << r << "\n";
  if (const auto& m = index.loss_masks()) {
    std::size_t joined = 0;
    for (std::size_t i = 0; i < index.size(); ++i) joined += index.entry(i).joined_loss_mask;
    os << "loss masks: " << joined << " records take theirs from " << m->path << " (" << m->size
       << " bytes when indexed)\n";
  }
  os << "conversation_id\ttokens\thidden\taux\tdtype\tformat\tcodec\tlocation\tstatus\n";
  for (std::size_t i = 0; i < index.size(); ++i) {
    const IndexEntry e = index.entry(i);
    os << (e.conversation_id.empty() ? std::string_view("-") : e.conversation_id) << "\t"
       << e.tokens << "\t" << e.hidden_size << "\t" << e.aux_width << "\t"
       << (e.ok ? dtype_name(e.hidden_dtype) : std::string_view("-")) << "\t"
       << format_name(e.format) << "\t" << (e.codec.empty() ? std::string_view("-") : e.codec)
       << "\t" << location(index, e) << "\t";
    if (e.ok) os << "ok";
    else os << "bad: " << e.error;
    os << "\n";
  }
  return os.str();
}

std::string index_to_json(const DatasetIndex& index) {
  using nlohmann::json;
  json j;
  j["path"] = index.path();
  j["version"] = index.version();
  j["roots"] = index.roots();
  j["records"] = index.size();
  j["bad_records"] = index.bad_count();
  if (const auto& m = index.loss_masks()) {
    char hash[17];
    std::snprintf(hash, sizeof hash, "%016llx", static_cast<unsigned long long>(m->xxh3));
    j["loss_masks"] = {{"path", m->path}, {"size", m->size}, {"mtime_ns", m->mtime_ns}, {"xxh3", hash}};
  } else {
    j["loss_masks"] = nullptr;
  }
  json files = json::array();
  for (std::size_t i = 0; i < index.file_count(); ++i) {
    const IndexFile f = index.file(i);
    json jf = {{"path", f.path},
               {"size", f.size},
               {"mtime_ns", f.mtime_ns},
               {"format", format_name(f.format)},
               {"first_entry", f.first_entry},
               {"entry_count", f.entry_count}};
    if (!f.error.empty()) jf["error"] = f.error;
    files.push_back(std::move(jf));
  }
  j["files"] = std::move(files);
  json entries = json::array();
  for (std::size_t i = 0; i < index.size(); ++i) {
    const IndexEntry e = index.entry(i);
    json je = {{"conversation_id", e.conversation_id},
               {"file", e.file},
               {"record", e.record},
               {"key", e.key},
               {"format", format_name(e.format)},
               {"ok", e.ok}};
    if (e.ok) {
      je["tokens"] = e.tokens;
      je["hidden_size"] = e.hidden_size;
      je["aux_width"] = e.aux_width;
      je["ids_dtype"] = dtype_name(e.ids_dtype);
      je["hidden_dtype"] = dtype_name(e.hidden_dtype);
      je["has_loss_mask"] = e.has_loss_mask;
      je["joined_loss_mask"] = e.joined_loss_mask;
      je["hidden_states_prenorm"] =
          e.hidden_states_prenorm ? json(*e.hidden_states_prenorm) : json(nullptr);
      je["layout_prenorm"] = e.layout_prenorm ? json(*e.layout_prenorm) : json(nullptr);
      je["codec"] = e.codec;
      je["byte_offset"] = e.byte_offset;
      je["byte_size"] = e.byte_size;
    } else {
      je["error"] = e.error;
      je["error_kind"] = entry_error_name(e.error_kind);
    }
    if (e.id_from_file_name) je["id_from_file_name"] = true;
    entries.push_back(std::move(je));
  }
  j["entries"] = std::move(entries);
  // Paths, ids and error texts are bytes, not always UTF-8 (Linux file names): invalid
  // sequences print as U+FFFD instead of making dump() throw.
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

std::string index_report_to_text(const IndexReport& r, const std::string& out) {
  std::ostringstream os;
  os << "indexed " << r.records << " records in " << r.files << " files into " << out << " ("
     << std::fixed;
  os.precision(2);
  os << r.seconds << " s)\n";
  if (r.had_previous)
    os << "files: " << r.new_files << " new, " << r.changed_files << " changed, "
       << r.unchanged_files << " unchanged, " << r.gone_files << " gone\n";
  if (!r.previous_error.empty())
    os << "warning: the previous index could not be read, so every file was read again: "
       << r.previous_error << "\n";
  if (!r.loss_masks.empty()) {
    os << "loss masks: " << r.loss_masks_joined << " records take theirs from " << r.loss_masks << " ("
       << (r.loss_masks_by_id ? "by conversation id" : "by row: hs_{i}.safetensors takes row i")
       << "; lengths checked, token ids checked as the loader reads)";
    if (r.loss_masks_kept) os << "; kept from the previous index (--full indexes without it)";
    os << "\n";
    if (r.loss_masks_bad_records > 0)
      os << "  " << r.loss_masks_bad_records << " bad records take none (they are not trained)\n";
    if (r.loss_masks_unused_rows > 0)
      os << "  " << r.loss_masks_unused_rows << " of its " << r.loss_masks_rows << " rows are no record's\n";
  }
  constexpr std::size_t kShow = 5;
  if (r.bad_records > 0) {
    os << "bad records: " << r.bad_records << " (kept in the index as bad; `eaglekit validate` "
       << "lists them all)\n";
    for (std::size_t i = 0; i < r.bad.size() && i < kShow; ++i) os << "  " << r.bad[i] << "\n";
    if (r.bad.size() > kShow) os << "  ... " << r.bad.size() - kShow << " more\n";
  }
  if (r.lock_files > 0) {
    os << "skipped " << r.lock_files << " .lock companion file" << (r.lock_files == 1 ? "" : "s")
       << " (vLLM's hidden-state connector: FILE.lock beside FILE.safetensors, not records)\n";
    if (!r.held_locks.empty()) {
      os << "warning: " << r.held_locks.size() << " of them locked by a running writer: their records were "
         << "still being written; index again when the writer is done\n";
      for (std::size_t i = 0; i < r.held_locks.size() && i < kShow; ++i) os << "  " << r.held_locks[i] << "\n";
      if (r.held_locks.size() > kShow) os << "  ... " << r.held_locks.size() - kShow << " more\n";
    }
  }
  if (!r.duplicate_ids.empty()) {
    os << "duplicate conversation ids: " << r.duplicate_ids.size()
       << " (held by more than one record; training leaves them out until one copy is removed)\n";
    for (std::size_t i = 0; i < r.duplicate_ids.size() && i < kShow; ++i)
      os << "  " << r.duplicate_ids[i] << "\n";
    if (r.duplicate_ids.size() > kShow) os << "  ... " << r.duplicate_ids.size() - kShow << " more\n";
  }
  return os.str();
}

std::string index_report_to_json(const IndexReport& r, const std::string& out) {
  nlohmann::json j = {{"index", out},
                      {"files", r.files},
                      {"records", r.records},
                      {"bad_records", r.bad_records},
                      {"new_files", r.new_files},
                      {"changed_files", r.changed_files},
                      {"unchanged_files", r.unchanged_files},
                      {"gone_files", r.gone_files},
                      {"incremental", r.had_previous},
                      {"duplicate_ids", r.duplicate_ids},
                      {"bad", r.bad},
                      {"lock_files", r.lock_files},
                      {"held_locks", r.held_locks},
                      {"seconds", r.seconds}};
  if (!r.previous_error.empty()) j["previous_error"] = r.previous_error;
  if (r.loss_masks.empty()) {
    j["loss_masks"] = nullptr;
  } else {
    j["loss_masks"] = {{"path", r.loss_masks},
                       {"kept", r.loss_masks_kept},
                       {"by", r.loss_masks_by_id ? "conversation id" : "row"},
                       {"joined", r.loss_masks_joined},
                       {"bad_records", r.loss_masks_bad_records},
                       {"rows", r.loss_masks_rows},
                       {"unused_rows", r.loss_masks_unused_rows}};
  }
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

}  // namespace eaglekit
