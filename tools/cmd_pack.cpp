// eaglekit pack: every record below a folder into compressed .eks shards (lib/pack.h).
#include <cxxopts.hpp>

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "formats/error.h"
#include "lib/pack.h"
#include "lib/progress.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace eaglekit::tools {

int run_pack(int argc, char** argv) {
  cxxopts::Options options(
      argv[0],
      "Pack every record below SRC_DIR (any supported format) into .eks shards "
      "OUT_DIR/shard-NNNNNN.eks, in source-path order. Rerun after an interruption to "
      "continue where it stopped (OUT_DIR/pack-manifest.json lists the finished shards).");
  options.positional_help("SRC_DIR");
  options.add_options()("src", "Folder (or file) of records", cxxopts::value<std::string>())
      ("out", "Output folder", cxxopts::value<std::string>())
      ("shard-size", "Close a shard before it passes this size (e.g. 1GiB, 512MiB)",
       cxxopts::value<std::string>()->default_value("1GiB"))
      ("codec", "zstd (lossless) or fp8 (lossy hidden/aux states: e4m3, one scale per token)",
       cxxopts::value<std::string>()->default_value("zstd"))
      ("level", "zstd level (1..22)", cxxopts::value<int>()->default_value("3"))
      ("block-size", "Decoded bytes per compressed block (prefix reads decode whole blocks)",
       cxxopts::value<std::string>()->default_value("256KiB"))
      ("jobs", "Threads (0: all cores)", cxxopts::value<int>()->default_value("0"))
      ("skip-bad", "Leave out records that cannot be read (listed) instead of stopping")
      ("json", "Print the summary as JSON");
  options.parse_positional({"src"});
  const auto args = parse_args(options, argc, argv);
  if (!args) return 0;
  if (!args->count("src")) throw UsageError("SRC_DIR is required (see --help)");
  if (!args->count("out")) throw UsageError("--out is required (see --help)");

  PackOptions o;
  o.src = (*args)["src"].as<std::string>();
  o.out_dir = (*args)["out"].as<std::string>();
  const std::int64_t shard = parse_bytes((*args)["shard-size"].as<std::string>());
  if (shard <= 0) throw UsageError("--shard-size must be positive");
  o.shard_bytes = static_cast<std::uint64_t>(shard);
  const std::string codec = (*args)["codec"].as<std::string>();
  const auto c = parse_eks_codec(codec);
  if (!c) throw UsageError("--codec must be zstd or fp8, not '" + codec + "'");
  o.encode.codec = *c;
  o.encode.level = (*args)["level"].as<int>();
  const std::int64_t block = parse_bytes((*args)["block-size"].as<std::string>());
  if (block <= 0) throw UsageError("--block-size must be positive");
  o.encode.block_bytes = static_cast<std::size_t>(block);
  o.jobs = (*args)["jobs"].as<int>();
  o.skip_bad = args->count("skip-bad") > 0;
  o.progress = stderr_is_tty();

  const PackResult r = pack_records(o);
  if (args->count("json")) {
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
