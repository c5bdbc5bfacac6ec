// bench_cp: per-rank peak memory and step time of context parallelism for one long sequence
// at CP = 1, 2, 4 (CPU, Gloo), in one run. For each C it launches C local ranks of itself
// (dist::launch_local, as `eaglekit launch` does); every rank runs, on its chunk:
//   attention: the TTT attention of steps 0..S-1 alone (random q/k/v), forward + backward;
//   unroll:    the full TTT unroll of the draft (S steps) + loss, forward + backward.
// Memory is the growth of the rank's peak RSS over its RSS before the first step (the
// model, the batch and LibTorch itself are excluded); time is the median step.
//
// usage: bench_cp [--length L] [--steps S] [--reps N] [--cp 1,2,4]
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
#include "trainer/base_model.h"
#include "trainer/config.h"
#include "trainer/distributed.h"
#include "trainer/draft_model.h"
#include "trainer/ring_attention.h"
#include "trainer/ttt.h"

using namespace eaglekit;

namespace {

struct Args {
  std::int64_t length = 2048;
  std::int64_t steps = 3;
  int reps = 3;
  std::vector<int> cps{1, 2, 4};
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error("missing value for " + k);
      return argv[++i];
    };
    if (k == "--length") a.length = std::stoll(next());
    else if (k == "--steps") a.steps = std::stoll(next());
    else if (k == "--reps") a.reps = std::stoi(next());
    else if (k == "--cp") {
      a.cps.clear();
      std::stringstream ss(next());
      for (std::string x; std::getline(ss, x, ',');) a.cps.push_back(std::stoi(x));
    } else if (k == "--worker") {
    } else {
      throw std::runtime_error("unknown option " + k);
    }
  }
  return a;
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
  double mib = 0;
};

// One mode on this rank; returns the median step time and the peak-RSS growth.
template <typename Step>
Measure measure(const dist::Mesh& mesh, int reps, Step&& step) {
  const double base = rss_mib();
  std::vector<double> times;
  for (int r = 0; r < reps + 1; ++r) {
    mesh.world().barrier();
    const auto t0 = std::chrono::steady_clock::now();
    step();
    mesh.world().barrier();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) times.push_back(ms);  // the first is a warm-up
  }
  return {median(times), std::max(0.0, peak_rss_mib() - base)};
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
        const at::Tensor o = c == 1 ? single.attention(q, ks, vs, valid, s, scale, {})
                                    : trainer::ring_ttt_attention(mesh.cp(), l, q, ks, vs, valid, s, scale);
        total = total + o.square().sum();
      }
      total.backward();
    });
    out << "attention " << m.ms << " " << m.mib << " " << rss_mib() << "\n";
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
    trainer::RingContext ctx(mesh);
    const Measure m = measure(mesh, a.reps, [&] {
      for (auto& p : draft.parameters()) p.mutable_grad() = at::Tensor();
      ctx.set_global_length(l);
      unroll.forward(local, &ctx).loss.backward();
    });
    out << "unroll " << m.ms << " " << m.mib << " " << rss_mib() << "\n";
  }
  const std::string dir = std::getenv("BENCH_CP_DIR") ? std::getenv("BENCH_CP_DIR") : ".";
  std::ofstream(dir + "/" + mode + "_c" + std::to_string(c) + "_rank" + std::to_string(mesh.rank()) + ".txt")
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
    const Args a = parse(argc, argv);
    if (argc > 1 && std::find_if(argv + 1, argv + argc, [](const char* s) { return std::string(s) == "--worker"; }) !=
                        argv + argc)
      return worker(a);

    char tmpl[] = "/tmp/bench_cp.XXXXXX";
    const std::string dir = ::mkdtemp(tmpl);
    std::printf("bench_cp: one sequence of %lld tokens, TTT steps %lld, H=256, 8 heads / 4 kv heads x 32, "
                "Vd=256; %d timed steps after a warm-up; %ld cores; OMP_NUM_THREADS=1 per rank\n",
                static_cast<long long>(a.length), static_cast<long long>(a.steps), a.reps, ::sysconf(_SC_NPROCESSORS_ONLN));
    struct Row {
      std::string mode;
      int c;
      double ms, mib, rss;
    };
    std::vector<Row> rows;
    for (const std::string mode : {"attention", "unroll"}) {
      for (int c : a.cps) {
        dist::LaunchOptions o;
        o.nproc = c;
        o.argv = {self_exe(), "--worker"};
        for (int i = 1; i < argc; ++i) o.argv.push_back(argv[i]);
        o.env["BENCH_CP_DIR"] = dir;
        o.env["BENCH_CP_MODE"] = mode;
        o.env["OMP_NUM_THREADS"] = "1";
        const auto r = dist::launch_local(o);
        if (r.exit_code != 0) {
          std::fprintf(stderr, "bench_cp: %s at CP=%d failed with exit code %d\n", mode.c_str(), c, r.exit_code);
          return 1;
        }
        Row row{mode, c, 0, 0, 0};
        for (int rank = 0; rank < c; ++rank) {
          std::ifstream f(dir + "/" + mode + "_c" + std::to_string(c) + "_rank" + std::to_string(rank) + ".txt");
          std::string m;
          double ms, mib, rss;
          while (f >> m >> ms >> mib >> rss) {
            row.ms = std::max(row.ms, ms);  // the step ends when the slowest rank does
            row.mib = std::max(row.mib, mib);
            row.rss = std::max(row.rss, rss);
          }
        }
        rows.push_back(row);
      }
    }
    std::printf("\n%-10s %4s %12s %16s %10s %14s\n", "part", "CP", "step ms", "peak MiB/rank", "vs CP=1",
                "1/C");
    for (const std::string mode : {"attention", "unroll"}) {
      double base = 0;
      for (const Row& r : rows) {
        if (r.mode != mode) continue;
        if (r.c == a.cps.front()) base = r.mib;
        std::printf("%-10s %4d %12.1f %16.1f %10.2f %14.2f\n", r.mode.c_str(), r.c, r.ms, r.mib,
                    base > 0 ? r.mib / base : 0.0, static_cast<double>(a.cps.front()) / r.c);
      }
    }
    std::printf("\n(peak MiB/rank: growth of the worst rank's peak RSS during the timed steps over its RSS "
                "before them; step ms: the slowest rank's median)\n");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cp: %s\n", e.what());
    return 1;
  }
}
