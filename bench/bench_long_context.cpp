// bench_long_context: eaglekit's side of bench/bench_long_context.sh. Training steps (TTT
// unroll forward, backward, gradient clipping, AdamW: the inner step of trainer/run/train.cpp) of
// a draft of the given shape at one or more row lengths, with the TTT attention kernel
// chosen by --attention (trainer/run/options.h TttAttention).
//
// The model and the batch are synthetic and defined so that bench/bench_train.py --synthetic
// builds exactly the same ones: every random tensor is drawn on the run device right after
// manual_seed(seed * 1000 + i) with a fixed i per tensor (0 embed_tokens, 1 the base lm_head,
// 2 fc, 3..5 q/k/v_proj, 6 o_proj, 7..9 gate/up/down_proj), N(0, 0.02), except q/k/v_proj
// N(0, 0.1): peaked attention whose output outweighs the residual, so that the first-step
// loss shows an attention that differs (a wrong mask moves it by far more than rounding
// does: bench/bench_long_context.sh's loss check); norms are 1, d2t 0
// (the draft vocabulary is the first Vd tokens) and the draft lm_head is the base's first Vd
// rows times 2 / (0.02 sqrt(H)) (logits of about unit scale, not a near-uniform softmax whose
// loss hardly moves). The batch of length L: manual_seed(seed * 1000 + 100 + L), then input_ids, target
// ids and k aux ids, each randint(V, [B, L]); hidden_states = base lm_head[target ids] * 8 /
// (H * 0.02^2) (a peaked target distribution), aux_hidden_states = cat_j embed_tokens[aux ids
// j] / 0.02; no padding. Each length starts from the same initial weights with a fresh AdamW,
// so the first step's loss is comparable between implementations.
//
// Per length it prints one JSON line: {"length", "status": "ok" | "oom", "first_loss",
// "losses", "step_s" (the timed steps), "step_s_median", "tokens", "tokens_per_s_median",
// "peak_bytes", "peak_kind", "rss_peak_delta_bytes"}. Peak memory: on CUDA the caching
// allocator's max allocated bytes over the length's steps (weights and optimizer state
// included; only when built against a CUDA LibTorch), on the CPU trainer/run/cpu_memory.h's
// allocator peak above the bytes live when the length started (the calling thread's
// allocations); rss_peak_delta_bytes is the growth of the process's peak RSS (VmHWM, reset
// per length through /proc/self/clear_refs) over its RSS at the start (CPU runs). A length
// that runs out of memory prints status "oom" and the next length still runs.
//
// --draft dflash: the same rows train a DFlash draft instead (trainer/unroll/dflash.h, docs/dflash.md):
// --draft-layers layers (default: one per aux layer), blocks of --block-size tokens (8,
// ModelOpt 0.47's default) after up to --anchors anchors per row (512, ModelOpt's default; seeded
// draws over the whole row, which is all loss mask), mask token 0, the base's full-vocabulary
// lm_head, D-PACE weights and self-distillation (train's defaults); the draft's weights are its
// own seeded initialisation (no other implementation draws them). Its JSON line adds "draft",
// "block_size", "anchors" (blocks per row drawn), "query_tokens" (blocks x block size x rows),
// "context" (the context length the block attention read) and "draft_layers"; --attention,
// --ttt-steps and --draft-vocab do not apply.
//
// usage: bench_long_context --lengths L1,L2,... [--batch-size 1] [--ttt-steps 7]
//          [--hidden 256] [--heads 4] [--kv-heads 1] [--head-dim 64] [--intermediate 768]
//          [--vocab 2048] [--draft-vocab 1024] [--aux-layers 3] [--rope-theta 500000]
//          [--attention auto|local|tiled|fused] [--recompute 0|1] [--device cpu|cuda] [--dtype fp32|bf16]
//          [--warmup 1] [--steps 3] [--max-seconds 60] [--threads 0] [--seed 1]
//          [--draft eagle3|dflash] [--block-size 8] [--anchors 512] [--draft-layers N]
// --steps timed steps per length after --warmup, fewer when they pass --max-seconds.
// Exit status 0, 1 on a runtime error, 2 on a usage error.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "trainer/model/base_model.h"
#include "trainer/model/config.h"
#include "trainer/model/draft_model.h"
#include "trainer/run/cpu_memory.h"
#include "trainer/run/optim.h"
#include "trainer/run/train.h"
#include "trainer/unroll/dflash.h"
#include "trainer/unroll/ttt.h"

