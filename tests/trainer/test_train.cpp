// The training loop: schedule, AdamW against torch.optim.AdamW, Muon against its formula, exact gradient
// accumulation, the normalizer computed ahead of the forward, learning on synthetic data,
// metrics.jsonl, options JSON, and the non-finite stop.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>  // c10::NoGradGuard: LibTorch 2.x ATen.h no longer declares at::NoGradGuard
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "formats/pt_format.h"
#include "lib/collate.h"
#include "lib/loader.h"
#include "tests/adamw_bound.h"
#include "tests/support.h"
#include "tests/tensor_compare.h"
#include "tests/trainer/train_data.h"
#include "trainer/io/checkpoint.h"
#include "trainer/io/export.h"
#include "trainer/model/base_model.h"
#include "trainer/model/vocab.h"
#include "trainer/run/evaluate.h"
#include "trainer/run/optim.h"
#include "trainer/run/options.h"
#include "trainer/run/train.h"

namespace fs = std::filesystem;
using namespace eaglekit;
using namespace eaglekit::trainer;

using test::read_jsonl;

TEST_CASE("train: learning-rate schedules (warmup, cosine, linear, constant)") {
  const double lr = 1e-3;
  // Relative, to double rounding: doctest's default Approx is an absolute 1.2e-5, which
  // would accept any value within 1% of these learning rates.
  auto exactly = [](double v) { return doctest::Approx(v).epsilon(1e-12).scale(0); };
  // Warmup ramps linearly to lr at its last step.
  CHECK(learning_rate(lr, Schedule::kCosine, 4, 20, 0) == exactly(lr / 4));
  CHECK(learning_rate(lr, Schedule::kCosine, 4, 20, 1) == exactly(lr / 2));
  CHECK(learning_rate(lr, Schedule::kCosine, 4, 20, 3) == exactly(lr));
  // Cosine: lr after warmup, lr/2 halfway through the decay, 0 at the end.
  CHECK(learning_rate(lr, Schedule::kCosine, 4, 20, 4) == exactly(lr));
  CHECK(learning_rate(lr, Schedule::kCosine, 4, 20, 8) == exactly(lr * 0.5 * (1 + std::cos(M_PI / 4))));
  CHECK(learning_rate(lr, Schedule::kCosine, 4, 20, 12) == exactly(lr / 2));
  CHECK(learning_rate(lr, Schedule::kCosine, 4, 20, 20) == 0.0);
  CHECK(learning_rate(lr, Schedule::kLinear, 0, 10, 5) == exactly(lr / 2));
  CHECK(learning_rate(lr, Schedule::kLinear, 0, 10, 7) == exactly(lr * 0.3));
  CHECK(learning_rate(lr, Schedule::kLinear, 0, 10, 10) == 0.0);
  CHECK(learning_rate(lr, Schedule::kConstant, 2, 10, 0) == exactly(lr / 2));
  CHECK(learning_rate(lr, Schedule::kConstant, 2, 10, 9) == exactly(lr));
  CHECK(parse_schedule("cosine") == Schedule::kCosine);
  CHECK(!parse_schedule("exponential"));
}

