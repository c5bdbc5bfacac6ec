#include "trainer/train.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <signal.h>
#include <sys/resource.h>
#include <tbb/blocked_range.h>
#include <tbb/combinable.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <variant>

#include "formats/atomic_file.h"
#include "formats/format.h"
#include "lib/dataset.h"
#include "lib/loader.h"
#include "trainer/checkpoint.h"
#include "trainer/config.h"
#include "trainer/data_parallel.h"
#include "trainer/distributed.h"
#include "trainer/draft_model.h"
#include "trainer/evaluate.h"
#include "trainer/metrics_log.h"
#include "trainer/export.h"
#include "trainer/open_run.h"
#include "trainer/optim.h"
#include "trainer/plan.h"
#include "trainer/run_setup.h"

namespace eaglekit::trainer {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

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

// --- options ---------------------------------------------------------------------------

opt::Groups TrainOptions::groups() {
  return {data_options(*this).without({"split"}), batch_options(*this), model_options(*this), optim_options(*this),
          run_options(*this)};
}

std::string TrainOptions::to_json() const { return opt::to_json(const_cast<TrainOptions&>(*this).groups()); }

void TrainOptions::apply_json(const std::string& json_text, const std::string& where) {
  opt::apply_json(groups(), json_text, where);
}

void TrainOptions::check() const {
  if (index.empty()) throw UsageError("--index is required (build one with eaglekit index)");
  if (base.empty()) throw UsageError("--base is required (the base model folder)");
  if (out.empty()) throw UsageError("--out is required (the output folder)");
  if (eval_fraction < 0 || eval_fraction >= 1) throw UsageError("--eval-fraction must be in [0, 1)");
  if (ttt_steps < 1) throw UsageError("--ttt-steps must be at least 1");
  check_ttt_attention(ttt_attention);
  if (!(loss_decay > 0)) throw UsageError("--loss-decay must be positive");
  if (max_length < 2) throw UsageError("--max-length must be at least 2");
  if (batch_size < 1) throw UsageError("--batch-size must be at least 1");
  if (grad_accum < 1) throw UsageError("--grad-accum must be at least 1");
  if (!(lr > 0) || !std::isfinite(lr)) throw UsageError("--lr must be a positive number");
  if (warmup_steps < 0) throw UsageError("--warmup-steps must not be negative");
  if (weight_decay < 0) throw UsageError("--weight-decay must not be negative");
  if (!(adam_beta1 >= 0 && adam_beta1 < 1) || !(adam_beta2 >= 0 && adam_beta2 < 1))
    throw UsageError("Adam betas must be in [0, 1)");
  if (!(adam_eps > 0)) throw UsageError("Adam eps must be positive");
  if (epochs < 0) throw UsageError("--epochs must not be negative");
  if (max_steps < 0) throw UsageError("--max-steps must not be negative");
  if (log_every < 1) throw UsageError("--log-every must be at least 1");
  if (!(progress_every >= 0) || !std::isfinite(progress_every))
    throw UsageError("--progress-every takes seconds, 0 or more (0: no plain progress lines)");
  if (draft_vocab_size < 0) throw UsageError("--draft-vocab-size must not be negative");
  if (cp_size < 1) throw UsageError("--cp must be at least 1");
  if (prefetch < 1) throw UsageError("--prefetch must be at least 1");
  if (jobs < 0 || threads < 0) throw UsageError("--jobs and --threads must not be negative");
  if (!(timeout > 0) || timeout > 7 * 24 * 3600.0)
    throw UsageError("--timeout takes a positive number of seconds (at most a week), not " + std::to_string(timeout));
  if (keep_checkpoints < 0)
    throw UsageError("--keep-checkpoints must not be negative (N > 0 keeps the newest N; 0 keeps all), not " +
                     std::to_string(keep_checkpoints));
  if (keep_best != KeepBest::kNone) {
    if (eval_every < 0)
      throw UsageError("--keep-best est_ar needs evaluation, which --eval-every " + std::to_string(eval_every) +
                       " turns off: set --eval-every N (every N steps) or 0 (at the end)");
    if (!(eval_fraction > 0))
      throw UsageError("--keep-best est_ar needs an eval split: set --eval-fraction above 0 (it enables evaluation)");
  }
  if (pad_multiple < 1) throw UsageError("--pad-multiple must be at least 1");
  if (!export_dtype.empty()) parse_float_dtype(export_dtype);
  parse_device(device, /*check_available=*/false);  // run_training checks the device itself
}

// --- the loop --------------------------------------------------------------------------

TrainResult run_training(const TrainOptions& opts, const dist::Mesh* mesh_arg, const TrainHooks& hooks) {
  const dist::Mesh single = dist::Mesh::single();
  const dist::Mesh& mesh = mesh_arg ? *mesh_arg : single;
  const bool main_rank = mesh.is_main();
  const int world = mesh.world_size();
  auto say = [&](const std::string& msg) {
    if (main_rank) std::cerr << "train: " << msg << "\n";
  };

  opts.check();
  if (opts.cp_size != mesh.cp_size())
    throw UsageError("--cp " + std::to_string(opts.cp_size) + " does not match the mesh (cp " +
                     std::to_string(mesh.cp_size()) + ")");
  const c10::Device device = parse_device(opts.device);  // before the data: a missing GPU is said first
  if (opts.threads > 0) at::set_num_threads(opts.threads);
  // Cores already busy: LibTorch's threads then wait for each other at every operator
  // (docs/benchmarks.md, "Under load"). Said once; the thread count stays what was asked.
  if (device.is_cpu() && main_rank) {
    const int threads = at::get_num_threads();
    const unsigned cores = std::thread::hardware_concurrency();
    double load = 0;
    if (threads > 1 && cores > 0 && getloadavg(&load, 1) == 1 && load + threads > cores + 0.5) {
      char text[400];
      std::snprintf(text, sizeof text,
                    "note: the load average is %.1f on %u cores and this run asks for %d LibTorch threads; "
                    "threads that share busy cores wait for each other (beside one busy process per core, "
                    "--threads 2 ran at about a fifth of its idle speed, --threads 1 at about half of it, "
                    "docs/benchmarks.md); consider --threads %d",
                    load, cores, threads, std::max(1, static_cast<int>(cores) - static_cast<int>(load + 0.5)));
      say(text);
    }
  }
  const std::int64_t steps_s = opts.ttt_steps;

  // --- decide once, then open ---
  const RunPlan plan = resolve(opts, world);
  if (plan.resume_step >= 0)
    say("resuming from " + plan.draft_dir + " (step " + std::to_string(plan.resume_step) + ")");
  say(plan.summary);
  for (const auto& line : plan.notes) say(line);
  const std::unique_ptr<OpenRun> run = open_run(plan, mesh, say);
  DraftModel& draft = *run->draft;
  TttUnroll& unroll = *run->unroll;
  Loader& loader = *run->loader;
  AdamW& optimizer = *run->optimizer;
  const std::vector<at::Tensor>& params = run->parameters;
  GradientSync* const sync = run->sync.get();
  SequenceContext* const context = run->context.get();
  const std::shared_ptr<const SelectedData>& eval_data = plan.eval_data;
  const std::int64_t total_steps = plan.total_steps;
  TrainResult result;
  result.summary = plan.summary;
  std::int64_t step = run->step;
  double tokens_total = run->tokens;
  if (plan.resume_step >= 0) result.resumed_from = plan.draft_dir;
  for (const auto& line : plan.schedule_said) say(line);
  result.start_step = step;

  say("draft: " + std::to_string(run->parameter_count) + " parameters, hidden " +
      std::to_string(draft.config().hidden_size) + ", draft vocab " + std::to_string(draft.config().draft_vocab_size) +
      "; " + std::to_string(total_steps) + " optimizer steps of " + std::to_string(plan.rows_per_step) +
      " rows on " + std::to_string(world) + " rank(s), " + std::to_string(at::get_num_threads()) + " threads, device " +
      run->device.str() + ", TTT attention " + std::string(ttt_attention_name(opts.ttt_attention)) +
      (opts.cp_size > 1 ? " (--cp > 1: the ring's own)" : ""));
  if (plan.resume_step < 0) say("learning rate: " + plan.schedule);
  if (const std::string w = schedule_warning(opts.lr, opts.schedule, opts.warmup_steps, total_steps); !w.empty())
    say("warning: " + w);

  // --- output: metrics.jsonl and TensorBoard, rank 0 ---
  std::unique_ptr<MetricsLog> log;
  if (main_rank) {
    MetricsLog::Options mo;
    mo.out = opts.out;
    mo.resume_step = plan.resume_step >= 0 ? step : -1;
    mo.tensorboard = opts.tensorboard;
    mo.no_tensorboard = opts.no_tensorboard;
    mo.on_line = hooks.on_metrics;
    mo.say = say;
    log = std::make_unique<MetricsLog>(mo);
  }
  auto emit = [&](const json& j) {
    if (log) log->write(j.dump());
  };

  auto make_checkpoint = [&]() {
    Checkpoint ck;
    ck.state.step = step;
    ck.state.sampler = loader.state();
    ck.state.epoch = ck.state.sampler.epoch;
    ck.state.optimizer_steps = optimizer.steps();
    ck.state.schedule_total_steps = total_steps;
    ck.state.tokens = tokens_total;
    ck.state.world_size = world;
    ck.state.cp_size = mesh.cp_size();
    ck.optimizer = optimizer.state();
    ck.rng = capture_rng_state();
    ck.options_json = opts.to_json();
    return ck;
  };
  auto checkpoint = [&]() {
    if (main_rank) {
      result.last_checkpoint = save_checkpoint(opts.out, draft, make_checkpoint());
      // Only now, with the new one whole on disk, do older ones go.
      for (const auto& gone : prune_checkpoints(opts.out, opts.keep_checkpoints, result.last_checkpoint))
        say("removed " + fs::path(gone).filename().string() + " (--keep-checkpoints " +
            std::to_string(opts.keep_checkpoints) + ")");
    }
    if (world > 1) mesh.world().barrier();
  };

  // --keep-best: a resumed run continues the saved best; a fresh one starts over.
  std::optional<BestCheckpoint> best;
  if (main_rank && opts.keep_best != KeepBest::kNone && plan.resume_step >= 0) best = read_best(opts.out);
  auto keep_if_best = [&](const TttStats& stats) {
    if (!main_rank || opts.keep_best == KeepBest::kNone) return;
    const double est_ar = stats.est_ar();
    if (!std::isfinite(est_ar) || (best && !(est_ar > best->est_ar))) return;
    BestCheckpoint b;
    b.step = step;
    b.est_ar = est_ar;
    const std::string dir = save_best_checkpoint(opts.out, draft, make_checkpoint(), b, result.last_checkpoint);
    char text[160];
    if (best)
      std::snprintf(text, sizeof text, "best est_ar %.4g at step %lld (was %.4g at step %lld): ", est_ar,
                    static_cast<long long>(step), best->est_ar, static_cast<long long>(best->step));
    else
      std::snprintf(text, sizeof text, "best est_ar %.4g at step %lld: ", est_ar, static_cast<long long>(step));
    say(text + dir);
    best = b;
  };

  std::int64_t last_eval_step = -1;
  auto run_eval = [&]() {
    if (!eval_data) return;
    LoaderOptions elo = run->loader_options;
    elo.sampler.shuffle = false;
    elo.sampler.epochs = 1;
    Loader eval_loader(eval_data->dataset, eval_data->samples, elo);
    const auto t0 = Clock::now();
    const TttStats stats = evaluate_loader(unroll, eval_loader, &mesh);
    json j;
    j["split"] = "eval";
    j["step"] = step;
    j["epoch"] = loader.state().epoch;
    const json metrics = json::parse(stats_json(stats, opts.loss_decay));
    for (const auto& [k, v] : metrics.items()) j[k] = v;
    j["seconds"] = seconds_since(t0);
    emit(j);
    result.eval_stats = stats;
    last_eval_step = step;
    keep_if_best(stats);
  };

  // --- the loop ---
  SignalGuard signals;
  const bool show_progress = opts.progress && main_rank && ::isatty(2) == 1;
  // In a log (stderr not a terminal) the progress line is a plain line instead: after the
  // first step, then every --progress-every seconds; metrics.jsonl has the rest.
  const bool log_progress = opts.progress && main_rank && !show_progress && opts.progress_every > 0;
  auto last_logged = Clock::now();
  bool logged_any = false;
  TttStats run_stats(steps_s);
  StepWindow window(steps_s);
  double run_tokens = 0, run_time = 0, run_wait = 0;
  double grad_norm = 0, lr = 0;
  std::uint64_t epoch_of_step = loader.state().epoch;
  auto last_draw = Clock::now() - std::chrono::seconds(1);
  const std::string last_good_hint = result.resumed_from.empty() ? std::string("none yet") : result.resumed_from;
  bool saved_at_step = false;
  const auto loop_start = Clock::now();

  auto log_window = [&]() {
    if (window.empty()) return;
    const std::string line =
        window.take_line(step, epoch_of_step, lr, grad_norm, opts.loss_decay, seconds_since(loop_start));
    if (log) log->write(line);
  };

  for (;;) {
    if (opts.max_steps > 0 && step >= opts.max_steps) break;
    const auto t0 = Clock::now();
    const double cpu0 = process_cpu_seconds();
    const double wait0 = loader.stats().wait_s;
    std::vector<Batch> micro;
    bool finished = false;
    while (static_cast<std::int64_t>(micro.size()) < opts.grad_accum) {
      std::optional<Batch> b = loader.next();
      if (!b) {
        finished = plan.epochs > 0 && loader.state().epoch >= static_cast<std::uint64_t>(plan.epochs);
        break;
      }
      micro.push_back(std::move(*b));
    }
    if (micro.empty()) {
      if (finished) break;
      continue;  // an epoch ended on a step boundary; the next call starts the next one
    }
    const double waited = loader.stats().wait_s - wait0;
    epoch_of_step = micro.back().epoch;

    // The normalizer of this step: mask sums over every micro-batch of every rank.
    at::Tensor sums = at::zeros({steps_s + 1}, at::kDouble);
    for (const Batch& b : micro) {
      sums.narrow(0, 0, steps_s).add_(loss_mask_sums(b, steps_s));
      sums[steps_s] += static_cast<double>(b.tokens);
    }
    sums = reduce_sum(mesh.world(), sums, run->device);
    at::Tensor normalizer = sums.narrow(0, 0, steps_s).to(run->device, at::kFloat);
    if (hooks.normalizer_scale) normalizer = normalizer * hooks.normalizer_scale(step);
    const double step_tokens = sums[steps_s].item<double>();

    optimizer.zero_grad();
    TttStats local(steps_s);
    std::int64_t last_real = -1;
    for (std::size_t i = 0; i < micro.size(); ++i)
      if (micro[i].rows() > 0) last_real = static_cast<std::int64_t>(i);
    for (std::size_t i = 0; i < micro.size(); ++i) {
      const Batch& b = micro[i];
      if (b.rows() == 0) continue;
      prepare_context(context, b);
      if (sync && static_cast<std::int64_t>(i) == last_real) sync->prepare();
      TttResult r = unroll.forward(to_ttt_batch(b), context);
      ttt_loss(r.ce_sum, normalizer, opts.loss_decay).backward();
      local += r.stats;
    }
    if (sync) sync->finish();

    // Metrics of the global batch, and whether any rank was asked to stop.
    at::Tensor flat = at::cat({local.to_tensor().reshape({-1}), at::full({1}, g_stop_signal != 0 ? 1.0 : 0.0, at::kDouble)});
    flat = reduce_sum(mesh.world(), flat, run->device);
    const TttStats step_stats = TttStats::from_tensor(flat.narrow(0, 0, 5 * steps_s).reshape({5, steps_s}));
    bool stop = flat[5 * steps_s].item<double>() > 0;

    const double loss = step_stats.loss(opts.loss_decay);
    grad_norm = clip_grad_norm(params, opts.grad_clip);
    if (!std::isfinite(loss) || !std::isfinite(grad_norm)) {
      if (show_progress) std::cerr << "\n";
      auto name = [](double x) { return std::string(std::isnan(x) ? "NaN" : x > 0 ? "+inf" : "-inf"); };
      const std::string what = !std::isfinite(loss) ? "the loss is " + name(loss) : "the gradient norm is " + name(grad_norm);
      // Name the batch, and the size of its values: the loader has already left out records
      // with NaN or Inf, so a finite but absurd value (a damaged dump of a format without
      // checksums) shows here as a huge largest |value|, and a normal one points at the
      // optimization instead.
      std::string ids;
      std::size_t n_ids = 0;
      double largest = 0;
      for (const Batch& b : micro) {
        for (const auto& id : b.conversation_ids)
          if (n_ids++ < 8) ids += (ids.empty() ? "" : ", ") + id;
        if (b.rows() > 0)
          largest = std::max({largest, b.hidden_states.abs().max().item<double>(),
                              b.aux_hidden_states.abs().max().item<double>()});
      }
      if (n_ids > 8) ids += ", ... (" + std::to_string(n_ids) + " in all)";
      char big[32];
      std::snprintf(big, sizeof big, "%.3g", largest);
      throw TrainingError("training stopped at step " + std::to_string(step + 1) + " (epoch " +
                          std::to_string(epoch_of_step) + "): " + what + " on the batch of conversations " +
                          (ids.empty() ? std::string("(none on this rank)") : ids) +
                          ", whose hidden states are finite with largest |value| " + big +
                          (world > 1 ? " on this rank" : "") +
                          "; nothing was saved after it, the last good checkpoint is " +
                          (result.last_checkpoint.empty() ? last_good_hint : result.last_checkpoint) +
                          ". If that value is far beyond what the base produces, check those records "
                          "(eaglekit validate --deep, eaglekit inspect --stats) and leave them out with "
                          "--quarantine; otherwise try a lower --lr, more --warmup-steps or --grad-clip");
    }
    lr = learning_rate(opts.lr, opts.schedule, opts.warmup_steps, total_steps, step);
    optimizer.step(lr);
    ++step;
    saved_at_step = false;

    const double dt = seconds_since(t0);
    tokens_total += step_tokens;
    window.add(step_stats, step_tokens, dt, waited, process_cpu_seconds() - cpu0);
    run_stats += step_stats;
    run_tokens += step_tokens;
    run_time += dt;
    run_wait += waited;

    if (hooks.after_step && !hooks.after_step(step, draft)) stop = true;
    const bool last = opts.max_steps > 0 && step >= opts.max_steps;
    if (step % opts.log_every == 0 || stop || last) log_window();
    // The run's progress: the redrawn line on a terminal, a plain line in a log.
    auto progress_text = [&](bool tty) {
      const double rate = run_time > 0 ? static_cast<double>(step - result.start_step) / run_time : 0;
      const double eta = rate > 0 && total_steps > step ? static_cast<double>(total_steps - step) / rate : 0;
      const auto acc = step_stats.acc();
      const double acc0 = acc.empty() ? 0.0 : acc[0], tokens_per_s = run_time > 0 ? run_tokens / run_time : 0;
      if (tty) return progress_line(step, total_steps, loss, acc0, tokens_per_s, eta);
      char text[200];
      std::snprintf(text, sizeof text, "step %lld/%lld, loss %.4g, acc0 %.3g, %s tok/s, ETA %s",
                    static_cast<long long>(step), static_cast<long long>(total_steps), loss, acc0,
                    rate_text(tokens_per_s).c_str(), format_duration(eta).c_str());
      return std::string(text);
    };
    if (show_progress && (seconds_since(last_draw) > 0.25 || stop)) {
      last_draw = Clock::now();
      std::cerr << progress_text(true) << std::flush;
    }
    if (log_progress && (!logged_any || seconds_since(last_logged) >= opts.progress_every)) {
      last_logged = Clock::now();
      logged_any = true;
      say(progress_text(false));
    }
    if (stop) {
      if (show_progress) std::cerr << "\n";
      checkpoint();
      saved_at_step = true;
      result.interrupted = true;
      say(std::string("stopped") + (g_stop_signal ? " by signal " + std::to_string(g_stop_signal) : "") +
          " at step " + std::to_string(step) + "; checkpoint " + result.last_checkpoint +
          " (continue with --resume)");
      break;
    }
    if (opts.save_every > 0 && step % opts.save_every == 0) {
      checkpoint();
      saved_at_step = true;
    }
    if (opts.eval_every > 0 && step % opts.eval_every == 0) run_eval();
  }
  if (show_progress && !result.interrupted) std::cerr << "\n";

  auto report_best = [&] {
    if (!best) return;
    result.best_dir = (fs::path(opts.out) / kBestFolder).string();
    result.best_step = best->step;
    result.best_est_ar = best->est_ar;
  };
  result.steps = step;
  result.epoch = loader.state().epoch;
  result.train_stats = run_stats;
  result.seconds = run_time;
  result.tokens_per_s = run_time > 0 ? run_tokens / run_time : 0;
  result.data_wait_share = run_time > 0 ? run_wait / run_time : 0;
  if (result.interrupted) {
    report_best();
    return result;
  }

  log_window();
  if (!saved_at_step) checkpoint();
  if (opts.eval_every >= 0 && last_eval_step != step) run_eval();
  report_best();
  if (main_rank) {
    result.final_dir = (fs::path(opts.out) / "final").string();
    ExportOptions eo;
    eo.serving = true;
    eo.allow_unservable = opts.allow_unservable;
    eo.run_options_json = opts.to_json();  // the bytes each checkpoint's train_options.json holds
    std::vector<std::string> warnings;
    eo.dtype = serving_export_dtype(opts.export_dtype, draft.config(), warnings);
    for (auto& w : serving_warnings(draft.config())) warnings.push_back(std::move(w));
    for (const auto& w : warnings) say("final/: " + w);
    // final/ appears complete (config.json with model.safetensors) or not at all, and a rerun
    // replaces an older one in one step.
    export_draft_folder(draft, result.final_dir, eo);
    say("done: " + std::to_string(step) + " steps; final draft in " + result.final_dir);
  }
  if (world > 1) mesh.world().barrier();
  return result;
}

}  // namespace eaglekit::trainer