// The CUDA caching allocator's statistics: only with a CUDA LibTorch (CMake defines
// EAGLEKIT_CUDA_LIBTORCH when it has torch_cuda; Debian's CPU LibTorch ships the headers
// without the library).
#if defined(EAGLEKIT_CUDA_LIBTORCH) && __has_include(<c10/cuda/CUDACachingAllocator.h>)
#include <c10/cuda/CUDACachingAllocator.h>
#define EAGLEKIT_CUDA_STATS 1
#endif

using namespace eaglekit;
using namespace eaglekit::trainer;

namespace {

struct Usage : std::runtime_error {
  using std::runtime_error::runtime_error;
};

constexpr const char* kUsage =
    "usage: bench_long_context --lengths L1,L2,... [--batch-size 1] [--ttt-steps 7]\n"
    "         [--hidden 256] [--heads 4] [--kv-heads 1] [--head-dim 64] [--intermediate 768]\n"
    "         [--vocab 2048] [--draft-vocab 1024] [--aux-layers 3] [--rope-theta 500000]\n"
    "         [--attention auto|local|tiled|fused] [--recompute 0|1] [--device cpu|cuda] [--dtype fp32|bf16]\n"
    "         [--warmup 1] [--steps 3] [--max-seconds 60] [--threads 0] [--seed 1]\n"
    "         [--draft eagle3|dflash] [--block-size 8] [--anchors 512] [--draft-layers N]\n"
    "eaglekit's training steps on a synthetic draft and batch (the same ones bench_train.py\n"
    "--synthetic builds), one JSON line per length (bench/bench_long_context.cpp's header).\n";

struct Args {
  std::vector<std::int64_t> lengths;
  std::int64_t batch = 1, ttt_steps = 7, hidden = 256, heads = 4, kv_heads = 1, head_dim = 64, intermediate = 768,
               vocab = 2048, draft_vocab = 1024, aux_layers = 3;
  double rope_theta = 500000.0, max_seconds = 60.0;
  TttAttention attention = TttAttention::kAuto;
  bool recompute = false;  // TttOptions::recompute
  std::string device = "cpu", dtype = "fp32";
  int warmup = 1, steps = 3, threads = 0;
  std::int64_t seed = 1;
  bool dflash = false;
  std::int64_t block_size = 8, anchors = 512, draft_layers = 0;
};

std::int64_t to_int(const std::string& k, const std::string& v) {
  std::size_t used = 0;
  long long x = 0;
  try {
    x = std::stoll(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != v.size() || v.empty()) throw Usage(k + " takes an integer, not '" + v + "'");
  return x;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "-h" || k == "--help") {
      std::cout << kUsage;
      std::exit(0);
    }
    if (i + 1 >= argc) throw Usage("unknown option or missing value: " + k);
    const std::string v = argv[++i];
    if (k == "--lengths") {
      std::stringstream ss(v);
      std::string item;
      while (std::getline(ss, item, ',')) a.lengths.push_back(to_int(k, item));
    } else if (k == "--batch-size") a.batch = to_int(k, v);
    else if (k == "--ttt-steps") a.ttt_steps = to_int(k, v);
    else if (k == "--hidden") a.hidden = to_int(k, v);
    else if (k == "--heads") a.heads = to_int(k, v);
    else if (k == "--kv-heads") a.kv_heads = to_int(k, v);
    else if (k == "--head-dim") a.head_dim = to_int(k, v);
    else if (k == "--intermediate") a.intermediate = to_int(k, v);
    else if (k == "--vocab") a.vocab = to_int(k, v);
    else if (k == "--draft-vocab") a.draft_vocab = to_int(k, v);
    else if (k == "--aux-layers") a.aux_layers = to_int(k, v);
    else if (k == "--rope-theta") a.rope_theta = std::stod(v);
    else if (k == "--max-seconds") a.max_seconds = std::stod(v);
    else if (k == "--warmup") a.warmup = static_cast<int>(to_int(k, v));
    else if (k == "--steps") a.steps = static_cast<int>(to_int(k, v));
    else if (k == "--threads") a.threads = static_cast<int>(to_int(k, v));
    else if (k == "--seed") a.seed = to_int(k, v);
    else if (k == "--block-size") a.block_size = to_int(k, v);
    else if (k == "--anchors") a.anchors = to_int(k, v);
    else if (k == "--draft-layers") a.draft_layers = to_int(k, v);
    else if (k == "--draft") {
      if (v != "eagle3" && v != "dflash") throw Usage("--draft takes eagle3 or dflash, not '" + v + "'");
      a.dflash = v == "dflash";
    }
    else if (k == "--device") {
      if (v != "cpu" && v.compare(0, 4, "cuda") != 0) throw Usage("--device takes cpu, cuda or cuda:N, not '" + v + "'");
      a.device = v;
    }
    else if (k == "--dtype") {
      if (v != "fp32" && v != "bf16") throw Usage("--dtype takes fp32 or bf16, not '" + v + "'");
      a.dtype = v;
    } else if (k == "--attention") {
      if (v == "auto") a.attention = TttAttention::kAuto;
      else if (v == "local") a.attention = TttAttention::kLocal;
      else if (v == "tiled") a.attention = TttAttention::kTiled;
      else if (v == "fused") a.attention = TttAttention::kFused;
      else throw Usage("--attention takes auto, local, tiled or fused, not '" + v + "'");
    } else if (k == "--recompute") {
      if (v != "0" && v != "1") throw Usage("--recompute takes 0 or 1, not '" + v + "'");
      a.recompute = v == "1";
    } else throw Usage("unknown option " + k);
  }
  if (a.lengths.empty()) throw Usage("--lengths L1,L2,... is required");
  for (std::int64_t l : a.lengths)
    if (l < 2) throw Usage("--lengths: every length must be at least 2");
  if (a.steps < 1 || a.warmup < 0 || a.batch < 1 || a.ttt_steps < 1)
    throw Usage("--steps, --batch-size and --ttt-steps must be at least 1, --warmup at least 0");
  if (a.dflash && (a.block_size < 2 || a.anchors < 1 || a.draft_layers < 0))
    throw Usage("--block-size must be at least 2, --anchors at least 1, --draft-layers at least 0");
  return a;
}

