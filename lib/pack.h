// Packing record files of any format into .eks shards (`eaglekit pack`) and checking
// record files (`eaglekit verify`).
//
// pack: every record below a folder, in a fixed order (source files sorted by path, then
// record number), compressed in parallel (TBB) and appended in that order to shards
// OUT/shard-000000.eks, shard-000001.eks, ... of about shard_bytes each; a shard states the
// file facts (formats/format.h FileFacts) of its sources, and records of a file stating
// other facts start the next shard. After each shard
// is renamed into place, OUT/pack-manifest.json (written atomically) lists the finished
// shards and the source records ("relative/path#record") inside each. A rerun reads the
// manifest and packs only the records not yet in a finished shard, numbering new shards
// after the finished ones; so a pack killed at any point and rerun ends with the same
// shards as one uninterrupted run, and a half-written shard (a temp file) never counts.
// One pack at a time per output folder.
//
// Thread safety: each call is independent; they use TBB internally.
// Errors: UsageError (bad options, an output folder packed with another codec), IoError,
// FormatError (a bad source record, unless skip_bad).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "formats/eks_format.h"

namespace eaglekit {

inline constexpr const char* kPackManifestName = "pack-manifest.json";

// A record (or whole file, record == -1) that could not be read.
struct BadRecord {
  std::string path;
  std::int64_t record = -1;
  std::string conversation_id;  // when known
  std::string error;
};

struct PackOptions {
  std::string src;                           // folder searched recursively, or one file
  std::string out_dir;                       // created if missing
  std::uint64_t shard_bytes = 1ull << 30;    // a shard is closed before it would pass this
  EksEncodeOptions encode;                   // codec, zstd level, block size
  int jobs = 0;                              // threads; 0 = all cores
  bool skip_bad = false;                     // leave unreadable records out (listed) instead of failing
  bool progress = false;                     // progress on stderr (lib/progress.h)
};

struct PackResult {
  std::int64_t records = 0;             // packed by this run
  std::int64_t already_packed = 0;      // found in finished shards of an earlier run
  std::int64_t source_files = 0;
  std::int64_t shards_written = 0;      // by this run
  std::int64_t shards_total = 0;        // finished shards in out_dir now
  std::uint64_t bytes_in = 0;           // decoded tensor bytes of the records packed
  std::uint64_t bytes_out = 0;          // shard bytes written by this run
  double seconds = 0;
  std::vector<std::string> shards;      // paths written by this run
  std::vector<BadRecord> bad;           // left out (skip_bad)

  double ratio() const { return bytes_in ? static_cast<double>(bytes_out) / bytes_in : 0.0; }
  double bytes_per_second() const { return seconds > 0 ? bytes_in / seconds : 0.0; }
};

// Throws UsageError for a bad option (before touching the output folder).
PackResult pack_records(const PackOptions& options);

struct VerifyOptions {
  int jobs = 0;           // threads; 0 = all cores
  bool progress = false;
};

struct VerifyResult {
  std::int64_t files = 0;
  std::int64_t records = 0;        // records checked
  std::uint64_t bytes = 0;         // decoded bytes of the good records
  double seconds = 0;
  std::vector<BadRecord> bad;      // sorted by path, then record

  bool ok() const { return bad.empty(); }
};

// Decodes every record of every file given (folders are searched like pack's source) and
// checks every checksum (.eks: every block's xxh3, whatever the read options; other
// formats: a full read). Bad files and records are collected, not thrown; IoError only
// when a path does not exist.
VerifyResult verify_records(const std::vector<std::string>& paths, const VerifyOptions& options);

}  // namespace eaglekit
