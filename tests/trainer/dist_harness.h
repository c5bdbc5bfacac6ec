// Multi-process tests on localhost: a test runs N copies of this test binary as the ranks
// of one job (through dist::launch_local, which hosts the rendezvous store on a free port),
// each running one registered scenario inside the skipped "distributed: worker" test case.
// Workers write their results with save_tensors(); the parent reads and compares them.
// Every job has a wall-clock bound, so a hang fails the test instead of stalling CI.
#pragma once

// LibTorch pulls in glog, whose CHECK clashes with doctest's: LibTorch first.
#include <torch/torch.h>
#include <unistd.h>

#include <doctest/doctest.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "tests/support.h"
#include "tests/trainer/trainer_fixtures.h"
#include "trainer/model/draft_model.h"
#include "trainer/parallel/data_parallel.h"
#include "trainer/parallel/distributed.h"
#include "trainer/parallel/ring_attention.h"
#include "trainer/unroll/ttt.h"

namespace eaglekit::test {

using Scenario = std::function<void()>;

inline std::map<std::string, Scenario>& scenarios() {
  static std::map<std::string, Scenario> m;
  return m;
}

struct ScenarioRegistration {
  ScenarioRegistration(const std::string& name, Scenario fn) { scenarios()[name] = std::move(fn); }
};

constexpr const char* kWorkerCase = "distributed: worker";

struct JobResult {
  dist::LaunchResult launch;
  std::vector<std::string> logs;  // per rank: stdout + stderr
  double seconds = 0;

  std::string all_logs() const {
    std::string s;
    for (std::size_t r = 0; r < logs.size(); ++r) s += "--- rank " + std::to_string(r) + "\n" + logs[r];
    return s;
  }
};

inline std::string self_exe() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  REQUIRE(n > 0);
  return std::string(buf, static_cast<std::size_t>(n));
}

struct JobOptions {
  std::map<std::string, std::string> env;
  std::chrono::milliseconds stop_grace{0};
  std::chrono::milliseconds kill_grace{std::chrono::seconds(5)};
  std::chrono::milliseconds limit{std::chrono::seconds(240)};
  int collective_timeout_ms = 60000;
};

// Runs `scenario` on `nproc` ranks; results and logs go to `dir`.
inline JobResult run_job(int nproc, const std::string& scenario, const std::string& dir,
                         const JobOptions& jo = {}) {
  dist::LaunchOptions o;
  o.nproc = nproc;
  o.argv = {self_exe(), "--no-skip=true", std::string("--test-case=") + kWorkerCase,
            "--no-intro=true", "--no-version=true"};
  o.env = jo.env;
  o.env["EAGLEKIT_TEST_SCENARIO"] = scenario;
  o.env["EAGLEKIT_TEST_DIR"] = dir;
  o.env["EAGLEKIT_TEST_TIMEOUT_MS"] = std::to_string(jo.collective_timeout_ms);
  // Two cores: ranks should not also fight over intra-op threads.
  o.env["OMP_NUM_THREADS"] = "1";
  o.log_dir = dir;
  o.stop_grace = jo.stop_grace;
  o.kill_grace = jo.kill_grace;
  o.timeout = jo.limit;
  o.quiet = true;
  const auto t0 = std::chrono::steady_clock::now();
  JobResult r;
  r.launch = dist::launch_local(o);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int i = 0; i < nproc; ++i) {
    std::ifstream f(dir + "/rank_" + std::to_string(i) + ".log");
    r.logs.emplace_back(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  return r;
}

// --- inside a worker --------------------------------------------------------------------

inline std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}
inline std::string job_dir() { return env_or("EAGLEKIT_TEST_DIR", "."); }
inline int env_int(const char* name, int fallback) { return std::stoi(env_or(name, std::to_string(fallback))); }

inline dist::GroupOptions worker_group_options() {
  dist::GroupOptions g;
  g.timeout = std::chrono::milliseconds(env_int("EAGLEKIT_TEST_TIMEOUT_MS", 60000));
  return g;
}

