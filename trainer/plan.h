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
// from 80 GB before a job is queued. For --device cpu it is compared with the host's
// available memory (a warning above it). The time is an estimate too: the run's FLOPs from
// the shapes, and on the CPU the rate of a short matmul measured here, which only bounds the
// run's time from below; for a GPU the FLOPs alone (a dry run does not open --device).
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
  // What the memory estimate is compared with: the host's MemAvailable for --device cpu; < 0
  // when not known (a GPU: a dry run does not open --device). Above it: a warning.
  double available_bytes = -1;
  std::string available_source;  // "MemAvailable of this host", ...
  // Time: the run's floating-point work per rank (a model of the draft's matmuls forward and
  // backward, attention over the row, and the base's lm_head for the targets; plan.cpp), and
  // for --device cpu the rate of a float matmul measured here in the compute dtype, which
  // bounds the run's: eta_s is a lower bound. eta_s < 0: not estimated (eta_basis says why).
  double flops = 0;
  double measured_flops_per_s = 0;  // 0: not measured
  double eta_s = -1;
  std::string eta_basis;
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

// The rate of a float32 (or bfloat16) 512 x 512 matmul on this host's CPU with LibTorch's
// current threads, timed for about 0.2 s: what bounds a CPU estimate of time. 0 when the
// timing failed.
double measure_cpu_matmul_flops_per_s(bool bfloat16 = false);
// 3.2e12 -> "3.2 TFLOP".
std::string flops_text(double flops);

// `world_size` and `cp_size` of the job the plan is for (1 and options.cp_size outside a
// launch: a dry run never joins a mesh).
TrainPlan plan_training(const TrainOptions& options, int world_size = 1);

}  // namespace eaglekit::trainer
