// How far apart the weights of two AdamW runs may end when their gradients agree at every
// step to a relative `rho` (of the largest gradient of each tensor), and a check of two runs'
// weights against that bound, element by element. Two computations of the same training that
// sum in another order (DP against one process, CP, gradient accumulation, another BLAS
// kernel) agree this way; a fixed relative bound on the weights does not hold for them,
// because AdamW divides each element's update by the root of its own second moment: where a
// gradient is near zero, rounding decides its update's sign.
//
// The bound, for one element after steps t = 1..T with learning rates lr_t (docs/testing.md):
//   |w_a - w_b| <= sum_t lr_t * e_t + kWeightRounding * max|w|
//   e_t = min(2 U_t, 2 d_t (1 + U_t S_t) / (sqrt(v_t / (1 - b2^t)) + eps))
// - U_t bounds |m_hat / (sqrt(v_hat) + eps)| for any gradients (Cauchy-Schwarz over the
//   moments' weights), so no rounding moves one step by more than 2 U_t lr_t (about 2 lr);
// - the second term is the first-order change of the update under gradient errors of at most
//   d_t = rho * max_{i<=t} G_i, with a factor 2 for the higher orders; S_t sums the weights
//   with which past gradients enter sqrt(v_hat);
// - v_t is the reference run's second moment after step t (exp_avg_sq), and G_i a bound on
//   the tensor's largest gradient at step i, sqrt(max v_i / (1 - b2)).
// Weight decay only shrinks differences, so it adds nothing. Header-only and LibTorch-free:
// the CLI tests read checkpoints with SafetensorsFile.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "formats/safetensors_format.h"

namespace eaglekit::test {

struct AdamWHyper {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
};

// The float32 rounding of the weights themselves over a few updates (a few ulps of the
// largest weight).
constexpr double kWeightRounding = 1e-6;

class AdamWBound {
 public:
  // rho: how closely the two runs' gradients agree, relative to each tensor's largest.
  explicit AdamWBound(double rho, AdamWHyper h = {}) : rho_(rho), h_(h) {}

  // Step t = steps() + 1 of the reference run: its learning rate and, per tensor, the second
  // moment exp_avg_sq after the update (flattened).
  void add_step(double lr, const std::map<std::string, std::vector<double>>& exp_avg_sq) {
    const double t = static_cast<double>(++steps_);
    const double b1 = h_.beta1, b2 = h_.beta2;
    double ratio_sum = 0, s = 0;  // sum_j (b1^2/b2)^j for j < t; sum_i b_i for i <= t
    for (std::int64_t j = 0; j < steps_; ++j) {
      ratio_sum += std::pow(b1 * b1 / b2, static_cast<double>(j));
      s += std::sqrt((1 - b2) * std::pow(b2, static_cast<double>(j)) / (1 - std::pow(b2, t)));
    }
    const double u = (1 - b1) / (1 - std::pow(b1, t)) * std::sqrt((1 - std::pow(b2, t)) / (1 - b2)) *
                     std::sqrt(ratio_sum);
    const double bias2 = 1 - std::pow(b2, t);
    for (const auto& [name, v] : exp_avg_sq) {
      double vmax = 0;
      for (std::size_t e = 0; e < v.size(); ++e) {
        // A NaN moment would drop out of the maximum and cap its element's bound at 2 u lr:
        // a reference run that went non-finite gives no bound at all.
        REQUIRE_MESSAGE(std::isfinite(v[e]), name << "[" << e << "]: the reference run's exp_avg_sq is " << v[e]);
        vmax = std::max(vmax, v[e]);
      }
      double& g = gmax_[name];
      g = std::max(g, std::sqrt(vmax / (1 - b2)));
      const double d = rho_ * g;
      std::vector<double>& tol = tol_[name];
      if (steps_ > 1) REQUIRE_MESSAGE(tol.size() == v.size(), name);
      tol.resize(v.size(), 0.0);
      for (std::size_t e = 0; e < v.size(); ++e) {
        const double first_order = 2 * d * (1 + u * s) / (std::sqrt(std::max(v[e], 0.0) / bias2) + h_.eps);
        tol[e] += lr * std::min(2 * u, first_order);
      }
    }
  }

  std::int64_t steps() const { return steps_; }
  double rho() const { return rho_; }
  // Per-element bound for tensor `name` (empty when no step named it).
  const std::vector<double>& tolerance(const std::string& name) const {
    static const std::vector<double> none;
    const auto it = tol_.find(name);
    return it == tol_.end() ? none : it->second;
  }

