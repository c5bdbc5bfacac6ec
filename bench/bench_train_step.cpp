// bench_train_step: where the time of one training step goes. Builds the draft of a base
// model folder (as `eaglekit train` does: draft_config_from_base, lm_head from the base
// rows), a random batch of B rows x L tokens (hidden states that the base lm_head reads, a
// tenth of each row padding), and runs --reps optimizer steps after --warmup: TTT unroll
// forward, backward, gradient clipping, AdamW, exactly the inner step of trainer/run/train.cpp.
//
// Prints, over the timed steps: the median wall and thread-CPU time of each phase, then
// LibTorch's legacy autograd profiler aggregated by operator (self time: time in the op
// minus the ops it calls; the ttt.* user scopes of trainer/unroll/ttt.cpp show the unroll's
// parts), the top --top rows; --shapes splits each operator by its input shapes (which
// tensor a `mul` or `copy_` was spent on).
//
// usage: bench_train_step --base DIR [--draft-vocab 256] [--batch-size 16] [--length 128]
//                         [--ttt-steps 3] [--threads 2] [--warmup 2] [--reps 5] [--top 25]
//                         [--shapes] [--ttt-attention auto|local|tiled|fused]
//                         [--cpu-kernels on|off|both]
//                         [--draft eagle3|dflash] [--block-size 4] [--anchors 32] [--draft-layers 3]
// --ttt-attention picks the TTT attention kernel (trainer/run/options.h TttAttention; default auto).
// --draft dflash: the block unroll (trainer/unroll/dflash.h) instead, a DFlash draft of
// --draft-layers layers (default 3) with --block-size (4) and up to --anchors (32) blocks per
// row drawn from the batch's loss mask (the shape bench/bench_modelopt.py --arch dflash
// trains), D-PACE weights and self-logit distillation as `eaglekit train` defaults.
// --cpu-kernels: the fused float32 CPU kernels (trainer/model/cpu_kernels.h; on, as `eaglekit train`
// runs) or the ATen composites (off); both runs the two side by side, steps alternating, from
// the same weights, prints the first loss of each, each one's table and the ratio, and profiles
// one step of each.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/profiler_legacy.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "lib/malloc_policy.h"
#include "trainer/model/base_model.h"
#include "trainer/model/config.h"
#include "trainer/model/cpu_kernels.h"
#include "trainer/model/draft_model.h"
#include "trainer/run/optim.h"
#include "trainer/run/train.h"
#include "trainer/unroll/dflash.h"
#include "trainer/unroll/ttt.h"

using namespace eaglekit;
using namespace eaglekit::trainer;

namespace {

struct Args {
  std::string base;
  std::int64_t draft_vocab = 256, batch = 16, length = 128, ttt_steps = 3;
  int threads = 2, warmup = 2, reps = 5, top = 25;
  bool shapes = false;
  TttAttention attention = TttAttention::kAuto;
  std::string kernels = "on";
  bool dflash = false;
  std::int64_t block_size = 4, anchors = 32, draft_layers = 3;
};

// A command-line mistake: exit status 2 (runtime errors are 1).
struct Usage : std::runtime_error {
  using std::runtime_error::runtime_error;
};

constexpr const char* kUsage =
    "usage: bench_train_step --base DIR [--draft-vocab 256] [--batch-size 16] [--length 128]\n"
    "                        [--ttt-steps 3] [--threads 2] [--warmup 2] [--reps 5] [--top 25]\n"
    "                        [--shapes] [--ttt-attention auto|local|tiled|fused]\n"
    "                        [--cpu-kernels on|off|both]\n"
    "                        [--draft eagle3|dflash] [--block-size 4] [--anchors 32] [--draft-layers 3]\n"
    "One training step's time by phase and by operator (the header of bench/bench_train_step.cpp).\n";

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw Usage("missing value for " + k);
      return argv[++i];
    };
    if (k == "--base") a.base = next();
    else if (k == "--draft-vocab") a.draft_vocab = std::stoll(next());
    else if (k == "--batch-size") a.batch = std::stoll(next());
    else if (k == "--length") a.length = std::stoll(next());
    else if (k == "--ttt-steps") a.ttt_steps = std::stoll(next());
    else if (k == "--threads") a.threads = std::stoi(next());
    else if (k == "--warmup") a.warmup = std::stoi(next());
    else if (k == "--reps") a.reps = std::stoi(next());
    else if (k == "--top") a.top = std::stoi(next());
    else if (k == "--shapes") a.shapes = true;
    else if (k == "--draft") {
      const std::string v = next();
      if (v != "eagle3" && v != "dflash") throw Usage("--draft takes eagle3 or dflash, not '" + v + "'");
      a.dflash = v == "dflash";
    }
    else if (k == "--block-size") a.block_size = std::stoll(next());
    else if (k == "--anchors") a.anchors = std::stoll(next());
    else if (k == "--draft-layers") a.draft_layers = std::stoll(next());
    else if (k == "--ttt-attention") {
      const std::string v = next();
      if (v == "auto") a.attention = TttAttention::kAuto;
      else if (v == "local") a.attention = TttAttention::kLocal;
      else if (v == "tiled") a.attention = TttAttention::kTiled;
      else if (v == "fused") a.attention = TttAttention::kFused;
      else throw Usage("--ttt-attention takes auto, local, tiled or fused, not '" + v + "'");
    }
    else if (k == "--cpu-kernels") {
      a.kernels = next();
      if (a.kernels != "on" && a.kernels != "off" && a.kernels != "both")
        throw Usage("--cpu-kernels takes on, off or both, not '" + a.kernels + "'");
    }
    else if (k == "-h" || k == "--help") {
      std::cout << kUsage;
      std::exit(0);
    }
    else throw Usage("unknown option " + k);
  }
  if (a.base.empty()) throw Usage("--base DIR is required");
  return a;
}

