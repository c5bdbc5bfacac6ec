// eaglekit: git-style subcommands. The table below drives both dispatch and
// `eaglekit --help`. Exit codes: 0 ok, 1 data or runtime error, 2 bad usage.
//
// Compiled twice (CMakeLists.txt): as `eaglekit-torch`, with every command, and with
// EAGLEKIT_FRONT as `eaglekit`, which links no LibTorch and runs the commands that need it
// (TORCH_COMMAND below) by exec'ing `eaglekit-torch` from its own folder with the same
// arguments: same process id, signals and exit code, so callers cannot tell the difference,
// except that `eaglekit index` no longer pays ~0.8 CPU-s to load LibTorch.
//
// Both start LibTorch's OpenMP threads waiting passively unless the user chose how they wait
// (lib/wait_policy.h): `eaglekit` sets the environment before its exec, and eaglekit-torch run
// directly execs itself once with it set. Both keep freed memory for reuse unless the user
// chose the allocator's settings (lib/malloc_policy.h).
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <exception>
#include <iostream>
#include <string>

#include "formats/error.h"
#include "formats/registry.h"
#include "lib/convert.h"
#include "lib/malloc_policy.h"
#include "lib/wait_policy.h"
#include "tools/build_info.h"
#include "tools/cli.h"
#include "tools/commands.h"

#if defined(EAGLEKIT_FRONT)
#define TORCH_COMMAND(fn) nullptr
#define VALIDATE_COMMAND run_validate
#else
#define TORCH_COMMAND(fn) fn
#define VALIDATE_COMMAND run_validate_base
#endif

namespace eaglekit::tools {

const std::vector<Command>& commands() {
  static const std::string kConvert =
      "Convert records between " + format_list(&FormatRow::name, convert_writes, ", ", " and ") +
      " (values exact)";
  static const std::vector<Command> kCommands = {
      {"index", "Index the records below folders (headers only; incremental)", run_index},
      {"validate", "Check records against the conversations and each other before training", VALIDATE_COMMAND},
      {"stats", "Token distribution, bytes per token and a disk estimate, from an index", run_stats},
      {"inspect", "Show a record file's format, id, tensors (dtype, shape) and optional stats", run_inspect},
      {"convert", kConvert.c_str(), run_convert},
      {"synth", "Write a synthetic, learnable dataset (and a tiny base model)", run_synth},
      {"pack", "Pack records of any format into compressed .eks shards (resumable)", run_pack},
      {"verify", "Decode every record and check every checksum; list bad records", run_verify},
      {"collate", "Write loader batches as torch.save dicts (inspection, interop)", TORCH_COMMAND(run_collate)},
      {"loader-bench", "Stream batches without writing; report samples/s, bytes/s, waits", TORCH_COMMAND(run_loader_bench)},
      {"launch", "Run N local ranks of a distributed job (torchrun-style env, fail-fast)", TORCH_COMMAND(run_launch)},
      {"vocab", "Count token frequencies and write the draft vocabulary map d2t.pt", TORCH_COMMAND(run_vocab)},
      {"train", "Train an EAGLE-3 draft with training-time test (checkpoints, resume, export)", TORCH_COMMAND(run_train)},
      {"evaluate", "Offline acceptance estimate of a draft: pooled loss, acc, cond_acc, est_ar", TORCH_COMMAND(run_evaluate)},
      {"export", "Write a checkpoint as the draft folder vLLM and SGLang load", TORCH_COMMAND(run_export)},
      {"report", "One self-contained HTML page of training runs' curves, evaluation, options and data", run_report},
  };
  return kCommands;
}

namespace {

// Replaces this process with eaglekit-torch, from this binary's folder, given the arguments
// this one got. Returns only on failure, with the exit code.
int exec_torch_binary(char** argv) {
  default_passive_wait();
  std::string path;
  try {
    path = own_executable();
  } catch (const Error&) {
  }
  const auto slash = path.rfind('/');
  path = (slash == std::string::npos ? std::string(".") : path.substr(0, slash)) + "/eaglekit-torch";
  ::execv(path.c_str(), argv);
  const int err = errno;
  std::cerr << "eaglekit: cannot run " << path << ": " << std::strerror(err)
            << " (the commands that need LibTorch live in eaglekit-torch, which must sit next to"
               " eaglekit; build it with the eaglekit target)\n";
  return 1;
}

void print_usage(std::ostream& os) {
  os << "eaglekit: offline EAGLE-3 draft training toolkit\n\n"
        "usage: eaglekit [--verbose] COMMAND [OPTIONS...]\n"
        "       eaglekit COMMAND --help\n\ncommands:\n";
  for (const auto& c : commands()) {
    std::string name = c.name;
    name.resize(std::max<std::size_t>(name.size(), 14), ' ');
    os << "  " << name << c.summary << "\n";
  }
  os << "\nexit codes: 0 ok, 1 data or runtime error, 2 usage error, 3 train interrupted (checkpoint saved;\n"
        "            --resume continues)\n";
}

}  // namespace
}  // namespace eaglekit::tools

int main(int argc, char** argv) {
  using namespace eaglekit;
  using namespace eaglekit::tools;
#if !defined(EAGLEKIT_FRONT)
  reexec_with_passive_wait(argv);
#endif
  keep_freed_memory();  // lib/malloc_policy.h (an exec'd eaglekit-torch sets it again for itself)
  int first = 1;
  while (first < argc && argv[first][0] == '-') {
    const std::string a = argv[first];
    if (a == "-h" || a == "--help") {
      print_usage(std::cout);
      return 0;
    }
    if (a == "-v" || a == "--verbose") {
      g_verbose = true;
      ++first;
      continue;
    }
    if (a == "--version") {
      // tools/build_info.h: one line each, stable for scripts to read.
      std::cout << "eaglekit " << kBuildVersion << "\n"
                << "git commit: " << kBuildGitCommit << "\n"
                << "built against LibTorch " << kBuildTorchVersion << "\n"
                << "CUDA: " << (kBuildCudaVersion != nullptr ? std::string("compiled in (") + kBuildCudaVersion + ")" : std::string("not compiled in")) << "\n";
      return 0;
    }
    std::cerr << "eaglekit: unknown option '" << a << "'\n";
    print_usage(std::cerr);
    return 2;
  }
  if (first >= argc) {
    print_usage(std::cerr);
    return 2;
  }
  const std::string name = argv[first];
  for (const auto& c : commands()) {
    if (name != c.name) continue;
    if (c.run == nullptr) return exec_torch_binary(argv);
#if defined(EAGLEKIT_FRONT)
    // validate --base runs the base's head: LibTorch's work.
    if (name == "validate")
      for (int i = first + 1; i < argc; ++i)
        if (std::string(argv[i]) == "--base" || std::string(argv[i]).rfind("--base=", 0) == 0)
          return exec_torch_binary(argv);
#endif
    std::string prog = std::string("eaglekit ") + c.name;
    argv[first] = prog.data();
    try {
      return c.run(argc - first, argv + first);
    } catch (const UsageError& e) {
      std::cerr << "eaglekit " << name << ": " << e.what() << "\n";
      return 2;
    } catch (const std::exception& e) {
      // c10::Error messages carry a C++ backtrace after the first line; keep it for --verbose.
      std::string msg = e.what();
      const auto nl = msg.find('\n');
      if (!g_verbose && nl != std::string::npos) msg.resize(nl);
      std::cerr << "eaglekit " << name << ": error: " << msg << "\n";
      return 1;
    }
  }
  std::cerr << "eaglekit: unknown command '" << name << "'\n";
  print_usage(std::cerr);
  return 2;
}
