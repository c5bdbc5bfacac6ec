#include "tools/cli.h"

#include <unistd.h>

#include <cxxopts.hpp>
#include <iostream>

#include "formats/error.h"

namespace eaglekit::tools {

bool g_verbose = false;

bool stderr_is_tty() { return ::isatty(2) == 1; }

std::unique_ptr<cxxopts::ParseResult> parse_args(cxxopts::Options& options, int argc,
                                                 char** argv) {
  options.add_options("Common")("h,help", "Show this help");
  try {
    auto result = std::make_unique<cxxopts::ParseResult>(options.parse(argc, argv));
    if (result->count("help")) {
      std::cout << options.help();
      return nullptr;
    }
    if (!result->unmatched().empty())
      throw UsageError("unexpected argument '" + result->unmatched().front() +
                       "' (see --help)");
    return result;
  } catch (const cxxopts::exceptions::exception& e) {
    throw UsageError(std::string(e.what()) + " (see --help)");
  }
}

}  // namespace eaglekit::tools