double process_cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct OpTime {
  double total_us = 0, self_us = 0;
  std::int64_t calls = 0;
};

// "[4, 256] [1024]": an event's input shapes, scalars and non-tensors as [].
std::string shape_key(const std::vector<std::vector<std::int64_t>>& shapes) {
  std::string s;
  for (const auto& shape : shapes) {
    s += s.empty() ? "[" : " [";
    for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    s += "]";
  }
  return s;
}

// Pairs push/pop ranges per thread and sums inclusive and self time per name (and per input
// shapes with `by_shape`).
std::map<std::string, OpTime> aggregate(const torch::autograd::profiler::thread_event_lists& lists,
                                        bool by_shape) {
  using torch::autograd::profiler::EventKind;
  using torch::autograd::profiler::LegacyEvent;
  std::map<std::string, OpTime> out;
  for (const auto& list : lists) {
    struct Open {
      const LegacyEvent* push;
      double child_us;
    };
    std::vector<Open> stack;
    for (const LegacyEvent& e : list) {
      if (e.kind() == EventKind::PushRange) {
        stack.push_back({&e, 0.0});
      } else if (e.kind() == EventKind::PopRange && !stack.empty()) {
        const Open o = stack.back();
        stack.pop_back();
        const double us = o.push->cpuElapsedUs(e);
        const std::string name = o.push->name();
        OpTime& t = out[by_shape && name.rfind("ttt.", 0) != 0 ? name + " " + shape_key(o.push->shapes()) : name];
        t.total_us += us;
        t.self_us += us - o.child_us;
        ++t.calls;
        if (!stack.empty()) stack.back().child_us += us;
      }
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) try {
  const Args a = parse(argc, argv);
  keep_freed_memory();  // as `eaglekit train` (lib/malloc_policy.h)
  at::set_num_threads(a.threads);
  const BaseModel base = load_base_model(a.base, {c10::kCPU, at::kFloat});
  DraftOptions dopts;
  dopts.draft_vocab_size = a.dflash ? 0 : a.draft_vocab;
  if (a.dflash) {
    dopts.architecture = "dflash";
    dopts.num_hidden_layers = a.draft_layers;
    dopts.block_size = a.block_size;
    dopts.mask_token_id = 0;
  }
  const DraftConfig c = draft_config_from_base(base.config, dopts);
  const at::Tensor d2t = at::zeros({c.draft_vocab_size}, at::kLong);  // the first Vd tokens
  DraftModel draft(c, d2t, a.dflash ? at::Tensor() : base.lm_head, 1);
  std::optional<TttUnroll> ttt;
  std::optional<DFlashUnroll> block;
  if (a.dflash) {
    block.emplace(base, draft, DFlashOptions{});
  } else {
    TttOptions topts;
    topts.steps = a.ttt_steps;
    topts.attention = a.attention;
    ttt.emplace(base, draft, topts);
  }
  const auto params = draft.parameters();
  AdamW optimizer(draft.named_parameters(), AdamW::Options{});

  // Hidden states from which the base lm_head reads a peaked next-token distribution.
  at::manual_seed(3);
  const std::int64_t b = a.batch, l = a.length, h = c.hidden_size;
  TttBatch batch;
  batch.input_ids = at::randint(c.vocab_size, {b, l}, at::kLong);
  batch.attention_mask = at::ones({b, l}, at::kLong);
  batch.attention_mask.narrow(1, l - l / 10, l / 10).zero_();
  batch.loss_mask = batch.attention_mask.clone();
  batch.hidden_states = at::embedding(base.lm_head, at::randint(c.vocab_size, {b, l}, at::kLong)) * 4.0;
  batch.aux_hidden_states = at::randn({b, l, c.aux_width()});
  DFlashAnchors anchors;
  if (a.dflash) {
    std::vector<std::uint64_t> seeds;
    for (std::int64_t r = 0; r < b; ++r) seeds.push_back(dflash_row_seed(0, 0, std::to_string(r)));
    anchors = dflash_anchors(batch.loss_mask, c.block_size, a.anchors, seeds);
  }
  // The step's loss: the TTT unroll's, or DFlash's weighted loss over its weight sum.
  auto forward = [&]() -> at::Tensor {
    if (!a.dflash) return ttt->forward(batch).loss;
    const DFlashResult r = block->forward(batch, anchors);
    return dflash_loss(r.weighted_loss, r.weight_sum);
  };

  if (a.dflash)
    std::printf("draft: DFlash, %lld layers, H=%lld heads=%lld/%lld head_dim=%lld I=%lld V=%lld; block %lld, %lld "
                "blocks per row (%lld asked); batch %lld x %lld, %d threads\n",
                static_cast<long long>(c.num_hidden_layers), static_cast<long long>(h),
                static_cast<long long>(c.num_attention_heads), static_cast<long long>(c.num_key_value_heads),
                static_cast<long long>(c.head_dim), static_cast<long long>(c.intermediate_size),
                static_cast<long long>(c.vocab_size), static_cast<long long>(c.block_size),
                static_cast<long long>(anchors.positions.size(1)), static_cast<long long>(a.anchors),
                static_cast<long long>(b), static_cast<long long>(l), a.threads);
  else
  std::printf("draft: H=%lld heads=%lld/%lld head_dim=%lld I=%lld V=%lld Vd=%lld; batch %lld x %lld, "
              "%lld TTT steps, %d threads\n",
              static_cast<long long>(h), static_cast<long long>(c.num_attention_heads),
              static_cast<long long>(c.num_key_value_heads), static_cast<long long>(c.head_dim),
              static_cast<long long>(c.intermediate_size), static_cast<long long>(c.vocab_size),
              static_cast<long long>(c.draft_vocab_size), static_cast<long long>(b),
              static_cast<long long>(l), static_cast<long long>(a.ttt_steps), a.threads);

  const char* kPhases[] = {"forward", "backward", "clip", "optimizer", "step"};
  // Per variant ("on": fused CPU kernels, "off": ATen composites), per phase.
  std::map<std::string, std::map<std::string, std::vector<double>>> wall, cpu;
  auto run_step = [&](const std::string& variant, bool record) {
    cpu_kernels::set_enabled(variant == "on");
    using Clock = std::chrono::steady_clock;
    auto t = Clock::now();
    double c0 = process_cpu_s();
    const auto start = t;
    const double cpu_start = c0;
    auto mark = [&](const char* name) {
      const auto now = Clock::now();
      const double cn = process_cpu_s();
      if (record) {
        wall[variant][name].push_back(std::chrono::duration<double>(now - t).count());
        cpu[variant][name].push_back(cn - c0);
      }
      t = now;
      c0 = cn;
    };
    optimizer.zero_grad();
    const at::Tensor loss = forward();
    mark("forward");
    loss.backward();
    mark("backward");
    clip_grad_norm(params, 1.0);
    mark("clip");
    optimizer.step(1e-3);
    mark("optimizer");
    if (record) {
      wall[variant]["step"].push_back(std::chrono::duration<double>(Clock::now() - start).count());
      cpu[variant]["step"].push_back(process_cpu_s() - cpu_start);
    }
    return loss.item<double>();
  };
  const std::vector<std::string> variants =
      a.kernels == "both" ? std::vector<std::string>{"off", "on"} : std::vector<std::string>{a.kernels};
  // The first loss of each variant from the same initial weights (forward only).
  std::map<std::string, double> loss0;
  for (const auto& v : variants) {
    cpu_kernels::set_enabled(v == "on");
    at::NoGradGuard no_grad;
    loss0[v] = forward().item<double>();
  }
  for (int i = 0; i < a.warmup; ++i)
    for (const auto& v : variants) run_step(v, false);
  for (int i = 0; i < a.reps; ++i)
    for (const auto& v : variants) run_step(v, true);
  const double tokens = batch.attention_mask.sum().item<double>();
  for (const auto& v : variants) {
    std::printf("cpu kernels %s: first loss %.6f; median over %d steps (process CPU = all threads):\n", v.c_str(),
                loss0[v], a.reps);
    std::printf("  %-10s %10s %10s\n", "phase", "wall ms", "CPU ms");
    for (const char* p : kPhases)
      std::printf("  %-10s %10.1f %10.1f\n", p, 1e3 * median(wall[v][p]), 1e3 * median(cpu[v][p]));
    std::printf("  tokens/s %.0f (wall), %.0f per CPU-second\n", tokens / median(wall[v]["step"]),
                tokens / median(cpu[v]["step"]));
  }
  if (variants.size() == 2)
    std::printf("ratio fused CPU kernels / ATen composites: %.2fx tokens/s (wall), %.2fx per CPU-second\n",
                median(wall["off"]["step"]) / median(wall["on"]["step"]),
                median(cpu["off"]["step"]) / median(cpu["on"]["step"]));

  // One more step of each variant under the profiler.
  using namespace torch::autograd::profiler;
  for (const auto& v : variants) {
    enableProfilerLegacy(ProfilerConfig(ProfilerState::CPU, /*report_input_shapes=*/a.shapes));
    run_step(v, false);
    const auto ops = aggregate(disableProfilerLegacy(), a.shapes);
    std::vector<std::pair<std::string, OpTime>> rows(ops.begin(), ops.end());
    double self_total = 0;
    std::int64_t calls = 0;
    for (const auto& [name, t] : rows) {
      self_total += t.self_us;
      if (name.rfind("aten::", 0) == 0) calls += t.calls;
    }
    std::sort(rows.begin(), rows.end(), [](const auto& x, const auto& y) { return x.second.self_us > y.second.self_us; });
    std::printf("\nprofiled step (cpu kernels %s): %.1f ms of operator self time, %lld aten:: calls; top %d by self "
                "time:\n",
                v.c_str(), self_total / 1e3, static_cast<long long>(calls), a.top);
    const int width = a.shapes ? 90 : 44;
    std::printf("  %-*s %7s %10s %10s %6s\n", width, "op", "calls", "self ms", "total ms", "self%");
    for (int i = 0; i < a.top && i < static_cast<int>(rows.size()); ++i) {
      const auto& [name, t] = rows[i];
      std::printf("  %-*s %7lld %10.2f %10.2f %5.1f%%\n", width, name.substr(0, width).c_str(),
                  static_cast<long long>(t.calls), t.self_us / 1e3, t.total_us / 1e3, 100.0 * t.self_us / self_total);
    }
    std::printf("\nscopes (inclusive):\n");
    for (const auto& [name, t] : ops)
      if (name.rfind("ttt.", 0) == 0)
        std::printf("  %-44s %7lld %10.2f ms\n", name.c_str(), static_cast<long long>(t.calls), t.total_us / 1e3);
  }
  return 0;
} catch (const Usage& e) {
  std::cerr << "bench_train_step: " << e.what() << "\n" << kUsage;
  return 2;
} catch (const std::exception& e) {
  std::cerr << "bench_train_step: " << e.what() << "\n";
  return 1;
}
