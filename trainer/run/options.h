// The option groups of the torch commands (train, evaluate, export), as tables
// (lib/options.h): the model ("Model"), the optimisation ("Optimization") and the run
// ("Run"). With lib/data_options.h's "Data" and "Batches" they make TrainOptions and
// EvaluateOptions (one struct per group; every field has its one default here), whose checks
// are here too. LibTorch-free.
//
// Thread safety: plain structs. Errors: UsageError from the tables.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "lib/data_options.h"
#include "lib/options.h"
#include "trainer/attention/kind.h"

namespace eaglekit::trainer {

enum class Schedule { kCosine, kLinear, kConstant };
inline constexpr NameTable<Schedule, 3> kScheduleNames{
    {{Schedule::kCosine, "cosine"}, {Schedule::kLinear, "linear"}, {Schedule::kConstant, "constant"}}};
inline std::string_view schedule_name(Schedule s) { return name_in(kScheduleNames, s); }
inline std::optional<Schedule> parse_schedule(std::string_view name) { return value_in(kScheduleNames, name); }

// --optimizer: AdamW on every parameter, or Muon on the 2-D weight matrices with AdamW on the
// rest (trainer/run/optim.h). --muon-adjust-lr: how Muon scales its learning rate by a
// matrix's shape (torch.optim.Muon's adjust_lr_fn).
enum class OptimizerKind { kAdamW, kMuon };
inline constexpr NameTable<OptimizerKind, 2> kOptimizerNames{{{OptimizerKind::kAdamW, "adamw"}, {OptimizerKind::kMuon, "muon"}}};
enum class MuonLrAdjust { kMatchRmsAdamW, kOriginal };
inline constexpr NameTable<MuonLrAdjust, 2> kMuonLrAdjustNames{
    {{MuonLrAdjust::kMatchRmsAdamW, "match-rms-adamw"}, {MuonLrAdjust::kOriginal, "original"}}};

// The compute dtype of the draft's forward and backward: float32, or bfloat16 autocast
// (weights and optimizer state stay float32).
enum class ComputeDType { kFloat32, kBFloat16 };

// Where a dump took the last layer's hidden states (the targets' input): after the base's
// final norm (post: what Hugging Face's output_hidden_states[-1] holds, ModelOpt's HF
// dumper, SpecForge) or before it (pre: the last decoder layer's output).
// auto: the form each record states, else the one its layout implies, else measured through
// the base's head (trainer/run/run_setup.h plan_hidden_states_norm).
enum class HiddenStatesNorm { kPost, kPre, kAuto };
inline constexpr NameTable<HiddenStatesNorm, 3> kHiddenStatesNormNames{
    {{HiddenStatesNorm::kPost, "post"}, {HiddenStatesNorm::kPre, "pre"}, {HiddenStatesNorm::kAuto, "auto"}}};

// --draft-arch: the draft architecture row of a fresh draft (trainer/model/architecture.h);
// auto: EAGLE-3 for a fresh draft, else the --init-draft's or the checkpoint's.
enum class DraftArch { kAuto, kEagle3, kEagle31, kDFlash };
inline constexpr NameTable<DraftArch, 4> kDraftArchNames{{{DraftArch::kAuto, "auto"},
                                                          {DraftArch::kEagle3, "eagle3"},
                                                          {DraftArch::kEagle31, "eagle3.1"},
                                                          {DraftArch::kDFlash, "dflash"}}};
// --dflash-weights: how DFlash's loss weighs block positions (trainer/unroll/dflash.h
// DFlashWeighting): D-PACE (ModelOpt 0.47's default) or an exponential decay.
enum class DFlashWeights { kDpace, kDecay };
inline constexpr NameTable<DFlashWeights, 2> kDFlashWeightsNames{
    {{DFlashWeights::kDpace, "dpace"}, {DFlashWeights::kDecay, "decay"}}};
// --fc-norm: EAGLE 3.1's norm on the fc input (DraftConfig::fc_norm, norm_before_fc); auto:
// per-layer for eagle3.1, none for eagle3.
enum class FcNorm { kAuto, kPerLayer, kConcat, kNone };
inline constexpr NameTable<FcNorm, 4> kFcNormNames{
    {{FcNorm::kAuto, "auto"}, {FcNorm::kPerLayer, "per-layer"}, {FcNorm::kConcat, "concat"}, {FcNorm::kNone, "none"}}};
// --norm-output (DraftConfig::norm_output); auto: on for eagle3.1, off for eagle3.
enum class Switch { kAuto, kOn, kOff };
inline constexpr NameTable<Switch, 3> kSwitchNames{{{Switch::kAuto, "auto"}, {Switch::kOn, "on"}, {Switch::kOff, "off"}}};

// --keep-best: which checkpoint OUT/best/ holds (trainer/io/checkpoint.h): none, or the one
// with the highest eval est_ar.
enum class KeepBest { kNone, kEstAr };

struct ModelOptions {
  std::string base;                          // Hugging Face base model folder
  std::string init_draft;                    // start from an exported draft folder ("" fresh)
  std::int64_t draft_vocab_size = 0;         // 0: the base vocabulary
  std::int64_t draft_layers = 0;             // decoder layers N; 0: 1 fresh, else the draft's
  std::string d2t;                           // d2t.pt (eaglekit vocab); "" count over the train split
  std::vector<std::int64_t> aux_layer_ids;   // as dumped (HF hidden_states indices)
  bool modelopt_norm = false;
  DraftArch draft_arch = DraftArch::kAuto;   // a fresh draft's row; else must match the draft's
  FcNorm fc_norm = FcNorm::kAuto;
  Switch norm_output = Switch::kAuto;
  bool norm_before_residual = false;         // the first layer's residual is hidden_norm(h)
  bool allow_unservable = false;             // train (and write final/ for) a draft no engine computes
  std::int64_t ttt_steps = 3;
  double loss_decay = 0.9;
  std::string loss;                          // trainer/unroll/losses.h spec; "": kl (soft CE)
  HiddenStatesNorm hidden_states_norm = HiddenStatesNorm::kAuto;
  TttAttention ttt_attention = TttAttention::kAuto;
  // DFlash (--draft-arch dflash; docs/dflash.md). block_size 0: a fresh draft takes 8
  // (ModelOpt 0.47's default), else the draft's; mask_token_id < 0: the draft's, required
  // for a fresh one.
  std::int64_t block_size = 0;
  std::int64_t mask_token_id = -1;
  std::int64_t dflash_anchors = 512;
  DFlashWeights dflash_weights = DFlashWeights::kDpace;
  double dpace_alpha = 0.5;
  double dflash_decay = 0.0;  // gamma of --dflash-weights decay; 0: every position alike
  Switch dflash_distill = Switch::kOn;  // the teacher: the base's distribution (on) or the dumped token (off)
};

struct OptimOptions {
  std::int64_t grad_accum = 1;
  double lr = 1e-4;
  std::int64_t warmup_steps = 0;
  Schedule schedule = Schedule::kCosine;
  double weight_decay = 0.0;
  double grad_clip = 1.0;  // <= 0: off
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.999;
  double adam_eps = 1e-8;
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  double muon_lr = 0;  // 0: lr
  double muon_momentum = 0.95;
  double muon_weight_decay = 0.1;
  std::int64_t muon_ns_steps = 5;
  MuonLrAdjust muon_adjust_lr = MuonLrAdjust::kMatchRmsAdamW;
  std::int64_t epochs = 0;     // 0: 1, unless max_steps is set (then unbounded)
  std::int64_t max_steps = 0;  // optimizer steps; 0: no limit

