// The optimizer side of training: the learning-rate schedule, AdamW exactly as
// torch.optim.AdamW, Muon as torch.optim.Muon (paired with AdamW as speculators 0.9 pairs
// them), and global gradient-norm clipping as torch.nn.utils.clip_grad_norm_.
//
// Thread safety: an optimizer is used by one thread at a time. Errors: load_state throws
// FormatError for missing or mis-shaped state; c10::Error from LibTorch.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "trainer/run/options.h"

namespace eaglekit::trainer {

// --- learning-rate schedule (Schedule is in trainer/run/options.h) -------------------------

// The learning rate of update number `step` (0-based): linear warmup from lr/warmup to lr
// over the first `warmup_steps` updates, then cosine or linear decay to 0 at
// `total_steps` (constant: lr). As Hugging Face's get_{cosine,linear,constant}_schedule_
// with_warmup, except that warmup starts at lr/warmup rather than 0 (an update at lr 0 is
// wasted).
double learning_rate(double lr, Schedule schedule, std::int64_t warmup_steps, std::int64_t total_steps,
                     std::int64_t step);
// The schedule in words, with the rate at a few steps (1-based, as the metrics count them):
// "cosine, warmup 200 steps to 0.0001, then to 0 at step 10000: step 1 5e-07, step 200
// 0.0001, step 5100 5e-05, step 10000 ...".
std::string schedule_text(double lr, Schedule schedule, std::int64_t warmup_steps, std::int64_t total_steps);
// A warning when the run never leaves warmup (warmup_steps >= total_steps): the peak rate is
// never reached and the draft barely trains. "" when the schedule is sound.
std::string schedule_warning(double lr, Schedule schedule, std::int64_t warmup_steps, std::int64_t total_steps);

// --- optimizer -------------------------------------------------------------------------

// AdamW exactly as torch.optim.AdamW (decoupled weight decay p -= lr * wd * p, bias
// corrected moments, eps outside the square root). Weight decay applies to matrices only;
// 1-D parameters (the RMSNorm weights) are not decayed, as Hugging Face's Trainer does.
// Moments are float32 on the parameters' device.
class AdamW {
 public:
  struct Options {
    double beta1 = 0.9;
    double beta2 = 0.999;
    double eps = 1e-8;
    double weight_decay = 0.0;
  };
  // params: name -> leaf tensor (shares storage with the model).
  AdamW(std::vector<std::pair<std::string, at::Tensor>> params, Options options);

  // One update with the gradients in p.grad(); parameters without a gradient are skipped.
  void step(double lr);
  void zero_grad();
  std::int64_t steps() const { return steps_; }
  const Options& options() const { return options_; }

  // "exp_avg.NAME" and "exp_avg_sq.NAME" for every parameter (CPU float32 copies).
  std::vector<std::pair<std::string, at::Tensor>> state() const;
  // Restores moments saved by state() after `steps` updates. Throws FormatError (path
  // `where`) when a tensor is missing or has the wrong shape.
  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& tensors, std::int64_t steps,
                  const std::string& where);

 private:
  std::vector<std::pair<std::string, at::Tensor>> params_;
  std::vector<at::Tensor> exp_avg_, exp_avg_sq_;
  std::vector<bool> decay_;
  Options options_;
  std::int64_t steps_ = 0;
};

