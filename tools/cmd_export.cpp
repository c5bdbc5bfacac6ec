// eaglekit export: a checkpoint (or output folder) -> the Hugging Face draft folder vLLM and
// SGLang load (docs/export.md), with the dump's aux layer ids and the serving dtype.
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "formats/error.h"
#include "tools/cli.h"
#include "tools/commands.h"
#include "trainer/checkpoint.h"

namespace eaglekit::tools {

int run_export(int argc, char** argv) {
  trainer::ExportCheckpointOptions o;
  std::string out;
  bool json = false;
  const opt::Groups groups{opt::Group{
      "Export",
      {opt::field("out", "DIR", out, "Folder to write (put in place whole; an earlier export there is replaced)"),
       opt::note(opt::field("aux_layer_ids", "IDS", o.aux_layer_ids,
                            "Aux layers of the dump, as HF hidden_states indices (e.g. 2,16,29)"),
                 "the checkpoint's"),
       opt::note(opt::field("dtype", "DTYPE", o.dtype, "Weights' dtype: bf16, fp16 or fp32"),
                 "the dtype the draft is served in, the base's torch_dtype"),
       opt::field("allow_unservable", "", o.allow_unservable,
                  "Write a draft vLLM and SGLang do not compute (--modelopt-norm) anyway"),
       opt::field("json", "", json, "Print {\"source\", \"out\", \"parameters\", \"dtype\", \"aux_layer_ids\"}")}}};
  const std::optional<CommandLine> cl = parse_or_help(
      argc, argv, groups, std::string(argv[0]) + " CHECKPOINT --out DIR [OPTIONS]",
      "Export a checkpoint as a draft folder (config.json + model.safetensors) for vLLM and "
      "SGLang. CHECKPOINT: a checkpoint-STEP folder, any exported draft, or a training output "
      "folder (its newest complete checkpoint).", 1);
  if (!cl) return 0;
  cl->apply();
  if (cl->positionals.empty()) throw UsageError("give the CHECKPOINT folder to export");
  if (out.empty()) throw UsageError("--out is required");
  const trainer::ExportReport r =
      trainer::export_checkpoint(cl->positionals[0], out, o);
  for (const auto& w : r.warnings) std::cerr << "eaglekit export: warning: " << w << "\n";
  if (json) {
    std::cout << r.to_json() << "\n";
  } else {
    std::cout << "exported " << r.source << " -> " << r.out << " (" << r.parameters << " parameters, " << r.dtype
              << ", aux layers";
    for (auto id : r.aux_layer_ids) std::cout << " " << id;
    std::cout << ")\n";
  }
  return 0;
}

}  // namespace eaglekit::tools