// Process RSS now and its peak since the last reset (VmRSS / VmHWM of /proc/self/status), bytes.
std::int64_t status_kib(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const std::string k = std::string(key) + ":";
  while (std::getline(f, line))
    if (line.compare(0, k.size(), k) == 0) return std::stoll(line.substr(k.size()));
  return -1;
}
void reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";  // resets VmHWM (Linux >= 4.0)
}

// The same draws as bench_train.py --synthetic: manual_seed(seed * 1000 + index), randn.
at::Tensor seeded_randn(std::int64_t seed, std::int64_t index, at::IntArrayRef shape, c10::Device device) {
  at::manual_seed(static_cast<std::uint64_t>(seed * 1000 + index));
  const double std = index >= 3 && index <= 5 ? 0.1 : 0.02;  // q/k/v_proj
  return at::randn(shape, at::TensorOptions().dtype(at::kFloat).device(device)) * std;
}

// Waits until every queued kernel of the device has run (a one-element copy to the host).
void sync(const at::Tensor& t) { (void)t.reshape({-1})[0].item<double>(); }

std::string json_list(const std::vector<double>& v) {
  std::ostringstream o;
  o.precision(9);
  o << "[";
  for (std::size_t i = 0; i < v.size(); ++i) o << (i ? ", " : "") << v[i];
  o << "]";
  return o.str();
}

bool is_oom(const std::exception& e) {
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr) return true;
  if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr) return true;
  const std::string m = e.what();
  return m.find("out of memory") != std::string::npos || m.find("DefaultCPUAllocator: can't allocate") != std::string::npos;
}

