// Training checkpoints: OUT/checkpoint-STEP/, everything a run needs to continue exactly
// where it stopped.
//
//   config.json, model.safetensors  the draft in export format (trainer/io/export.h), in the
//                                   parameters' dtype (float32: bit-exact), so a checkpoint
//                                   is also a servable draft and an --init-draft folder
//   optimizer.safetensors           AdamW moments "exp_avg.NAME", "exp_avg_sq.NAME", and with
//                                   --optimizer muon Muon's "momentum_buffer.NAME" (float32)
//   rng.safetensors                 LibTorch generator states, uint8: "cpu", and per visible
//                                   CUDA device "cuda" (device 0), "cuda:1", "cuda:2", ...
//   trainer_state.json              {"format": "eaglekit-checkpoint", "version": 1, "step",
//                                   "epoch", "sampler": SamplerState, "optimizer_steps",
//                                   "schedule_total_steps", "tokens", "world_size", "cp_size"}
//   train_options.json              the TrainOptions of the run (TrainOptions::to_json)
//
// A checkpoint is written into OUT/.checkpoint-STEP.tmp-PID/ and renamed into place once
// every file is on disk, so a folder named checkpoint-STEP is always complete; an older
// folder of the same name is exchanged for it atomically (replace_folder_atomic). Temp
// folders left by a killed process are removed by the next save. find_latest_checkpoint()
// also checks that each file is present before it trusts a folder.
//
// Errors: IoError (cannot write, rename or read), FormatError (a file that does not parse or
// lacks a field). Not thread-safe; one writer (rank 0).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "lib/sampler.h"
#include "trainer/io/speculators_format.h"
#include "trainer/model/draft_model.h"

namespace eaglekit::trainer {

struct TrainerState {
  std::int64_t step = 0;  // optimizer steps done
  std::uint64_t epoch = 0;
  SamplerState sampler;   // the loader's state after the last batch of `step`
  std::int64_t optimizer_steps = 0;
  std::int64_t schedule_total_steps = 0;  // what the LR schedule was computed for
  double tokens = 0;                      // real tokens trained on so far (all ranks)
  int world_size = 1;
  int cp_size = 1;