TEST_CASE("train: AdamW equals torch.optim.AdamW (decay on matrices only)") {
  test::require_python("torch");
  test::TempDir dir("adamw");
  at::manual_seed(7);
  const at::Tensor w0 = at::randn({5, 3}), n0 = at::randn({3});
  std::vector<at::Tensor> grads;
  for (int i = 0; i < 4; ++i) grads.push_back(at::randn({5, 3})), grads.push_back(at::randn({3}));
  std::vector<PtEntry> entries = {{"w", to_host_tensor(w0)}, {"n", to_host_tensor(n0)}};
  for (std::size_t i = 0; i < grads.size(); ++i) entries.push_back({"g" + std::to_string(i), to_host_tensor(grads[i])});
  write_pt(dir / "in.pt", entries);

  at::Tensor w = w0.clone().set_requires_grad(true), n = n0.clone().set_requires_grad(true);
  AdamW::Options ao;
  ao.beta1 = 0.8;
  ao.beta2 = 0.95;
  ao.eps = 1e-6;
  ao.weight_decay = 0.1;
  AdamW opt({{"w", w}, {"n", n}}, ao);
  const double lrs[4] = {1e-2, 2e-2, 5e-3, 1e-2};
  for (int i = 0; i < 4; ++i) {
    opt.zero_grad();
    w.mutable_grad() = grads[2 * i].clone();
    n.mutable_grad() = grads[2 * i + 1].clone();
    opt.step(lrs[i]);
  }
  CHECK(opt.steps() == 4);
  const auto r = test::python(R"(
import sys, torch
d = torch.load(sys.argv[1])
w = torch.nn.Parameter(d["w"].clone()); n = torch.nn.Parameter(d["n"].clone())
opt = torch.optim.AdamW([{"params": [w], "weight_decay": 0.1}, {"params": [n], "weight_decay": 0.0}],
                        lr=1e-2, betas=(0.8, 0.95), eps=1e-6)
for i, lr in enumerate([1e-2, 2e-2, 5e-3, 1e-2]):
    for g in opt.param_groups: g["lr"] = lr
    w.grad = d["g%d" % (2 * i)].clone(); n.grad = d["g%d" % (2 * i + 1)].clone()
    opt.step()
torch.save({"w": w.detach(), "n": n.detach(), "m": opt.state[w]["exp_avg"], "v": opt.state[w]["exp_avg_sq"]}, sys.argv[2])
)",
                              {dir / "in.pt", dir / "out.pt"});
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const PtContents py = read_pt(dir / "out.pt");
  auto get = [&](const char* k) { return tensor_from_host(*py.tensor(k)); };
  CHECK(at::allclose(w.detach(), get("w"), 1e-6, 1e-7));
  CHECK(at::allclose(n.detach(), get("n"), 1e-6, 1e-7));
  const auto state = opt.state();
  REQUIRE(state.size() == 4);
  CHECK(state[0].first == "exp_avg.w");
  CHECK(at::allclose(state[0].second, get("m"), 1e-6, 1e-7));
  CHECK(at::allclose(state[1].second, get("v"), 1e-6, 1e-7));

  // Moments restore exactly; a missing one is named.
  AdamW again({{"w", w}, {"n", n}}, ao);
  again.load_state(state, 4, "opt.safetensors");
  CHECK(again.steps() == 4);
  CHECK(at::equal(again.state()[1].second, state[1].second));
  auto missing = state;
  missing.pop_back();
  CHECK_THROWS_WITH_AS(again.load_state(missing, 4, "opt.safetensors"),
                       "opt.safetensors: exp_avg_sq.n: missing optimizer state", FormatError);
}

namespace {

// Muon as Jordan's post and torch.optim.Muon's docs write it, in double precision and in the
// other (non-EMA) momentum form: B <- mu B + g; U <- g + mu B (Nesterov); the quintic
// Newton-Schulz X <- a X + b (X X^T) X + c (X X^T)^2 X on the normalised U (transposed
// when tall); W <- W (1 - lr wd) - lr adjust O. Both forms' U differ by the factor (1 - mu),
// which the normalisation removes.
struct MuonReference {
  double a = 3.4445, b = -4.7750, c = 2.0315;
  double mu = 0.95, wd = 0.1;
  int ns_steps = 5;
  at::Tensor w, buf;
  explicit MuonReference(const at::Tensor& w0) : w(w0.to(at::kDouble)), buf(at::zeros_like(w)) {}
  void step(const at::Tensor& grad, double lr) {
    const at::Tensor g = grad.to(at::kDouble);
    buf = mu * buf + g;
    at::Tensor x = g + mu * buf;
    const bool tall = x.size(0) > x.size(1);
    if (tall) x = x.t();
    x = x / x.norm();
    for (int k = 0; k < ns_steps; ++k) {
      const at::Tensor A = x.matmul(x.t());
      x = a * x + b * A.matmul(x) + c * A.matmul(A).matmul(x);
    }
    if (tall) x = x.t();
    const double rows = static_cast<double>(w.size(0)), cols = static_cast<double>(w.size(1));
    w = w * (1 - lr * wd) - lr * 0.2 * std::sqrt(std::max(rows, cols)) * x;
  }
};

}  // namespace

