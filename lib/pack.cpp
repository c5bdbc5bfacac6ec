#include "lib/pack.h"

#include <tbb/parallel_for.h>
#include <tbb/parallel_pipeline.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <unordered_set>

#include "formats/atomic_file.h"
#include "formats/error.h"
#include "formats/format.h"
#include "lib/clock.h"
#include "lib/progress.h"

namespace eaglekit {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::string shard_name(std::int64_t n) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "shard-%06lld.eks", static_cast<long long>(n));
  return buf;
}

// "shard-000042.eks" -> 42.
std::optional<std::int64_t> shard_number(const std::string& name) {
  if (name.size() < 11 || name.compare(0, 6, "shard-") != 0 ||
      name.compare(name.size() - 4, 4, ".eks") != 0)
    return std::nullopt;
  const std::string digits = name.substr(6, name.size() - 10);
  if (digits.empty() || !std::all_of(digits.begin(), digits.end(), ::isdigit)) return std::nullopt;
  return std::stoll(digits);
}

struct ManifestShard {
  std::string file;
  std::uint64_t bytes = 0;
  std::vector<std::string> sources;  // "relative/path#record"
};

struct Manifest {
  std::string codec;
  int level = 0;
  std::vector<ManifestShard> shards;
};

std::optional<Manifest> load_manifest(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return std::nullopt;
  std::ifstream in(path);
  if (!in) throw IoError::from_errno(path, "cannot open", errno);
  Manifest m;
  try {
    const json j = json::parse(in);
    if (j.at("format").get<std::string>() != "eaglekit-pack" || j.at("version").get<int>() != 1)
      throw FormatError(path, std::nullopt, "format", "not an eaglekit pack manifest (version 1)");
    m.codec = j.at("codec").get<std::string>();
    m.level = j.at("level").get<int>();
    for (const auto& s : j.at("shards")) {
      ManifestShard ms;
      ms.file = s.at("file").get<std::string>();
      ms.bytes = s.at("bytes").get<std::uint64_t>();
      ms.sources = s.at("sources").get<std::vector<std::string>>();
      if (!shard_number(ms.file))
        throw FormatError(path, std::nullopt, "shards", "bad shard name '" + ms.file + "'");
      m.shards.push_back(std::move(ms));
    }
  } catch (const json::exception& e) {
    throw FormatError(path, std::nullopt, "manifest", e.what());
  }
  return m;
}

void save_manifest(const std::string& path, const Manifest& m, const PackOptions& o) {
  json j;
  j["format"] = "eaglekit-pack";
  j["version"] = 1;
  j["codec"] = m.codec;
  j["level"] = m.level;
  j["source"] = fs::absolute(o.src).lexically_normal().string();
  j["shards"] = json::array();
  for (const auto& s : m.shards)
    j["shards"].push_back({{"file", s.file}, {"bytes", s.bytes}, {"records", s.sources.size()},
                           {"sources", s.sources}});
  const std::string text = j.dump(1) + "\n";
  write_file_atomic(path, text.data(), text.size());
}

// Exact size of a record's index entry (formats/eks_format.h), to keep shards under the limit.
std::uint64_t index_entry_bytes(const EksRecordEntry& e) {
  std::uint64_t n = 2 + e.conversation_id.size() + 8 + 8 + 8 + 1 + 1;
  for (const auto& t : e.tensors) n += 4 + 8 * t.shape.size() + 4 + 4 + 20 * t.blocks.size();
  return n;
}

bool is_inside(const fs::path& file, const fs::path& dir) {
  const std::string f = file.string(), d = dir.string();
  return f.size() > d.size() && f.compare(0, d.size(), d) == 0 && f[d.size()] == '/';
}

fs::path canonical_or_absolute(const std::string& p) {
  std::error_code ec;
  fs::path c = fs::weakly_canonical(p, ec);
  return ec ? fs::absolute(p).lexically_normal() : c;
}

int concurrency(int jobs) {
  return jobs > 0 ? jobs : static_cast<int>(tbb::this_task_arena::max_concurrency());
}