inline void save_tensors(const std::string& path, const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> c;
  for (const auto& t : ts) c.push_back(t.detach().cpu().contiguous());
  torch::save(c, path);
}

inline std::vector<at::Tensor> load_tensors(const std::string& path) {
  std::vector<at::Tensor> ts;
  torch::load(ts, path);
  return ts;
}

// max |a - b| <= rel * max |b| (plus a floor for all-zero references).
// `atol`: an absolute floor, for slices whose exact value is 0 but whose reference carries
// rounding noise of the whole tensor's scale (pass rel * that scale).
inline bool close(const at::Tensor& a, const at::Tensor& b, double rel = 1e-5, double atol = 1e-9) {
  if (a.sizes() != b.sizes()) return false;
  const at::Tensor a64 = a.to(at::kDouble), b64 = b.to(at::kDouble);
  if (!at::isfinite(a64).all().item<bool>()) return false;
  const double err = (a64 - b64).abs().max().item<double>();
  const double ref = b64.abs().max().item<double>();
  return err <= rel * ref + atol;
}

inline std::string diff_text(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes()) return "shapes " + c10::str(a.sizes()) + " vs " + c10::str(b.sizes());
  const at::Tensor a64 = a.to(at::kDouble), b64 = b.to(at::kDouble);
  return "max abs diff " + std::to_string((a64 - b64).abs().max().item<double>()) + ", max abs ref " +
         std::to_string(b64.abs().max().item<double>());
}

// --- the draft under a mesh, against a single process --------------------------------------

// Rows dp_rank, dp_rank + dp_size, ... of a batch (the sampler's round-robin deal).
inline trainer::TttBatch select_rows(const trainer::TttBatch& b, int dp_rank, int dp_size) {
  const at::Tensor idx = at::arange(dp_rank, b.input_ids.size(0), dp_size, at::kLong);
  auto pick = [&](const at::Tensor& t) { return t.defined() ? t.index_select(0, idx) : t; };
  trainer::TttBatch r;
  r.input_ids = pick(b.input_ids);
  r.attention_mask = pick(b.attention_mask);
  r.loss_mask = pick(b.loss_mask);
  r.hidden_states = pick(b.hidden_states);
  r.aux_hidden_states = pick(b.aux_hidden_states);
  r.document_ids = pick(b.document_ids);
  r.position_ids = pick(b.position_ids);
  return r;
}

// Four rows of uneven real lengths (so uneven valid-token counts per rank), zero padded.
inline trainer::TttBatch model_batch(const trainer::DraftConfig& c, std::int64_t length, std::uint64_t seed) {
  return trainer::fixtures::random_batch(c, 4, length, {length, length - 3, length - 5, length}, seed);
}

inline trainer::TttOptions ttt_options(std::int64_t steps) {
  trainer::TttOptions o;
  o.steps = steps;
  return o;
}

struct ModelSetup {
  ModelSetup() = default;
  // A draft of `layers` decoder layers (docs/draft.md); base and d2t do not depend on it.
  explicit ModelSetup(std::int64_t layers) { config.num_hidden_layers = layers; }
  trainer::DraftConfig config = trainer::fixtures::tiny_config();
  trainer::BaseModel base = trainer::fixtures::random_base(config, 7);
  at::Tensor d2t = trainer::fixtures::spread_d2t(config);
  trainer::DraftModel fresh_draft() const { return trainer::DraftModel(config, d2t, base.lm_head, 3); }
  bool recompute = false;  // TttOptions::recompute of the runs below
  trainer::TttOptions options(std::int64_t steps) const {
    trainer::TttOptions o = ttt_options(steps);
    o.recompute = recompute;
    return o;
  }
};

// Loss (summed over ranks), statistics (summed) and gradients of one forward/backward.
struct ModelRun {
  at::Tensor loss;
  trainer::TttStats stats;
  std::vector<at::Tensor> grads;

