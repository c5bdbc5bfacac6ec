// Offline evaluation: pooled metrics independent of the batch size and collation, equal to
// the sums of a single pass, the report formats, and refusals.
#include <ATen/ATen.h>
#include <doctest/doctest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/support.h"
#include "tests/trainer/train_data.h"
#include "trainer/io/checkpoint.h"
#include "trainer/io/export.h"
#include "trainer/run/evaluate.h"
#include "trainer/run/train.h"

using namespace eaglekit;
using namespace eaglekit::trainer;

namespace {

// A trained draft (a few steps, so that accuracies are neither 0 nor 1) and its data.
struct Trained {
  std::unique_ptr<test::SynthJob> job = test::make_synth_job(30, 48, 6, 30);
  test::TempDir dir{"eval"};
  Trained() {
    TrainOptions o = test::small_options(*job, dir / "out");
    o.max_steps = 15;
    o.lr = 1e-2;
    o.max_length = 32;
    run_training(o);
  }
  EvaluateOptions options() const {
    EvaluateOptions e;
    e.base = job->base;
    e.draft = dir / "out/final";
    e.data = job->data;
    e.index = job->index;
    e.split = "all";
    e.max_length = 32;
    e.jobs = 2;
    e.progress = false;
    return e;
  }
};

void check_same(const TttStats& a, const TttStats& b) {
  REQUIRE(a.steps() == b.steps());
  for (std::int64_t s = 0; s < a.steps(); ++s) {
    CAPTURE(s);
    const auto i = static_cast<std::size_t>(s);
    CHECK(a.mask_sum[i] == b.mask_sum[i]);
    CHECK(a.correct[i] == b.correct[i]);
    CHECK(a.cond_correct[i] == b.cond_correct[i]);
    CHECK(a.cond_total[i] == b.cond_total[i]);
    CHECK(a.ce_sum[i] == doctest::Approx(b.ce_sum[i]).epsilon(1e-6));
  }
}

// Trained once for the whole file.
const Trained& trained() {
  static const Trained t;
  return t;
}

}  // namespace

TEST_CASE("evaluate: pooled metrics do not depend on the batch size or the collation") {
  const Trained& t = trained();
  EvaluateOptions o = t.options();
  o.batch_size = 1;
  const EvaluateReport one = run_evaluate(o);
  o.batch_size = 7;
  const EvaluateReport seven = run_evaluate(o);
  o.batch_size = 64;  // the whole split in one batch: the plain formulas of docs/ttt.md
  const EvaluateReport all = run_evaluate(o);
  o.batch_size = 5;
  o.mode = CollateMode::kLongest;
  const EvaluateReport longest = run_evaluate(o);
  check_same(one.stats, all.stats);
  check_same(seven.stats, all.stats);
  check_same(longest.stats, all.stats);
  CHECK(one.stats.loss(0.9) == doctest::Approx(all.stats.loss(0.9)).epsilon(1e-6));
  CHECK(one.samples == 30);

  // The metrics are the ratios of the sums, and not trivially 0 or 1.
  const auto acc = all.stats.acc();
  REQUIRE(acc.size() == 3);
  CHECK(acc[0] > 0.05);
  CHECK(acc[0] < 1.0);
  CHECK(acc[0] == all.stats.correct[0] / all.stats.mask_sum[0]);
  CHECK(all.stats.est_ar() == doctest::Approx(1 + acc[0] + acc[0] * acc[1] + acc[0] * acc[1] * acc[2]));
  // Step s scores the positions from s + 1 on: fewer at each step.
  CHECK(all.stats.mask_sum[0] > all.stats.mask_sum[1]);
  CHECK(all.stats.mask_sum[1] > all.stats.mask_sum[2]);

  const auto j = nlohmann::json::parse(all.to_json());
  for (const char* k : {"loss", "loss_per_step", "acc", "cond_acc", "est_ar", "tokens"}) CHECK_MESSAGE(j.contains(k), k);
  CHECK(j["acc"][0].get<double>() == doctest::Approx(acc[0]));
  CHECK(j["tokens"].get<double>() == all.stats.mask_sum[0]);
  const std::string text = all.to_text();
  CHECK(text.find("est_ar") != std::string::npos);
  CHECK(text.find("cond_acc") != std::string::npos);

  // A checkpoint folder and the output folder evaluate the same draft as the export (fp32).
  o = t.options();
  o.draft = t.dir / "out";
  check_same(run_evaluate(o).stats, one.stats);

  // More TTT steps: one more entry, the first ones unchanged.
  o = t.options();
  o.ttt_steps = 4;
  const EvaluateReport four = run_evaluate(o);
  CHECK(four.stats.steps() == 4);
  CHECK(four.stats.correct[0] == all.stats.correct[0]);
}