// Readers of multi-record files shared by the records being packed at once, dropped when
// their last record is done (a pack may see far more files than it can keep mapped).
class ReaderCache {
 public:
  ReaderCache(const std::vector<std::string>& files, const std::vector<std::int64_t>& pending)
      : files_(files) {
    for (auto n : pending) {
      slots_.push_back(std::make_unique<Slot>());
      slots_.back()->remaining = n;
    }
  }
  std::shared_ptr<RecordReader> get(std::size_t f) {
    Slot& s = *slots_[f];
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.reader) s.reader = open_reader(files_[f]);
    return s.reader;
  }
  void done(std::size_t f) {
    Slot& s = *slots_[f];
    std::lock_guard<std::mutex> lock(s.mu);
    if (--s.remaining <= 0) s.reader.reset();
  }

 private:
  struct Slot {
    std::mutex mu;
    std::shared_ptr<RecordReader> reader;
    std::int64_t remaining = 0;
  };
  const std::vector<std::string>& files_;
  std::vector<std::unique_ptr<Slot>> slots_;
};

struct Item {
  std::size_t file = 0;
  std::int64_t record = 0;
  std::string key;
};

struct Work {
  const Item* item = nullptr;
  std::optional<EksEncodedRecord> rec;
  std::optional<BadRecord> bad;
  std::exception_ptr error;
};

}  // namespace