TEST_CASE("train: Muon steps equal the paper's update in double precision (1e-5); the split as speculators'") {
  at::manual_seed(11);
  // A tall and a wide matrix (the transposed and the plain path), three steps (momentum).
  const at::Tensor t0 = at::randn({12, 5}), v0 = at::randn({4, 9});
  std::vector<at::Tensor> gt, gv;
  for (int i = 0; i < 3; ++i) gt.push_back(at::randn({12, 5})), gv.push_back(at::randn({4, 9}));
  // Rates large enough that each update is a fair part of the weight, so float32's rounding
  // of the stored weights stays far below the 1e-5 of the update compared.
  const double lrs[3] = {0.5, 1.0, 0.25};

  auto run = [&](const Muon::Options& mo) {
    at::Tensor t = t0.clone().set_requires_grad(true), v = v0.clone().set_requires_grad(true);
    Muon opt({{"t", t}, {"v", v}}, mo);
    for (int i = 0; i < 3; ++i) {
      t.mutable_grad() = gt[i].clone();
      v.mutable_grad() = gv[i].clone();
      opt.step(lrs[i]);
    }
    return std::make_pair(t.detach().clone(), v.detach().clone());
  };
  MuonReference rt(t0), rv(v0);
  for (int i = 0; i < 3; ++i) rt.step(gt[i], lrs[i]), rv.step(gv[i], lrs[i]);
  // Relative to the size of the weights' whole change, so the test sees the updates, not
  // the starting weights.
  auto update_diff = [](const at::Tensor& ours, const at::Tensor& ref, const at::Tensor& w0) {
    const at::Tensor d_ours = ours.to(at::kDouble) - w0.to(at::kDouble), d_ref = ref - w0.to(at::kDouble);
    return (d_ours - d_ref).abs().max().item<double>() / d_ref.abs().max().item<double>();
  };
  const auto [t, v] = run(Muon::Options{});
  CHECK(update_diff(t, rt.w, t0) < 1e-5);
  CHECK(update_diff(v, rv.w, v0) < 1e-5);

  // What the comparison catches: a Newton-Schulz coefficient off by 1%, one iteration less,
  // Nesterov off, the other learning-rate adjustment.
  Muon::Options coef;
  coef.ns_coefficients[1] *= 1.01;
  CHECK(update_diff(run(coef).first, rt.w, t0) > 1e-3);
  Muon::Options steps;
  steps.ns_steps = 4;
  CHECK(update_diff(run(steps).first, rt.w, t0) > 1e-3);
  Muon::Options plain;
  plain.nesterov = false;
  CHECK(update_diff(run(plain).second, rv.w, v0) > 1e-3);
  Muon::Options original;
  original.adjust_lr = MuonLrAdjust::kOriginal;
  CHECK(update_diff(run(original).second, rv.w, v0) > 1e-3);

  // The orthogonalisation: singular values of NS_5(G) near 1 (Jordan: within about 0.5-1.5)
  // where G's spread over two decades.
  const at::Tensor g = at::randn({16, 8}).matmul(at::diag(at::logspace(0, 2, 8)));
  const at::Tensor sv = std::get<1>(at::linalg_svd(newton_schulz(g, Muon::Options{}.ns_coefficients, 5, 1e-7)));
  CHECK(sv.min().item<double>() > 0.5);
  CHECK(sv.max().item<double>() < 1.5);

  // Which parameters Muon takes: matrices with both sides > 1, but lm_head and embeddings.
  CHECK(muon_takes("fc.weight", at::zeros({4, 12})));
  CHECK(muon_takes("layers.0.self_attn.q_proj.weight", at::zeros({8, 4})));
  CHECK_FALSE(muon_takes("lm_head.weight", at::zeros({20, 4})));
  CHECK_FALSE(muon_takes("embed_tokens.weight", at::zeros({20, 4})));
  CHECK_FALSE(muon_takes("norm.weight", at::zeros({4})));
  CHECK_FALSE(muon_takes("gate", at::zeros({1, 4})));

  // The pair: AdamW on the rest, Muon at lr * muon_lr_ratio; state restores, a missing
  // buffer is named.
  at::Tensor w = t0.clone().set_requires_grad(true), head = v0.clone().set_requires_grad(true);
  DraftOptimizer::Options po;
  po.muon = true;
  po.muon_lr_ratio = 2.0;
  DraftOptimizer pair({{"w", w}, {"lm_head.weight", head}}, po);
  CHECK(pair.muon_parameters() == std::vector<std::string>{"w"});
  w.mutable_grad() = gt[0].clone();
  head.mutable_grad() = gv[0].clone();
  pair.step(0.25);
  MuonReference one(t0);
  one.step(gt[0], 0.5);
  CHECK(update_diff(w.detach(), one.w, t0) < 1e-5);
  // Its AdamW half: lm_head takes AdamW's step at lr itself (not lr * muon_lr_ratio), equal to
  // an AdamW of the same options on its own (a pair that left lm_head alone, or stepped it at
  // Muon's rate, fails here).
  at::Tensor head_alone = v0.clone().set_requires_grad(true);
  AdamW adamw_alone({{"lm_head.weight", head_alone}}, po.adamw);
  head_alone.mutable_grad() = gv[0].clone();
  adamw_alone.step(0.25);
  CHECK_FALSE(at::equal(head.detach(), v0));
  CHECK(at::equal(head.detach(), head_alone.detach()));
  const auto state = pair.state();
  REQUIRE(state.size() == 3);
  CHECK(state[0].first == "exp_avg.lm_head.weight");
  CHECK(state[2].first == "momentum_buffer.w");
  CHECK(at::allclose(state[2].second, 0.05 * gt[0]));  // (1 - mu) g after one step
  DraftOptimizer again({{"w", w}, {"lm_head.weight", head}}, po);
  again.load_state(state, 1, "opt.safetensors");
  CHECK(at::equal(again.state()[2].second, state[2].second));
  auto missing = state;
  missing.pop_back();
  CHECK_THROWS_WITH_AS(again.load_state(missing, 1, "opt.safetensors"),
                       "opt.safetensors: momentum_buffer.w: missing optimizer state", FormatError);
}