// Muon (Jordan et al. 2024; torch.optim.Muon, which speculators 0.9 uses): per matrix W with
// gradient G, momentum buffer B (zero at first) and learning rate lr,
//   B <- mu B + (1 - mu) G;   U <- (1 - mu) G + mu B  (Nesterov; else U <- B)
//   O <- NS_k(U);   W <- W (1 - lr wd) - lr * adjust(R, C) * O
// NS_k: k Newton-Schulz iterations of X <- a X + (b A + c A^2) X, A = X X^T, from
// X = U / max(||U||_F, eps), on U^T when R > C (so A is the smaller Gram matrix). It maps U
// to roughly its orthogonal polar factor: the update has all singular values near 1.
// adjust: 0.2 sqrt(max(R, C)) (match-rms-adamw) or sqrt(max(1, R/C)) (original). NS runs
// in float32 here (torch runs it in bfloat16; that rounding is torch's, not the method's).
class Muon {
 public:
  struct Options {
    double momentum = 0.95;
    bool nesterov = true;
    double weight_decay = 0.1;
    std::int64_t ns_steps = 5;
    std::array<double, 3> ns_coefficients = {3.4445, -4.7750, 2.0315};
    double eps = 1e-7;
    MuonLrAdjust adjust_lr = MuonLrAdjust::kMatchRmsAdamW;
  };
  // params: name -> 2-D leaf tensor (shares storage with the model).
  Muon(std::vector<std::pair<std::string, at::Tensor>> params, Options options);

  // One update with the gradients in p.grad(); parameters without a gradient are skipped.
  void step(double lr);
  const Options& options() const { return options_; }
  // "momentum_buffer.NAME" for every parameter (CPU float32 copies).
  std::vector<std::pair<std::string, at::Tensor>> state() const;
  // Throws FormatError (path `where`) when a buffer is missing or has the wrong shape.
  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& tensors, const std::string& where);

 private:
  std::vector<std::pair<std::string, at::Tensor>> params_;
  std::vector<at::Tensor> momentum_;
  Options options_;
};

// NS_k(g) as above, in float32 (g 2-D).
at::Tensor newton_schulz(const at::Tensor& g, const std::array<double, 3>& coefficients, std::int64_t steps,
                         double eps);
// lr * adjust(R, C) for a matrix of `rows` x `cols`.
double muon_adjusted_lr(double lr, MuonLrAdjust adjust, std::int64_t rows, std::int64_t cols);
// Whether --optimizer muon gives `name` to Muon: a 2-D matrix with both sides > 1 whose name
// has none of speculators' AdamW hints (embed_tokens, lm_head: vocabulary-sized rows, which
// Muon's orthogonalisation does not suit).
bool muon_takes(const std::string& name, const at::Tensor& p);

// The draft's optimizer: AdamW on every parameter, or Muon on the muon_takes() matrices and
// AdamW on the rest. Both follow one schedule: step(lr) gives AdamW lr and Muon
// lr * muon_lr_ratio (--muon-lr / --lr), as speculators schedules each optimizer from its
// own base rate.
class DraftOptimizer {
 public:
  struct Options {
    AdamW::Options adamw;
    bool muon = false;
    Muon::Options muon_options;
    double muon_lr_ratio = 1.0;
  };
  DraftOptimizer(const std::vector<std::pair<std::string, at::Tensor>>& params, const Options& options);

  void step(double lr);
  void zero_grad();
  std::int64_t steps() const { return adamw_.steps(); }
  // The names Muon updates (empty without Muon).
  std::vector<std::string> muon_parameters() const;
  // AdamW's state, then Muon's ("momentum_buffer.NAME").
  std::vector<std::pair<std::string, at::Tensor>> state() const;
  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& tensors, std::int64_t steps,
                  const std::string& where);

 private:
  std::vector<std::pair<std::string, at::Tensor>> muon_params_;
  AdamW adamw_;
  std::optional<Muon> muon_;
  double muon_lr_ratio_;
};

// The options of the optimizer `o` selects (--optimizer, --adam-*, --weight-decay, --muon-*).
DraftOptimizer::Options draft_optimizer_options(const OptimOptions& o);
// The plan's line for it: "muon on the 2-D matrices but lm_head (...); adamw on the rest (...)".
std::string optimizer_text(const OptimOptions& o);

// Global L2 norm of the gradients (missing ones count as 0); when max_norm > 0 and the
// norm exceeds it, scales them by max_norm / (norm + 1e-6) as torch.nn.utils.clip_grad_norm_.
// Returns the norm before clipping (NaN/Inf pass through unclipped).
double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm);

}  // namespace eaglekit::trainer