PackResult pack_records(const PackOptions& o) {
  const auto start = std::chrono::steady_clock::now();
  check_eks_options(o.encode);
  if (o.shard_bytes == 0) throw UsageError("--shard-size must be positive");
  if (o.jobs < 0) throw UsageError("--jobs must be >= 0");
  if (o.out_dir.empty()) throw UsageError("--out is required");
  std::error_code ec;
  if (!fs::exists(o.src, ec)) throw IoError(o.src + ": no such file or directory");
  fs::create_directories(o.out_dir, ec);
  if (ec) throw IoError::from_errno(o.out_dir, "cannot create folder", ec.value());

  PackResult result;
  const std::string manifest_path = (fs::path(o.out_dir) / kPackManifestName).string();
  const std::string codec_name(eks_codec_name(o.encode.codec));
  Manifest manifest;
  manifest.codec = codec_name;
  manifest.level = o.encode.level;
  std::unordered_set<std::string> done;
  std::int64_t next_shard = 0;
  if (auto old = load_manifest(manifest_path)) {
    if (old->codec != codec_name)
      throw UsageError(o.out_dir + " holds shards packed with codec " + old->codec +
                       "; rerun with --codec " + old->codec + " or pack into another --out");
    manifest.level = old->level;
    for (auto& s : old->shards) {
      next_shard = std::max(next_shard, *shard_number(s.file) + 1);
      const fs::path p = fs::path(o.out_dir) / s.file;
      // A listed shard that is gone or changed no longer counts: its records are packed again.
      if (!fs::is_regular_file(p, ec) || fs::file_size(p, ec) != s.bytes) continue;
      for (const auto& k : s.sources) done.insert(k);
      manifest.shards.push_back(std::move(s));
    }
  }
  // Temp files of a killed earlier pack (dead writers only; a live one's stay).
  remove_stale_temp_files(o.out_dir, [](const std::string& name) {
    return name.rfind("shard-", 0) == 0 || name == kPackManifestName;
  });

  // Sources, minus anything inside the output folder.
  const fs::path out_canon = canonical_or_absolute(o.out_dir);
  const bool src_is_dir = fs::is_directory(o.src, ec);
  std::string src_dir = src_is_dir ? o.src : fs::path(o.src).parent_path().string();
  if (src_dir.empty()) src_dir = ".";
  const fs::path src_root = canonical_or_absolute(src_dir);
  std::vector<std::string> files;
  for (auto& f : find_record_files(o.src))
    if (!is_inside(canonical_or_absolute(f), out_canon)) files.push_back(f);
  result.source_files = static_cast<std::int64_t>(files.size());

  tbb::task_arena arena(concurrency(o.jobs));
  std::vector<std::int64_t> counts(files.size(), 0);
  std::vector<FileFacts> facts(files.size());  // what each file states for all its records
  std::vector<std::optional<BadRecord>> open_errors(files.size());
  std::vector<std::exception_ptr> open_exceptions(files.size());
  arena.execute([&] {
    tbb::parallel_for(std::size_t{0}, files.size(), [&](std::size_t i) {
      try {
        const auto reader = open_reader(files[i]);
        counts[i] = static_cast<std::int64_t>(reader->size());
        facts[i] = reader->facts();
      } catch (const Error& e) {
        open_errors[i] = BadRecord{files[i], -1, "", e.what()};
        open_exceptions[i] = std::current_exception();
      }
    });
  });

  std::vector<Item> items;
  std::vector<std::int64_t> pending(files.size(), 0);
  for (std::size_t f = 0; f < files.size(); ++f) {
    if (open_errors[f]) {
      if (!o.skip_bad) std::rethrow_exception(open_exceptions[f]);
      result.bad.push_back(*open_errors[f]);
      continue;
    }
    const std::string rel = canonical_or_absolute(files[f]).lexically_relative(src_root).string();
    for (std::int64_t r = 0; r < counts[f]; ++r) {
      std::string key = rel + "#" + std::to_string(r);
      if (done.count(key)) {
        ++result.already_packed;
        continue;
      }
      items.push_back(Item{f, r, std::move(key)});
      ++pending[f];
    }
  }

  ReaderCache readers(files, pending);
  Progress progress("pack", static_cast<std::int64_t>(items.size()), o.progress ? -1 : 0);
  std::unique_ptr<EksWriter> writer;
  std::vector<std::string> current_sources;
  std::uint64_t current_index_bytes = 0;
  const FileFacts* current_facts = nullptr;  // the open shard's: one set of facts a shard

  auto finish_shard = [&] {
    writer->finish();
    const std::string name = fs::path(writer->path()).filename().string();
    const std::uint64_t bytes = fs::file_size(writer->path());
    manifest.shards.push_back(ManifestShard{name, bytes, std::move(current_sources)});
    save_manifest(manifest_path, manifest, o);
    result.shards.push_back(writer->path());
    result.bytes_out += bytes;
    ++result.shards_written;
    writer.reset();
    current_sources.clear();
    current_index_bytes = 0;
    ++next_shard;
  };

  std::size_t next_item = 0;
  const std::size_t live = static_cast<std::size_t>(2 * concurrency(o.jobs));
  arena.execute([&] {
    tbb::parallel_pipeline(
        live,
        tbb::make_filter<void, std::size_t>(
            tbb::filter_mode::serial_in_order,
            [&](tbb::flow_control& fc) -> std::size_t {
              if (next_item == items.size()) {
                fc.stop();
                return 0;
              }
              return next_item++;
            }) &
            tbb::make_filter<std::size_t, std::shared_ptr<Work>>(
                tbb::filter_mode::parallel,
                [&](std::size_t k) {
                  auto w = std::make_shared<Work>();
                  const Item& it = items[k];
                  w->item = &it;
                  const std::string& path = files[it.file];
                  try {
                    Record r;
                    try {
                      r = readers.get(it.file)->read(static_cast<std::size_t>(it.record));
                    } catch (const Error& e) {
                      w->bad = BadRecord{path, it.record, "", e.what()};
                      w->error = std::current_exception();
                    }
                    if (!w->bad) {
                      try {
                        w->rec = encode_eks_record(r, o.encode);
                      } catch (const FormatError& e) {
                        // Record::check names the conversation; add where it came from.
                        FormatError named(path, std::nullopt, "record " + std::to_string(it.record),
                                          e.what());
                        w->bad = BadRecord{path, it.record, r.conversation_id, named.what()};
                        w->error = std::make_exception_ptr(named);
                      }
                    }
                  } catch (...) {
                    readers.done(it.file);
                    throw;
                  }
                  readers.done(it.file);
                  return w;
                }) &
            tbb::make_filter<std::shared_ptr<Work>, void>(
                tbb::filter_mode::serial_in_order, [&](std::shared_ptr<Work> w) {
                  if (w->bad) {
                    if (!o.skip_bad) std::rethrow_exception(w->error);
                    result.bad.push_back(std::move(*w->bad));
                    progress.add(1);
                    return;
                  }
                  EksEncodedRecord& rec = *w->rec;
                  const std::uint64_t entry_bytes = index_entry_bytes(rec.entry);
                  const FileFacts& item_facts = facts[w->item->file];
                  // A shard states its sources' facts (aux layer ids, a target vocabulary),
                  // so records of files stating other facts start a new shard.
                  if (writer && writer->size() > 0 &&
                      (*current_facts != item_facts ||
                       writer->bytes_written() + rec.data.size() + current_index_bytes + entry_bytes + 4 +
                               kEksTrailerSize >
                           o.shard_bytes))
                    finish_shard();
                  if (!writer) {
                    writer = std::make_unique<EksWriter>(
                        (fs::path(o.out_dir) / shard_name(next_shard)).string(), o.encode);
                    writer->set_facts(item_facts);
                    current_facts = &item_facts;
                  }
                  const std::uint64_t raw = rec.raw_bytes;
                  writer->add_encoded(std::move(rec));
                  current_sources.push_back(w->item->key);
                  current_index_bytes += entry_bytes;
                  ++result.records;
                  result.bytes_in += raw;
                  progress.add(1, static_cast<std::int64_t>(raw));
                }));
  });
  if (writer && writer->size() > 0) finish_shard();
  save_manifest(manifest_path, manifest, o);  // also when nothing was left to pack
  progress.finish();
  result.shards_total = static_cast<std::int64_t>(manifest.shards.size());
  result.seconds =
      seconds_since(start);
  return result;
}

