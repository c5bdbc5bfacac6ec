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
};

std::vector<Record> read_unit(const Unit& u, const LossMasks* masks) {
  std::shared_ptr<const RecordReader> reader = u.reader;
  if (!reader) reader = open_reader(u.path);
  std::vector<Record> out;
  if (u.record) {
    out.push_back(reader->read(*u.record));
  } else {
    for (std::size_t i = 0; i < reader->size(); ++i) out.push_back(reader->read(i));
  }
  // The form the source's layout implies is stated in the output, whose layout implies none.
  for (Record& r : out) {
    // No writer has a field for a stored target distribution (NeMo's cache), and every
    // output format's readers and the trainer take a record without hidden states for
    // one with them: refused rather than written without its target.
    if (r.target_probs)
      throw UnsupportedError(u.path, std::nullopt, "conversation " + r.conversation_id + " target_probs",
                             "the record stores the target's distribution over the draft vocabulary instead of a "
                             "last hidden state (NeMo AutoModel's EAGLE-3 cache), and no output format carries "
                             "that; train on the cache where it is (eaglekit train reads it directly)");
    r.hidden_states_prenorm = r.known_prenorm();
    if (masks) masks->apply(r, u.path);
  }
  return out;
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
      units.push_back({f, nullptr, std::nullopt});
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
      units.push_back({rs.path, reader, *i});
      src_single_record = true;
    } else {
      for (std::size_t i = 0; i < reader->size(); ++i) units.push_back({rs.path, reader, i});
      src_single_record = reader->size() == 1;
      if (units.empty()) throw Error(rs.path + ": holds no records");
    }
    if (fs::exists(dst, ec) && fs::equivalent(rs.path, dst, ec))
      throw UsageError("DST " + dst + " is the source file; write elsewhere");
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
  if (res.folder_output) {
    fs::create_directories(dst, ec);
    if (ec) throw IoError::from_errno(dst, "cannot create folder", ec.value());
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

  if (res.folder_output) {
    std::mutex mu;
    std::set<std::string> names;  // output file names taken (duplicate ids collide)
    arena.execute([&] {
      tbb::parallel_for(tbb::blocked_range<std::size_t>(0, units.size(), 1),
                        [&](const tbb::blocked_range<std::size_t>& range) {
        for (std::size_t u = range.begin(); u != range.end(); ++u) {
          for (const Record& r : read_unit(units[u], masks.get())) {
            const std::string name = file_stem(r.conversation_id) + ext;
            {
              std::lock_guard<std::mutex> lock(mu);
              if (!names.insert(name).second)
                throw Error("two records have conversation id '" + r.conversation_id +
                            "' (the second in " + units[u].path + "); a folder output names "
                            "files by id, so ids must be unique");
            }
            const std::string out = (fs::path(dst) / name).string();
            auto w = create_writer(out, wo);
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
    // Read a batch in parallel (decoding may be the costly part), then add in order.
    const std::size_t batch = static_cast<std::size_t>(4 * std::max(1, arena.max_concurrency()));
    for (std::size_t b = 0; b < units.size(); b += batch) {
      const std::size_t e = std::min(units.size(), b + batch);
      std::vector<std::vector<Record>> got(e - b);
      arena.execute([&] {
        tbb::parallel_for(tbb::blocked_range<std::size_t>(b, e, 1),
                          [&](const tbb::blocked_range<std::size_t>& range) {
          for (std::size_t u = range.begin(); u != range.end(); ++u) got[u - b] = read_unit(units[u], masks.get());
        });
      });
      for (std::size_t u = b; u < e; ++u) {
        for (const Record& r : got[u - b]) {
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
  res.seconds = seconds_since(start);
  return res;
}

}  // namespace eaglekit