// Every optimizer flag reaches the optimizer's options, read as a command line sets them
// (values other than the defaults, so an option parsed and dropped fails here).
TEST_CASE("train: the --optimizer, --adam-*, --weight-decay and --muon-* flags reach the optimizer") {
  TrainOptions t;
  const opt::Groups groups = t.groups();
  auto set = [&](const std::string& flag, const std::string& value) {
    const opt::Option* row = nullptr;
    for (const auto& g : groups)
      if (!row) row = g.find(flag);
    REQUIRE_MESSAGE(row, flag);
    row->set_text(value);
  };
  set("optimizer", "muon");
  set("lr", "0.002");
  set("muon-lr", "0.02");
  set("muon-momentum", "0.9");
  set("muon-weight-decay", "0.05");
  set("muon-ns-steps", "3");
  set("muon-adjust-lr", "original");
  set("adam-beta1", "0.8");
  set("adam-beta2", "0.99");
  set("adam-eps", "1e-7");
  set("weight-decay", "0.01");
  const DraftOptimizer::Options d = draft_optimizer_options(t);
  CHECK(d.muon);
  CHECK(d.muon_lr_ratio == doctest::Approx(10.0));
  CHECK(d.muon_options.momentum == 0.9);
  CHECK(d.muon_options.weight_decay == 0.05);
  CHECK(d.muon_options.ns_steps == 3);
  CHECK(d.muon_options.adjust_lr == MuonLrAdjust::kOriginal);
  CHECK(d.adamw.beta1 == 0.8);
  CHECK(d.adamw.beta2 == 0.99);
  CHECK(d.adamw.eps == 1e-7);
  CHECK(d.adamw.weight_decay == 0.01);
  set("optimizer", "adamw");
  CHECK_FALSE(draft_optimizer_options(t).muon);
}

TEST_CASE("train: clip_grad_norm is torch's global-norm clipping") {
  at::Tensor a = at::zeros({2}).set_requires_grad(true), b = at::zeros({1}).set_requires_grad(true);
  a.mutable_grad() = at::tensor({3.0f, 0.0f});
  b.mutable_grad() = at::tensor({4.0f});
  auto near = [](double v, double rel) { return doctest::Approx(v).epsilon(rel).scale(0); };
  CHECK(clip_grad_norm({a, b}, 10.0) == near(5.0, 1e-7));
  CHECK(a.grad()[0].item<float>() == 3.0f);  // under the limit: untouched
  CHECK(clip_grad_norm({a, b}, 1.0) == near(5.0, 1e-7));
  CHECK(b.grad()[0].item<float>() == near(4.0 / (5.0 + 1e-6), 1e-7));
  // A norm of the order of torch's 1e-6 guard tells max / (norm + 1e-6) from max / norm:
  // 1/6 against 1/5 of each gradient.
  a.mutable_grad() = at::tensor({3e-6f, 0.0f});
  b.mutable_grad() = at::tensor({4e-6f});
  CHECK(clip_grad_norm({a, b}, 1e-6) == near(5e-6, 1e-6));
  CHECK(a.grad()[0].item<float>() == near(3e-6 / 6, 1e-6));
  CHECK(b.grad()[0].item<float>() == near(4e-6 / 6, 1e-6));
  b.mutable_grad() = at::tensor({NAN});
  CHECK(std::isnan(clip_grad_norm({a, b}, 1.0)));
}

