#include "trainer/run/evaluate.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <ATen/Context.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iomanip>
#include <sstream>

#include "formats/error.h"
#include "lib/clock.h"
#include "lib/progress.h"
#include "trainer/io/checkpoint.h"
#include "trainer/io/metrics_log.h"
#include "trainer/model/base_model.h"
#include "trainer/parallel/data_parallel.h"
#include "trainer/parallel/distributed.h"
#include "trainer/run/open_run.h"
#include "trainer/run/plan.h"
#include "trainer/run/run_setup.h"

namespace eaglekit::trainer {

namespace {
using Clock = std::chrono::steady_clock;

// The stats of `forward` pooled over the loader's next epoch (or max_batches batches), with
// no gradients and the draft in eval mode, summed over the mesh's ranks.
template <typename Forward>
TttStats pool_batches(DraftModel& draft, std::int64_t steps, Loader& loader, const dist::Mesh& m,
                      std::int64_t max_batches, const std::function<void(const TttStats&)>& on_batch,
                      Forward&& forward) {
  TttStats total(steps);
  c10::NoGradGuard no_grad;
  draft.train(false);
  std::int64_t done = 0;
  while (max_batches < 0 || done < max_batches) {
    std::optional<Batch> batch = loader.next();
    if (!batch) break;
    ++done;
    if (batch->rows() > 0) total += forward(*batch);
    if (on_batch) on_batch(total);
  }
  draft.train(true);
  if (m.world_size() > 1) total = all_reduce_stats(m.world(), total);
  return total;
}

}  // namespace

TttStats evaluate_loader(TttUnroll& unroll, Loader& loader, const dist::Mesh* mesh, std::int64_t max_batches,
                         const std::function<void(const TttStats&)>& on_batch) {
  const dist::Mesh single = dist::Mesh::single();
  const dist::Mesh& m = mesh ? *mesh : single;
  const std::unique_ptr<SequenceContext> context = make_sequence_context(m, unroll.options().attention);
  return pool_batches(unroll.draft(), unroll.options().steps, loader, m, max_batches, on_batch, [&](Batch& b) {
    prepare_context(context.get(), b);
    return unroll.forward(to_ttt_batch(b), context.get()).stats;
  });
}

TttStats evaluate_loader(DFlashUnroll& unroll, Loader& loader, const dist::Mesh* mesh, std::int64_t max_batches,
                         const std::function<void(const TttStats&)>& on_batch) {
  const dist::Mesh single = dist::Mesh::single();
  const dist::Mesh& m = mesh ? *mesh : single;
  const DraftConfig& c = unroll.draft().config();
  return pool_batches(unroll.draft(), c.block_size - 1, loader, m, max_batches, on_batch, [&](Batch& b) {
    b.epoch = 0;  // the same anchors in every evaluation of the split
    return unroll.forward(to_ttt_batch(b), dflash_batch_anchors(b, c, unroll.options().num_anchors, 0)).stats;
  });
}

std::string EvaluateReport::to_json() const {
  nlohmann::ordered_json j = stats_json(stats, loss_decay);
  j["steps"] = stats.steps();
  j["loss_decay"] = loss_decay;
  j["loss_fn"] = loss_fn;
  j["samples"] = samples;
  j["seconds"] = seconds;
  return j.dump();
}

std::string EvaluateReport::to_text() const {
  std::ostringstream os;
  os << std::fixed;
  os << "evaluated " << samples << " samples, " << static_cast<std::int64_t>(stats.tokens())
     << " scored positions, " << stats.steps() << (loss_decay == 0 ? " block positions in " : " TTT steps in ") << std::setprecision(1) << seconds
     << " s\n";
  os << std::setprecision(4);
  if (loss_decay == 0)
    os << "loss      " << stats.loss(loss_decay) << "  (the mean over every scored position)\n";
  else
    os << "loss      " << stats.loss(loss_decay) << "  (sum of " << loss_decay << "^s * loss_s)\n";
  os << (loss_decay == 0 ? "pos   loss      acc     cond_acc\n" : "step  loss      acc     cond_acc\n");
  const auto l = stats.loss_per_step(), a = stats.acc(), c = stats.cond_acc();
  for (std::int64_t s = 0; s < stats.steps(); ++s) {
    os << std::left << std::setw(6) << (loss_decay == 0 ? s + 1 : s) << std::setw(10) << l[static_cast<std::size_t>(s)] << std::setw(8)
       << a[static_cast<std::size_t>(s)] << c[static_cast<std::size_t>(s)] << "\n";
  }
  os << std::setprecision(3) << "est_ar    " << stats.est_ar() << "  (conditional " << stats.est_ar_conditional()
     << ")\n";
  return os.str();
}

EvaluateReport run_evaluate(const EvaluateOptions& options, const dist::Mesh* mesh) {
  const auto t0 = Clock::now();
  const dist::Mesh single = dist::Mesh::single();
  const dist::Mesh& m = mesh ? *mesh : single;
  options.check();
  if (options.cp_size != m.cp_size())
    throw UsageError("--cp " + std::to_string(options.cp_size) + " does not match the mesh (cp " +
                     std::to_string(m.cp_size()) + ")");
  parse_device(options.device);  // before the data: a missing GPU is said first
  const RunPlan plan = resolve(options, m.world_size());
  at::set_num_threads(plan.threads);
  const std::unique_ptr<OpenRun> run = open_run(plan, m, [](const std::string&) {});
  Progress progress("evaluate", run->loader->steps_in_epoch(), options.progress && m.is_main() ? -1 : 0);
  EvaluateReport report;
  report.loss_decay = plan.report_decay();
  report.loss_fn = plan.block() ? std::string(plan.dflash.self_distillation ? "dflash-kd" : "dflash-ce")
                                : loss_spec_text(plan.ttt.loss_terms);
  report.summary = plan.summary + "\ndraft: " + plan.draft.source;
  for (const auto& w : plan.norm.warnings) report.summary += "\nwarning: " + w;
  report.summary += "\n" + plan.norm.said;
  for (const auto& line : plan.notes) report.summary += "\n" + line;
  report.samples = plan.train_samples;
  const auto tick = [&](const TttStats&) { progress.add(1); };
  report.stats = plan.block() ? evaluate_loader(*run->block_unroll, *run->loader, &m, options.max_batches, tick)
                              : evaluate_loader(*run->unroll, *run->loader, &m, options.max_batches, tick);
  progress.finish();
  report.seconds = seconds_since(t0);
  return report;
}

}  // namespace eaglekit::trainer
