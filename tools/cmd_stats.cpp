// eaglekit stats: token distribution, disk use and a disk estimate from an index, and the
// SpecForge batch padding of its torch.save records; with --plan-dump, the disk a dump of
// the conversations will take before it is made (lib/stats.h plan_dump).
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "formats/error.h"
#include "lib/index.h"
#include "lib/progress.h"
#include "lib/stats.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace eaglekit::tools {

namespace {

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// tools/python/eaglekit_dump.py beside this binary: the source tree's (build/bin/../../tools/python)
// or an installed share/eaglekit/python, or $EAGLEKIT_PYTHON_TOOLS.
std::string dump_script() {
  namespace fs = std::filesystem;
  std::vector<fs::path> dirs;
  if (const char* env = std::getenv("EAGLEKIT_PYTHON_TOOLS")) dirs.emplace_back(env);
  const fs::path bin = fs::path(own_executable()).parent_path();
  for (const char* rel : {"../../tools/python", "../tools/python", "../share/eaglekit/python"})
    dirs.push_back(bin / rel);
  for (const auto& d : dirs)
    if (fs::exists(d / "eaglekit_dump.py")) return fs::weakly_canonical(d / "eaglekit_dump.py").string();
  return "";
}

// The tokens of --data counted by the base's own tokenizer, when the base folder holds a
// tokenizer.json and nothing else gives the ratio: eaglekit_dump.py --count-tokens applies the
// chat template as the dump does (no model loaded). Its stderr goes to the user.
void count_with_tokenizer(DumpPlanOptions& plan, const std::string& python) {
  namespace fs = std::filesystem;
  const fs::path base = fs::is_directory(plan.base) ? fs::path(plan.base) : fs::path(plan.base).parent_path();
  if (!fs::exists(base / "tokenizer.json")) return;  // plan_dump says what to pass
  const std::string script = dump_script();
  const std::string how = "pass --text-bytes-per-token X or --index SAMPLE instead, or install what the dump tool "
                          "needs (pip install -r scripts/requirements-dump.txt) and name its Python with --python";
  if (script.empty())
    throw UsageError("stats --plan-dump: " + (base / "tokenizer.json").string() +
                     " would count the tokens, but tools/python/eaglekit_dump.py is not beside this binary "
                     "(set EAGLEKIT_PYTHON_TOOLS to its folder); " + how);
  const std::string cmd = shell_quote(python) + " " + shell_quote(script) + " --model " + shell_quote(base.string()) +
                          " --data " + shell_quote(plan.conversations) + " --count-tokens";
  std::FILE* f = ::popen(cmd.c_str(), "r");
  if (f == nullptr) throw UsageError("stats --plan-dump: cannot run " + cmd + "; " + how);
  std::string out;
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) out.append(buf, n);
  const int status = ::pclose(f);
  const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::int64_t tokens = 0;
  try {
    if (rc == 0) tokens = nlohmann::json::parse(out).at("tokens").get<std::int64_t>();
  } catch (const std::exception&) {
    tokens = 0;
  }
  if (rc != 0 || tokens <= 0)
    throw UsageError("stats --plan-dump: counting the tokens with " + (base / "tokenizer.json").string() +
                     " failed (`" + cmd + "` exited " + std::to_string(rc) + ", its error above); " + how);
  plan.counted_tokens = tokens;
  plan.counted_basis = "counted with the base's tokenizer (" + (base / "tokenizer.json").string() +
                       ", its chat template applied as eaglekit_dump.py applies it)";
}

}  // namespace

