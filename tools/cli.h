// Shared plumbing of the CLI: the command table that drives both dispatch and help,
// argument parsing that turns cxxopts failures into UsageError, and JSON printing.
// Internal to tools/; each subcommand lives in tools/cmd_NAME.cpp and only parses options,
// calls one library function and prints.
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace cxxopts {
class Options;
class ParseResult;
}  // namespace cxxopts

namespace eaglekit::tools {

struct Command {
  const char* name;
  const char* summary;
  int (*run)(int argc, char** argv);  // argv[0] is "eaglekit NAME"; nullptr: in eaglekit-torch
};

// The single table (tools/main.cpp).
const std::vector<Command>& commands();

// Parses argv. Returns nullptr after printing help when --help was given; throws
// UsageError for unknown options, missing values and unmatched positionals.
std::unique_ptr<cxxopts::ParseResult> parse_args(cxxopts::Options& options, int argc,
                                                 char** argv);

// Set by --verbose on the main command line: print error detail on failure.
extern bool g_verbose;

// True when stderr is a terminal (progress bars only then).
bool stderr_is_tty();

}  // namespace eaglekit::tools
