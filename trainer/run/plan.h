// A run's decisions, made once. resolve() takes the options of `train` (or `evaluate`) and
// the world size, reads the base's config.json (not its weights), the conversations and the
// index (both splits), the first record's shape, a resumed checkpoint's metadata and an
// --init-draft folder, and decides everything the run needs before its first step: the
// splits and whether evaluation runs, the norm form of the hidden states, the draft (where
// it comes from, its config, its aux layer ids and vocabulary), RoPE, the steps and the
// learning-rate schedule, the unroll's options, and an estimate of the memory per rank. Each
// decision carries why it was made (RunPlan::decisions). trainer/run/open_run.h then builds the
// run from the plan alone; `train`, `train --dry-run` (which prints the plan) and `evaluate`
// go through the same two functions, so a plan accepts what the run accepts and says what
// the run will do.
//
// What resolve reads: no base weights and no tensors beyond the ones that are themselves a
// decision's input: under --hidden-states-norm auto, when some records neither state their
// norm form nor have a layout that implies it, the base's embeddings, lm_head and final norm
// and a sample of those records (the form is measured: run_setup.h plan_hidden_states_norm);
// an --init-draft (the layout it names and the d2t that --d2t
// is compared with are facts of its weights), or `evaluate --draft` (the plan keeps that
// one, float32 on the CPU, for open_run, which takes it over: a copy of a DraftModel shares
// its tensors).
// --device is not opened: a plan for a GPU job resolves on a login node without one.
//
// The memory figure is an estimate from the shapes, not a measurement (the formula is in
// plan.cpp, next to the code): float32 weights, gradients and AdamW moments of the draft,
// the base's embed_tokens and lm_head on the device, and the activations the TTT unroll
// keeps for backward over S steps of one micro-batch (O(L^2) attention scores per head
// included). Expect the real peak within a factor of about two; it is meant to tell 8 GB
// from 80 GB before a job is queued. For --device cpu it is compared with the host's
// available memory (a warning above it). The time (estimate_time, for a dry run) is an
// estimate too: the run's FLOPs from the shapes, and on the CPU the rate of a short matmul
// measured here, which only bounds the run's time from below; for a GPU the FLOPs alone.
//
// Thread safety: free functions; a RunPlan is a value, read-only once resolved. Errors: the
// UsageError a run throws for the same options (a missing option, an unknown aux layer id, a
// draft that does not fit the data, a checkpoint of another world size), and what reading
// throws.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "lib/loader.h"
#include "trainer/io/checkpoint.h"
#include "trainer/model/architecture_rows.h"
#include "trainer/model/config.h"
#include "trainer/run/draft_setup.h"
#include "trainer/run/options.h"
#include "trainer/run/run_setup.h"

namespace eaglekit::trainer {

// One decision, as a person reads it: "aux ids" = "2,16,29", because "EAGLE-3's default ...".
struct PlanDecision {
  std::string name;
  std::string value;
  std::string why;
};

struct RunPlan {
  enum class Purpose { kTrain, kEvaluate };
  Purpose purpose = Purpose::kTrain;

  // --- what open_run builds the run from -----------------------------------------------
  // The options, checked. For evaluate: its options in TrainOptions' groups (the ones train
  // has and evaluate does not keep their defaults, unused), after what came from the run.
  TrainOptions options;
  BaseConfig base;
  // The train split (evaluate: the split it scores), and the eval split when evaluation runs
  // (--eval-every >= 0 and the split is not empty; else null).
  std::shared_ptr<const SelectedData> train_data, eval_data;
  RecordShape shape;  // of the first record that opens
  // Records that store the target's distribution instead of hidden states (NeMo AutoModel's
  // EAGLE-3 cache; shape.target_probs_width > 0): the draft vocabulary it is over. The run's
  // targets are those distributions (TttBatch::target_probs), the draft's d2t is theirs, and
  // only the soft cross-entropy trains; the norm form is moot.
  struct StoredTargets {
    std::string source;                  // the first cache's manifest
    std::vector<std::int64_t> selected;  // selected_token_ids: draft id i is target id selected[i]
    std::int64_t target_vocab = 0;       // the caches' target_vocab_size
    std::int64_t topk = 0;               // the largest target_probs_topk among the caches (0: full)
    at::Tensor d2t() const;              // [Vd] int64: selected[i] - i
  };
  std::optional<StoredTargets> stored_targets;
  NormPlan norm;      // over the records the run reads
  DraftDecision draft;
  DraftOrigin::Kind draft_kind = DraftOrigin::Kind::kFresh;
  std::string draft_dir;  // the checkpoint resumed, or the --init-draft / --draft folder
  // evaluate's --draft as read. Training reads an --init-draft here to decide, then again in
  // open_run: a draft's construction draws from LibTorch's global generator, and the run
  // seeds that first (--seed), so the random state its checkpoints save stays what it was.
  std::shared_ptr<const DraftModel> loaded_draft;
  std::string loaded_layout;  // what load_draft recognised in the --init-draft / --draft folder
  std::int64_t resume_step = -1;  // the resumed checkpoint's step; -1 fresh
  // Resume: whether the schedule continues (the run says it once the checkpoint is open; a
  // plan prints it among its notes).
  std::vector<std::string> schedule_said;
  TttOptions ttt;                 // the unroll's (steps, decay, autocast, norm form, kernel)
  // A DFlash draft (the block unroll, trainer/unroll/dflash.h) takes these instead; block()
  // says which unroll the draft's row names.
  DFlashOptions dflash;
  bool block() const { return draft_architecture(draft.config.architecture).unroll() == DraftUnrollKind::kBlock; }
  // The decay the figures are reported with: --loss-decay for TTT, 0 (the mean over every
  // counted position, TttStats::loss) for a block drafter.
  double report_decay() const { return block() ? 0.0 : options.loss_decay; }
  std::int64_t epochs = 1;        // the loader's; 0: until --max-steps
  std::int64_t micro_batches_per_epoch = 0;  // of a dp rank, in the epoch the run starts in

