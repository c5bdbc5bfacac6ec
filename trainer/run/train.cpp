#include "trainer/run/train.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <signal.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <thread>

#include "lib/clock.h"
#include "lib/loader.h"
#include "trainer/io/checkpoint.h"
#include "trainer/io/export.h"
#include "trainer/io/metrics_log.h"
#include "trainer/model/config.h"
#include "trainer/model/draft_model.h"
#include "trainer/parallel/data_parallel.h"
#include "trainer/parallel/distributed.h"
#include "trainer/run/evaluate.h"
#include "trainer/run/open_run.h"
#include "trainer/run/optim.h"
#include "trainer/run/plan.h"
#include "trainer/run/run_setup.h"
#include "trainer/run/threads.h"

namespace eaglekit::trainer {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

namespace {

// --- SIGINT/SIGTERM: a flag read at step boundaries ------------------------------------

volatile std::sig_atomic_t g_stop_signal = 0;

extern "C" void on_stop_signal(int sig) { g_stop_signal = sig; }

// Installed for the duration of a run. SA_RESETHAND: a second ^C kills the process the
// usual way, for when the checkpoint itself hangs.
class SignalGuard {
 public:
  SignalGuard() {
    g_stop_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESETHAND;
    ::sigaction(SIGINT, &sa, &old_int_);
    ::sigaction(SIGTERM, &sa, &old_term_);
  }
  ~SignalGuard() {
    ::sigaction(SIGINT, &old_int_, nullptr);
    ::sigaction(SIGTERM, &old_term_, nullptr);
  }
  SignalGuard(const SignalGuard&) = delete;
  SignalGuard& operator=(const SignalGuard&) = delete;

