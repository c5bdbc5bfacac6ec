// Shared plumbing of the CLI: the command table that drives both dispatch and help, and
// command lines parsed against option tables (lib/options.h) into values, help and UsageError.
// Internal to tools/; each subcommand lives in tools/cmd_NAME.cpp and only parses options,
// calls one library function and prints.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "lib/data_options.h"
#include "lib/options.h"
#include "lib/validate.h"
#include "trainer/run/options.h"

namespace eaglekit {
class Loader;
}  // namespace eaglekit

namespace eaglekit::tools {

struct Command {
  const char* name;
  const char* summary;
  int (*run)(int argc, char** argv);  // argv[0] is "eaglekit NAME"; nullptr: in eaglekit-torch
};

// The single table (tools/main.cpp).
const std::vector<Command>& commands();

// Set by --verbose on the main command line: print error detail on failure.
extern bool g_verbose;

// True when stderr is a terminal (progress bars only then).
bool stderr_is_tty();

// The path of the running executable (/proc/self/exe), for finding its siblings.
std::string own_executable();

// --- commands driven by option tables (lib/options.h) ----------------------------------

// What a command line gave, checked against the tables: each value is known to belong to
// an option, not yet converted (apply() does, after --config).
struct CommandLine {
  bool help = false;
  std::vector<std::string> positionals;
  std::vector<std::pair<const opt::Option*, std::string>> values;  // in command-line order

  bool given(std::string_view key) const;
  // Before apply(): a value given for the choice `key` that is none of its spellings throws
  // UsageError(message(value)) instead of the table's "--KEY must be A or B, not 'X'", for
  // a command whose error text predates the tables.
  void check_choice(std::string_view key, const std::function<std::string(const std::string& value)>& message) const;
  // Sets every given value. When a --config FILE was given and `on_config` is set, calls
  // it first with the path, so that flags win over the file. Throws UsageError for a value
  // that does not parse.
  void apply(const std::function<void(const std::string& path)>& on_config = {}) const;
};

// Parses argv (argv[0] is "eaglekit NAME") against `groups`, plus -h/--help: `--flag
// VALUE`, `--flag=VALUE`, `-f VALUE` / `-fVALUE` for a row with a short flag, `--flag` /
// `--no-flag` for booleans, `--resume [DIR]` for an optional value, and up to
// `max_positionals` positionals; after `--` everything is a positional. Throws UsageError for an
// unknown flag (naming the new spelling of an old one), a missing value, or too many
// positionals.
CommandLine parse_command_line(int argc, char** argv, const opt::Groups& groups, std::size_t max_positionals = 0);

// parse_command_line, and for --help the help text on stdout and nullopt (exit 0).
std::optional<CommandLine> parse_or_help(int argc, char** argv, const opt::Groups& groups, const std::string& usage,
                                         const std::string& description, std::size_t max_positionals = 0);

// `usage` (after "usage: "), the description, then every group's options: flag, metavar,
// help, and the default read from the bound field (or its note), or "(required)".
std::string help_text(const std::string& usage, const std::string& description, const opt::Groups& groups);

// --- what the loader-driven commands share (collate, loader-bench) ----------------------

// Their options: the data and batch groups plus the loader's own knobs. Shuffling is off
// by default here (reference order, for comparing batches); train shuffles by default.
struct LoaderJob : DataSelection, BatchOptions {
  std::int64_t batches = -1;  // stop after N batches, into later epochs; < 0: one epoch
  int rank = 0, world_size = 1;
  std::int64_t first_token = 0, last_token = -1;
  int cp_rank = 0, cp_size = 1;
  std::string resume;  // sampler state JSON, or a file holding it
  bool strict = false;
  LoaderJob() { shuffle = false; }
  opt::Groups groups();
};

// The loader the job describes (tools/cmd_collate.cpp); `summary` says what matched.
std::unique_ptr<Loader> open_loader(const LoaderJob& job, std::string& summary);

// --- validate, whose --base part runs in eaglekit-torch ---------------------------------

struct ValidateCli {
  DataSelection data;
  ValidateOptions options;
  bool json = false;
  // validate --base: the semantic check (trainer/run/semantic_check.h).
  std::string base;
  std::int64_t positions = 32;
  std::string device = "cpu";
  trainer::HiddenStatesNorm hidden_states_norm = trainer::HiddenStatesNorm::kAuto;
  opt::Groups groups();
};

// --timeout SECONDS as the bound on a rendezvous and every collective.
std::chrono::milliseconds collective_timeout(double seconds);

}  // namespace eaglekit::tools
