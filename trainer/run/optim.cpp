#include "trainer/run/optim.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "formats/error.h"

namespace eaglekit::trainer {

namespace {
constexpr double kPi = 3.14159265358979323846;
}  // namespace

// --- schedule --------------------------------------------------------------------------

double learning_rate(double lr, Schedule schedule, std::int64_t warmup_steps, std::int64_t total_steps,
                     std::int64_t step) {
  if (warmup_steps > 0 && step < warmup_steps)
    return lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  if (schedule == Schedule::kConstant) return lr;
  const double span = static_cast<double>(std::max<std::int64_t>(1, total_steps - warmup_steps));
  const double progress = std::clamp(static_cast<double>(step - warmup_steps) / span, 0.0, 1.0);
  if (schedule == Schedule::kLinear) return lr * (1.0 - progress);
  return lr * 0.5 * (1.0 + std::cos(kPi * progress));
}

namespace {

std::string rate_text(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", x);
  return buf;
}

}  // namespace

std::string schedule_text(double lr, Schedule schedule, std::int64_t warmup, std::int64_t total) {
  std::string s(schedule_name(schedule));
  if (warmup > 0) s += ", warmup " + std::to_string(warmup) + " steps to " + rate_text(lr);
  else s += " from " + rate_text(lr);
  if (schedule != Schedule::kConstant) s += ", then to 0 at step " + std::to_string(total);
  std::vector<std::int64_t> at = {1, std::min(warmup, total), (total + 1) / 2, total};
  std::sort(at.begin(), at.end());
  at.erase(std::unique(at.begin(), at.end()), at.end());
  std::string points;
  for (const std::int64_t k : at)
    if (k >= 1 && k <= total)
      points += (points.empty() ? "" : ", ") + ("step " + std::to_string(k) + " " +
                                                 rate_text(learning_rate(lr, schedule, warmup, total, k - 1)));
  return points.empty() ? s : s + ": " + points;
}

std::string schedule_warning(double lr, Schedule schedule, std::int64_t warmup, std::int64_t total) {
  if (warmup <= 0 || total <= 0 || warmup < total) return "";
  const double last = learning_rate(lr, schedule, warmup, total, total - 1);
  return "--warmup-steps " + std::to_string(warmup) + " is not shorter than the run (" + std::to_string(total) +
         " steps): the learning rate never leaves warmup and reaches only " + rate_text(last) + " (--lr " +
         rate_text(lr) + "); give fewer --warmup-steps (a few percent of the run) or more steps";
}

// --- AdamW -----------------------------------------------------------------------------

AdamW::AdamW(std::vector<std::pair<std::string, at::Tensor>> params, Options options)
    : params_(std::move(params)), options_(options) {
  at::NoGradGuard no_grad;
  for (const auto& [name, p] : params_) {
    exp_avg_.push_back(at::zeros_like(p, p.options().dtype(at::kFloat)));
    exp_avg_sq_.push_back(at::zeros_like(p, p.options().dtype(at::kFloat)));
    decay_.push_back(p.dim() >= 2);
  }
}

void AdamW::step(double lr) {
  at::NoGradGuard no_grad;
  ++steps_;
  const double b1 = options_.beta1, b2 = options_.beta2;
  const double bias1 = 1.0 - std::pow(b1, static_cast<double>(steps_));
  const double bias2_sqrt = std::sqrt(1.0 - std::pow(b2, static_cast<double>(steps_)));
  for (std::size_t i = 0; i < params_.size(); ++i) {
    at::Tensor p = params_[i].second;
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    if (decay_[i] && options_.weight_decay != 0) p.mul_(1.0 - lr * options_.weight_decay);
    exp_avg_[i].mul_(b1).add_(g, 1.0 - b1);
    exp_avg_sq_[i].mul_(b2).addcmul_(g, g, 1.0 - b2);
    const at::Tensor denom = (exp_avg_sq_[i].sqrt() / bias2_sqrt).add_(options_.eps);
    p.addcdiv_(exp_avg_[i], denom, -lr / bias1);
  }
}

void AdamW::zero_grad() {
  for (auto& [name, p] : params_) {
    if (p.grad().defined()) p.mutable_grad().reset();
  }
}

std::vector<std::pair<std::string, at::Tensor>> AdamW::state() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    out.emplace_back("exp_avg." + params_[i].first, exp_avg_[i].detach().to(at::kCPU).clone());
    out.emplace_back("exp_avg_sq." + params_[i].first, exp_avg_sq_[i].detach().to(at::kCPU).clone());
  }
  return out;
}