int run_stats(int argc, char** argv) {
  DataSelection data;
  StatsOptions o;
  DumpPlanOptions plan;
  bool planning = false;
  std::string disk;
  std::string python = std::getenv("EAGLEKIT_PYTHON") ? std::getenv("EAGLEKIT_PYTHON") : "python3";
  bool json = false;
  using opt::field;
  const opt::Groups groups{
      data_options(data).only({"index"}),
      opt::Group{"Stats",
                 {field("plan_conversations", "N", o.plan_conversations,
                        "Estimate the disk a dump of N conversations takes"),
                  opt::note(field("plan_tokens", "T", o.plan_tokens, "Tokens per conversation in that dump"),
                            "this dataset's mean"),
                  field("skip_padding", "", o.skip_padding,
                        "Open no record: leave out the count of SpecForge batch padding (read from the "
                        "torch.save records that hold a loss mask)"),
                  opt::short_named(field("jobs", "N", o.jobs, "Threads reading records (0: all cores)"), 'j'),
                  field("json", "", json, "Machine-readable output")}},
      opt::Group{"Plan a dump (--plan-dump: before dumping, from --data and --base; --index is then a sample)",
                 {field("plan_dump", "", planning,
                        "Print the tokens of --data and the bytes a dump of them takes raw (bf16), as .eks zstd "
                        "and as .eks fp8, and suggest one"),
                  field("data", "PATH", plan.conversations,
                        "The conversations to dump: a .jsonl file, a folder of them, or a JSON array file"),
                  field("base", "DIR", plan.base, "The base's folder (its config.json gives the hidden size)"),
                  field("aux_layers", "K", plan.aux_layers, "Aux layers the dump captures (EAGLE-3: 3)"),
                  opt::note(field("text_bytes_per_token", "X", plan.text_bytes_per_token,
                                  "UTF-8 bytes of conversation text per token"),
                            "counted with the base's tokenizer.json when its folder has one, else measured on "
                            "--index SAMPLE, an index of some of these conversations already dumped"),
                  opt::note(field("python", "PY", python,
                                  "The Python (with transformers: scripts/requirements-dump.txt) that counts the "
                                  "tokens with the base's tokenizer"),
                            "$EAGLEKIT_PYTHON, else python3"),
                  opt::note(field("disk", "SIZE", disk, "The disk the dump may take (e.g. 20TiB): the suggestion fits it"),
                            "no limit")}}};
  const std::optional<CommandLine> cl = parse_or_help(
      argc, argv, groups,
      std::string(argv[0]) + " --index FILE [OPTIONS]\n       " + argv[0] +
          " --plan-dump --data CONVERSATIONS --base DIR [--index SAMPLE | --text-bytes-per-token X] [OPTIONS]\n"
          "  (without --index or --text-bytes-per-token the base's tokenizer.json counts the tokens)",
      "Token distribution, bytes on disk per token, records per format and dtype, and a disk "
      "estimate for a planned dump. With --plan-dump, before anything is dumped: the tokens of the "
      "conversations and the disk a dump of them takes in each format, and the one to choose.");
  if (!cl) return 0;
  cl->apply();
  if (planning) {
    for (const char* only : {"plan_conversations", "plan_tokens", "skip_padding"})
      if (cl->given(only))
        throw UsageError(std::string("--") + only + " is for a dump that exists; --plan-dump plans from --data");
    if (!disk.empty()) plan.disk_bytes = static_cast<double>(parse_bytes(disk));
    std::optional<DatasetIndex> sample;
    if (cl->given("index")) sample = DatasetIndex::load(data.index);
    if (!sample && plan.text_bytes_per_token == 0 && !plan.conversations.empty() && !plan.base.empty())
      count_with_tokenizer(plan, python);
    const DumpPlan p = eaglekit::plan_dump(plan, sample ? &*sample : nullptr);
    std::cout << (json ? dump_plan_to_json(p) : dump_plan_to_text(p));
    return 0;
  }
  for (const char* only : {"data", "base", "aux_layers", "text_bytes_per_token", "disk", "python"})
    if (cl->given(only)) throw UsageError(std::string("--") + only + " goes with --plan-dump");
  if (!cl->given("index")) throw UsageError("--index INDEX is required (or --plan-dump to plan a dump)");
  const DatasetIndex index = DatasetIndex::load(data.index);
  const DatasetStats s = compute_stats(index, o);
  std::cout << (json ? stats_to_json(s) : stats_to_text(s));
  return 0;
}

}  // namespace eaglekit::tools