TEST_CASE("train: the normalizer computed ahead equals the unroll's mask sums (pad, longest, pack, cp chunks)") {
  auto job = test::make_synth_job(12, 48, 6, 30);
  DataSelection sel;
  sel.data = job->data;
  sel.index = job->index;
  sel.split = "all";
  const SelectedData data = select_data(sel);
  const BaseModel base = load_base_model(job->base);
  DraftOptions dopts;
  const DraftConfig cfg = draft_config_from_base(base.config, dopts);
  TttOptions to;
  to.steps = 4;
  TttUnroll unroll(base, DraftModel(cfg, identity_d2t(cfg.vocab_size), base.lm_head, 1), to);
  c10::NoGradGuard no_grad;
  for (const char* mode : {"pad", "longest", "pack"}) {
    CAPTURE(mode);
    LoaderOptions lo;
    lo.collate.mode = *parse_collate_mode(mode);
    lo.collate.max_length = 24;
    lo.sampler.batch_size = 3;
    lo.sampler.epochs = 1;
    lo.jobs = 2;
    Loader loader(data.dataset, data.samples, lo);
    int batches = 0;
    while (auto b = loader.next()) {
      const TttResult r = unroll.forward(to_ttt_batch(*b));
      const at::Tensor mine = loss_mask_sums(*b, 4);
      CHECK(at::allclose(mine, r.mask_sum.to(at::kDouble), 0, 1e-3));
      ++batches;
    }
    CHECK(batches > 0);
  }
  // A context-parallel chunk's share: the shares of the chunks add up to the whole row's.
  for (const char* mode : {"pad", "pack"}) {
    CAPTURE(mode);
    at::Tensor whole = at::zeros({4}, at::kDouble), chunks = at::zeros({4}, at::kDouble);
    for (int cp_rank = -1; cp_rank < 3; ++cp_rank) {
      LoaderOptions lo;
      lo.collate.mode = *parse_collate_mode(mode);
      lo.collate.max_length = 24;
      if (cp_rank >= 0) {
        lo.collate.cp_size = 3;
        lo.collate.cp_rank = cp_rank;
      }
      lo.sampler.batch_size = 4;
      lo.sampler.epochs = 1;
      lo.jobs = 2;
      Loader loader(data.dataset, data.samples, lo);
      while (auto b = loader.next()) (cp_rank < 0 ? whole : chunks) += loss_mask_sums(*b, 4);
    }
    CHECK(at::equal(whole, chunks));
    CHECK(whole[0].item<double>() > whole[3].item<double>());
  }
}

TEST_CASE("train: gradient accumulation equals one big batch (weights, and grad_norm at every step)") {
  auto job = test::make_synth_job(24);
  auto run = [&](std::int64_t batch, std::int64_t accum, const std::string& out, const TrainHooks& hooks = {}) {
    TrainOptions o = test::small_options(*job, out);
    o.batch_size = batch;
    o.grad_accum = accum;
    o.max_steps = 3;
    o.save_every = 1;  // every step's moments, for the bound
    o.shuffle = false;
    o.weight_decay = 0.01;
    o.schedule = Schedule::kLinear;
    o.warmup_steps = 1;
    run_training(o, nullptr, hooks);
    return out + "/checkpoint-3/model.safetensors";
  };
  test::TempDir dir("accum");
  const auto big = run(4, 1, dir / "b4");
  const std::string big_metrics = dir / "b4/metrics.jsonl";
  // Sums in another order: the weights agree within what AdamW makes of gradients that agree
  // to rounding (rho as in test_data_parallel).
  const auto bound = test::AdamWBound::from_run(dir / "b4", 3, 1e-4);
  for (const auto& [batch, accum] : {std::pair<std::int64_t, std::int64_t>{2, 2}, {1, 4}}) {
    CAPTURE(batch);
    const auto w = test::agreement(run(batch, accum, dir / ("b" + std::to_string(batch))), big, bound);
    CHECK_MESSAGE(w.holds(), w.text());
    // The gradient norm before clipping, per step: the scale of the gradients, which the
    // weights cannot show (below).
    CHECK(test::metric_rel_diff(dir / ("b" + std::to_string(batch) + "/metrics.jsonl"), big_metrics, "grad_norm") < 1e-4);
  }
  // ... and a different batch trains to different weights (the comparison can fail).
  const auto other = run(2, 1, dir / "other");
  CHECK_FALSE(test::agreement(other, big, bound).holds());

  // The must-fail of the scale: accumulation whose normalizer is doubled (as a bug reducing
  // the mask sums twice would) halves every gradient. grad_norm sees it at every step; the
  // weights barely do, since AdamW divides the update by the gradient's own scale and the
  // clip at 1.0 removes the rest (this is why grad_norm is compared at all): when written,
  // they stayed within 0.0007 of the bound the correct runs are held to.
  TrainHooks doubled;
  doubled.normalizer_scale = [](std::int64_t) { return 2.0; };
  const auto twice = run(2, 2, dir / "doubled", doubled);
  const double g = test::metric_rel_diff(dir / "doubled/metrics.jsonl", big_metrics, "grad_norm");
  CHECK(g > 0.4);
  CHECK(g < 0.6);  // the gradients are halved, not otherwise changed
  MESSAGE("normalizer x2: grad_norm off by " << g << ", weights " << test::agreement(twice, big, bound).text());
}