  std::string to_json() const;
  static TrainerState from_json(const std::string& text, const std::string& where);
};

struct Checkpoint {
  TrainerState state;
  std::vector<std::pair<std::string, at::Tensor>> optimizer;  // AdamW::state()
  std::vector<std::pair<std::string, at::Tensor>> rng;        // generator name -> uint8 state
  std::string options_json;                                   // TrainOptions::to_json()
};

// "checkpoint-STEP"
std::string checkpoint_name(std::int64_t step);
// OUT/checkpoint-STEP, written atomically as described above. Returns the folder.
std::string save_checkpoint(const std::string& out_dir, const DraftModel& draft, const Checkpoint& ckpt);

// --keep-checkpoints N: once `newest` (a checkpoint folder just written below out_dir) is
// complete, removes every other checkpoint-STEP folder below out_dir but the N-1 with the
// highest steps, so that N remain. Each folder first goes out of sight in one rename (to a
// temp name the next save removes if the deletion is interrupted), so find_latest_checkpoint
// never sees half of one. best/ and final/ are not checkpoint-STEP folders and are never
// touched. keep <= 0: keeps all. Returns the folders removed. Throws IoError.
std::vector<std::string> prune_checkpoints(const std::string& out_dir, std::int64_t keep, const std::string& newest);

// --keep-best est_ar: OUT/best/ is a complete checkpoint (the files above) of the evaluation
// with the highest est_ar so far, plus best.json {"format": "eaglekit-best", "metric":
// "est_ar", "step", "est_ar", "checkpoint": "checkpoint-STEP"}. It is written like a
// checkpoint (temp folder, then one exchange), so it is always whole, and it is an export
// source and an --init-draft folder like any checkpoint. find_latest_checkpoint (resume)
// does not look at it.
constexpr const char* kBestFolder = "best";
constexpr const char* kBestFile = "best.json";
struct BestCheckpoint {
  std::string metric = "est_ar";
  std::int64_t step = 0;
  double est_ar = 0;
  std::string to_json() const;
};
// Writes OUT/best for `ckpt` (whose step is best.step). When `same_step` names a complete
// checkpoint of that step, its files are hard-linked (copied where links fail) instead of
// written again. Returns the folder.
std::string save_best_checkpoint(const std::string& out_dir, const DraftModel& draft, const Checkpoint& ckpt,
                                 const BestCheckpoint& best, const std::string& same_step = "");
// OUT/best/best.json; nullopt when absent. FormatError when it does not parse.
std::optional<BestCheckpoint> read_best(const std::string& out_dir);

struct LoadedCheckpoint {
  std::string dir;
  DraftModel draft;  // float32 on the CPU (trainer/io/export.h load_draft)
  Checkpoint checkpoint;
};
// Reads a folder written by save_checkpoint. Throws IoError / FormatError naming the file.
LoadedCheckpoint load_checkpoint(const std::string& dir);
// What a run decides from a checkpoint before it loads it (trainer/run/plan.h): its draft's
// config, its trainer state and the options it was saved with; no tensors. Throws as
// load_checkpoint.
struct CheckpointInfo {
  std::string dir;
  DraftConfig config;
  TrainerState state;
  std::string options_json;  // TrainOptions::to_json()
};
CheckpointInfo read_checkpoint_info(const std::string& dir);

// True when DIR holds every file of a checkpoint and its trainer_state.json parses.
bool is_complete_checkpoint(const std::string& dir);
// The complete checkpoint folder with the highest step directly below `out_dir`;
// nullopt when there is none (or out_dir does not exist).
std::optional<std::string> find_latest_checkpoint(const std::string& out_dir);
// The integer option `key` (a TrainOptions JSON key such as "ttt_steps") of the run that
// trained the draft in `source`: from its own train_options.json (a checkpoint), else from
// the newest checkpoint's beside it (OUT/final). The value and the file; nullopt when there
// is no such file or it lacks the key. FormatError for a file that is not JSON.
std::optional<std::pair<std::int64_t, std::string>> trained_with(const std::string& source, const std::string& key);
// `--resume [DIR]`: DIR itself when it is a complete checkpoint, else the newest complete
// checkpoint below it. Throws UsageError saying what was looked for when there is none.
std::string resolve_resume(const std::string& dir);

// The generator states of this process: "cpu", and one per visible CUDA device ("cuda",
// "cuda:1", ...; none without CUDA). Restoring sets each named generator that exists here
// and skips the states of devices not visible now.
std::vector<std::pair<std::string, at::Tensor>> capture_rng_state();
void restore_rng_state(const std::vector<std::pair<std::string, at::Tensor>>& states);

// `eaglekit export CHECKPOINT --out DIR`: a checkpoint (or any draft folder in export format,
// or an output folder: its newest checkpoint) re-exported, with the aux layer ids replaced
// when given (the ids the dump used) and the weights cast to `dtype` ("" keep; "bfloat16",
// "bf16", "float16", "fp16", "float32", "fp32").
//
// format "speculators" writes vLLM's speculators layout (trainer/io/speculators_format.h). Its
// speculative token count is `speculative_tokens`, else the --ttt-steps of the run that
// trained the draft (train_options.json of the checkpoint, or of the newest checkpoint
// beside the folder, as for OUT/final), else the source's own when it is a speculators
// draft (a DFlash draft: `speculative_tokens`, else block_size - 1, the block vLLM drafts
// being that plus one); its verifier is `verifier`, else the run's --base, else the source's. Neither is
// guessed: UsageError naming the option when none applies. Which one applied is in the
// report's notes.
struct ExportCheckpointOptions {
  std::vector<std::int64_t> aux_layer_ids;
  std::string dtype;  // "": the draft's serving dtype (the base's torch_dtype)
  bool allow_unservable = false;  // write a modelopt_norm draft anyway
  ExportFormat format = ExportFormat::kEaglekit;
  std::int64_t speculative_tokens = 0;  // speculators: 0 = derived as above
  std::string verifier;                 // speculators: "" = derived as above
};
struct ExportReport {
  std::string source;  // the folder read
  std::string layout;  // what load_draft recognised in it
  std::string out;
  std::string format;  // "eaglekit", "speculators"
  std::int64_t parameters = 0;
  std::string dtype;
  std::vector<std::int64_t> aux_layer_ids;
  std::int64_t speculative_tokens = 0;  // speculators only
  std::string verifier;                 // speculators only
  std::vector<std::string> notes;       // which default applied, for the user
  std::vector<std::string> warnings;    // for the user (a float32 export, ...)
  std::string to_json() const;
};
// The dtype a serving export is written in: `requested` if given, else the draft's serving
// dtype; a name that is no float dtype ("auto") falls back to bfloat16. Appends to
// `warnings` what a user should know: the fallback, and that SGLang's --dtype auto serves
// a float32 config as float16.
c10::ScalarType serving_export_dtype(const std::string& requested, const DraftConfig& config,
                                     std::vector<std::string>& warnings);
ExportReport export_checkpoint(const std::string& checkpoint, const std::string& out_dir,
                               const ExportCheckpointOptions& options = {});

// "bfloat16"/"bf16" -> kBFloat16, "float16"/"fp16"/"half" -> kHalf, "float32"/"fp32"/"float"
// -> kFloat; UsageError otherwise.
c10::ScalarType parse_float_dtype(const std::string& name);

}  // namespace eaglekit::trainer