  std::vector<at::Tensor> to_tensors() const {
    std::vector<at::Tensor> v{loss, stats.to_tensor()};
    v.insert(v.end(), grads.begin(), grads.end());
    return v;
  }
  static ModelRun from_tensors(const std::vector<at::Tensor>& v) {
    ModelRun r;
    r.loss = v.at(0);
    r.stats = trainer::TttStats::from_tensor(v.at(1));
    r.grads.assign(v.begin() + 2, v.end());
    return r;
  }
};

inline std::vector<at::Tensor> grads_of(const trainer::DraftModel& draft) {
  std::vector<at::Tensor> g;
  for (const auto& p : draft.parameters())
    g.push_back(p.grad().defined() ? p.grad().detach().clone() : at::zeros_like(p));
  return g;
}

inline ModelRun single_process_run(const ModelSetup& m, std::int64_t steps, const trainer::TttBatch& batch) {
  trainer::DraftModel draft = m.fresh_draft();
  trainer::TttUnroll unroll(m.base, draft, m.options(steps));
  const auto res = unroll.forward(batch);
  res.loss.backward();
  return {res.loss.detach(), res.stats, grads_of(draft)};
}

// This rank's share of `global`: its dp rows, then its cp chunk.
inline trainer::TttBatch local_share(const dist::Mesh& mesh, const trainer::TttBatch& global) {
  return trainer::shard_batch(select_rows(global, mesh.dp_rank(), mesh.dp_size()), mesh.cp_size(),
                              mesh.cp_rank());
}

inline ModelRun mesh_run(const dist::Mesh& mesh, const ModelSetup& m, std::int64_t steps,
                         const trainer::TttBatch& global, bool overlap,
                         trainer::RingOptions ring = {}) {
  trainer::DraftModel draft = m.fresh_draft();
  trainer::TttUnroll unroll(m.base, draft, m.options(steps));
  trainer::RingContext ctx(mesh, ring);
  ctx.set_global_length(global.input_ids.size(1));
  trainer::GradSyncOptions go;
  go.overlap = overlap;
  go.bucket_bytes = 4096;  // several buckets even for the tiny draft
  trainer::GradientSync sync(mesh.world(), draft.parameters(), go);
  sync.prepare();
  const auto res = unroll.forward(local_share(mesh, global), &ctx);
  res.loss.backward();
  sync.finish();
  at::Tensor loss = res.loss.detach().clone();
  mesh.world().all_reduce_sum(loss);
  return {loss, trainer::all_reduce_stats(mesh.world(), res.stats), grads_of(draft)};
}

// Compares a mesh run with the single-process run of the same global batch.
inline void check_same_run(const ModelRun& got, const ModelRun& want,
                           const std::vector<std::pair<std::string, at::Tensor>>& names) {
  CHECK_MESSAGE(close(got.loss, want.loss), "loss " << diff_text(got.loss, want.loss));
  CHECK(got.stats.mask_sum == want.stats.mask_sum);
  CHECK(got.stats.correct == want.stats.correct);
  CHECK(got.stats.cond_correct == want.stats.cond_correct);
  CHECK(got.stats.cond_total == want.stats.cond_total);
  const at::Tensor ce_got = at::tensor(got.stats.ce_sum, at::kDouble);
  const at::Tensor ce_want = at::tensor(want.stats.ce_sum, at::kDouble);
  CHECK_MESSAGE(close(ce_got, ce_want), "ce_sum " << diff_text(ce_got, ce_want));
  REQUIRE(got.grads.size() == want.grads.size());
  for (std::size_t i = 0; i < want.grads.size(); ++i) {
    const std::string name = i < names.size() ? names[i].first : std::to_string(i);
    CHECK_MESSAGE(close(got.grads[i], want.grads[i]), "grad of " << name << ": "
                                                                  << diff_text(got.grads[i], want.grads[i]));
  }
}

}  // namespace eaglekit::test