TEST_CASE("train: the weight comparison counts a NaN or an infinity as infinitely different") {
  // test::max_rel_diff over tensors, as the resume and checkpoint tests use it.
  const auto w = [](std::vector<float> v) {
    return std::vector<std::pair<std::string, at::Tensor>>{{"w", at::tensor(v)}};
  };
  const auto good = w({1, -2, 3, 4});
  CHECK(test::max_rel_diff(good, good) == 0);
  CHECK(test::max_rel_diff(w({1, -2, 3, 4.0000004f}), good) < 1e-6);
  for (const float bad : {std::nanf(""), INFINITY}) {
    CAPTURE(bad);
    CHECK(std::isinf(test::max_rel_diff(w({1, bad, 3, 4}), good)));
    CHECK(std::isinf(test::max_rel_diff(good, w({1, bad, 3, 4}))));
    CHECK(std::isinf(test::max_rel_diff(w({1, bad, 3, 4}), w({1, bad, 3, 4}))));
  }
  // tensor_rel_diff (tests/tensor_compare.h), as the TTT, attention and kernel tests use it:
  // a NaN in a non-first element of either side.
  const at::Tensor t = at::tensor(std::vector<float>{1, -2, 3, 4});
  CHECK(test::tensor_rel_diff(t, t) == 0);
  for (const std::int64_t at_index : {1, 3}) {
    CAPTURE(at_index);
    const at::Tensor bad = t.clone();
    bad[at_index] = std::nanf("");
    CHECK(std::isinf(test::tensor_rel_diff(bad, t)));
    CHECK(std::isinf(test::tensor_rel_diff(t, bad)));
  }
  // A running maximum with the NaN after the first value: std::max keeps the others' maximum
  // (what the TTT tests' ce_sum gaps did before), worst_of makes it +inf.
  double naive = 0, worst = 0;
  for (const double x : {0.1, std::nan(""), 0.2}) {
    naive = std::max(naive, x);
    worst = test::worst_of(worst, x);
  }
  CHECK(naive == 0.2);
  CHECK(std::isinf(worst));
}

