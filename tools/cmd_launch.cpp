// eaglekit launch: run N local ranks of a distributed job with the torchrun variables set
// (for users without torchrun). `eaglekit launch --nproc 4 -- train --cp 2 ...`.
#include <unistd.h>

#include <cxxopts.hpp>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "formats/error.h"
#include "tools/cli.h"
#include "tools/commands.h"
#include "trainer/distributed.h"

namespace eaglekit::tools {

int run_launch(int argc, char** argv) {
  // Everything after "--" is the command; cxxopts only sees what comes before.
  int split = argc;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--") {
      split = i;
      break;
    }
  }
  cxxopts::Options options(
      argv[0],
      "Run NPROC local processes of one distributed job, like `torchrun --no-python "
      "--nproc-per-node NPROC`: each gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, "
      "MASTER_ADDR and MASTER_PORT; the launcher hosts the rendezvous store. SIGINT/SIGTERM "
      "are forwarded to every rank; when one rank fails the others are stopped, and the exit "
      "code is the failed rank's.\n\nCOMMAND is an eaglekit command (train, evaluate, ...) "
      "or a program.");
  options.positional_help("-- COMMAND [ARGS...]");
  options.add_options()("nproc", "Processes to start", cxxopts::value<int>())
      ("master-addr", "Address of the rendezvous store", cxxopts::value<std::string>()->default_value("127.0.0.1"))
      ("master-port", "Port of the rendezvous store (0: a free one)", cxxopts::value<int>()->default_value("0"))
      ("log-dir", "Write rank i's output to DIR/rank_i.log instead of the terminal", cxxopts::value<std::string>())
      ("stop-grace", "Seconds the other ranks get to exit on their own after one fails",
       cxxopts::value<double>()->default_value("0"))
      ("timeout", "Stop the whole job after this many seconds (0: never)", cxxopts::value<double>()->default_value("0"))
      ("json", "Print each rank's exit code as JSON at the end");
  const auto args = parse_args(options, split, argv);
  if (!args) return 0;
  if (!args->count("nproc")) throw UsageError("--nproc is required (see --help)");
  if (split + 1 >= argc) throw UsageError("nothing to launch: give the command after -- (see --help)");

  dist::LaunchOptions o;
  o.nproc = (*args)["nproc"].as<int>();
  o.master_addr = (*args)["master-addr"].as<std::string>();
  o.master_port = (*args)["master-port"].as<int>();
  if (args->count("log-dir")) o.log_dir = (*args)["log-dir"].as<std::string>();
  const double grace = (*args)["stop-grace"].as<double>(), limit = (*args)["timeout"].as<double>();
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
  if (args->count("json")) {
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