 private:
  struct sigaction old_int_ {};
  struct sigaction old_term_ {};
};


}  // namespace

// --- the loop --------------------------------------------------------------------------

namespace {

// Cores already busy: LibTorch's threads then wait for each other at every operator
// (docs/benchmarks.md, "Under load"). Said once; the thread count stays what the plan says
// unless the run adapts it.
void say_if_cores_busy(const Say& say, bool adapting) {
  const int threads = at::get_num_threads();
  const unsigned cores = std::thread::hardware_concurrency();
  double load = 0;
  if (!adapting && threads > 1 && cores > 0 && getloadavg(&load, 1) == 1 && load + threads > cores + 0.5) {
    char text[480];
    std::snprintf(text, sizeof text,
                  "note: the load average is %.1f on %u cores and this run asks for %d LibTorch threads; "
                  "threads that share busy cores wait for each other (beside one busy process per core, "
                  "--threads 2 ran at about a fifth of its idle speed, --threads 1 at about half of it, "
                  "docs/benchmarks.md); consider --threads %d, or --adapt-threads to follow the load",
                  load, cores, threads, std::max(1, static_cast<int>(cores) - static_cast<int>(load + 0.5)));
    say(text);
  }
}

// The TrainingError of a step whose loss or gradient norm is not finite: it names the batch,
// and the size of its values. The loader has already left out records with NaN or Inf, so a
// finite but absurd value (a damaged dump of a format without checksums) shows here as a
// huge largest |value|, and a normal one points at the optimization instead.
TrainingError non_finite_error(double loss, double grad_norm, const std::vector<Batch>& micro, std::int64_t step,
                               std::uint64_t epoch, bool several_ranks, const std::string& last_good) {
  auto name = [](double x) { return std::string(std::isnan(x) ? "NaN" : x > 0 ? "+inf" : "-inf"); };
  const std::string what = !std::isfinite(loss) ? "the loss is " + name(loss) : "the gradient norm is " + name(grad_norm);
  std::string ids;
  std::size_t n_ids = 0;
  double largest = 0;
  for (const Batch& b : micro) {
    for (const auto& id : b.conversation_ids)
      if (n_ids++ < 8) ids += (ids.empty() ? "" : ", ") + id;
    if (b.rows() > 0)
      largest = std::max({largest,
                          (b.hidden_states.defined() ? b.hidden_states : b.target_probs).abs().max().item<double>(),
                          b.aux_hidden_states.abs().max().item<double>()});
  }
  if (n_ids > 8) ids += ", ... (" + std::to_string(n_ids) + " in all)";
  char big[32];
  std::snprintf(big, sizeof big, "%.3g", largest);
  return TrainingError("training stopped at step " + std::to_string(step + 1) + " (epoch " + std::to_string(epoch) +
                       "): " + what + " on the batch of conversations " +
                       (ids.empty() ? std::string("(none on this rank)") : ids) +
                       ", whose hidden states are finite with largest |value| " + big +
                       (several_ranks ? " on this rank" : "") +
                       "; nothing was saved after it, the last good checkpoint is " + last_good +
                       ". If that value is far beyond what the base produces, check those records "
                       "(eaglekit validate --deep, eaglekit inspect --stats) and leave them out with "
                       "--quarantine; otherwise try a lower --lr, more --warmup-steps or --grad-clip");
}

// One run's loop over an opened run (trainer/run/open_run.h): its state (the step, the tokens,
// the metrics window, the best evaluation) and what a step, a checkpoint, an evaluation and
// the end do with it. Built and run once by run_training.
class TrainLoop {
 public:
  TrainLoop(const RunPlan& plan, OpenRun& run, const dist::Mesh& mesh, const TrainHooks& hooks, Say say)
      : plan_(plan), o_(plan.options), run_(run), mesh_(mesh), hooks_(hooks), say_(std::move(say)),
        main_rank_(mesh.is_main()),
        steps_s_(plan.block() ? plan.draft.config.block_size - 1 : plan.options.ttt_steps),
        report_decay_(plan.report_decay()), step_(run.step), tokens_total_(run.tokens),
        run_stats_(steps_s_), window_(steps_s_), epoch_of_step_(run.loader->state().epoch) {
    result_.summary = plan.summary;
    result_.start_step = step_;
    if (plan.resume_step >= 0) result_.resumed_from = plan.draft_dir;
    if (main_rank_) {  // metrics.jsonl and TensorBoard
      MetricsLog::Options mo;
      mo.out = o_.out;
      mo.resume_step = plan.resume_step >= 0 ? step_ : -1;
      mo.tensorboard = o_.tensorboard;
      mo.no_tensorboard = o_.no_tensorboard;
      mo.block_positions = plan.block();
      mo.on_line = hooks.on_metrics;
      mo.say = say_;
      log_ = std::make_unique<MetricsLog>(mo);
    }
    // --keep-best: a resumed run continues the saved best; a fresh one starts over.
    if (main_rank_ && o_.keep_best != KeepBest::kNone && plan.resume_step >= 0) best_ = read_best(o_.out);
  }

  TrainResult run() {
    SignalGuard signals;
    loop_start_ = Clock::now();
    while (!(o_.max_steps > 0 && step_ >= o_.max_steps)) {
      const auto t0 = Clock::now();
      if (governor_) step_counters_ = read_cpu_counters();
      const double cpu0 = process_cpu_seconds();
      const double wait0 = run_.loader->stats().wait_s;
      bool finished = false;
      const std::vector<Batch> micro = next_micro_batches(finished);
      if (micro.empty()) {
        if (finished) break;
        continue;  // an epoch ended on a step boundary; the next call starts the next one
      }
      const double waited = run_.loader->stats().wait_s - wait0;
      epoch_of_step_ = micro.back().epoch;
      if (train_step(micro, t0, cpu0, waited)) break;
    }
    if (show_progress_ && !result_.interrupted) std::cerr << "\n";
    result_.steps = step_;
    result_.epoch = run_.loader->state().epoch;
    result_.train_stats = run_stats_;
    result_.seconds = run_time_;
    result_.tokens_per_s = run_time_ > 0 ? run_tokens_ / run_time_ : 0;
    result_.data_wait_share = run_time_ > 0 ? run_wait_ / run_time_ : 0;
    if (!result_.interrupted) finish();
    report_best();
    return result_;
  }

