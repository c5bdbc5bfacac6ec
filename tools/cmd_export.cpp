// eaglekit export: a checkpoint (or output folder) -> the Hugging Face draft folder vLLM and
// SGLang load (docs/export.md), with the dump's aux layer ids and the serving dtype.
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "formats/error.h"
#include "tools/cli.h"
#include "tools/commands.h"
#include "trainer/io/checkpoint.h"

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
       opt::choice("format", o.format,
                   {{trainer::ExportFormat::kEaglekit, "eaglekit"}, {trainer::ExportFormat::kSpeculators, "speculators"}},
                   "Layout: eaglekit (vLLM and SGLang) or speculators (vLLM's speculators format)"),
       opt::note(opt::field("speculative_tokens", "N", o.speculative_tokens,
                            "speculators: tokens proposed per step (speculators_config)"),
                 "the --ttt-steps the draft was trained with"),
       opt::note(opt::field("verifier", "NAME_OR_PATH", o.verifier,
                            "speculators: the target model as vLLM loads it"),
                 "the run's --base"),
       opt::field("json", "", json,
                  "Print {\"source\", \"layout\", \"out\", \"format\", \"parameters\", \"dtype\", "
                  "\"aux_layer_ids\", \"notes\", \"warnings\"} (speculators: \"speculative_tokens\", \"verifier\")")}}};
  const std::optional<CommandLine> cl = parse_or_help(
      argc, argv, groups, std::string(argv[0]) + " CHECKPOINT --out DIR [OPTIONS]",
      "Export a checkpoint as a draft folder (config.json + model.safetensors) for vLLM and "
      "SGLang (docs/export.md). CHECKPOINT: a checkpoint-STEP folder, a training output folder "
      "(its newest complete checkpoint), or a draft folder in any layout load_draft reads "
      "(eaglekit, ModelOpt, speculators, SpecForge, the EAGLE authors').", 1);
  if (!cl) return 0;
  cl->apply();
  if (cl->positionals.empty()) throw UsageError("give the CHECKPOINT folder to export");
  if (out.empty()) throw UsageError("--out is required");
  const trainer::ExportReport r =
      trainer::export_checkpoint(cl->positionals[0], out, o);
  for (const auto& n : r.notes) std::cerr << "eaglekit export: " << n << "\n";
  for (const auto& w : r.warnings) std::cerr << "eaglekit export: warning: " << w << "\n";
  if (json) {
    std::cout << r.to_json() << "\n";
  } else {
    std::cout << "exported " << r.source << " [" << r.layout << "] -> " << r.out << " (" << r.format << " layout, "
              << r.parameters << " parameters, " << r.dtype << ", aux layers";
    for (auto id : r.aux_layer_ids) std::cout << " " << id;
    if (r.format == "speculators")
      std::cout << ", " << r.speculative_tokens << " speculative tokens, verifier " << r.verifier;
    std::cout << ")\n";
  }
  return 0;
}

}  // namespace eaglekit::tools
