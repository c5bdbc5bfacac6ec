// eaglekit synth: a synthetic, learnable dataset (conversations.jsonl + one record per
// conversation) and optionally a tiny base model consistent with it. docs/synth.md.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "formats/error.h"
#include "lib/progress.h"
#include "lib/synth.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace eaglekit::tools {

int run_synth(int argc, char** argv) {
  SynthOptions o;
  bool json = false;
  using opt::field;
  const opt::Groups groups{opt::Group{
      "Synth",
      {field("out", "DIR", o.out_dir, "Output folder"),
       field("conversations", "N", o.conversations, "Number of conversations"),
       field("hidden", "H", o.hidden, "Hidden size H"),
       field("aux_layers", "K", o.aux_layers, "Aux layers k (aux_hidden_states is [T, k*H])"),
       field("vocab", "V", o.vocab, "Vocabulary size V"),
       field("min_tokens", "N", o.min_tokens, "Fewest tokens per conversation"),
       field("max_tokens", "N", o.max_tokens, "Most tokens per conversation"),
       opt::choice("dtype", o.dtype,
                   {{DType::kBFloat16, "bf16"},
                    {DType::kFloat16, "fp16"},
                    {DType::kFloat32, "fp32"},
                    {DType::kBFloat16, "bfloat16"},
                    {DType::kFloat16, "float16"},
                    {DType::kFloat16, "half"},
                    {DType::kFloat16, "f16"},
                    {DType::kFloat32, "float32"},
                    {DType::kFloat32, "float"},
                    {DType::kFloat32, "f32"}},
                   "Hidden-state dtype"),
       opt::choice("format", o.format, {{Format::kPt, "pt"}, {Format::kSafetensors, "safetensors"}, {Format::kPt, "ckpt"}},
                   "Record format"),
       opt::choice("hidden_states_norm", o.prenorm, {{false, "post"}, {true, "pre"}},
                   "hidden_states after the base's final norm (post) or before it (pre: the last layer's "
                   "output; the base folder's model.norm.weight turns it back)"),
       field("seed", "N", o.seed, "Random seed"),
       field("jobs", "N", o.jobs, "Threads (0: all cores)"),
       field("base_out", "DIR", o.base_out,
             "Also write a tiny base model folder (config.json + model.safetensors with embed_tokens and lm_head) "
             "consistent with the data"),
       field("json", "", json, "Print the result as JSON")}}};
  const std::optional<CommandLine> cl = parse_or_help(
      argc, argv, groups, std::string(argv[0]) + " --out DIR [OPTIONS]",
      "Write a synthetic dataset: DIR/conversations.jsonl and one ModelOpt-style record per "
      "conversation under DIR/records/. Tokens follow a sparse Markov chain and the hidden "
      "states encode it, so a draft model can learn it. Deterministic for a seed, whatever "
      "--jobs is.");
  if (!cl) return 0;
  if (!cl->given("out")) throw UsageError("--out DIR is required (see --help)");
  cl->check_choice("dtype", [](const std::string& v) { return "--dtype must be bf16, fp16 or fp32, not " + v; });
  cl->apply();
  o.progress = true;  // redrawn on a terminal, plain lines in a log (lib/progress.h)

  const SynthResult r = synthesize(o);
  if (json) {
    nlohmann::json j;
    j["out"] = o.out_dir;
    j["conversations"] = r.conversations;
    j["tokens"] = r.tokens;
    j["bytes"] = r.bytes;
    j["seconds"] = r.seconds;
    j["jsonl"] = r.jsonl_path;
    j["base"] = r.base_dir.empty() ? nlohmann::json(nullptr) : nlohmann::json(r.base_dir);
    std::cout << j.dump(2) << "\n";
  } else {
    char line[512];
    std::snprintf(line, sizeof line,
                  "wrote %lld conversations (%lld tokens, %s of records) to %s in %.2f s (%s/s)\n",
                  static_cast<long long>(r.conversations), static_cast<long long>(r.tokens),
                  human_bytes(static_cast<double>(r.bytes)).c_str(), o.out_dir.c_str(), r.seconds,
                  human_bytes(static_cast<double>(r.bytes) / std::max(r.seconds, 1e-9)).c_str());
    std::cout << line;
    if (!r.base_dir.empty()) std::cout << "base model: " << r.base_dir << "\n";
  }
  return 0;
}

}  // namespace eaglekit::tools
