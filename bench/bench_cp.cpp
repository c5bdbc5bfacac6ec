// bench_cp: per-rank peak memory and step time of context parallelism for one long sequence
// at CP = 1, 2, 4 (CPU, Gloo), in one run, with both ring pair kernels side by side
// (--kernels tiled: TttAttention::kTiled, the default; dense: kLocal, the per-pair score matrix;
// docs/context-parallel.md, "Ring attention"). For each C and kernel it launches C local
// ranks of itself (dist::launch_local, as `eaglekit launch` does); every rank runs, on its
// chunk:
//   attention: the TTT attention of steps 0..S-1 alone (random q/k/v), forward + backward;
//   unroll:    the full TTT unroll of the draft (S steps) + loss, forward + backward.
// Memory: the growth of the rank's peak RSS over its RSS before the first step (the model,
// the batch and LibTorch itself are excluded), and LibTorch's CPU allocator peak over the
// warm-up and timed steps counted exactly by trainer/run/cpu_memory.h (one thread per rank, so it sees every
// allocation); time is the median step. CP = 1 runs no ring, so it has one row.
#include <ATen/ATen.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "formats/error.h"
#include "trainer/model/base_model.h"
#include "trainer/model/config.h"
#include "trainer/model/draft_model.h"
#include "trainer/parallel/distributed.h"
#include "trainer/parallel/ring_attention.h"
#include "trainer/run/cpu_memory.h"
#include "trainer/unroll/ttt.h"

using namespace eaglekit;

namespace {

const char* const kUsage =
    "usage: bench_cp [--length L] [--steps S] [--reps N] [--cp 1,2,4] [--kernels tiled,dense]\n"
    "  --length L    tokens in the one sequence (default 2048; at least the largest CP)\n"
    "  --steps S     TTT steps (default 3)\n"
    "  --reps N      timed steps after one warm-up (default 3)\n"
    "  --cp LIST     cp sizes, comma-separated (default 1,2,4)\n"
    "  --kernels K   ring pair kernels to compare, comma-separated: tiled, dense (default both)\n"
    "  --help        this text\n";

struct Args {
  std::int64_t length = 2048;
  std::int64_t steps = 3;
  int reps = 3;
  std::vector<int> cps{1, 2, 4};
  std::vector<std::string> kernels{"tiled", "dense"};
  bool help = false;
};

std::int64_t parse_int(const std::string& key, const std::string& v, std::int64_t min) {
  std::size_t used = 0;
  std::int64_t x = 0;
  try {
    x = std::stoll(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != v.size() || x < min)
    throw UsageError(key + " needs an integer >= " + std::to_string(min) + ", got '" + v + "'");
  return x;
}

std::vector<std::string> split(const std::string& v) {
  std::vector<std::string> out;
  std::stringstream ss(v);
  for (std::string x; std::getline(ss, x, ',');) out.push_back(x);
  return out;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw UsageError("missing value for " + k);
      return argv[++i];
    };
    if (k == "--help" || k == "-h") a.help = true;
    else if (k == "--length") a.length = parse_int(k, next(), 1);
    else if (k == "--steps") a.steps = parse_int(k, next(), 1);
    else if (k == "--reps") a.reps = static_cast<int>(parse_int(k, next(), 1));
    else if (k == "--cp") {
      a.cps.clear();
      for (const std::string& x : split(next())) a.cps.push_back(static_cast<int>(parse_int(k, x, 1)));
      if (a.cps.empty()) throw UsageError("--cp needs at least one size");
    } else if (k == "--kernels") {
      a.kernels = split(next());
      if (a.kernels.empty()) throw UsageError("--kernels needs tiled, dense or both");
      for (const std::string& x : a.kernels)
        if (x != "tiled" && x != "dense") throw UsageError("--kernels: unknown kernel '" + x + "' (tiled, dense)");
    } else if (k == "--worker") {
    } else {
      throw UsageError("unknown option " + k);
    }
  }
  for (int c : a.cps)
    if (a.length < c)
      throw UsageError("--length " + std::to_string(a.length) + " cannot be split over " + std::to_string(c) +
                       " ranks");
  return a;
}

// The ring pair kernel of a --kernels name: dense is TttAttention::kLocal, the per-pair scores.
trainer::TttAttention kernel_of(const std::string& name) {
  return name == "dense" ? trainer::TttAttention::kLocal : trainer::TttAttention::kTiled;
}

using bench::median;
using bench::peak_rss_mib;
using bench::rss_mib;

trainer::DraftConfig bench_config() {
  trainer::BaseConfig b;
  b.hidden_size = 256;
  b.intermediate_size = 512;
  b.num_attention_heads = 8;
  b.num_key_value_heads = 4;
  b.head_dim = 32;
  b.num_hidden_layers = 8;
  b.vocab_size = 1024;
  b.max_position_embeddings = 1 << 20;
  b.rms_norm_eps = 1e-5;
  trainer::DraftOptions o;
  o.draft_vocab_size = 256;
  return trainer::draft_config_from_base(b, o);
}