TEST_CASE("train: a short run raises step-0 accuracy far above chance; metrics.jsonl has every field") {
  auto job = test::make_synth_job(60, 48, 12, 28);
  test::TempDir dir("learn");
  TrainOptions o = test::small_options(*job, dir / "out");
  o.draft_vocab_size = 32;  // d2t counted over the train split
  o.max_steps = 60;
  o.lr = 1e-2;
  o.warmup_steps = 5;
  o.log_every = 20;
  o.eval_every = 30;
  o.eval_fraction = 0.25;
  std::vector<std::string> lines;
  TrainHooks hooks;
  hooks.on_metrics = [&](const std::string& l) { lines.push_back(l); };
  const TrainResult r = run_training(o, nullptr, hooks);
  CHECK(r.steps == 60);
  CHECK(!r.interrupted);
  REQUIRE(r.eval_stats);
  const double chance = 1.0 / 32;
  const auto acc = r.eval_stats->acc();
  INFO("eval acc[0] = " << acc[0]);
  CHECK(acc[0] > 10 * chance);
  CHECK(r.eval_stats->est_ar() > 1.3);
  CHECK(r.tokens_per_s > 0);
  CHECK(fs::exists(dir / "out/final/model.safetensors"));
  CHECK(fs::exists(dir / "out/checkpoint-60/trainer_state.json"));

  const auto rows = read_jsonl(dir / "out/metrics.jsonl");
  REQUIRE(rows.size() == lines.size());
  int train_rows = 0, eval_rows = 0;
  for (const auto& j : rows) {
    if (j.contains("split")) {
      CHECK(j["split"] == "eval");
      for (const char* k : {"step", "loss", "loss_per_step", "acc", "cond_acc", "est_ar", "tokens"}) CHECK(j.contains(k));
      ++eval_rows;
    } else {
      for (const char* k : {"step", "epoch", "lr", "loss", "loss_per_step", "acc", "cond_acc", "est_ar", "grad_norm",
                            "tokens_per_s", "loader_wait_ms"})
        CHECK_MESSAGE(j.contains(k), k);
      CHECK(j["loss_per_step"].size() == 3);
      ++train_rows;
    }
  }
  CHECK(train_rows == 3);  // steps 20, 40, 60
  CHECK(eval_rows == 2);   // steps 30, 60
  const double first_loss = rows.front()["loss"], last_loss = rows[rows.size() - 2]["loss"];
  CHECK(last_loss < first_loss);
  // The eval acc of the last line is the result's.
  CHECK(rows.back()["acc"][0].get<double>() == doctest::Approx(acc[0]));
  // The d2t was calibrated: the draft vocabulary is the 32 most frequent target tokens.
  const DraftModel final_draft = load_draft(dir / "out/final");
  CHECK(final_draft.config().draft_vocab_size == 32);
}

TEST_CASE("train: a non-finite loss stops the run with a clear message; the last good checkpoint stays") {
  auto job = test::make_synth_job(24);
  test::TempDir dir("nan");
  TrainOptions o = test::small_options(*job, dir / "out");
  o.max_steps = 10;
  o.save_every = 2;
  TrainHooks hooks;
  hooks.after_step = [](std::int64_t step, DraftModel& d) {
    if (step == 3) {
      c10::NoGradGuard g;
      d.named_parameters()[0].second.fill_(NAN);
    }
    return true;
  };
  try {
    run_training(o, nullptr, hooks);
    FAIL("no error");
  } catch (const TrainingError& e) {
    const std::string msg = e.what();
    CHECK(msg.find("training stopped at step 4") != std::string::npos);
    CHECK(msg.find("the loss is NaN on the batch of conversations ") != std::string::npos);
    // The data were fine (the weights were poisoned): the message says how large the batch's
    // values are rather than blaming one side.
    CHECK(msg.find("whose hidden states are finite with largest |value| ") != std::string::npos);
    CHECK(msg.find("checkpoint-2") != std::string::npos);
  }
  CHECK(is_complete_checkpoint(dir / "out/checkpoint-2"));
  CHECK(!fs::exists(dir / "out/checkpoint-4"));
  CHECK(find_latest_checkpoint(dir / "out") == (dir / "out/checkpoint-2"));
  // The saved weights are finite.
  for (const auto& [name, t] : test::read_weights(dir / "out/checkpoint-2/model.safetensors"))
    if (at::isFloatingType(t.scalar_type())) CHECK(at::isfinite(t).all().item<bool>());
}

