// bench_ttt_attention: the fast TTT attentions side by side in one process on the same data
// (docs/ttt.md, "Two implementations" and "Fused kernels"): local (ttt_attention_local,
// block-0 scores per query chunk, kept by autograd), tiled (ttt_attention_flash, tiled online
// softmax, one autograd node, scores recomputed in backward) and, on a build against
// LibTorch >= 2.5, fused (ttt_attention_fused, LibTorch's fused SDPA kernels for block 0).
// One measured unit is the attention of a whole S-step TTT
// unroll: steps s = 0..S-1, each over its s + 1 kept blocks, forward then backward of a
// weighted sum of the outputs. Per (S, L) it prints:
//   time:   median wall ms of the unit over --reps rounds (the variants take turns, in a
//           rotating order, after one warm-up each), and the ratios of each variant to tiled
//           of the median wall and of the median process CPU time (steadier on a shared machine);
//   memory: bytes that stay allocated after the S forwards (what autograd keeps for backward,
//           outputs included) and the allocator peak of forward + backward, counted exactly by
//           trainer/run/cpu_memory.h on the calling thread (intra-op worker threads' temporaries
//           are not seen); with --rss also the peak-RSS growth of the unit run alone in a
//           fresh process (ru_maxrss is a lifetime peak, so one process per measurement).
//
// usage: bench_ttt_attention [--lengths 256,512,1024,2048] [--steps 3,7] [--heads 8]
//                            [--kv-heads 2] [--head-dim 64] [--batch 1] [--reps 3]
//                            [--threads N] [--query-rows N] [--key-rows N] [--rss]
//                            [--variants local,tiled,fused] (default: all this build has)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/version.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <optional>
#include <sstream>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "trainer/attention/ttt_flash.h"
#include "trainer/attention/ttt_fused.h"
#include "trainer/run/cpu_memory.h"
#include "trainer/unroll/ttt.h"

using namespace eaglekit;

namespace {

struct Args {
  std::vector<std::int64_t> lengths{256, 512, 1024, 2048};
  std::vector<std::int64_t> steps{3, 7};
  std::int64_t heads = 8, kv_heads = 2, head_dim = 64, batch = 1;
  int reps = 3;
  int threads = 0;
  trainer::TttFlashTiles tiles;
  bool rss = false;
  std::vector<std::string> variants;  // local, tiled, fused
  std::string child;  // a variant: run one unit of (steps[0], lengths[0]) and print RSS
};

std::vector<std::int64_t> list_of(const std::string& s) {
  std::vector<std::int64_t> v;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');) v.push_back(std::stoll(x));
  return v;
}

const char kUsage[] =
    "usage: bench_ttt_attention [--lengths 256,512,1024,2048] [--steps 3,7] [--heads 8]\n"
    "                           [--kv-heads 2] [--head-dim 64] [--batch 1] [--reps 3]\n"
    "                           [--threads N] [--query-rows N] [--key-rows N] [--rss]\n"
    "                           [--variants local,tiled,fused] (default: all this build has)\n"
    "The TTT attentions side by side in one process on the same data: forward + backward of a\n"
    "whole S-step unroll's attention per (S, L); median wall ms over --reps rounds in rotating\n"
    "order, ratios to tiled (wall and CPU time), bytes kept for backward and the allocator peak.\n"
    "--query-rows / --key-rows: the tiled kernel's tile sizes (default 128 x 256).\n"
    "Exit status 0, 1 (runtime error), 2 (usage).\n";

struct BadUsage : std::runtime_error {
  using std::runtime_error::runtime_error;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "-h" || k == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw BadUsage("missing value for " + k);
      return argv[++i];
    };
    if (k == "--lengths") a.lengths = list_of(next());
    else if (k == "--steps") a.steps = list_of(next());
    else if (k == "--heads") a.heads = std::stoll(next());
    else if (k == "--kv-heads") a.kv_heads = std::stoll(next());
    else if (k == "--head-dim") a.head_dim = std::stoll(next());
    else if (k == "--batch") a.batch = std::stoll(next());
    else if (k == "--reps") a.reps = std::stoi(next());
    else if (k == "--threads") a.threads = std::stoi(next());
    else if (k == "--query-rows") a.tiles.query_rows = std::stoll(next());
    else if (k == "--key-rows") a.tiles.key_rows = std::stoll(next());
    else if (k == "--rss") a.rss = true;
    else if (k == "--variants") {
      std::stringstream ss(next());
      for (std::string x; std::getline(ss, x, ',');) a.variants.push_back(x);
    }
    else if (k == "--child") a.child = next();
    else throw BadUsage("unknown option " + k + " (--help lists them)");
  }
  if (a.lengths.empty() || a.steps.empty() || a.reps < 1) throw BadUsage("nothing to measure");
  if (a.variants.empty()) {
    a.variants = {"local", "tiled"};
    if (trainer::ttt_fused_available()) a.variants.push_back("fused");
  }
  for (const std::string& v : a.variants) {
    std::string why;
    if (v == "fused" && !trainer::ttt_fused_available(&why)) throw std::runtime_error("--variants fused: " + why);
    if (v != "local" && v != "tiled" && v != "fused")
      throw BadUsage("--variants takes local, tiled and fused, not '" + v + "'");
  }
  return a;
}

