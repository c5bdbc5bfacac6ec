// eaglekit index: build (or incrementally refresh) a dataset index, or print one.
#include <cstddef>
#include <iostream>
#include <limits>
#include <string>

#include "formats/error.h"
#include "lib/index.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace eaglekit::tools {

int run_index(int argc, char** argv) {
  IndexOptions o;
  std::string show;
  bool full = false, json = false;
  using opt::field;
  const opt::Groups groups{opt::Group{
      "Index",
      {opt::short_named(field("out", "INDEX", o.out, "Index file to write (atomically)"), 'o'),
       opt::short_named(field("jobs", "N", o.jobs, "Threads (0: all cores)"), 'j'),
       field("full", "", full, "Read every file again, ignoring an existing index at --out (and the loss-mask file it joined)"),
       field("loss-masks", "FILE", o.loss_masks,
             "Records take their loss masks from FILE (scripts/speculators/loss_masks.py: hs_{i}.safetensors takes "
             "row i; tools/python/eaglekit_masks.py: by conversation id), as `convert --loss-masks` joins them; "
             "every readable record must find one of its length. Without it, an incremental run keeps the file the "
             "index at --out joined"),
       field("show", "INDEX", show, "Print an index: one line per record"),
       field("json", "", json, "Machine-readable output")}}};
  const CommandLine cl = parse_command_line(argc, argv, groups, std::numeric_limits<std::size_t>::max());
  if (cl.help) {
    const std::string me = argv[0];
    std::cout << help_text(me + " DIR... --out INDEX [--loss-masks FILE] [--jobs N] [--full] [--json]\n       " + me +
                               " --show INDEX [--json]",
                           "Index the hidden-state records below folders (or record files), recursively, headers "
                           "only, into one binary index file; or print one. Formats are found by content (a "
                           "DeepSpec target cache or a NeMo AutoModel EAGLE-3 cache by its manifest.json); vLLM's FILE.lock companions are "
                           "skipped and counted, and named when a writer still holds their lock.",
                           groups);
    return 0;
  }
  if (cl.given("show") && (!cl.positionals.empty() || cl.given("out") || cl.given("loss-masks")))
    throw UsageError("--show INDEX takes no folders, no --out and no --loss-masks");
  cl.apply();

  if (cl.given("show")) {
    const DatasetIndex index = DatasetIndex::load(show);
    std::cout << (json ? index_to_json(index) : index_to_text(index));
    return 0;
  }
  o.roots = cl.positionals;
  if (o.roots.empty()) throw UsageError("give at least one folder to index (see --help)");
  if (!cl.given("out")) throw UsageError("--out INDEX is required");
  o.incremental = !full;
  const IndexReport report = build_index(o);
  std::cout << (json ? index_report_to_json(report, o.out) : index_report_to_text(report, o.out));
  return 0;
}

}  // namespace eaglekit::tools
