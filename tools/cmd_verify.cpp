// eaglekit verify: decode every record and check every checksum; exit 1 if any is bad.
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

int run_verify(int argc, char** argv) {
  cxxopts::Options options(
      argv[0],
      "Decode every record of the given files and folders and check every checksum (.eks: "
      "each block's xxh3; other formats: a full read). Lists the bad records; exit 1 if any.");
  options.positional_help("PATH...");
  options.add_options()("paths", "Files or folders", cxxopts::value<std::vector<std::string>>())
      ("jobs", "Threads (0: all cores)", cxxopts::value<int>()->default_value("0"))
      ("json", "Print the result as JSON");
  options.parse_positional({"paths"});
  const auto args = parse_args(options, argc, argv);
  if (!args) return 0;
  if (!args->count("paths")) throw UsageError("at least one PATH is required (see --help)");

  VerifyOptions o;
  o.jobs = (*args)["jobs"].as<int>();
  o.progress = stderr_is_tty();
  const VerifyResult r = verify_records((*args)["paths"].as<std::vector<std::string>>(), o);
  if (args->count("json")) {
    nlohmann::json j;
    j["ok"] = r.ok();
    j["files"] = r.files;
    j["records"] = r.records;
    j["bytes"] = r.bytes;
    j["seconds"] = r.seconds;
    j["bad"] = nlohmann::json::array();
    for (const auto& b : r.bad)
      j["bad"].push_back({{"path", b.path},
                          {"record", b.record},
                          {"conversation_id", b.conversation_id},
                          {"error", b.error}});
    std::cout << j.dump(2) << "\n";
  } else {
    for (const auto& b : r.bad) std::cout << "BAD " << b.error << "\n";
    char line[256];
    std::snprintf(line, sizeof line, "%s: %lld files, %lld records, %zu bad, %s decoded in %.1f s\n",
                  r.ok() ? "ok" : "FAILED", static_cast<long long>(r.files),
                  static_cast<long long>(r.records), r.bad.size(),
                  human_bytes(static_cast<double>(r.bytes)).c_str(), r.seconds);
    std::cout << line;
  }
  return r.ok() ? 0 : 1;
}

}  // namespace eaglekit::tools
