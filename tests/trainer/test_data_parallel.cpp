// trainer/parallel/data_parallel.h: bucketed gradient sums and the DP update, against one process on
// the same global batch: DP=2 (2 processes) and DP=2 x CP=2 (4 processes), gradients after
// one step and weights after several AdamW steps (within what AdamW makes of gradients that
// agree to rounding: tests/adamw_bound.h).
#include "trainer/parallel/data_parallel.h"

#include "tests/adamw_bound.h"
#include "tests/trainer/dist_harness.h"

using namespace eaglekit;
using namespace eaglekit::test;

namespace {

constexpr int kTrainSteps = 3;
constexpr double kLr = 1e-3;

std::int64_t train_length(int k) { return k % 2 == 0 ? 13 : 16; }

std::vector<double> doubles(const at::Tensor& t) {
  const at::Tensor d = t.detach().to(at::kDouble).contiguous();
  return std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
}

// Weights after kTrainSteps AdamW steps on global batches `seed` + k. Non-main ranks start
// from perturbed weights: broadcast_parameters must make them equal first. Without a mesh
// (the reference) and with `bound`, each step's second moments go into the bound.
std::vector<at::Tensor> train(const ModelSetup& m, const dist::Mesh* mesh, AdamWBound* bound = nullptr,
                              std::uint64_t seed = 700) {
  trainer::DraftModel draft = m.fresh_draft();
  trainer::TttUnroll unroll(m.base, draft, ttt_options(3));
  std::vector<at::Tensor> params = draft.parameters();
  std::unique_ptr<trainer::GradientSync> sync;
  std::unique_ptr<trainer::RingContext> ctx;
  if (mesh) {
    if (!mesh->is_main()) {
      at::NoGradGuard no_grad;
      for (auto& p : params) p.add_(0.01 * (mesh->rank() + 1));
    }
    trainer::broadcast_parameters(mesh->world(), params, 0);
    sync = std::make_unique<trainer::GradientSync>(mesh->world(), params);
    ctx = std::make_unique<trainer::RingContext>(*mesh);
  }
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(kLr));  // betas 0.9, 0.999, eps 1e-8
  std::vector<at::Tensor> second_moment;
  for (const auto& p : params) second_moment.push_back(at::zeros_like(p, p.options().dtype(at::kDouble)));
  const auto names = draft.named_parameters();
  for (int k = 0; k < kTrainSteps; ++k) {
    const auto global = model_batch(m.config, train_length(k), seed + k);
    opt.zero_grad();
    if (mesh) {
      sync->prepare();
      ctx->set_global_length(train_length(k));
      unroll.forward(local_share(*mesh, global), ctx.get()).loss.backward();
      sync->finish();
    } else {
      unroll.forward(global).loss.backward();
    }
    if (bound) {
      std::map<std::string, std::vector<double>> v;
      for (std::size_t p = 0; p < params.size(); ++p) {
        const at::Tensor g = params[p].grad().defined() ? params[p].grad().to(at::kDouble) : at::zeros_like(second_moment[p]);
        second_moment[p].mul_(0.999).addcmul_(g, g, 0.001);
        v[names[p].first] = doubles(second_moment[p]);
      }
      bound->add_step(kLr, v);
    }
    opt.step();
  }
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone());
  return out;
}

ScenarioRegistration dp_job("data_parallel", [] {
  const auto mesh = dist::Mesh::from_environment(env_int("EAGLEKIT_TEST_CP", 1), worker_group_options());
  const ModelSetup m;
  const std::string dir = job_dir();
  for (int i = 0; i < 2; ++i) {
    const auto batch = model_batch(m.config, i == 0 ? 16 : 13, 600 + i);
    const ModelRun run = mesh_run(mesh, m, 3, batch, /*overlap=*/i == 0);
    if (mesh.is_main()) save_tensors(dir + "/grads_" + std::to_string(i) + ".pt", run.to_tensors());
  }
  const auto weights = train(m, &mesh);
  save_tensors(dir + "/weights_" + std::to_string(mesh.rank()) + ".pt", weights);
});