 private:
  // The micro-batches of the next optimizer step (fewer at an epoch's end; none when it
  // ended on a step boundary, `finished` when it was the last epoch).
  std::vector<Batch> next_micro_batches(bool& finished) {
    std::vector<Batch> micro;
    while (static_cast<std::int64_t>(micro.size()) < o_.grad_accum) {
      std::optional<Batch> b = run_.loader->next();
      if (!b) {
        finished = plan_.epochs > 0 && run_.loader->state().epoch >= static_cast<std::uint64_t>(plan_.epochs);
        break;
      }
      micro.push_back(std::move(*b));
    }
    return micro;
  }

  // The forward and backward of a TTT draft's step over `micro`: its stats on this rank and
  // the tokens of the global batch.
  TttStats backward_ttt(const std::vector<Batch>& micro, double& step_tokens) {
    const c10::Device device = run_.device;
    // The normalizer of this step: mask sums over every micro-batch of every rank.
    at::Tensor sums = at::zeros({steps_s_ + 1}, at::kDouble);
    for (const Batch& b : micro) {
      sums.narrow(0, 0, steps_s_).add_(loss_mask_sums(b, steps_s_));
      sums[steps_s_] += static_cast<double>(b.tokens);
    }
    sums = reduce_sum(mesh_.world(), sums, device);
    at::Tensor normalizer = sums.narrow(0, 0, steps_s_).to(device, at::kFloat);
    if (hooks_.normalizer_scale) normalizer = normalizer * hooks_.normalizer_scale(step_);
    step_tokens = sums[steps_s_].item<double>();

    TttStats local(steps_s_);
    std::int64_t last_real = -1;
    for (std::size_t i = 0; i < micro.size(); ++i)
      if (micro[i].rows() > 0) last_real = static_cast<std::int64_t>(i);
    for (std::size_t i = 0; i < micro.size(); ++i) {
      const Batch& b = micro[i];
      if (b.rows() == 0) continue;
      prepare_context(run_.context.get(), b);
      if (run_.sync && static_cast<std::int64_t>(i) == last_real) run_.sync->prepare();
      TttResult r = run_.unroll->forward(to_ttt_batch(b), run_.context.get());
      ttt_loss(r.ce_sum, normalizer, o_.loss_decay).backward();
      local += r.stats;
    }
    if (run_.sync) run_.sync->finish();
    return local;
  }

  // The same for a block drafter (DFlash, trainer/unroll/dflash.h): every micro-batch's
  // forward first, since its loss weights (D-PACE) come from the forward; then the weight
  // sum of the global batch normalizes each backward, so that the ranks' summed gradients
  // are those of one rank with the whole batch.
  TttStats backward_block(const std::vector<Batch>& micro, double& step_tokens) {
    const c10::Device device = run_.device;
    TttStats local(steps_s_);
    std::vector<DFlashResult> results;
    // The block count per row (ModelOpt's min(anchors, max n - 1)) from the global batch, so
    // that a row draws the same blocks on any rank and in any micro-batch.
    at::Tensor most = at::zeros({1}, at::kLong);
    for (const Batch& b : micro)
      most[0] = std::max(most[0].item<std::int64_t>(), dflash_batch_most_valid(b, plan_.draft.config));
    if (mesh_.world().size() > 1) {
      if (mesh_.world().backend() == dist::Backend::kNccl) most = most.to(device);
      mesh_.world().all_reduce_max(most);
    }
    const std::int64_t most_valid = most.to(at::kCPU)[0].item<std::int64_t>();
    double sums_local[2] = {0, 0};  // weight sum, tokens
    for (const Batch& b : micro) {
      sums_local[1] += static_cast<double>(b.tokens);
      if (b.rows() == 0) continue;
      const DFlashAnchors anchors = dflash_batch_anchors(b, plan_.draft.config, plan_.dflash.num_anchors,
                                                         static_cast<std::uint64_t>(o_.seed), most_valid);
      results.push_back(run_.block_unroll->forward(to_ttt_batch(b), anchors));
      sums_local[0] += results.back().weight_sum;
      local += results.back().stats;
    }
    const at::Tensor sums = reduce_sum(mesh_.world(), at::tensor({sums_local[0], sums_local[1]}, at::kDouble), device);
    const double weight_sum = sums[0].item<double>();
    step_tokens = sums[1].item<double>();
    for (std::size_t i = 0; i < results.size(); ++i) {
      if (run_.sync && i + 1 == results.size()) run_.sync->prepare();
      dflash_loss(results[i].weighted_loss, weight_sum).backward();
    }
    if (run_.sync) run_.sync->finish();
    return local;
  }

