// eaglekit inspect: format, conversation id, codec and each tensor's dtype and shape of a
// record (FILE or FILE#conversation_id), or the list of records of a shard.
#include <iostream>
#include <optional>
#include <string>

#include "formats/error.h"
#include "formats/registry.h"
#include "lib/inspect.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace eaglekit::tools {

int run_inspect(int argc, char** argv) {
  InspectOptions o;
  bool json = false;
  const opt::Groups groups{opt::Group{
      "Inspect",
      {opt::field("stats", "", o.stats, "Add min/max/mean/std and NaN/Inf counts per tensor (reads every value)"),
       opt::field("loss-masks", "FILE", o.loss_masks,
                  "Show the mask the record takes from a loss-mask file, as `convert --loss-masks` and "
                  "`index --loss-masks` join it (hs_{i}.safetensors: row i; else by conversation id), checked"),
       opt::field("json", "", json, "Print JSON")}}};
  const std::optional<CommandLine> cl = parse_or_help(
      argc, argv, groups, std::string(argv[0]) + " FILE[#conversation_id] [OPTIONS]",
      "Show a record file's format, conversation id, codec and each tensor's dtype and shape. "
      "FILE#conversation_id picks one record of a multi-record file (" +
          format_list(&FormatRow::name, [](const FormatRow& r) { return !r.one_record; }, ", ", " or ") +
          "); without it such a file lists its records.",
      1);
  if (!cl) return 0;
  if (cl->positionals.empty()) throw UsageError("FILE is required (see --help)");
  cl->apply();
  const InspectResult r = inspect(cl->positionals[0], o);
  std::cout << (json ? inspect_json(r) : inspect_text(r));
  return 0;
}

}  // namespace eaglekit::tools