  // --- figures, for the user -----------------------------------------------------------
  std::string summary;               // what matched
  std::int64_t train_samples = 0, eval_samples = 0;
  std::int64_t hidden = 0, aux_layers = 0;  // of the data
  std::string draft_config_json;     // the config.json final/ would carry
  std::string rope;                  // "theta 500000, rope_scaling {...}"
  std::int64_t parameters = 0;       // trainable, of the draft
  int world_size = 1, dp_size = 1, cp_size = 1;
  int threads = 1;             // LibTorch's, at the start (trainer/run/threads.h)
  bool adapt_threads = false;  // train --adapt-threads
  std::string wait_policy;     // how OpenMP threads wait (lib/wait_policy.h), e.g. "passive"
  std::string malloc_policy;   // whether freed memory is kept for reuse (lib/malloc_policy.h)
  std::int64_t rows_per_step = 0;    // global: batch x grad_accum x dp
  std::int64_t steps_per_epoch = 0;  // optimizer steps
  std::int64_t total_steps = 0;      // what the schedule spans
  std::int64_t tokens_per_epoch = 0;  // real tokens of the train split (each sample cut at max_length)
  // Estimated device bytes per rank.
  double state_bytes = 0;       // draft weights + gradients + AdamW moments (float32)
  double base_bytes = 0;        // embed_tokens + lm_head
  double activation_bytes = 0;  // one micro-batch's unroll (TTT or DFlash's blocks), kept for backward
  double total_bytes() const { return state_bytes + base_bytes + activation_bytes; }
  // What the memory estimate is compared with: the host's MemAvailable for --device cpu; < 0
  // when not known (a GPU: a plan does not open --device). Above it: a warning.
  double available_bytes = -1;
  std::string available_source;  // "MemAvailable of this host", ...
  // Time (estimate_time): the run's floating-point work per rank (a model of the draft's
  // matmuls forward and backward, attention over the row, and the base's lm_head for the
  // targets; plan.cpp), and for --device cpu the rate of a float matmul measured here in the
  // compute dtype, which bounds the run's: eta_s is a lower bound. eta_s < 0: not estimated
  // (eta_basis says why).
  double flops = 0;
  double measured_flops_per_s = 0;  // 0: not measured
  double eta_s = -1;
  std::string eta_basis;
  std::string schedule;              // the learning-rate schedule with a few of its rates
  std::int64_t median_tokens = 0;    // of the train records, cut at max_length
  double padding_share = 0;          // --mode pad: share of row tokens that are padding
  std::vector<std::string> notes;    // defaults applied, as the run says them
  // Things that would waste the run: warmup not shorter than it, padding above half of
  // every row in pad mode, more memory than this host has.
  std::vector<std::string> warnings;
  std::vector<PlanDecision> decisions;  // each decision and why, in the order made

  std::string to_text() const;
  std::string to_json() const;
};

// `train`'s plan for a job of `world_size` ranks (1 outside a launch: a dry run never joins
// a mesh); options.cp_size of them per context-parallel group.
RunPlan resolve(const TrainOptions& options, int world_size = 1);
// `evaluate`'s plan: the draft folder (an export, a checkpoint, or a run folder's newest
// checkpoint) read and checked against the base and the data, one split, one epoch.
RunPlan resolve(const EvaluateOptions& options, int world_size = 1);

// A dry run's time estimate into `plan` (flops, and for --device cpu a matmul timed here);
// also notes that --device was not checked where this LibTorch has no CUDA.
void estimate_time(RunPlan& plan);

// The rate of a float32 (or bfloat16) 512 x 512 matmul on this host's CPU with LibTorch's
// current threads, timed for about 0.2 s: what bounds a CPU estimate of time. 0 when the
// timing failed.
double measure_cpu_matmul_flops_per_s(bool bfloat16 = false);
// 3.2e12 -> "3.2 TFLOP".
std::string flops_text(double flops);

}  // namespace eaglekit::trainer