using bench::median;
using bench::peak_rss_mib;
using bench::rss_mib;

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// The inputs of an S-step unroll's attention: per step a query, per block a key and value.
struct Unit {
  std::vector<at::Tensor> qs, ks, vs, weights;
  at::Tensor valid;
  double scale = 1.0;
};

Unit make_unit(const Args& a, std::int64_t steps, std::int64_t l) {
  auto gen = at::detail::createCPUGenerator(static_cast<std::uint64_t>(1000 * steps + l));
  Unit u;
  for (std::int64_t s = 0; s < steps; ++s) {
    u.qs.push_back(at::randn({a.batch, a.heads, l, a.head_dim}, gen).requires_grad_());
    u.ks.push_back(at::randn({a.batch, a.kv_heads, l, a.head_dim}, gen).requires_grad_());
    u.vs.push_back(at::randn({a.batch, a.kv_heads, l, a.head_dim}, gen).requires_grad_());
    u.weights.push_back(at::randn({a.batch, a.heads, l, a.head_dim}, gen));
  }
  u.valid = at::ones({a.batch, l}, at::kBool);
  u.scale = 1.0 / std::sqrt(static_cast<double>(a.head_dim));
  return u;
}

double cpu_ms() {
  timespec t{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) * 1e3 + static_cast<double>(t.tv_nsec) / 1e6;
}

struct Run {
  double ms = 0;                  // forward + backward, wall
  double cpu = 0;                 // the same, process CPU time (every thread)
  std::int64_t kept = 0, peak = 0;  // bytes (only when measured with a probe)
};

// Forward of every step, then one backward; gradients are dropped afterwards.
Run run_unit(const Args& a, Unit& u, const std::string& variant, bool probe_memory) {
  for (auto* list : {&u.qs, &u.ks, &u.vs})
    for (auto& t : *list) t.mutable_grad() = at::Tensor();
  std::optional<trainer::CpuAllocationProbe> probe;
  if (probe_memory) probe.emplace();
  trainer::TttMaskCache cache;
  Run r;
  const auto t0 = std::chrono::steady_clock::now();
  const double c0 = cpu_ms();
  {
    at::Tensor total;
    const auto steps = static_cast<std::int64_t>(u.qs.size());
    for (std::int64_t s = 0; s < steps; ++s) {
      const std::vector<at::Tensor> ks(u.ks.begin(), u.ks.begin() + s + 1), vs(u.vs.begin(), u.vs.begin() + s + 1);
      const auto i = static_cast<std::size_t>(s);
      const at::Tensor out =
          variant == "tiled"   ? trainer::ttt_attention_flash({u.qs[i], ks, vs, u.valid, s, u.scale, {}}, a.tiles)
          : variant == "fused" ? trainer::ttt_attention_fused({u.qs[i], ks, vs, u.valid, s, u.scale})
                               : trainer::ttt_attention_local({u.qs[i], ks, vs, u.valid, s, u.scale, {}}, &cache);
      const at::Tensor part = (out * u.weights[i]).sum();
      total = total.defined() ? total + part : part;
    }
    if (probe) r.kept = probe->live_bytes();
    total.backward();
  }
  r.ms = ms_since(t0);
  r.cpu = cpu_ms() - c0;
  if (probe) r.peak = probe->peak_bytes();
  return r;
}

std::string self_exe() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : "bench_ttt_attention";
}