// The rows of length l (the header's draws).
TttBatch make_batch(const Args& a, const BaseModel& base, std::int64_t l, c10::Device device) {
  const std::int64_t b = a.batch, h = a.hidden;
  at::manual_seed(static_cast<std::uint64_t>(a.seed * 1000 + 100 + l));
  const auto long_opts = at::TensorOptions().dtype(at::kLong).device(device);
  TttBatch batch;
  batch.input_ids = at::randint(a.vocab, {b, l}, long_opts);
  const at::Tensor target_ids = at::randint(a.vocab, {b, l}, long_opts);
  std::vector<at::Tensor> aux;
  for (std::int64_t j = 0; j < a.aux_layers; ++j)
    aux.push_back(at::embedding(base.embed_tokens, at::randint(a.vocab, {b, l}, long_opts)) / 0.02);
  batch.hidden_states = at::embedding(base.lm_head, target_ids) * (8.0 / (static_cast<double>(h) * 0.02 * 0.02));
  batch.aux_hidden_states = at::cat(aux, -1);
  batch.attention_mask = at::ones({b, l}, long_opts);
  batch.loss_mask = batch.attention_mask;
  return batch;
}

// Peak memory of a length's steps: the CPU allocator probe and peak RSS growth, or CUDA's
// caching allocator's max allocated bytes.
struct PeakMemory {
  explicit PeakMemory(c10::Device device) : device_(device) {
    if (device.is_cpu()) {
      reset_peak_rss();
      rss0_ = status_kib("VmRSS");
      probe_ = std::make_unique<CpuAllocationProbe>();
    }
#ifdef EAGLEKIT_CUDA_STATS
    if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(index());
#endif
  }
  // (peak bytes, kind, RSS growth bytes)
  void read(std::int64_t& peak, std::string& kind, std::int64_t& rss_delta) const {
    if (probe_) {
      peak = probe_->peak_bytes();
      kind = "cpu_allocator";
      rss_delta = (status_kib("VmHWM") - rss0_) * 1024;
    }
#ifdef EAGLEKIT_CUDA_STATS
    if (device_.is_cuda()) {
      peak = c10::cuda::CUDACachingAllocator::getDeviceStats(index()).allocated_bytes[0].peak;
      kind = "cuda_max_allocated";
    }
#endif
  }

 private:
  c10::DeviceIndex index() const { return static_cast<c10::DeviceIndex>(device_.index() < 0 ? 0 : device_.index()); }
  c10::Device device_;
  std::unique_ptr<CpuAllocationProbe> probe_;
  std::int64_t rss0_ = 0;
};

