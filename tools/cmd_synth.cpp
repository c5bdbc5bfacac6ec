// eaglekit synth: a synthetic, learnable dataset (conversations.jsonl + one record per
// conversation) and optionally a tiny base model consistent with it. docs/synth.md.
#include <cxxopts.hpp>

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "formats/error.h"
#include "lib/progress.h"
#include "lib/synth.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace eaglekit::tools {

int run_synth(int argc, char** argv) {
  const SynthOptions d;
  cxxopts::Options options(
      argv[0],
      "Write a synthetic dataset: DIR/conversations.jsonl and one ModelOpt-style record per "
      "conversation under DIR/records/. Tokens follow a sparse Markov chain and the hidden "
      "states encode it, so a draft model can learn it. Deterministic for a seed, whatever "
      "--jobs is.");
  options.add_options()("out", "Output folder", cxxopts::value<std::string>())
      ("conversations", "Number of conversations",
       cxxopts::value<std::int64_t>()->default_value(std::to_string(d.conversations)))
      ("hidden", "Hidden size H", cxxopts::value<std::int64_t>()->default_value(std::to_string(d.hidden)))
      ("aux-layers", "Aux layers k (aux_hidden_states is [T, k*H])",
       cxxopts::value<int>()->default_value(std::to_string(d.aux_layers)))
      ("vocab", "Vocabulary size V", cxxopts::value<std::int64_t>()->default_value(std::to_string(d.vocab)))
      ("min-tokens", "Fewest tokens per conversation",
       cxxopts::value<std::int64_t>()->default_value(std::to_string(d.min_tokens)))
      ("max-tokens", "Most tokens per conversation",
       cxxopts::value<std::int64_t>()->default_value(std::to_string(d.max_tokens)))
      ("dtype", "Hidden-state dtype: bf16, fp16 or fp32", cxxopts::value<std::string>()->default_value("bf16"))
      ("format", "Record format: pt or safetensors", cxxopts::value<std::string>()->default_value("pt"))
      ("seed", "Random seed", cxxopts::value<std::uint64_t>()->default_value("0"))
      ("jobs", "Threads (0: all cores)", cxxopts::value<int>()->default_value("0"))
      ("base-out", "Also write a tiny base model folder (config.json + model.safetensors with "
                   "embed_tokens and lm_head) consistent with the data",
       cxxopts::value<std::string>())
      ("json", "Print the result as JSON");
  const auto args = parse_args(options, argc, argv);
  if (!args) return 0;
  if (!args->count("out")) throw UsageError("--out DIR is required (see --help)");

  SynthOptions o;
  o.out_dir = (*args)["out"].as<std::string>();
  o.conversations = (*args)["conversations"].as<std::int64_t>();
  o.hidden = (*args)["hidden"].as<std::int64_t>();
  o.aux_layers = (*args)["aux-layers"].as<int>();
  o.vocab = (*args)["vocab"].as<std::int64_t>();
  o.min_tokens = (*args)["min-tokens"].as<std::int64_t>();
  o.max_tokens = (*args)["max-tokens"].as<std::int64_t>();
  const std::string dt = (*args)["dtype"].as<std::string>();
  const auto dtype = parse_dtype(dt);
  if (!dtype) throw UsageError("--dtype: unknown dtype '" + dt + "' (bf16, fp16 or fp32)");
  o.dtype = *dtype;
  const std::string fmt = (*args)["format"].as<std::string>();
  const auto format = parse_format(fmt);
  if (!format) throw UsageError("--format: unknown format '" + fmt + "' (pt or safetensors)");
  o.format = *format;
  o.seed = (*args)["seed"].as<std::uint64_t>();
  o.jobs = (*args)["jobs"].as<int>();
  if (args->count("base-out")) o.base_out = (*args)["base-out"].as<std::string>();
  o.progress = stderr_is_tty();

  const SynthResult r = synthesize(o);
  if (args->count("json")) {
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
