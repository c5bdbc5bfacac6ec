// eaglekit launch: run N local ranks of a distributed job with the torchrun variables set
// (for users without torchrun). `eaglekit launch --nproc 4 -- train --cp 2 ...`.
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "formats/error.h"
#include "tools/cli.h"
#include "tools/commands.h"
#include "trainer/parallel/distributed.h"

namespace eaglekit::tools {

int run_launch(int argc, char** argv) {
  // Everything after "--" is the command; the option table only sees what comes before.
  int split = argc;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--") {
      split = i;
      break;
    }
  }
  dist::LaunchOptions o;
  double grace = 0, limit = 0;
  bool json = false;
  using opt::field;
  const opt::Groups groups{opt::Group{
      "Launch",
      {opt::required(field("nproc", "N", o.nproc, "Processes to start")),
       field("master_addr", "ADDR", o.master_addr, "Address of the rendezvous store"),
       field("master_port", "PORT", o.master_port, "Port of the rendezvous store (0: a free one)"),
       field("log_dir", "DIR", o.log_dir, "Write rank i's output to DIR/rank_i.log instead of the terminal"),
       field("stop_grace", "SECONDS", grace, "Seconds the other ranks get to exit on their own after one fails"),
       field("timeout", "SECONDS", limit, "Stop the whole job after this many seconds (0: never)"),
       field("json", "", json, "Print each rank's exit code as JSON at the end")}}};
  const std::optional<CommandLine> cl = parse_or_help(
      split, argv, groups, std::string(argv[0]) + " --nproc N [OPTIONS] -- COMMAND [ARGS...]",
      "Run NPROC local processes of one distributed job, like `torchrun --no-python "
      "--nproc-per-node NPROC`: each gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, "
      "MASTER_ADDR and MASTER_PORT; the launcher hosts the rendezvous store. SIGINT/SIGTERM "
      "are forwarded to every rank; when one rank fails the others are stopped, and the exit "
      "code is the failed rank's (3 when the ranks were interrupted and saved a checkpoint). COMMAND is an eaglekit command (train, evaluate, ...) or a "
      "program.");
  if (!cl) return 0;
  if (!cl->given("nproc")) throw UsageError("--nproc is required (see --help)");
  if (split + 1 >= argc) throw UsageError("nothing to launch: give the command after -- (see --help)");
  cl->apply();
  if (grace < 0 || limit < 0) throw UsageError("--stop-grace and --timeout must not be negative");
  o.stop_grace = std::chrono::milliseconds(static_cast<std::int64_t>(grace * 1000));
  o.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(limit * 1000));
  o.argv.assign(argv + split + 1, argv + argc);
  const std::string& first = o.argv.front();
  for (const auto& c : commands()) {
    if (first == c.name) {
      o.argv.insert(o.argv.begin(), own_executable());
      break;
    }
  }

  const dist::LaunchResult r = dist::launch_local(o);
  if (json) {
    nlohmann::json j;
    j["exit_code"] = r.exit_code;
    j["first_failed"] = r.first_failed;
    j["timed_out"] = r.timed_out;
    j["ranks"] = nlohmann::json::array();
    for (const auto& re : r.ranks)
      j["ranks"].push_back({{"rank", re.rank}, {"exit_code", re.exit_code}, {"stopped", re.stopped}});
    std::cout << j.dump(2) << "\n";
  }
  return r.exit_code;
}

}  // namespace eaglekit::tools