// Peak-RSS growth (MiB) of one unit in a fresh process.
double child_rss(const Args& a, const std::string& variant, std::int64_t steps, std::int64_t l) {
  std::ostringstream cmd;
  cmd << "'" << self_exe() << "' --child " << variant << " --steps " << steps << " --lengths " << l << " --heads "
      << a.heads << " --kv-heads " << a.kv_heads << " --head-dim " << a.head_dim << " --batch " << a.batch;
  if (a.threads > 0) cmd << " --threads " << a.threads;
  if (a.tiles.query_rows > 0) cmd << " --query-rows " << a.tiles.query_rows;
  if (a.tiles.key_rows > 0) cmd << " --key-rows " << a.tiles.key_rows;
  FILE* p = ::popen(cmd.str().c_str(), "r");
  if (!p) throw std::runtime_error("cannot start " + cmd.str());
  double mib = -1;
  if (std::fscanf(p, "%lf", &mib) != 1) mib = -1;
  if (::pclose(p) != 0 || mib < 0) throw std::runtime_error("child failed: " + cmd.str());
  return mib;
}

int child(const Args& a) {
  Unit u = make_unit(a, a.steps.front(), a.lengths.front());
  const double before = rss_mib();
  run_unit(a, u, a.child, false);
  std::printf("%.1f\n", std::max(0.0, peak_rss_mib() - before));
  return 0;
}

double mib(std::int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args a = parse(argc, argv);
    if (a.threads > 0) at::set_num_threads(a.threads);
    if (!a.child.empty()) return child(a);
    const std::int64_t qr = a.tiles.query_rows > 0 ? a.tiles.query_rows : trainer::kTttFlashQueryRows;
    const std::int64_t kr = a.tiles.key_rows > 0 ? a.tiles.key_rows : trainer::kTttFlashKeyRows;
    std::printf("bench_ttt_attention: batch %lld, %lld heads / %lld kv heads x %lld, float32, %d threads, "
                "tiled tiles %lld x %lld; forward + backward of all S steps' attention; median of %d rounds; "
                "LibTorch %s\n",
                static_cast<long long>(a.batch), static_cast<long long>(a.heads), static_cast<long long>(a.kv_heads),
                static_cast<long long>(a.head_dim), at::get_num_threads(), static_cast<long long>(qr),
                static_cast<long long>(kr), a.reps, TORCH_VERSION);
    const std::size_t nv = a.variants.size();
    const auto tiled_at = std::find(a.variants.begin(), a.variants.end(), "tiled") - a.variants.begin();
    std::printf("\n%3s %6s %-6s %10s %9s %9s %11s %11s %13s", "S", "L", "impl", "wall ms", "wall/tld", "CPU/tld",
                "kept MiB", "peak MiB", "kept KiB/row");
    if (a.rss) std::printf(" %9s", "RSS MiB");
    std::printf("\n");
    for (const std::int64_t steps : a.steps) {
      for (const std::int64_t l : a.lengths) {
        Unit u = make_unit(a, steps, l);
        // Memory first (exact, untimed), which also warms every variant up.
        std::vector<Run> mem;
        for (const std::string& v : a.variants) mem.push_back(run_unit(a, u, v, true));
        std::vector<std::vector<double>> ms(nv), cpu(nv);
        for (int r = 0; r < a.reps; ++r) {
          // A rotating order, so that no variant always runs on a warmer cache.
          for (std::size_t j = 0; j < nv; ++j) {
            const std::size_t i = (j + static_cast<std::size_t>(r)) % nv;
            const Run run = run_unit(a, u, a.variants[i], false);
            ms[i].push_back(run.ms);
            cpu[i].push_back(run.cpu);
          }
        }
        for (std::size_t i = 0; i < nv; ++i) {
          const bool has_tiled = tiled_at < static_cast<std::ptrdiff_t>(nv);
          const double rw = has_tiled ? median(ms[i]) / median(ms[static_cast<std::size_t>(tiled_at)]) : 0;
          const double rc = has_tiled ? median(cpu[i]) / median(cpu[static_cast<std::size_t>(tiled_at)]) : 0;
          std::printf("%3lld %6lld %-6s %10.1f %9.2f %9.2f %11.1f %11.1f %13.2f", static_cast<long long>(steps),
                      static_cast<long long>(l), a.variants[i].c_str(), median(ms[i]), rw, rc, mib(mem[i].kept),
                      mib(mem[i].peak), static_cast<double>(mem[i].kept) / 1024.0 / static_cast<double>(l * a.batch));
          if (a.rss) std::printf(" %9.1f", child_rss(a, a.variants[i], steps, l));
          std::printf("\n");
        }
        std::fflush(stdout);
      }
    }
    std::printf("\n(kept: bytes allocated by the S forwards and still alive before backward: saved for "
                "backward, outputs included; peak: allocator peak over forward + backward, inputs excluded, "
                "gradients included; both on the calling thread)\n");
    return 0;
  } catch (const BadUsage& e) {
    std::fprintf(stderr, "bench_ttt_attention: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_ttt_attention: %s\n", e.what());
    return 1;
  }
}