TEST_CASE("evaluate: the train split, max_batches and refusals") {
  const Trained& t = trained();
  EvaluateOptions o = t.options();
  o.split = "eval";
  o.batch_size = 2;
  const EvaluateReport ev = run_evaluate(o);
  CHECK(ev.samples == 2);  // 30 - floor(0.95 * 30)
  o.split = "train";
  const EvaluateReport train = run_evaluate(o);
  CHECK(train.samples == 28);
  o.max_batches = 1;
  const EvaluateReport first = run_evaluate(o);
  CHECK(first.stats.mask_sum[0] > 0);
  CHECK(first.stats.mask_sum[0] < train.stats.mask_sum[0]);

  o = t.options();
  o.split = "bogus";
  CHECK_THROWS_AS(run_evaluate(o), UsageError);
  o = t.options();
  o.draft = t.dir / "nowhere";
  CHECK_THROWS_AS(run_evaluate(o), IoError);
  o = t.options();
  o.device = "tpu";
  CHECK_THROWS_WITH_AS(run_evaluate(o), "--device must be cpu, cuda or cuda:N, not 'tpu'", UsageError);
  CHECK((autocast_type(ComputeDType::kBFloat16) == at::kBFloat16));
  CHECK(!autocast_type(ComputeDType::kFloat32));
  CHECK(parse_device("cpu").is_cpu());

  // A draft whose fc reads another aux width than the data's.
  SynthOptions so;
  so.out_dir = t.dir / "wide";
  so.conversations = 4;
  so.hidden = 32;
  so.aux_layers = 2;
  so.vocab = 48;
  so.min_tokens = 6;
  so.max_tokens = 10;
  so.jobs = 1;
  synthesize(so);
  IndexOptions io;
  io.roots = {t.dir / "wide"};
  io.out = t.dir / "wide.eki";
  io.progress = 0;
  build_index(io);
  o = t.options();
  o.data = t.dir / "wide/conversations.jsonl";
  o.index = t.dir / "wide.eki";
  CHECK_THROWS_WITH_AS(run_evaluate(o),
                       "the data has hidden size 32 and aux width 64, the draft expects 32 and 96", UsageError);
}

TEST_CASE("evaluate: bf16 autocast stays close to fp32") {
  const Trained& t = trained();
  EvaluateOptions o = t.options();
  const EvaluateReport fp32 = run_evaluate(o);
  o.compute_dtype = ComputeDType::kBFloat16;
  const EvaluateReport bf16 = run_evaluate(o);
  o.compute_dtype = ComputeDType::kFloat32;
  const EvaluateReport again = run_evaluate(o);
  // Two-sided: the same draft and data, so the loss differs only by the arithmetic. Two float32
  // evaluations agree to 1e-6; bf16 autocast moves the loss beyond float32 rounding (1e-5)
  // and within a few units of bf16's 2^-8 precision. Autocast not applied gives the float32 loss.
  const double moved = test::rel_diff(bf16.stats.loss(0.9), fp32.stats.loss(0.9));
  MESSAGE("bf16 autocast moves evaluate's loss by " << moved << " relative");
  CHECK(test::rel_diff(again.stats.loss(0.9), fp32.stats.loss(0.9)) <= 1e-6);
  CHECK(moved > 1e-5);
  CHECK(moved < 3e-2);
  CHECK(std::abs(bf16.stats.acc()[0] - fp32.stats.acc()[0]) < 0.05);
}