  // One optimizer step over `micro`, its metrics, progress, checkpoint and evaluation.
  // True when the run stops here (a signal or a hook).
  bool train_step(const std::vector<Batch>& micro, Clock::time_point t0, double cpu0, double waited) {
    const c10::Device device = run_.device;
    run_.optimizer->zero_grad();
    double step_tokens = 0;
    const TttStats local = plan_.block() ? backward_block(micro, step_tokens) : backward_ttt(micro, step_tokens);

    // Metrics of the global batch, and whether any rank was asked to stop.
    at::Tensor flat =
        at::cat({local.to_tensor().reshape({-1}), at::full({1}, g_stop_signal != 0 ? 1.0 : 0.0, at::kDouble)});
    flat = reduce_sum(mesh_.world(), flat, device);
    const TttStats step_stats = TttStats::from_tensor(flat.narrow(0, 0, 5 * steps_s_).reshape({5, steps_s_}));
    bool stop = flat[5 * steps_s_].item<double>() > 0;

    const double loss = step_stats.loss(report_decay_);
    grad_norm_ = clip_grad_norm(run_.parameters, o_.grad_clip);
    if (!std::isfinite(loss) || !std::isfinite(grad_norm_)) {
      if (show_progress_) std::cerr << "\n";
      const std::string last_good = !result_.last_checkpoint.empty() ? result_.last_checkpoint
                                    : result_.resumed_from.empty()    ? std::string("none yet")
                                                                      : result_.resumed_from;
      throw non_finite_error(loss, grad_norm_, micro, step_, epoch_of_step_, mesh_.world_size() > 1, last_good);
    }
    lr_ = learning_rate(o_.lr, o_.schedule, o_.warmup_steps, plan_.total_steps, step_);
    run_.optimizer->step(lr_);
    ++step_;
    saved_at_step_ = false;

    const double dt = seconds_since(t0);
    if (governor_) adapt_threads(dt - waited, step_tokens);
    tokens_total_ += step_tokens;
    window_.add(step_stats, step_tokens, dt, waited, process_cpu_seconds() - cpu0);
    run_stats_ += step_stats;
    run_tokens_ += step_tokens;
    run_time_ += dt;
    run_wait_ += waited;

    if (hooks_.after_step && !hooks_.after_step(step_, *run_.draft)) stop = true;
    const bool last = o_.max_steps > 0 && step_ >= o_.max_steps;
    if (step_ % o_.log_every == 0 || stop || last) log_window();
    show_progress(step_stats, loss, stop);
    if (stop) {
      if (show_progress_) std::cerr << "\n";
      checkpoint();
      saved_at_step_ = true;
      result_.interrupted = true;
      say_(std::string("stopped") + (g_stop_signal ? " by signal " + std::to_string(g_stop_signal) : "") +
           " at step " + std::to_string(step_) + "; checkpoint " + result_.last_checkpoint +
           " (continue with --resume)");
      return true;
    }
    if (o_.save_every > 0 && step_ % o_.save_every == 0) {
      checkpoint();
      saved_at_step_ = true;
    }
    if (o_.eval_every > 0 && step_ % o_.eval_every == 0) evaluate();
    return false;
  }