void check_dp_job(int nproc, int cp) {
  TempDir d("dp");
  JobOptions jo;
  jo.env["EAGLEKIT_TEST_CP"] = std::to_string(cp);
  const JobResult r = run_job(nproc, "data_parallel", d.path(), jo);
  INFO(r.all_logs());
  REQUIRE(r.launch.exit_code == 0);

  const ModelSetup m;
  const auto names = m.fresh_draft().named_parameters();
  for (int i = 0; i < 2; ++i) {
    CAPTURE(i);
    const auto batch = model_batch(m.config, i == 0 ? 16 : 13, 600 + i);
    const ModelRun want = single_process_run(m, 3, batch);
    check_same_run(ModelRun::from_tensors(load_tensors(d / ("grads_" + std::to_string(i) + ".pt"))), want, names);
  }
  // The gradients above agree to 1e-5 of their largest at equal weights; later steps also see
  // the weights' own (tiny) differences, hence rho 1e-4.
  AdamWBound bound(1e-4);
  const auto want = train(m, nullptr, &bound);
  auto agree = [&](const std::vector<at::Tensor>& got) {
    REQUIRE(got.size() == want.size());
    WeightsAgreement w;
    for (std::size_t p = 0; p < want.size(); ++p)
      w.add(names[p].first, doubles(got[p]), doubles(want[p]), bound.tolerance(names[p].first));
    return w;
  };
  for (int rank = 0; rank < nproc; ++rank) {
    CAPTURE(rank);
    const WeightsAgreement w = agree(load_tensors(d / ("weights_" + std::to_string(rank) + ".pt")));
    CHECK_MESSAGE(w.holds(), w.text());
  }
  // The bound is not vacuous: training on other batches leaves it.
  CHECK_FALSE(agree(train(m, nullptr, nullptr, 900)).holds());
}

}  // namespace

TEST_CASE("data_parallel: buckets, and a group of one leaves gradients as they are") {
  std::vector<at::Tensor> params{at::ones({10}).requires_grad_(true), at::ones({300}).requires_grad_(true),
                                 at::ones({5, 5}).requires_grad_(true)};
  trainer::GradSyncOptions o;
  o.bucket_bytes = 1024;  // 256 floats: the 300-float parameter gets a bucket of its own
  trainer::GradientSync sync(dist::Group(), params, o);
  CHECK(sync.bucket_count() == 3);
  sync.prepare();
  (params[0] * 2).sum().backward();
  ((params[2] * 3).sum()).backward();
  sync.finish();
  CHECK(params[0].grad().eq(2).all().item<bool>());
  REQUIRE(params[1].grad().defined());  // no gradient: zeros, like every other rank's sum
  CHECK(params[1].grad().eq(0).all().item<bool>());
  CHECK(params[2].grad().eq(3).all().item<bool>());

  o.bucket_bytes = 1 << 20;
  CHECK(trainer::GradientSync(dist::Group(), params, o).bucket_count() == 1);
  const at::Tensor not_leaf = params[0] * 2;
  CHECK_THROWS_WITH_AS(trainer::GradientSync(dist::Group(), {not_leaf}),
                       "GradientSync: parameter 0 is not a leaf tensor that requires grad", UsageError);

  trainer::TttStats s(2);
  s.ce_sum = {1, 2};
  s.mask_sum = {3, 4};
  CHECK(trainer::all_reduce_stats(dist::Group(), s).mask_sum == s.mask_sum);
}

TEST_CASE("data_parallel: DP=2 equals one process on the global batch (gradients, weights after AdamW)") {
  check_dp_job(2, 1);
}

TEST_CASE("data_parallel: DP=2 x CP=2 on 4 processes equals one process") { check_dp_job(4, 2); }
