// eaglekit pack: every record below a folder into compressed .eks shards (lib/pack.h).
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "formats/eks_format.h"
#include "formats/error.h"
#include "lib/pack.h"
#include "lib/progress.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace eaglekit::tools {

int run_pack(int argc, char** argv) {
  PackOptions o;
  std::string shard_size = "1GiB", block_size = "256KiB";  // PackOptions' and EksEncodeOptions' defaults
  bool json = false;
  using opt::field;
  const opt::Groups groups{opt::Group{
      "Pack",
      {field("out", "DIR", o.out_dir, "Output folder"),
       field("shard_size", "SIZE", shard_size, "Close a shard before it passes this size (e.g. 1GiB, 512MiB)"),
       opt::choice_of("codec", o.encode.codec, kEksCodecNames,
                      "zstd (lossless) or fp8 (lossy hidden/aux states: e4m3, one scale per token)"),
       field("level", "N", o.encode.level, "zstd level (1..22)"),
       field("block_size", "SIZE", block_size, "Decoded bytes per compressed block (prefix reads decode whole blocks)"),
       field("jobs", "N", o.jobs, "Threads (0: all cores)"),
       field("skip_bad", "", o.skip_bad, "Leave out records that cannot be read (listed) instead of stopping"),
       field("json", "", json, "Print the summary as JSON")}}};
  const std::optional<CommandLine> cl = parse_or_help(
      argc, argv, groups, std::string(argv[0]) + " SRC_DIR --out OUT_DIR [OPTIONS]",
      "Pack every record below SRC_DIR (any supported format) into .eks shards "
      "OUT_DIR/shard-NNNNNN.eks, in source-path order; each shard keeps what its sources state "
      "(a cache's aux layer ids and target vocabulary), so files stating other facts go to other shards. "
      "Rerun after an interruption to "
      "continue where it stopped (OUT_DIR/pack-manifest.json lists the finished shards).", 1);
  if (!cl) return 0;
  if (cl->positionals.empty()) throw UsageError("SRC_DIR is required (see --help)");
  if (!cl->given("out")) throw UsageError("--out is required (see --help)");
  cl->apply();
  o.src = cl->positionals[0];
  const std::int64_t shard = parse_bytes(shard_size);
  if (shard <= 0) throw UsageError("--shard-size must be positive");
  o.shard_bytes = static_cast<std::uint64_t>(shard);
  const std::int64_t block = parse_bytes(block_size);
  if (block <= 0) throw UsageError("--block-size must be positive");
  o.encode.block_bytes = static_cast<std::size_t>(block);
  o.progress = true;  // redrawn on a terminal, plain lines in a log (lib/progress.h)
  const std::string codec(eks_codec_name(o.encode.codec));

  const PackResult r = pack_records(o);
  if (json) {
    nlohmann::json j;
    j["records"] = r.records;
    j["already_packed"] = r.already_packed;
    j["source_files"] = r.source_files;
    j["shards_written"] = r.shards_written;
    j["shards_total"] = r.shards_total;
    j["bytes_in"] = r.bytes_in;
    j["bytes_out"] = r.bytes_out;
    j["ratio"] = r.ratio();
    j["seconds"] = r.seconds;
    j["bytes_per_second"] = r.bytes_per_second();
    j["codec"] = codec;
    j["shards"] = r.shards;
    j["skipped"] = nlohmann::json::array();
    for (const auto& b : r.bad)
      j["skipped"].push_back({{"path", b.path}, {"record", b.record}, {"error", b.error}});
    std::cout << j.dump(2) << "\n";
  } else {
    char line[512];
    std::snprintf(line, sizeof line,
                  "packed %lld records (%lld already packed) from %lld files into %lld new "
                  "shards (%lld in all)\n"
                  "bytes in %s, out %s, ratio %.3f (%.1f%% smaller), %.1f s, %s/s\n",
                  static_cast<long long>(r.records), static_cast<long long>(r.already_packed),
                  static_cast<long long>(r.source_files),
                  static_cast<long long>(r.shards_written),
                  static_cast<long long>(r.shards_total),
                  human_bytes(static_cast<double>(r.bytes_in)).c_str(),
                  human_bytes(static_cast<double>(r.bytes_out)).c_str(), r.ratio(),
                  r.bytes_in ? 100.0 * (1.0 - r.ratio()) : 0.0, r.seconds,
                  human_bytes(r.bytes_per_second()).c_str());
    std::cout << line;
    for (const auto& b : r.bad) std::cout << "skipped: " << b.error << "\n";
  }
  return 0;
}

}  // namespace eaglekit::tools