  // The run's progress: the redrawn line on a terminal; in a log (stderr not a terminal) a
  // plain line instead, after the first step and then every --progress-every seconds
  // (metrics.jsonl has the rest).
  void show_progress(const TttStats& step_stats, double loss, bool stop) {
    auto text = [&](bool tty) {
      const double rate = run_time_ > 0 ? static_cast<double>(step_ - result_.start_step) / run_time_ : 0;
      const std::int64_t total = plan_.total_steps;
      const double eta = rate > 0 && total > step_ ? static_cast<double>(total - step_) / rate : 0;
      const auto acc = step_stats.acc();
      const double acc0 = acc.empty() ? 0.0 : acc[0], tokens_per_s = run_time_ > 0 ? run_tokens_ / run_time_ : 0;
      if (tty) return progress_line(step_, total, loss, acc0, tokens_per_s, eta);
      char line[200];
      std::snprintf(line, sizeof line, "step %lld/%lld, loss %.4g, acc0 %.3g, %s tok/s, ETA %s",
                    static_cast<long long>(step_), static_cast<long long>(total), loss, acc0,
                    rate_text(tokens_per_s).c_str(), format_duration(eta).c_str());
      return std::string(line);
    };
    if (show_progress_ && (seconds_since(last_draw_) > 0.25 || stop)) {
      last_draw_ = Clock::now();
      std::cerr << text(true) << std::flush;
    }
    if (log_progress_ && (!logged_any_ || seconds_since(last_logged_) >= o_.progress_every)) {
      last_logged_ = Clock::now();
      logged_any_ = true;
      say_(text(false));
    }
  }

  // --adapt-threads: the step's figures to the governor, and its count for the next step.
  void adapt_threads(double compute_s, double tokens) {
    ThreadGovernor::Step s;
    s.seconds = compute_s;
    s.tokens = tokens;
    s.load = cpu_load_between(step_counters_, read_cpu_counters());
    threads_of_step_ = at::get_num_threads();
    const std::string said = governor_->observe(s);
    if (governor_->threads() != threads_of_step_) at::set_num_threads(governor_->threads());
    if (!said.empty()) {
      if (show_progress_) std::cerr << "\n";
      say_("step " + std::to_string(step_) + ": " + said);
    }
  }

  void log_window() {
    if (window_.empty()) return;
    const std::string line =
        window_.take_line(step_, epoch_of_step_, lr_, grad_norm_, report_decay_, seconds_since(loop_start_),
                          governor_ ? threads_of_step_ : 0);
    if (log_) log_->write(line);
  }

  Checkpoint make_checkpoint() const {
    Checkpoint ck;
    ck.state.step = step_;
    ck.state.sampler = run_.loader->state();
    ck.state.epoch = ck.state.sampler.epoch;
    ck.state.optimizer_steps = run_.optimizer->steps();
    ck.state.schedule_total_steps = plan_.total_steps;
    ck.state.tokens = tokens_total_;
    ck.state.world_size = mesh_.world_size();
    ck.state.cp_size = mesh_.cp_size();
    ck.optimizer = run_.optimizer->state();
    ck.rng = capture_rng_state();
    ck.options_json = o_.to_json();
    return ck;
  }

  void checkpoint() {
    if (main_rank_) {
      result_.last_checkpoint = save_checkpoint(o_.out, *run_.draft, make_checkpoint());
      // Only now, with the new one whole on disk, do older ones go.
      for (const auto& gone : prune_checkpoints(o_.out, o_.keep_checkpoints, result_.last_checkpoint))
        say_("removed " + fs::path(gone).filename().string() + " (--keep-checkpoints " +
             std::to_string(o_.keep_checkpoints) + ")");
    }
    if (mesh_.world_size() > 1) mesh_.world().barrier();
  }

