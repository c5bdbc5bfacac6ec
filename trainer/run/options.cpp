#include "trainer/run/options.h"

#include <string>

#include "formats/error.h"
#include "trainer/io/checkpoint.h"
#include "trainer/unroll/losses.h"

namespace eaglekit::trainer {

opt::Group model_options(ModelOptions& m) {
  using opt::at_least;
  using opt::field;
  using opt::note;
  return {"Model",
          {
              field("base", "DIR", m.base,
                    "Base model folder: config.json and the weights (model.safetensors, or the shards of "
                    "model.safetensors.index.json)"),
              field("init_draft", "DIR", m.init_draft, "Start from an exported draft folder (its config wins)"),
              note(at_least(field("draft_vocab_size", "N", m.draft_vocab_size, "Draft vocabulary size Vd"), 0),
                   "the d2t's size, else the base's vocab_size"),
              note(field("draft_layers", "N", m.draft_layers,
                         "Decoder layers of the draft: the first reads cat(emb, h), the others are plain "
                         "Llama layers (docs/draft.md; N > 1 serves as trained in vLLM, not SGLang)"),
                   "1 for a fresh draft, else the --init-draft's"),
              note(field("d2t", "FILE", m.d2t, "d2t.pt from eaglekit vocab"),
                   "counted over the train split when Vd < V"),
              note(field("aux_layer_ids", "IDS", m.aux_layer_ids,
                         "Aux layers of the dump, as HF hidden_states indices (e.g. 2,16,29)"),
                   "the data's, else 2,N/2,N-3 for 3 layers"),
              opt::choice_of("draft_arch", m.draft_arch, kDraftArchNames,
                             "Draft architecture (docs/draft.md): eagle3, eagle3.1 (EAGLE-3 with a learned norm "
                             "on the fc input and the final norm's output fed to the next step; served by vLLM >= "
                             "0.32), or dflash (the block-parallel drafter, docs/dflash.md); auto: eagle3 for a "
                             "fresh draft, else the --init-draft's or checkpoint's"),
              opt::choice_of("fc_norm", m.fc_norm, kFcNormNames,
                             "EAGLE 3.1's norm on the fc input: per-layer (one RMSNorm per aux layer, fc_norm), "
                             "concat (one over all of them, norm_before_fc), none; auto: per-layer for eagle3.1, "
                             "none for eagle3"),
              opt::choice_of("norm_output", m.norm_output, kSwitchNames,
                             "EAGLE 3.1's norm_output: the next TTT step takes the final norm's output instead of "
                             "the last layer's; auto: on for eagle3.1, off for eagle3"),
              field("norm_before_residual", "", m.norm_before_residual,
                    "The first layer's residual is hidden_norm(h) instead of h (vLLM's and speculators' "
                    "norm_before_residual)"),
              field("modelopt_norm", "", m.modelopt_norm,
                    "ModelOpt's form: input_layernorm also applied to the hidden input (no serving engine "
                    "computes it)"),
              field("allow_unservable", "", m.allow_unservable,
                    "Train and write final/ for a draft vLLM and SGLang do not compute (--modelopt-norm)"),
              at_least(field("ttt_steps", "S", m.ttt_steps, "Training-time test steps (docs/ttt.md)"), 1),
              opt::positive(field("loss_decay", "X", m.loss_decay, "Weight of TTT step s is X^s")),
              note(field("loss", "SPEC", m.loss,
                         "Per-position loss, as speculators 0.9 defines them: kl (forward KL, computed as the soft "
                         "cross-entropy), rkl, js, tv, nla, lk-hybrid, ce (hard labels), or a weighted mix "
                         "tv:0.9,ce:0.1 (trainer/unroll/losses.h); losses other than kl take each step's whole "
                         "logits"),
                   "kl"),
              opt::choice_of("hidden_states_norm", m.hidden_states_norm, kHiddenStatesNormNames,
                             "Whether the dump's hidden_states come after the base's final norm (post: HF "
                             "hidden_states[-1], ModelOpt's HF dumper, SpecForge) or before it (pre: the last "
                             "layer's output; the base's final RMSNorm is applied before lm_head). A record's "
                             "stored hidden_states_prenorm wins; post/pre is the form of records that state none "
                             "(over what their layout implies); auto: the stated form, else the one the record's "
                             "layout implies (speculators' stacked [T, k+1, H]: pre), else measured through the "
                             "base's head on a sample (the plan says which decided), an error (exit 2) when that "
                             "is unclear"),
              note(at_least(field("block_size", "N", m.block_size,
                                  "DFlash: tokens one draft forward covers, the anchor and N-1 predictions "
                                  "(speculators trains 16)"),
                            0),
                   "8 (ModelOpt 0.47's) for a fresh draft, else the draft's"),
              note(field("mask_token_id", "ID", m.mask_token_id,
                         "DFlash: the token fed at a block's unknown positions (a reserved or otherwise unused "
                         "token of the base's vocabulary; ModelOpt takes the tokenizer's mask token)"),
                   "required for a fresh DFlash draft, else the draft's"),
              at_least(field("dflash_anchors", "N", m.dflash_anchors,
                             "DFlash: blocks drawn per sequence (anchors inside the loss mask, seeded by --seed, "
                             "the epoch and the conversation id)"),
                       1),
              opt::choice_of("dflash_weights", m.dflash_weights, kDFlashWeightsNames,
                             "DFlash: the loss weights of block positions: dpace (D-PACE, what ModelOpt 0.47 uses unless told) "
                             "or decay (exp(-(k-1)/gamma), --dflash-decay)"),
              opt::at_most(opt::positive(field("dpace_alpha", "X", m.dpace_alpha, "DFlash: D-PACE's smoothing alpha")), 1),
              at_least(field("dflash_decay", "X", m.dflash_decay,
                             "DFlash: gamma of --dflash-weights decay (ModelOpt suggests 4 for block 8, 7 for 16; 0: "
                             "every position alike)"),
                       0),
              opt::choice_of("dflash_distill", m.dflash_distill, kSwitchNames,
                             "DFlash: on, each position learns the base's distribution (self-logit distillation, "
                             "ModelOpt's default); off, the dumped token (cross-entropy)"),
              opt::choice_of("ttt_attention", m.ttt_attention, kTttAttentionNames,
                             "TTT attention kernel (docs/ttt.md, two implementations): local keeps O(L^2) scores per "
                             "head for backward, tiled recomputes them in tiles and keeps O(L) (any device), fused "
                             "runs block 0 on LibTorch's fused attention kernels, O(L) (a build against LibTorch "
                             ">= 2.5); auto: fused where built, else tiled on the CPU from 512 positions and local "
                             "below and on GPUs"),
          }};
}

opt::Group optim_options(OptimOptions& o) {
  using opt::at_least;
  using opt::field;
  return {"Optimization",
          {
              at_least(field("grad_accum", "N", o.grad_accum, "Micro-batches per optimizer step"), 1),
              opt::finite(opt::positive(field("lr", "X", o.lr, "Peak learning rate"))),
              at_least(field("warmup_steps", "N", o.warmup_steps, "Linear warmup steps"), 0),
              opt::choice_of("schedule", o.schedule, kScheduleNames, "Learning-rate decay after warmup"),
              at_least(field("weight_decay", "X", o.weight_decay, "AdamW weight decay on matrices"), 0),
              field("grad_clip", "X", o.grad_clip, "Clip the global gradient norm to X (0: off)"),
              opt::below(at_least(field("adam_beta1", "X", o.adam_beta1, "AdamW beta1"), 0), 1),
              opt::below(at_least(field("adam_beta2", "X", o.adam_beta2, "AdamW beta2"), 0), 1),
              opt::positive(field("adam_eps", "X", o.adam_eps, "AdamW eps")),
              opt::choice_of("optimizer", o.optimizer, kOptimizerNames,
                             "adamw on every parameter, or muon: Newton-Schulz orthogonalised momentum on the 2-D "
                             "weight matrices but lm_head, AdamW (the --adam-* and --weight-decay options) on "
                             "lm_head and the norms, as speculators 0.9 pairs them (muon is what its CLI uses unless told)"),
              opt::note(opt::finite(at_least(field("muon_lr", "X", o.muon_lr,
                                                   "Muon's peak learning rate, on the same schedule as --lr"),
                                             0)),
                        "--lr"),
              opt::below(at_least(field("muon_momentum", "X", o.muon_momentum, "Muon momentum (Nesterov)"), 0), 1),
              at_least(field("muon_weight_decay", "X", o.muon_weight_decay, "Muon decoupled weight decay"), 0),
              opt::at_most(at_least(field("muon_ns_steps", "N", o.muon_ns_steps, "Muon Newton-Schulz iterations"), 1),
                           99),
              opt::choice_of("muon_adjust_lr", o.muon_adjust_lr, kMuonLrAdjustNames,
                             "Muon's learning rate per matrix of R x C: match-rms-adamw scales it by "
                             "0.2 sqrt(max(R, C)) (an update of AdamW's RMS, so --lr carries over), original by "
                             "sqrt(max(1, R/C))"),
              opt::note(at_least(field("epochs", "N", o.epochs, "Epochs"), 0),
                        "1, or no limit when only --max-steps is given"),
              opt::note(at_least(field("max_steps", "N", o.max_steps, "Stop after this many optimizer steps"), 0),
                        "no limit"),
          }};
}

opt::Group run_options(RunOptions& r) {
  using opt::at_least;
  using opt::field;
  using opt::note;
  return {"Run",
          {
              field("out", "DIR", r.out, "Output folder"),
              field("device", "NAME", r.device, "cpu, cuda or cuda:N"),
              opt::alias(opt::choice("compute_dtype", r.compute_dtype,
                                     {{ComputeDType::kFloat32, "fp32"},
                                      {ComputeDType::kBFloat16, "bf16"},
                                      {ComputeDType::kFloat32, "float32"},
                                      {ComputeDType::kBFloat16, "bfloat16"}},
                                     "Compute dtype: fp32, or bf16 autocast (weights and optimizer state stay fp32)"),
                         "dtype"),
              note(at_least(field("threads", "N", r.threads, "LibTorch threads"), 0),
                   "OMP_NUM_THREADS if set, else the cores this process may run on, shared by a launch's local "
                   "ranks; the run says which"),
              field("adapt_threads", "", r.adapt_threads,
                    "Run fewer threads (never more than --threads) while other processes keep the cores busy, "
                    "and go back up when they are free; each count is kept only where it measured faster. The "
                    "thread count changes float rounding: a run that adapts is not bit-reproducible "
                    "(docs/benchmarks.md, \"Under load\")"),
              opt::flag_named(at_least(field("cp_size", "N", r.cp_size,
                                             "Context-parallel size (world / cp = data-parallel size)"),
                                       1),
                              "cp"),
              opt::refusal(opt::at_most(opt::positive(field("timeout", "SECONDS", r.timeout,
                                                            "How long a rendezvous or collective may wait for the "
                                                            "other ranks before the job fails")),
                                        7 * 24 * 3600.0),
                           "takes a positive number of seconds (at most a week), not {}"),
              field("eval_every", "N", r.eval_every, "Evaluate every N steps (0: at the end only; -1: never)"),
              note(field("save_every", "N", r.save_every, "Checkpoint every N steps (one is always saved at the end)"),
                   "at the end only"),
              note(opt::refusal(at_least(field("keep_checkpoints", "N", r.keep_checkpoints,
                                               "Keep only the newest N checkpoint-STEP folders in --out: an older "
                                               "one is deleted once a new one is completely written; --resume still "
                                               "finds the newest; best/ is never deleted (0: keep all)"),
                                         0),
                                "must not be negative (N > 0 keeps the newest N; 0 keeps all), not {}"),
                   "0, keep all"),
              opt::choice("keep_best", r.keep_best, {{KeepBest::kNone, "none"}, {KeepBest::kEstAr, "est_ar"}},
                          "Keep OUT/best/, a checkpoint of the evaluation with the highest est_ar so far, with "
                          "best.json naming its step and est_ar (needs evaluation: --eval-every >= 0 and "
                          "--eval-fraction > 0); export takes it like any checkpoint"),
              at_least(field("log_every", "N", r.log_every, "A metrics line every N steps"), 1),
              opt::optional_value("resume", "[DIR]", r.resume, r.resume_from,
                                  "Continue from the newest complete checkpoint in DIR (default: --out)"),
              opt::json_only(field("resume_from", "DIR", r.resume_from, "")),
              note(field("export_dtype", "DTYPE", r.export_dtype, "dtype of OUT/final: bf16, fp16 or fp32"),
                   "the base's torch_dtype"),
              note(field("tensorboard", "DIR", r.tensorboard, "Folder of the TensorBoard event files"), "OUT/tensorboard"),
              field("no_tensorboard", "", r.no_tensorboard, "Write no TensorBoard event files"),
              field("progress", "", r.progress,
                    "A progress line on stderr: redrawn on a terminal; in a log (not a terminal) a plain line "
                    "after the first step and every --progress-every seconds"),
              opt::refusal(opt::finite(at_least(field("progress_every", "SECONDS", r.progress_every,
                                                      "Seconds between the plain progress lines when stderr is not "
                                                      "a terminal (0: none)"),
                                                0)),
                           "takes seconds, 0 or more (0: no plain progress lines)"),
              note(field("loss_chunk_tokens", "N", r.loss_chunk_tokens,
                         "Tokens of a TTT step's lm_head and loss computed at a time, so the step's [tokens, Vd] "
                         "logits are never whole (0: all at once; docs/ttt.md)"),
                   "-1: auto, chunks only when a step's logits would exceed 2^26 values (256 MiB)"),
              field("recompute", "", r.recompute,
                    "Recompute each draft layer's projections and MLP in backward instead of keeping their "
                    "activations: the same result in less memory, for one more forward of those pieces per step "
                    "(docs/ttt.md, recomputation)"),
          }};
}

// --- train ----------------------------------------------------------------------------

opt::Groups TrainOptions::groups() {
  return {data_options(*this).without({"split"}), batch_options(*this), model_options(*this), optim_options(*this),
          run_options(*this)};
}

std::string TrainOptions::to_json() const { return opt::to_json(const_cast<TrainOptions&>(*this).groups()); }

void TrainOptions::apply_json(const std::string& json_text, const std::string& where) {
  opt::apply_json(groups(), json_text, where);
}

void TrainOptions::check() const {
  if (index.empty()) throw UsageError("--index is required (build one with eaglekit index)");
  if (base.empty()) throw UsageError("--base is required (the base model folder)");
  if (out.empty()) throw UsageError("--out is required (the output folder)");
  opt::check_bounds(const_cast<TrainOptions&>(*this).groups());  // reads only
  check_ttt_attention(ttt_attention);
  parse_loss_spec(loss);
  if (keep_best != KeepBest::kNone) {
    if (eval_every < 0)
      throw UsageError("--keep-best est_ar needs evaluation, which --eval-every " + std::to_string(eval_every) +
                       " turns off: set --eval-every N (every N steps) or 0 (at the end)");
    if (!(eval_fraction > 0))
      throw UsageError("--keep-best est_ar needs an eval split: set --eval-fraction above 0 (it enables evaluation)");
  }
  if (adapt_threads && device != "cpu")
    throw UsageError("--adapt-threads adapts the CPU's LibTorch threads; with --device " + device +
                     " the work runs elsewhere: leave it out");
  if (!export_dtype.empty()) parse_float_dtype(export_dtype);
  parse_device_name(device);  // run_training checks that the device is there
}

// --- evaluate -------------------------------------------------------------------------

opt::Groups EvaluateOptions::groups() {
  opt::Group own{"Evaluate",
                 {opt::field("draft", "DIR", draft,
                             "Draft folder: an export, a checkpoint, or a run folder (its newest checkpoint)"),
                  opt::note(opt::field("max_batches", "N", max_batches, "Stop after N batches"), "the whole split")}};
  // Train's bounds, but --eval-fraction may be 1 (every sample eval), which train refuses
  // for leaving it nothing to train on.
  return {own,
          split_data_options(*this),
          batch_options(*this).only({"batch_size", "max_length", "mode", "pad_multiple", "jobs", "prefetch"}),
          model_options(*this).only({"base", "ttt_steps", "loss_decay", "loss", "hidden_states_norm", "ttt_attention"}),
          run_options(*this).only({"device", "compute_dtype", "threads", "cp_size", "timeout", "progress"})};
}

void EvaluateOptions::check() const {
  if (base.empty()) throw UsageError("--base is required (the base model folder)");
  if (draft.empty()) throw UsageError("--draft is required (an exported draft or a checkpoint)");
  if (index.empty()) throw UsageError("--index is required (build one with eaglekit index)");
  opt::check_bounds(const_cast<EvaluateOptions&>(*this).groups());  // reads only
  check_ttt_attention(ttt_attention);
  parse_loss_spec(loss);
}

// --- names -----------------------------------------------------------------------------

DeviceName parse_device_name(const std::string& name) {
  if (name == "cpu") return {};
  if (name == "cuda") return {true, 0};
  if (name.rfind("cuda:", 0) == 0) {
    const std::string idx = name.substr(5);
    if (idx.empty() || idx.find_first_not_of("0123456789") != std::string::npos || idx.size() > 3)
      throw UsageError("--device '" + name + "': expected cuda:N");
    return {true, std::stoi(idx)};
  }
  throw UsageError("--device must be cpu, cuda or cuda:N, not '" + name + "'");
}

}  // namespace eaglekit::trainer
