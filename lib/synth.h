// Synthetic, learnable hidden-state datasets (`eaglekit synth`): conversations.jsonl plus one
// record per conversation, and optionally a tiny base model folder (config.json +
// model.safetensors with embed_tokens and lm_head) consistent with the records, so that
// indexing, validation, compression and training can run end to end without a GPU.
//
// The data are not noise: tokens follow a sparse random Markov chain (each token has 2-6
// likely successors with Zipf-skewed ids), the last hidden state encodes the current
// token's successor distribution so that softmax(lm_head @ h[t]) predicts token t+1, and
// the aux layers are noisy orthogonal projections of the current token, its context and
// the prediction, with heavy-tailed noise and a few large outlier channels. docs/synth.md
// describes the generator in full.
//
// Everything is a pure function of (options, seed): the same seed gives the same bytes
// whatever --jobs is. SynthGenerator is immutable and thread-safe. Errors: UsageError for
// bad options, IoError / FormatError from writing.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "formats/dtype.h"
#include "formats/format.h"
#include "formats/host_tensor.h"
#include "formats/record.h"

namespace eaglekit {

struct SynthOptions {
  std::string out_dir;             // records and conversations.jsonl go here
  std::int64_t conversations = 100;
  std::int64_t hidden = 64;        // H
  int aux_layers = 3;              // k
  std::int64_t vocab = 1024;       // V
  std::int64_t min_tokens = 32;    // T is uniform in [min_tokens, max_tokens]
  std::int64_t max_tokens = 256;
  DType dtype = DType::kBFloat16;  // hidden states: bf16, fp16 or fp32
  std::uint64_t seed = 0;
  int jobs = 0;                    // threads; 0 = all cores
  std::string base_out;            // tiny base model folder; empty = none
  Format format = Format::kPt;     // record format: pt or safetensors (one file each)
  // hidden_states before the base's final norm (the last layer's output, as some dumpers
  // write it): a per-token scale and the norm weight divided out, so that the base's
  // RMSNorm (model.norm.weight in the base folder) gives back the post-norm direction.
  bool prenorm = false;
  bool progress = false;           // progress on stderr (lib/progress.h: a terminal, or plain lines in a log)
};

// Throws UsageError naming the option when a value is out of range.
void check_synth_options(const SynthOptions& options);

// The generator behind synthesize(), usable directly by tests and benchmarks to get
// records in memory.
class SynthGenerator {
 public:
  explicit SynthGenerator(const SynthOptions& options);  // checks options
  ~SynthGenerator();
  SynthGenerator(const SynthGenerator&) = delete;
  SynthGenerator& operator=(const SynthGenerator&) = delete;

  const SynthOptions& options() const;
  std::string conversation_id(std::int64_t i) const;  // "synth-000042"
  // Where record i goes, relative to out_dir: "records/000/synth-000042.pt", every fifth
  // one a level deeper ("records/000/more/...").
  std::string record_path(std::int64_t i) const;
  // Token ids of conversation i (cheap: no hidden states).
  std::vector<std::int64_t> tokens(std::int64_t i) const;
  // The full record of conversation i (owning tensors, dtype options().dtype).
  Record record(std::int64_t i) const;
  // One line of conversations.jsonl (no trailing newline).
  std::string conversation_json(std::int64_t i) const;

  // The base model consistent with the records ([V, H], dtype options().dtype).
  HostTensor embed_tokens() const;
  HostTensor lm_head() const;
  HostTensor final_norm() const;  // [H] the final RMSNorm's weight (model.norm.weight)
  // config.json of the base model (LlamaForCausalLM fields).
  std::string base_config_json() const;

  // The successors of a token and their probabilities (before the uniform jump), most
  // likely first: what a perfect predictor knows.
  struct Successors {
    std::vector<std::int64_t> ids;
    std::vector<double> probs;
  };
  Successors successors(std::int64_t token) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct SynthResult {
  std::int64_t conversations = 0;
  std::int64_t tokens = 0;
  std::int64_t bytes = 0;      // record bytes written
  double seconds = 0;
  std::string jsonl_path;
  std::string base_dir;        // empty without base_out
};

// Writes out_dir/conversations.jsonl, the records (in parallel, options.jobs threads) and
// the base model folder when options.base_out is set. Every file is written atomically.
SynthResult synthesize(const SynthOptions& options);

// Writes base_dir/config.json and base_dir/model.safetensors for a generator.
void write_synth_base_model(const SynthGenerator& gen, const std::string& base_dir);

}  // namespace eaglekit