  void keep_if_best(const TttStats& stats) {
    if (!main_rank_ || o_.keep_best == KeepBest::kNone) return;
    const double est_ar = stats.est_ar();
    if (!std::isfinite(est_ar) || (best_ && !(est_ar > best_->est_ar))) return;
    BestCheckpoint b;
    b.step = step_;
    b.est_ar = est_ar;
    const std::string dir = save_best_checkpoint(o_.out, *run_.draft, make_checkpoint(), b, result_.last_checkpoint);
    char text[160];
    if (best_)
      std::snprintf(text, sizeof text, "best est_ar %.4g at step %lld (was %.4g at step %lld): ", est_ar,
                    static_cast<long long>(step_), best_->est_ar, static_cast<long long>(best_->step));
    else
      std::snprintf(text, sizeof text, "best est_ar %.4g at step %lld: ", est_ar, static_cast<long long>(step_));
    say_(text + dir);
    best_ = b;
  }

  void evaluate() {
    if (!plan_.eval_data) return;
    LoaderOptions elo = run_.loader_options;
    elo.sampler.shuffle = false;
    elo.sampler.epochs = 1;
    Loader eval_loader(plan_.eval_data->dataset, plan_.eval_data->samples, elo);
    const auto t0 = Clock::now();
    const TttStats stats = plan_.block() ? evaluate_loader(*run_.block_unroll, eval_loader, &mesh_)
                                         : evaluate_loader(*run_.unroll, eval_loader, &mesh_);
    json j;
    j["split"] = "eval";
    j["step"] = step_;
    j["epoch"] = run_.loader->state().epoch;
    j.update(stats_json(stats, report_decay_));
    j["seconds"] = seconds_since(t0);
    if (log_) log_->write(j.dump());
    result_.eval_stats = stats;
    last_eval_step_ = step_;
    keep_if_best(stats);
  }

  // The end of an uninterrupted run: the last metrics, checkpoint and evaluation, and final/.
  void finish() {
    log_window();
    if (!saved_at_step_) checkpoint();
    if (o_.eval_every >= 0 && last_eval_step_ != step_) evaluate();
    if (main_rank_) {
      const DraftModel& draft = *run_.draft;
      result_.final_dir = (fs::path(o_.out) / "final").string();
      ExportOptions eo;
      eo.serving = true;
      eo.allow_unservable = o_.allow_unservable;
      eo.run_options_json = o_.to_json();  // the bytes each checkpoint's train_options.json holds
      std::vector<std::string> warnings;
      eo.dtype = serving_export_dtype(o_.export_dtype, draft.config(), warnings);
      for (auto& w : serving_warnings(draft.config())) warnings.push_back(std::move(w));
      for (const auto& w : warnings) say_("final/: " + w);
      // final/ appears complete (config.json with model.safetensors) or not at all, and a
      // rerun replaces an older one in one step.
      export_draft_folder(draft, result_.final_dir, eo);
      say_("done: " + std::to_string(step_) + " steps; final draft in " + result_.final_dir);
    }
    if (mesh_.world_size() > 1) mesh_.world().barrier();
  }

  void report_best() {
    if (!best_) return;
    result_.best_dir = (fs::path(o_.out) / kBestFolder).string();
    result_.best_step = best_->step;
    result_.best_est_ar = best_->est_ar;
  }

