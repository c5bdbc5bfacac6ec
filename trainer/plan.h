// `eaglekit train --dry-run`: everything a run would decide before its first step, without
// loading weights or training. It resolves the options, reads the base's config.json (not
// its weights), loads the conversations and the index and matches them (the same split
// train uses), reads the first record's shape, derives the draft config as train would
// (aux layer ids, RoPE, vocabulary) and counts steps and tokens; then it estimates the
// device memory of one rank.
//
// The memory figure is an estimate from the shapes, not a measurement (the formula is in
// plan.cpp, next to the code): float32 weights, gradients and AdamW moments of the draft,
// the base's embed_tokens and lm_head on the device, and the activations the TTT unroll
// keeps for backward over S steps of one micro-batch (O(L^2) attention scores per head
// included). Expect the real peak within a factor of about two; it is meant to tell 8 GB
// from 80 GB before a job is queued.
//
// The draft is decided by the function train uses (trainer/draft_setup.h decide_draft), so a
// plan accepts what train accepts. --device is not opened: a plan for a GPU job runs on a
// login node without one.
//
// Errors: the UsageError train would throw for the same options (a missing option, an
// unknown aux layer id, a draft that does not fit the data), and what reading throws.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace eaglekit::trainer {

struct TrainOptions;

struct TrainPlan {
  std::string summary;               // what matched
  std::int64_t train_samples = 0, eval_samples = 0;
  std::int64_t hidden = 0, aux_layers = 0;  // of the data
  std::string draft_source;          // "fresh from the base", "--init-draft DIR", "resume DIR"
  std::string draft_config_json;     // the config.json final/ would carry
  std::vector<std::int64_t> aux_layer_ids;
  std::string aux_layer_ids_source;  // "--aux-layer-ids", "the draft", "default for N layers"
  std::string rope;                  // "llama3 (factor 8, ...), theta 500000"
  std::int64_t draft_vocab_size = 0, vocab_size = 0;
  std::int64_t parameters = 0;       // trainable, of the draft
  std::int64_t draft_layers = 1;     // its decoder layers
  int world_size = 1, dp_size = 1, cp_size = 1;
  std::int64_t rows_per_step = 0;    // global: batch x grad_accum x dp
  std::int64_t steps_per_epoch = 0;  // optimizer steps
  std::int64_t total_steps = 0;
  std::int64_t tokens_per_epoch = 0;  // real tokens of the train split (each sample cut at max_length)
  // Estimated device bytes per rank.
  double state_bytes = 0;       // draft weights + gradients + AdamW moments (float32)
  double base_bytes = 0;        // embed_tokens + lm_head
  double activation_bytes = 0;  // one micro-batch's TTT unroll, kept for backward
  double total_bytes() const { return state_bytes + base_bytes + activation_bytes; }
  std::string schedule;              // the learning-rate schedule with a few of its rates
  std::int64_t median_tokens = 0;    // of the train records, cut at max_length
  double padding_share = 0;          // --mode pad: share of row tokens that are padding
  std::vector<std::string> notes;  // defaults applied, as train says them
  // Things that would waste the run: warmup not shorter than it, padding above half of
  // every row in pad mode.
  std::vector<std::string> warnings;

  std::string to_text() const;
  std::string to_json() const;
};

// `world_size` and `cp_size` of the job the plan is for (1 and options.cp_size outside a
// launch: a dry run never joins a mesh).
TrainPlan plan_training(const TrainOptions& options, int world_size = 1);

}  // namespace eaglekit::trainer