struct Measure {
  double ms = 0;
  double mib = 0;        // peak-RSS growth
  double alloc_mib = 0;  // LibTorch CPU allocator peak
};

// One mode on this rank; returns the median step time, the peak-RSS growth and the
// allocator peak.
template <typename Step>
Measure measure(const dist::Mesh& mesh, int reps, Step&& step) {
  const double base = rss_mib();
  std::vector<double> times;
  trainer::CpuAllocationProbe probe;
  for (int r = 0; r < reps + 1; ++r) {
    mesh.world().barrier();
    const auto t0 = std::chrono::steady_clock::now();
    step();
    mesh.world().barrier();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) times.push_back(ms);  // the first is a warm-up
  }
  return {median(times), std::max(0.0, peak_rss_mib() - base), static_cast<double>(probe.peak_bytes()) / (1 << 20)};
}

int worker(const Args& a) {
  const auto env = dist::launch_env_from_environment();
  const int c = env ? env->world_size : 1;
  const dist::Mesh mesh = env ? dist::Mesh::create(*env, c, {}) : dist::Mesh::single();
  const trainer::DraftConfig cfg = bench_config();
  const std::int64_t l = a.length;
  const auto chunk = trainer::cp_chunk(l, c, mesh.cp_rank());
  auto gen = at::detail::createCPUGenerator(1);
  std::ostringstream out;

  // One mode per process: ru_maxrss is a lifetime peak.
  const std::string mode = std::getenv("BENCH_CP_MODE") ? std::getenv("BENCH_CP_MODE") : "unroll";
  const std::string kernel = std::getenv("BENCH_CP_KERNEL") ? std::getenv("BENCH_CP_KERNEL") : "tiled";
  trainer::RingOptions ro;
  ro.pair_kernel = kernel_of(kernel);
  // Attention alone: S steps of TTT attention on this rank's chunk.
  if (mode == "attention") {
    const std::int64_t heads = cfg.num_attention_heads, kv = cfg.num_key_value_heads, d = cfg.head_dim;
    const at::Tensor valid = at::ones({1, chunk.size()}, at::kBool);
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    trainer::SingleRankContext single;
    const Measure m = measure(mesh, a.reps, [&] {
      std::vector<at::Tensor> ks, vs, leaves;
      at::Tensor total = at::zeros({}, at::kFloat);
      for (std::int64_t s = 0; s < a.steps; ++s) {
        at::Tensor q = at::randn({1, heads, chunk.size(), d}, gen).requires_grad_(true);
        ks.push_back(at::randn({1, kv, chunk.size(), d}, gen).requires_grad_(true));
        vs.push_back(at::randn({1, kv, chunk.size(), d}, gen).requires_grad_(true));
        const at::Tensor o = c == 1 ? single.attention({q, ks, vs, valid, s, scale})
                                    : trainer::ring_ttt_attention(mesh.cp(), l, {q, ks, vs, valid, s, scale}, ro);
        total = total + o.square().sum();
      }
      total.backward();
    });
    out << "attention " << m.ms << " " << m.mib << " " << m.alloc_mib << "\n";
  }

  // The whole unroll on one sequence.
  if (mode == "unroll") {
    trainer::BaseModel base;
    base.embed_tokens = at::randn({cfg.vocab_size, cfg.hidden_size}, gen);
    base.lm_head = at::randn({cfg.vocab_size, cfg.hidden_size}, gen) * 0.05;
    const at::Tensor d2t = at::zeros({cfg.draft_vocab_size}, at::kLong);
    trainer::DraftModel draft(cfg, d2t, base.lm_head, 1);
    trainer::TttOptions topt;
    topt.steps = a.steps;
    trainer::TttUnroll unroll(base, draft, topt);
    trainer::TttBatch full;
    full.input_ids = at::randint(cfg.vocab_size, {1, l}, gen, at::kLong);
    full.attention_mask = at::ones({1, l}, at::kLong);
    full.loss_mask = at::ones({1, l}, at::kLong);
    full.hidden_states = at::randn({1, l, cfg.hidden_size}, gen);
    full.aux_hidden_states = at::randn({1, l, cfg.aux_width()}, gen);
    const trainer::TttBatch local = trainer::shard_batch(full, c, mesh.cp_rank());
    trainer::RingContext ctx(mesh, ro);
    const Measure m = measure(mesh, a.reps, [&] {
      for (auto& p : draft.parameters()) p.mutable_grad() = at::Tensor();
      ctx.set_global_length(l);
      unroll.forward(local, &ctx).loss.backward();
    });
    out << "unroll " << m.ms << " " << m.mib << " " << m.alloc_mib << "\n";
  }
  const std::string dir = std::getenv("BENCH_CP_DIR") ? std::getenv("BENCH_CP_DIR") : ".";
  std::ofstream(dir + "/" + mode + "_" + kernel + "_c" + std::to_string(c) + "_rank" + std::to_string(mesh.rank()) +
                ".txt")
      << out.str();
  return 0;
}