// --draft dflash: the same lengths, rows and step for a DFlash draft.
int run_dflash(const Args& a, const DraftConfig& c, const BaseModel& base, c10::Device device) {
  DraftModel draft(c, at::zeros({c.vocab_size}, at::kLong), at::Tensor(), static_cast<std::uint64_t>(a.seed));
  draft.to(device, at::kFloat);
  draft.train(true);
  std::vector<std::pair<std::string, at::Tensor>> initial;
  for (const auto& np : draft.named_parameters()) initial.emplace_back(np.first, np.second.detach().clone());
  DFlashOptions o;
  o.num_anchors = a.anchors;
  if (a.dtype == "bf16") o.autocast = at::kBFloat16;
  DFlashUnroll unroll(base, draft, o);
  const auto params = unroll.draft().parameters();
  for (const std::int64_t l : a.lengths) {
    for (const auto& [name, value] : initial) unroll.draft().load_parameter(name, value);
    std::ostringstream out;
    out.precision(9);
    out << "{\"length\": " << l;
    std::vector<double> losses, times;
    std::int64_t peak = -1, rss_delta = -1, blocks = 0, context = 0;
    std::string peak_kind = "none";
    bool oom = false;
    try {
      const TttBatch batch = make_batch(a, base, l, device);
      std::vector<std::uint64_t> seeds;
      for (std::int64_t r = 0; r < a.batch; ++r)
        seeds.push_back(dflash_row_seed(static_cast<std::uint64_t>(a.seed), 0, "row" + std::to_string(r)));
      const DFlashAnchors anchors = dflash_anchors(batch.loss_mask.cpu(), a.block_size, a.anchors, seeds);
      blocks = anchors.positions.size(1);
      context = (anchors.positions * anchors.keep.to(at::kLong)).max().item<std::int64_t>();
      AdamW optimizer(unroll.draft().named_parameters(), AdamW::Options{});
      const PeakMemory memory(device);
      double timed_s = 0;
      for (int i = 0; i < a.warmup + a.steps; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        optimizer.zero_grad();
        const DFlashResult r = unroll.forward(batch, anchors);
        const at::Tensor loss = dflash_loss(r.weighted_loss, r.weight_sum);
        loss.backward();
        clip_grad_norm(params, 1.0);
        optimizer.step(1e-4);
        sync(params.back());
        const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        losses.push_back(loss.item<double>());
        if (i >= a.warmup) {
          times.push_back(dt);
          timed_s += dt;
          if (timed_s > a.max_seconds) break;
        } else if (dt > a.max_seconds) {
          times.push_back(dt);
          break;
        }
      }
      memory.read(peak, peak_kind, rss_delta);
    } catch (const std::exception& e) {
      if (!is_oom(e)) throw;
      oom = true;
    }
    const double tokens = static_cast<double>(a.batch * l);
    if (oom) {
      out << ", \"status\": \"oom\"";
    } else {
      out << ", \"status\": \"ok\", \"first_loss\": " << losses.front() << ", \"losses\": " << json_list(losses)
          << ", \"step_s\": " << json_list(times) << ", \"step_s_median\": " << bench::median(times)
          << ", \"tokens\": " << tokens << ", \"tokens_per_s_median\": " << tokens / bench::median(times)
          << ", \"peak_bytes\": " << peak << ", \"peak_kind\": \"" << peak_kind << "\""
          << ", \"rss_peak_delta_bytes\": " << rss_delta << ", \"anchors\": " << blocks
          << ", \"query_tokens\": " << blocks * a.block_size * a.batch << ", \"context\": " << context;
    }
    out << ", \"draft\": \"dflash\", \"block_size\": " << a.block_size << ", \"draft_layers\": " << c.num_hidden_layers
        << ", \"device\": \"" << a.device << "\", \"dtype\": \"" << a.dtype << "\", \"batch_size\": " << a.batch
        << ", \"threads\": " << at::get_num_threads() << "}";
    std::cout << out.str() << std::endl;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  const Args a = parse(argc, argv);
  if (a.threads > 0) at::set_num_threads(a.threads);
  const c10::Device device(a.device);
#ifndef EAGLEKIT_CUDA_STATS
  if (device.is_cuda())
    std::cerr << "bench_long_context: built against a LibTorch without CUDA statistics; peak memory is not reported\n";
#endif

  DraftConfig c;
  c.hidden_size = a.hidden;
  c.intermediate_size = a.intermediate;
  c.num_attention_heads = a.heads;
  c.num_key_value_heads = a.kv_heads;
  c.head_dim = a.head_dim;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = a.rope_theta;
  c.vocab_size = a.vocab;
  c.draft_vocab_size = a.draft_vocab;
  c.target_hidden_size = a.hidden;
  c.num_aux_layers = a.aux_layers;
  std::int64_t longest = 0;
  for (std::int64_t l : a.lengths) longest = std::max(longest, l);
  c.max_position_embeddings = std::max<std::int64_t>(longest + a.block_size, 2048);
  if (a.dflash) {
    c.architecture = "dflash";
    c.draft_vocab_size = a.vocab;  // the base's lm_head, the whole vocabulary
    c.num_hidden_layers = a.draft_layers > 0 ? a.draft_layers : a.aux_layers;
    c.block_size = a.block_size;
    c.mask_token_id = 0;
  }
  c.check();

  BaseModel base;
  base.config.hidden_size = a.hidden;
  base.config.vocab_size = a.vocab;
  base.config.rms_norm_eps = 1e-5;
  base.embed_tokens = seeded_randn(a.seed, 0, {a.vocab, a.hidden}, device);
  base.lm_head = seeded_randn(a.seed, 1, {a.vocab, a.hidden}, device);

  if (a.dflash) return run_dflash(a, c, base, device);
  DraftModel draft(c, at::zeros({c.draft_vocab_size}, at::kLong), base.lm_head, 0);
  const std::vector<std::pair<std::string, std::int64_t>> seeded = {
      {"fc.weight", 2}, {"midlayer.self_attn.q_proj.weight", 3}, {"midlayer.self_attn.k_proj.weight", 4},
      {"midlayer.self_attn.v_proj.weight", 5}, {"midlayer.self_attn.o_proj.weight", 6},
      {"midlayer.mlp.gate_proj.weight", 7}, {"midlayer.mlp.up_proj.weight", 8}, {"midlayer.mlp.down_proj.weight", 9}};
  draft.to(device, at::kFloat);
  for (const auto& [name, index] : seeded) {
    at::Tensor shape_of;
    for (const auto& np : draft.named_parameters())
      if (np.first == name) shape_of = np.second;
    if (!shape_of.defined()) throw std::runtime_error("the draft has no parameter " + name);
    draft.load_parameter(name, seeded_randn(a.seed, index, shape_of.sizes(), device));
  }
  draft.load_parameter("lm_head.weight", base.lm_head.narrow(0, 0, a.draft_vocab) *
                                             (2.0 / (0.02 * std::sqrt(static_cast<double>(a.hidden)))));
  draft.train(true);
  // The initial weights, restored before each length.
  std::vector<std::pair<std::string, at::Tensor>> initial;
  for (const auto& np : draft.named_parameters()) initial.emplace_back(np.first, np.second.detach().clone());

  TttOptions topts;
  topts.steps = a.ttt_steps;
  topts.attention = a.attention;
  topts.recompute = a.recompute;
  if (a.dtype == "bf16") topts.autocast = at::kBFloat16;
  TttUnroll unroll(base, draft, topts);
  const auto params = unroll.draft().parameters();

  for (const std::int64_t l : a.lengths) {
    for (const auto& [name, value] : initial) unroll.draft().load_parameter(name, value);
    std::ostringstream out;
    out.precision(9);
    out << "{\"length\": " << l;
    std::vector<double> losses, times;
    std::int64_t peak = -1, rss_delta = -1;
    std::string peak_kind = "none";
    double tokens = 0;
    bool oom = false;
    try {
      const TttBatch batch = make_batch(a, base, l, device);
      tokens = static_cast<double>(a.batch * l);

      AdamW optimizer(unroll.draft().named_parameters(), AdamW::Options{});
      const PeakMemory memory(device);
      double timed_s = 0;
      for (int i = 0; i < a.warmup + a.steps; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        optimizer.zero_grad();
        TttResult r = unroll.forward(batch);
        r.loss.backward();
        clip_grad_norm(params, 1.0);
        optimizer.step(1e-4);
        sync(params.back());
        const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        losses.push_back(r.loss.item<double>());
        if (i >= a.warmup) {
          times.push_back(dt);
          timed_s += dt;
          if (timed_s > a.max_seconds) break;
        } else if (dt > a.max_seconds) {
          times.push_back(dt);  // one step is all the time allows: time the warm-up itself
          break;
        }
      }
      memory.read(peak, peak_kind, rss_delta);
    } catch (const std::exception& e) {
      if (!is_oom(e)) throw;
      oom = true;
    }
    if (oom) {
      out << ", \"status\": \"oom\"";
    } else {
      out << ", \"status\": \"ok\", \"first_loss\": " << losses.front() << ", \"losses\": " << json_list(losses)
          << ", \"step_s\": " << json_list(times) << ", \"step_s_median\": " << bench::median(times)
          << ", \"tokens\": " << tokens << ", \"tokens_per_s_median\": " << tokens / bench::median(times)
          << ", \"peak_bytes\": " << peak << ", \"peak_kind\": \"" << peak_kind << "\""
          << ", \"rss_peak_delta_bytes\": " << rss_delta;
    }
    out << ", \"attention\": \"" << ttt_attention_name(a.attention) << "\", \"recompute\": " << (a.recompute ? "true" : "false") << ", \"device\": \"" << a.device << "\", \"dtype\": \"" << a.dtype << "\", \"ttt_steps\": " << a.ttt_steps
        << ", \"batch_size\": " << a.batch << ", \"threads\": " << at::get_num_threads() << "}";
    std::cout << out.str() << std::endl;
  }
  return 0;
} catch (const Usage& e) {
  std::cerr << "bench_long_context: " << e.what() << "\n" << kUsage;
  return 2;
} catch (const std::exception& e) {
  std::cerr << "bench_long_context: " << e.what() << "\n";
  return 1;
}
