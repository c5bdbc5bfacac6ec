// eaglekit verify: decode every record and check every checksum; exit 1 if any is bad.
#include <cstddef>
#include <cstdio>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>

#include "formats/error.h"
#include "lib/pack.h"
#include "lib/progress.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace eaglekit::tools {

int run_verify(int argc, char** argv) {
  VerifyOptions o;
  bool json = false;
  const opt::Groups groups{opt::Group{"Verify",
                                      {opt::field("jobs", "N", o.jobs, "Threads (0: all cores)"),
                                       opt::field("json", "", json, "Print the result as JSON")}}};
  const std::optional<CommandLine> cl = parse_or_help(
      argc, argv, groups, std::string(argv[0]) + " PATH... [OPTIONS]",
      "Decode every record of the given files and folders and check every checksum (.eks: "
      "each block's xxh3; other formats: a full read). Lists the bad records; exit 1 if any.", std::numeric_limits<std::size_t>::max());
  if (!cl) return 0;
  if (cl->positionals.empty()) throw UsageError("at least one PATH is required (see --help)");
  cl->apply();
  o.progress = true;  // redrawn on a terminal, plain lines in a log (lib/progress.h)
  const VerifyResult r = verify_records(cl->positionals, o);
  if (json) {
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