std::string self_exe() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : "bench_cp";
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Args a;
    try {
      a = parse(argc, argv);
    } catch (const UsageError& e) {  // a bad command line: the usage, exit code 2
      std::fprintf(stderr, "bench_cp: %s\n%s", e.what(), kUsage);
      return 2;
    }
    if (a.help) {
      std::printf("%s", kUsage);
      return 0;
    }
    if (argc > 1 && std::find_if(argv + 1, argv + argc, [](const char* s) { return std::string(s) == "--worker"; }) !=
                        argv + argc)
      return worker(a);

    char tmpl[] = "/tmp/bench_cp.XXXXXX";
    const std::string dir = ::mkdtemp(tmpl);
    std::printf("bench_cp: one sequence of %lld tokens, TTT steps %lld, H=256, 8 heads / 4 kv heads x 32, "
                "Vd=256; %d timed steps after a warm-up; %ld cores; OMP_NUM_THREADS=1 per rank\n",
                static_cast<long long>(a.length), static_cast<long long>(a.steps), a.reps, ::sysconf(_SC_NPROCESSORS_ONLN));
    struct Row {
      std::string mode, kernel;
      int c;
      double ms, mib, alloc;
    };
    std::vector<Row> rows;
    for (const std::string mode : {"attention", "unroll"}) {
      for (int c : a.cps) {
        // CP = 1 runs no ring: one row, whatever the kernels.
        const std::vector<std::string> kernels = c == 1 ? std::vector<std::string>{"-"} : a.kernels;
        for (const std::string& kernel : kernels) {
          dist::LaunchOptions o;
          o.nproc = c;
          o.argv = {self_exe(), "--worker"};
          for (int i = 1; i < argc; ++i) o.argv.push_back(argv[i]);
          o.env["BENCH_CP_DIR"] = dir;
          o.env["BENCH_CP_MODE"] = mode;
          o.env["BENCH_CP_KERNEL"] = kernel == "-" ? "tiled" : kernel;
          o.env["OMP_NUM_THREADS"] = "1";
          const auto r = dist::launch_local(o);
          if (r.exit_code != 0) {
            std::fprintf(stderr, "bench_cp: %s at CP=%d (%s) failed with exit code %d\n", mode.c_str(), c,
                         kernel.c_str(), r.exit_code);
            return 1;
          }
          Row row{mode, kernel, c, 0, 0, 0};
          for (int rank = 0; rank < c; ++rank) {
            std::ifstream f(dir + "/" + mode + "_" + o.env["BENCH_CP_KERNEL"] + "_c" + std::to_string(c) + "_rank" +
                            std::to_string(rank) + ".txt");
            std::string m;
            double ms, mib, alloc;
            while (f >> m >> ms >> mib >> alloc) {
              row.ms = std::max(row.ms, ms);  // the step ends when the slowest rank does
              row.mib = std::max(row.mib, mib);
              row.alloc = std::max(row.alloc, alloc);
            }
          }
          rows.push_back(row);
        }
      }
    }
    std::printf("\n%-10s %4s %7s %10s %15s %16s %8s %6s\n", "part", "CP", "kernel", "step ms", "peak RSS MiB",
                "alloc peak MiB", "vs CP=1", "1/C");
    for (const std::string mode : {"attention", "unroll"}) {
      double base = 0;
      for (const Row& r : rows) {
        if (r.mode != mode) continue;
        if (r.c == a.cps.front() && base == 0) base = r.alloc;
        std::printf("%-10s %4d %7s %10.1f %15.1f %16.1f %8.2f %6.2f\n", r.mode.c_str(), r.c, r.kernel.c_str(), r.ms,
                    r.mib, r.alloc, base > 0 ? r.alloc / base : 0.0, static_cast<double>(a.cps.front()) / r.c);
      }
    }
    // The two kernels side by side.
    bool header = false;
    for (const Row& t : rows) {
      if (t.kernel != "tiled") continue;
      for (const Row& d : rows) {
        if (d.kernel != "dense" || d.mode != t.mode || d.c != t.c) continue;
        if (!header) {
          std::printf("\n%-10s %4s %16s %22s %22s\n", "part", "CP", "time tiled/dense", "peak RSS tiled/dense",
                      "alloc peak tiled/dense");
          header = true;
        }
        std::printf("%-10s %4d %16.2f %22.2f %22.2f\n", t.mode.c_str(), t.c, t.ms / d.ms, d.mib > 0 ? t.mib / d.mib : 0.0,
                    d.alloc > 0 ? t.alloc / d.alloc : 0.0);
      }
    }
    std::printf("\n(peak RSS MiB: growth of the worst rank's peak RSS during the timed steps over its RSS "
                "before them; alloc peak MiB: the worst rank's LibTorch CPU allocator peak over the steps; "
                "step ms: the slowest rank's median; vs CP=1: alloc peak over CP=1's)\n");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cp: %s\n", e.what());
    return 1;
  }
}