  const RunPlan& plan_;
  const TrainOptions& o_;
  OpenRun& run_;
  const dist::Mesh& mesh_;
  const TrainHooks& hooks_;
  const Say say_;
  const bool main_rank_;
  const std::int64_t steps_s_;  // TTT steps, or a block's predicted positions
  const double report_decay_;   // RunPlan::report_decay
  std::unique_ptr<MetricsLog> log_;
  TrainResult result_;
  std::int64_t step_;
  double tokens_total_;
  std::optional<BestCheckpoint> best_;
  std::int64_t last_eval_step_ = -1;
  bool saved_at_step_ = false;
  // Progress and the metrics window.
  const bool show_progress_ = o_.progress && main_rank_ && ::isatty(2) == 1;
  const bool log_progress_ = o_.progress && main_rank_ && !show_progress_ && o_.progress_every > 0;
  Clock::time_point loop_start_ = Clock::now();
  Clock::time_point last_logged_ = Clock::now();
  Clock::time_point last_draw_ = Clock::now() - std::chrono::seconds(1);
  bool logged_any_ = false;
  TttStats run_stats_;
  StepWindow window_;
  double run_tokens_ = 0, run_time_ = 0, run_wait_ = 0;
  double grad_norm_ = 0, lr_ = 0;
  std::uint64_t epoch_of_step_;
  // --adapt-threads (trainer/run/threads.h); none otherwise.
  std::optional<ThreadGovernor> governor_ =
      plan_.adapt_threads ? std::optional<ThreadGovernor>(std::in_place, plan_.threads) : std::nullopt;
  CpuCounters step_counters_;
  int threads_of_step_ = 0;  // the count the last step ran at
};

}  // namespace

TrainResult run_training(const TrainOptions& opts, const dist::Mesh* mesh_arg, const TrainHooks& hooks) {
  const dist::Mesh single = dist::Mesh::single();
  const dist::Mesh& mesh = mesh_arg ? *mesh_arg : single;
  const Say say = [main_rank = mesh.is_main()](const std::string& msg) {
    if (main_rank) std::cerr << "train: " << msg << "\n";
  };
  opts.check();
  if (opts.cp_size != mesh.cp_size())
    throw UsageError("--cp " + std::to_string(opts.cp_size) + " does not match the mesh (cp " +
                     std::to_string(mesh.cp_size()) + ")");
  const c10::Device device = parse_device(opts.device);  // before the data: a missing GPU is said first

  // Decide once, then open: the plan's lines first, then what opening says.
  const RunPlan plan = resolve(opts, mesh.world_size());
  at::set_num_threads(plan.threads);
  if (device.is_cpu() && mesh.is_main()) say_if_cores_busy(say, plan.adapt_threads);
  if (plan.resume_step >= 0)
    say("resuming from " + plan.draft_dir + " (step " + std::to_string(plan.resume_step) + ")");
  say(plan.summary);
  for (const auto& line : plan.notes) say(line);
  const std::unique_ptr<OpenRun> run = open_run(plan, mesh, say);
  for (const auto& line : plan.schedule_said) say(line);
  const DraftConfig& dc = run->draft->config();
  say("draft: " + std::to_string(run->parameter_count) + " parameters, hidden " + std::to_string(dc.hidden_size) +
      ", draft vocab " + std::to_string(dc.draft_vocab_size) + "; " + std::to_string(plan.total_steps) +
      " optimizer steps of " + std::to_string(plan.rows_per_step) + " rows on " + std::to_string(mesh.world_size()) +
      " rank(s), " + std::to_string(at::get_num_threads()) + " threads (OpenMP waiting " + plan.wait_policy +
      "), device " + run->device.str() +
      (plan.block() ? ", DFlash block " + std::to_string(dc.block_size) + " (dense block attention)"
                    : ", TTT attention " + std::string(ttt_attention_name(opts.ttt_attention)) +
                          (opts.cp_size > 1 ? " (--cp > 1: the ring's own)" : "")));
  if (plan.resume_step < 0) say("learning rate: " + plan.schedule);
  if (const std::string w = schedule_warning(opts.lr, opts.schedule, opts.warmup_steps, plan.total_steps); !w.empty())
    say("warning: " + w);

  return TrainLoop(plan, *run, mesh, hooks, say).run();
}

}  // namespace eaglekit::trainer