namespace {

// Copies the tensor named `name` of `by_name` into `slot`; FormatError (path `where`) when it
// is missing or mis-shaped.
void restore(const std::map<std::string, at::Tensor>& by_name, const std::string& name, at::Tensor& slot,
             const std::string& where) {
  const auto it = by_name.find(name);
  if (it == by_name.end()) throw FormatError(where, std::nullopt, name, "missing optimizer state");
  if (it->second.sizes() != slot.sizes()) {
    throw FormatError(where, std::nullopt, name,
                      "shape " + c10::str(it->second.sizes()) + ", the parameter has " + c10::str(slot.sizes()));
  }
  slot.copy_(it->second);
}

}  // namespace

void AdamW::load_state(const std::vector<std::pair<std::string, at::Tensor>>& tensors, std::int64_t steps,
                       const std::string& where) {
  const std::map<std::string, at::Tensor> by_name(tensors.begin(), tensors.end());
  at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    restore(by_name, "exp_avg." + params_[i].first, exp_avg_[i], where);
    restore(by_name, "exp_avg_sq." + params_[i].first, exp_avg_sq_[i], where);
  }
  steps_ = steps;
}

// --- Muon ------------------------------------------------------------------------------

at::Tensor newton_schulz(const at::Tensor& g, const std::array<double, 3>& coefficients, std::int64_t steps,
                         double eps) {
  TORCH_CHECK(g.dim() == 2, "newton_schulz takes a matrix, got ", g.sizes());
  const auto [a, b, c] = coefficients;
  const bool tall = g.size(0) > g.size(1);
  at::Tensor x = g.to(at::kFloat);
  if (tall) x = x.t();
  x = x / x.norm().clamp_min(eps);
  for (std::int64_t k = 0; k < steps; ++k) {
    const at::Tensor gram = at::mm(x, x.t());
    const at::Tensor poly = at::addmm(gram, gram, gram, /*beta=*/b, /*alpha=*/c);
    x = at::addmm(x, poly, x, /*beta=*/a, /*alpha=*/1.0);
  }
  return tall ? x.t().contiguous() : x;
}

double muon_adjusted_lr(double lr, MuonLrAdjust adjust, std::int64_t rows, std::int64_t cols) {
  const double r = static_cast<double>(rows), c = static_cast<double>(cols);
  if (adjust == MuonLrAdjust::kOriginal) return lr * std::sqrt(std::max(1.0, r / c));
  return lr * 0.2 * std::sqrt(std::max(r, c));
}

bool muon_takes(const std::string& name, const at::Tensor& p) {
  if (p.dim() != 2 || std::min(p.size(0), p.size(1)) <= 1) return false;
  for (const char* hint : {"embed_tokens", "lm_head"})
    if (name.find(hint) != std::string::npos) return false;
  return true;
}

Muon::Muon(std::vector<std::pair<std::string, at::Tensor>> params, Options options)
    : params_(std::move(params)), options_(options) {
  at::NoGradGuard no_grad;
  for (const auto& [name, p] : params_) {
    TORCH_CHECK(p.dim() == 2, "Muon takes matrices; ", name, " has shape ", p.sizes());
    momentum_.push_back(at::zeros_like(p, p.options().dtype(at::kFloat)));
  }
}

void Muon::step(double lr) {
  at::NoGradGuard no_grad;
  const double mu = options_.momentum;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    at::Tensor p = params_[i].second;
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    at::Tensor& buf = momentum_[i];
    buf.mul_(mu).add_(g, 1.0 - mu);
    const at::Tensor update = options_.nesterov ? g * (1.0 - mu) + buf * mu : buf;
    const at::Tensor o = newton_schulz(update, options_.ns_coefficients, options_.ns_steps, options_.eps);
    if (options_.weight_decay != 0) p.mul_(1.0 - lr * options_.weight_decay);
    p.add_(o, -muon_adjusted_lr(lr, options_.adjust_lr, p.size(0), p.size(1)));
  }
}

std::vector<std::pair<std::string, at::Tensor>> Muon::state() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (std::size_t i = 0; i < params_.size(); ++i)
    out.emplace_back("momentum_buffer." + params_[i].first, momentum_[i].detach().to(at::kCPU).clone());
  return out;
}

