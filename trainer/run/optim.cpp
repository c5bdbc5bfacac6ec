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

void AdamW::load_state(const std::vector<std::pair<std::string, at::Tensor>>& tensors, std::int64_t steps,
                       const std::string& where) {
  std::map<std::string, at::Tensor> by_name(tensors.begin(), tensors.end());
  at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    for (auto* slot : {&exp_avg_[i], &exp_avg_sq_[i]}) {
      const std::string name = (slot == &exp_avg_[i] ? "exp_avg." : "exp_avg_sq.") + params_[i].first;
      const auto it = by_name.find(name);
      if (it == by_name.end()) throw FormatError(where, std::nullopt, name, "missing optimizer state");
      if (it->second.sizes() != slot->sizes()) {
        throw FormatError(where, std::nullopt, name,
                          "shape " + c10::str(it->second.sizes()) + ", the parameter has " + c10::str(slot->sizes()));
      }
      slot->copy_(it->second);
    }
  }
  steps_ = steps;
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
