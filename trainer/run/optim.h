// The optimizer side of training: the learning-rate schedule, AdamW exactly as
// torch.optim.AdamW, and global gradient-norm clipping as torch.nn.utils.clip_grad_norm_.
//
// Thread safety: an AdamW is used by one thread at a time. Errors: AdamW::load_state throws
// FormatError for missing or mis-shaped moments; c10::Error from LibTorch.
#pragma once

#include <ATen/core/Tensor.h>

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

// Global L2 norm of the gradients (missing ones count as 0); when max_norm > 0 and the
// norm exceeds it, scales them by max_norm / (norm + 1e-6) as torch.nn.utils.clip_grad_norm_.
// Returns the norm before clipping (NaN/Inf pass through unclipped).
double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm);

}  // namespace eaglekit::trainer