void Muon::load_state(const std::vector<std::pair<std::string, at::Tensor>>& tensors, const std::string& where) {
  const std::map<std::string, at::Tensor> by_name(tensors.begin(), tensors.end());
  at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < params_.size(); ++i)
    restore(by_name, "momentum_buffer." + params_[i].first, momentum_[i], where);
}

// --- the draft's optimizer ---------------------------------------------------------------

namespace {

using Named = std::vector<std::pair<std::string, at::Tensor>>;

// The parameters of `params` that Muon takes (want_muon) or leaves to AdamW.
Named split(const Named& params, bool muon, bool want_muon) {
  Named out;
  for (const auto& np : params)
    if ((muon && muon_takes(np.first, np.second)) == want_muon) out.push_back(np);
  return out;
}

}  // namespace

DraftOptimizer::DraftOptimizer(const Named& params, const Options& options)
    : muon_params_(split(params, options.muon, true)),
      adamw_(split(params, options.muon, false), options.adamw),
      muon_lr_ratio_(options.muon_lr_ratio) {
  if (options.muon) muon_.emplace(muon_params_, options.muon_options);
}

void DraftOptimizer::step(double lr) {
  adamw_.step(lr);
  if (muon_) muon_->step(lr * muon_lr_ratio_);
}

void DraftOptimizer::zero_grad() {
  adamw_.zero_grad();
  for (auto& [name, p] : muon_params_)
    if (p.grad().defined()) p.mutable_grad().reset();
}

std::vector<std::string> DraftOptimizer::muon_parameters() const {
  std::vector<std::string> out;
  for (const auto& np : muon_params_) out.push_back(np.first);
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> DraftOptimizer::state() const {
  auto out = adamw_.state();
  if (muon_)
    for (auto& np : muon_->state()) out.push_back(std::move(np));
  return out;
}

void DraftOptimizer::load_state(const std::vector<std::pair<std::string, at::Tensor>>& tensors, std::int64_t steps,
                                const std::string& where) {
  adamw_.load_state(tensors, steps, where);
  if (muon_) muon_->load_state(tensors, where);
}

DraftOptimizer::Options draft_optimizer_options(const OptimOptions& o) {
  DraftOptimizer::Options out;
  out.adamw.beta1 = o.adam_beta1;
  out.adamw.beta2 = o.adam_beta2;
  out.adamw.eps = o.adam_eps;
  out.adamw.weight_decay = o.weight_decay;
  out.muon = o.optimizer == OptimizerKind::kMuon;
  out.muon_options.momentum = o.muon_momentum;
  out.muon_options.weight_decay = o.muon_weight_decay;
  out.muon_options.ns_steps = o.muon_ns_steps;
  out.muon_options.adjust_lr = o.muon_adjust_lr;
  out.muon_lr_ratio = o.muon_lr > 0 ? o.muon_lr / o.lr : 1.0;
  return out;
}

std::string optimizer_text(const OptimOptions& o) {
  const std::string adamw = "betas " + rate_text(o.adam_beta1) + ", " + rate_text(o.adam_beta2) + ", eps " +
                            rate_text(o.adam_eps) + ", weight decay " + rate_text(o.weight_decay);
  if (o.optimizer == OptimizerKind::kAdamW) return "adamw (" + adamw + " on matrices)";
  return "muon on the 2-D matrices but lm_head (peak lr " + rate_text(o.muon_lr > 0 ? o.muon_lr : o.lr) + " x " +
         (o.muon_adjust_lr == MuonLrAdjust::kOriginal ? "sqrt(max(1, rows/cols))" : "0.2 sqrt(max(rows, cols))") +
         ", Nesterov momentum " + rate_text(o.muon_momentum) + ", " + std::to_string(o.muon_ns_steps) +
         " Newton-Schulz steps, weight decay " + rate_text(o.muon_weight_decay) + "); adamw on lm_head and the norms (" +
         adamw + ")";
}

double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> norms;
  for (const auto& p : params)
    if (p.grad().defined()) norms.push_back(p.grad().detach().to(at::kFloat).norm());
  if (norms.empty()) return 0.0;
  const double total = at::stack(norms).norm().item<double>();
  if (max_norm > 0 && std::isfinite(total)) {
    const double coef = max_norm / (total + 1e-6);
    if (coef < 1.0)
      for (const auto& p : params)
        if (p.grad().defined()) p.grad().mul_(coef);
  }
  return total;
}

}  // namespace eaglekit::trainer
