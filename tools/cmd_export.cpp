// eaglekit export: a checkpoint (or output folder) -> the Hugging Face draft folder vLLM and
// SGLang load (docs/export.md), with the dump's aux layer ids and the serving dtype.
#include <cxxopts.hpp>

#include <iostream>
#include <string>
#include <vector>

#include "formats/error.h"
#include "tools/cli.h"
#include "tools/commands.h"
#include "trainer/checkpoint.h"

namespace eaglekit::tools {

std::vector<std::int64_t> parse_layer_ids(const std::string& text, const char* flag);  // cmd_train.cpp

int run_export(int argc, char** argv) {
  cxxopts::Options options(argv[0],
                           "Export a checkpoint as a draft folder (config.json + model.safetensors) for vLLM "
                           "and SGLang. CHECKPOINT: a checkpoint-STEP folder, any exported draft, or a "
                           "training output folder (its newest complete checkpoint)");
  options.positional_help("CHECKPOINT");
  options.add_options()
      ("checkpoint", "Checkpoint folder", cxxopts::value<std::string>())
      ("out", "Folder to write", cxxopts::value<std::string>())
      ("aux-layer-ids", "Aux layers of the dump, HF hidden_states ids (e.g. 2,16,29); default: the checkpoint's",
       cxxopts::value<std::string>())
      ("dtype", "bf16, fp16 or fp32 (default: the dtype the draft is served in, the base's torch_dtype)",
       cxxopts::value<std::string>()->default_value(""))
      ("allow-unservable", "Write a draft vLLM and SGLang do not compute (--modelopt-norm) anyway")
      ("json", "Print {\"source\", \"out\", \"parameters\", \"dtype\", \"aux_layer_ids\"}");
  options.parse_positional({"checkpoint"});
  auto args = parse_args(options, argc, argv);
  if (!args) return 0;
  const auto& a = *args;
  if (!a.count("checkpoint")) throw UsageError("give the CHECKPOINT folder to export");
  if (!a.count("out")) throw UsageError("--out is required");
  trainer::ExportCheckpointOptions o;
  if (a.count("aux-layer-ids")) o.aux_layer_ids = parse_layer_ids(a["aux-layer-ids"].as<std::string>(), "--aux-layer-ids");
  o.dtype = a["dtype"].as<std::string>();
  o.allow_unservable = a.count("allow-unservable") > 0;
  const trainer::ExportReport r =
      trainer::export_checkpoint(a["checkpoint"].as<std::string>(), a["out"].as<std::string>(), o);
  for (const auto& w : r.warnings) std::cerr << "eaglekit export: warning: " << w << "\n";
  if (a.count("json")) {
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