  // The bound of a run written by `eaglekit train --save-every 1 --log-every 1`: exp_avg_sq
  // from DIR/checkpoint-K/optimizer.safetensors and lr from DIR/metrics.jsonl, K = 1..steps.
  static AdamWBound from_run(const std::string& dir, std::int64_t steps, double rho, AdamWHyper h = {}) {
    std::vector<double> lrs;
    std::ifstream metrics(dir + "/metrics.jsonl");
    for (std::string line; std::getline(metrics, line);) {
      if (line.empty()) continue;
      const auto j = nlohmann::json::parse(line);
      if (j.contains("lr") && j.contains("step")) lrs.push_back(j["lr"].get<double>());
    }
    REQUIRE_MESSAGE(static_cast<std::int64_t>(lrs.size()) >= steps, dir << "/metrics.jsonl: needs one line per step");
    AdamWBound b(rho, h);
    const std::string prefix = "exp_avg_sq.";
    for (std::int64_t k = 1; k <= steps; ++k) {
      const auto f = SafetensorsFile::open(dir + "/checkpoint-" + std::to_string(k) + "/optimizer.safetensors");
      std::map<std::string, std::vector<double>> v;
      for (const auto& e : f->entries()) {
        if (e.name.rfind(prefix, 0) != 0) continue;
        const auto t = f->get(e.name);
        std::vector<double>& out = v[e.name.substr(prefix.size())];
        out.resize(static_cast<std::size_t>(t->numel()));
        for (std::int64_t i = 0; i < t->numel(); ++i) out[static_cast<std::size_t>(i)] = t->get(i);
      }
      REQUIRE_MESSAGE(!v.empty(), dir << "/checkpoint-" << k << ": no exp_avg_sq tensors");
      b.add_step(lrs[static_cast<std::size_t>(k - 1)], v);
    }
    return b;
  }

 private:
  double rho_;
  AdamWHyper h_;
  std::int64_t steps_ = 0;
  std::map<std::string, double> gmax_;
  std::map<std::string, std::vector<double>> tol_;
};

// The worst element of two runs' weights against the bound: ratio = |a - b| / allowed
// (<= 1 passes), with where it was.
struct WeightsAgreement {
  double worst_ratio = 0;
  std::string where;

  void add(const std::string& name, const std::vector<double>& a, const std::vector<double>& b,
           const std::vector<double>& tol) {
    REQUIRE_MESSAGE(a.size() == b.size(), name);
    REQUIRE_MESSAGE(tol.size() == b.size(), name << ": the bound has no step for this tensor");
    double wmax = 0;
    for (double x : b) wmax = std::max(wmax, std::abs(x));
    for (std::size_t e = 0; e < b.size(); ++e) {
      const double allowed = tol[e] + kWeightRounding * wmax + 1e-30;
      const double ratio = std::abs(a[e] - b[e]) / allowed;
      if (!(ratio <= worst_ratio)) {  // NaN counts as the worst
        worst_ratio = std::isnan(ratio) ? INFINITY : ratio;
        std::ostringstream s;
        s << name << "[" << e << "]: " << a[e] << " vs " << b[e] << ", allowed " << allowed;
        where = s.str();
      }
    }
  }
  bool holds() const { return worst_ratio <= 1; }
  std::string text() const {
    std::ostringstream s;
    s << "worst |a - b| / bound " << worst_ratio << " at " << where;
    return s.str();
  }
};

// Two model.safetensors files against the bound of the reference run (`b_path` is its).
inline WeightsAgreement agreement(const std::string& a_path, const std::string& b_path, const AdamWBound& bound) {
  const auto a = SafetensorsFile::open(a_path), b = SafetensorsFile::open(b_path);
  REQUIRE(a->entries().size() == b->entries().size());
  WeightsAgreement w;
  for (const auto& e : b->entries()) {
    const auto x = a->get(e.name), y = b->get(e.name);
    REQUIRE_MESSAGE(x, e.name);
    REQUIRE(x->numel() == y->numel());
    if (e.name == "d2t" || e.name == "t2d") continue;  // not trained
    std::vector<double> xa(static_cast<std::size_t>(x->numel())), yb(xa.size());
    for (std::int64_t i = 0; i < x->numel(); ++i) {
      xa[static_cast<std::size_t>(i)] = x->get(i);
      yb[static_cast<std::size_t>(i)] = y->get(i);
    }
    w.add(e.name, xa, yb, bound.tolerance(e.name));
  }
  return w;
}

}  // namespace eaglekit::test