VerifyResult verify_records(const std::vector<std::string>& paths, const VerifyOptions& o) {
  const auto start = std::chrono::steady_clock::now();
  if (o.jobs < 0) throw UsageError("--jobs must be >= 0");
  std::vector<std::string> files;
  for (const auto& p : paths) {
    std::error_code ec;
    if (!fs::exists(p, ec)) throw IoError(p + ": no such file or directory");
    for (auto& f : find_record_files(p)) files.push_back(std::move(f));
  }
  std::sort(files.begin(), files.end());
  files.erase(std::unique(files.begin(), files.end()), files.end());

  VerifyResult result;
  result.files = static_cast<std::int64_t>(files.size());
  std::mutex mu;
  std::atomic<std::int64_t> records{0};
  std::atomic<std::uint64_t> bytes{0};
  Progress progress("verify", static_cast<std::int64_t>(files.size()), o.progress ? -1 : 0);
  auto add_bad = [&](BadRecord b) {
    std::lock_guard<std::mutex> lock(mu);
    result.bad.push_back(std::move(b));
  };
  tbb::task_arena arena(concurrency(o.jobs));
  arena.execute([&] {
    tbb::parallel_for(std::size_t{0}, files.size(), [&](std::size_t f) {
      std::unique_ptr<RecordReader> reader;
      try {
        reader = open_reader(files[f]);
      } catch (const Error& e) {
        add_bad(BadRecord{files[f], -1, "", e.what()});
        progress.add(1);
        return;
      }
      const auto* eks = dynamic_cast<const EksReader*>(reader.get());
      std::atomic<std::uint64_t> file_bytes{0};
      tbb::parallel_for(std::size_t{0}, reader->size(), [&](std::size_t i) {
        ++records;
        std::string id;
        try {
          id = reader->info(i).conversation_id;
          std::uint64_t n = 0;
          if (eks != nullptr) {
            eks->verify_record(i);
            for (const auto& t : eks->entry(i).tensors)
              n += static_cast<std::uint64_t>(t.shape[0]) * t.row_bytes();
          } else {
            const Record r = reader->read(i);
            n = r.input_ids.nbytes() + (r.target_probs ? r.target_probs->nbytes() : r.hidden_states.nbytes()) +
                r.aux_hidden_states.nbytes() + (r.loss_mask ? r.loss_mask->nbytes() : 0);
          }
          file_bytes += n;
        } catch (const Error& e) {
          add_bad(BadRecord{files[f], static_cast<std::int64_t>(i), id, e.what()});
        }
      });
      bytes += file_bytes;
      progress.add(1, static_cast<std::int64_t>(file_bytes.load()));
    });
  });
  progress.finish();
  std::sort(result.bad.begin(), result.bad.end(), [](const BadRecord& a, const BadRecord& b) {
    return a.path != b.path ? a.path < b.path : a.record < b.record;
  });
  result.records = records;
  result.bytes = bytes;
  result.seconds =
      seconds_since(start);
  return result;
}

}  // namespace eaglekit