TEST_CASE("train: options from JSON (either key style), refusals name the key") {
  TrainOptions o;
  o.apply_json(R"({"max-length": 64, "lr": 0.002, "aux_layer_ids": [1, 2, 3], "shuffle": false, "seed": 5,
                  "schedule": "linear"})",
               "cfg.json");
  CHECK(o.max_length == 64);
  CHECK(o.lr == 0.002);
  CHECK(o.aux_layer_ids == std::vector<std::int64_t>{1, 2, 3});
  CHECK(!o.shuffle);
  CHECK(o.seed == 5);
  TrainOptions back;
  back.apply_json(o.to_json(), "round trip");
  CHECK(back.to_json() == o.to_json());
  CHECK_THROWS_WITH_AS(o.apply_json(R"({"learning_rate": 1})", "cfg.json"), "cfg.json: unknown option 'learning_rate'",
                       UsageError);
  CHECK_THROWS_WITH_AS(o.apply_json(R"({"max_steps": "ten"})", "cfg.json"),
                       "cfg.json: option 'max_steps' must be an integer, not \"ten\"", UsageError);
  CHECK_THROWS_WITH_AS(o.apply_json("[1]", "cfg.json"), "cfg.json: expected a JSON object of options", UsageError);
  TrainOptions bad;
  CHECK_THROWS_WITH_AS(bad.check(), "--index is required (build one with eaglekit index)", UsageError);
  bad.data = "d";
  bad.index = "i";
  bad.base = "b";
  bad.out = "o";
  bad.timeout = 0;
  CHECK_THROWS_WITH_AS(bad.check(), "--timeout takes a positive number of seconds (at most a week), not 0.000000",
                       UsageError);
  // Enum options are parsed once, by the table, from a flag's text or a JSON string.
  const opt::Groups groups = bad.groups();
  const opt::Option* schedule = nullptr;
  const opt::Option* dtype = nullptr;
  for (const auto& g : groups) {
    if (!schedule) schedule = g.find("schedule");
    if (!dtype) dtype = g.find("compute_dtype");
  }
  REQUIRE(schedule);
  REQUIRE(dtype);
  CHECK_THROWS_WITH_AS(schedule->set_text("step"), "--schedule must be cosine, linear or constant, not 'step'",
                       UsageError);
  CHECK_THROWS_WITH_AS(dtype->set_text("int8"), "--compute-dtype must be fp32 or bf16, not 'int8'", UsageError);
  dtype->set_text("bfloat16");  // the long spelling is accepted too
  CHECK(bad.compute_dtype == ComputeDType::kBFloat16);
  schedule->set_text("constant");
  CHECK(bad.schedule == Schedule::kConstant);
  CHECK_THROWS_WITH_AS(bad.apply_json(R"({"schedule": "step"})", "cfg.json"),
                       "cfg.json: option 'schedule' must be cosine, linear or constant, not \"step\"", UsageError);
  // A checkpoint written before --compute-dtype named it "dtype": still read.
  TrainOptions old;
  old.apply_json(R"({"dtype": "bfloat16", "cp_size": 2})", "train_options.json");
  CHECK(old.compute_dtype == ComputeDType::kBFloat16);
  CHECK(old.cp_size == 2);
  CHECK(old.to_json().find("\"compute_dtype\": \"bf16\"") != std::string::npos);
}

TEST_CASE("train: refuses an output folder that holds checkpoints unless resuming; vocab writes d2t") {
  auto job = test::make_synth_job(16);
  test::TempDir dir("refuse");
  TrainOptions o = test::small_options(*job, dir / "out");
  o.max_steps = 1;
  run_training(o);
  const std::string refused = "--out " + (dir / "out") +
                              " already holds checkpoint-1; pass --resume to continue that run, or choose another --out";
  CHECK_THROWS_WITH_AS(run_training(o), refused.c_str(), UsageError);
  // eaglekit vocab: ModelOpt's d2t over the train split, equal to what train counts itself.
  VocabOptions vo;
  vo.data = job->data;
  vo.index = job->index;
  vo.base = job->base;
  vo.draft_vocab_size = 20;
  vo.out = dir / "d2t.pt";
  vo.eval_fraction = 0.2;
  const VocabReport vr = build_vocab(vo);
  CHECK(vr.vocab_size == 48);
  CHECK(vr.coverage > 0.5);
  CHECK(vr.coverage <= 1.0);
  const at::Tensor d2t = load_d2t(dir / "d2t.pt");
  REQUIRE(d2t.size(0) == 20);
  TrainOptions counted = test::small_options(*job, dir / "counted");
  counted.max_steps = 1;
  counted.draft_vocab_size = 20;
  run_training(counted);
  CHECK(at::equal(load_draft(dir / "counted/final").d2t(), d2t));
  // The most frequent token is draft id 0.
  DataSelection sel;
  sel.data = job->data;
  sel.index = job->index;
  sel.eval_fraction = 0.2;
  const SelectedData train = select_data(sel);
  const auto counts = count_tokens(train.dataset, train.samples, 48, 2);
  const auto top = std::max_element(counts.begin(), counts.end()) - counts.begin();
  CHECK(d2t[0].item<std::int64_t>() == top);
}