  // Epochs the loader runs: epochs, else 1, or 0 (no limit) when only max_steps is set.
  std::int64_t effective_epochs() const { return epochs > 0 ? epochs : (max_steps > 0 ? 0 : 1); }
  // Optimizer steps of one epoch of `micro_batches` batches, and of the whole run (what the
  // learning-rate schedule spans).
  std::int64_t steps_per_epoch(std::int64_t micro_batches) const { return (micro_batches + grad_accum - 1) / grad_accum; }
  std::int64_t total_steps(std::int64_t micro_batches) const {
    const std::int64_t e = effective_epochs();
    const std::int64_t t = e > 0 ? steps_per_epoch(micro_batches) * e : max_steps;
    return max_steps > 0 && max_steps < t ? max_steps : t;
  }
};

struct RunOptions {
  std::string out;
  std::string device = "cpu";  // cpu, cuda, cuda:N
  ComputeDType compute_dtype = ComputeDType::kFloat32;
  int threads = 0;             // LibTorch intra-op threads; 0: the cores (trainer/run/threads.h)
  bool adapt_threads = false;  // fewer threads while other processes keep the cores busy
  int cp_size = 1;             // context-parallel size (world / cp = data-parallel size)
  double timeout = 300;        // seconds a rendezvous or collective may wait
  std::int64_t eval_every = 0;  // > 0: every N steps and at the end; 0: at the end; < 0: never
  std::int64_t save_every = 0;  // > 0: every N steps; a checkpoint is always saved at the end
  std::int64_t keep_checkpoints = 0;  // > 0: only the newest N checkpoint-STEP folders stay; 0 all
  KeepBest keep_best = KeepBest::kNone;
  std::int64_t log_every = 10;
  bool resume = false;
  std::string resume_from;      // checkpoint folder or output folder; "" = out
  std::string export_dtype;     // OUT/final dtype: "" the base's torch_dtype
  std::string tensorboard;      // TensorBoard event files: "" OUT/tensorboard
  bool no_tensorboard = false;  // write none
  bool progress = true;         // a progress line with ETA when stderr is a terminal
  // When stderr is not a terminal (a log): a plain progress line after the first step and
  // then every this many seconds; 0: none.
  double progress_every = 60;
  // Rows of a TTT step's lm_head + loss computed at a time (trainer/model/soft_ce.h): 0 all at
  // once, -1 auto (chunked only when a step's logits would exceed 256 MiB).
  std::int64_t loss_chunk_tokens = -1;
  // Recompute each decoder layer's projections and MLP in backward (TttOptions::recompute).
  bool recompute = false;
};

opt::Group model_options(ModelOptions& m);
opt::Group optim_options(OptimOptions& o);
opt::Group run_options(RunOptions& r);

// --- the commands' options ----------------------------------------------------------

// Every option of `eaglekit train`, one struct per group (lib/data_options.h,
// trainer/run/options.h); the groups' tables drive its flags, help, --config keys and
// to_json. DataSelection::split is not a training option (train uses both splits);
// BatchOptions::pad_multiple and drop_last are (longest mode; a partial last batch).
struct TrainOptions : DataSelection, BatchOptions, ModelOptions, OptimOptions, RunOptions {
  // The tables of this struct's fields, in the order of the help text and of to_json.
  opt::Groups groups();
  // Canonical JSON (every option, keys as the tables name them). apply_json reads a
  // subset: keys may use '_' or '-' ("max_length", "max-length"); an unknown key or a
  // mistyped value throws UsageError naming the key and `where`.
  std::string to_json() const;
  void apply_json(const std::string& json_text, const std::string& where);
  // Throws UsageError naming the first option that cannot work: a required one missing, a
  // value outside its row's bound (opt::check_bounds), then what involves several options.
  void check() const;
};

// Every option of `eaglekit evaluate`: the groups of train that apply (the split defaults to
// eval and the order is the reference one), plus the draft to evaluate.
struct EvaluateOptions : DataSelection, BatchOptions, ModelOptions, RunOptions {
  std::string draft;              // exported draft or checkpoint folder, or a run folder
  std::int64_t max_batches = -1;  // < 0: the whole split
  // Options the user did not set (TrainOptions JSON keys; "ttt_steps", "max_length"): they
  // take the value the draft was trained with (trainer/io/checkpoint.h trained_with) when its
  // run's train_options.json is found, else keep their own; the report says which applied.
  std::vector<std::string> from_run;
  EvaluateOptions() {
    split = "eval";
    shuffle = false;
  }
  opt::Groups groups();
  void check() const;  // UsageError naming the first option that cannot work (as TrainOptions)
};

// "cpu", "cuda", "cuda:N" as the (LibTorch-free) parts of a device: UsageError otherwise.
struct DeviceName {
  bool cuda = false;
  int index = 0;
};
DeviceName parse_device_name(const std::string& name);

}  // namespace eaglekit::trainer
