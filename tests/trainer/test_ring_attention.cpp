// trainer/parallel/ring_attention.h: context-parallel TTT attention, boundary rows and the unroll on
// cp ranks, against the single-rank computation: in process (a group of one) and over
// 2 and 4 real processes, for TTT steps 0..3 (S = 1..4), lengths that are and are not
// multiples of the cp size, padding and packed documents (attention alone, and the whole
// unroll on packed rows: document_ids and position_ids through every chunk); both pair
// kernels (TttAttention::kTiled, the default, kLocal, the dense reference, and kFused where
// the build has it), which of them --ttt-attention runs on a cp group (ring_pair_kernel), the
// block-0 tile pieces on chunk pairs (with a must-fail wrong key offset), and the tiled pairs'
// memory per rank.
#include "trainer/parallel/ring_attention.h"

#include <cmath>

#include "tests/trainer/dist_harness.h"
#include "trainer/attention/ttt_fused.h"
#include "trainer/attention/ttt_tiles.h"
#include "trainer/run/cpu_memory.h"

using namespace eaglekit;
using namespace eaglekit::test;
using trainer::KvExchange;
using trainer::TttAttention;

namespace {

constexpr std::int64_t kB = 2, kHeads = 4, kKvHeads = 2, kDim = 8;
const double kScale = 1.0 / std::sqrt(static_cast<double>(kDim));

struct AttnCase {
  std::int64_t length;
  std::int64_t step;
  bool docs;
  KvExchange exchange;
  std::int64_t query_chunk_rows = 0;  // RingOptions::query_chunk_rows (kLocal; 0: the default)
  TttAttention kernel = TttAttention::kTiled;
  trainer::TttFlashTiles tiles = {};  // RingOptions::tiles (kTiled; 0: the default 128 x 256)
  bool empty_row = false;             // batch row 1 all padding: no visible key anywhere
};

std::vector<AttnCase> attention_cases(int cp) {
  std::vector<AttnCase> v;
  std::vector<std::int64_t> lengths{12, 13};
  if (cp == 4) lengths.push_back(7);  // chunks of 1-2 rows: chains cross several ranks
  // The default kernel (tiled, one tile per pair at these lengths).
  for (std::int64_t l : lengths)
    for (std::int64_t s = 0; s <= 3; ++s) v.push_back({l, s, l == 13, KvExchange::kRing});
  v.push_back({13, 2, true, KvExchange::kAllGather});
  v.push_back({12, 3, false, KvExchange::kAllGather});
  // Tiled with tiles of 1-3 rows: several query and key tiles per pair, tiles straddling the
  // shifted diagonal, skipped tiles past it and all-padding key tiles, the online rescale
  // across key tiles; documents crossing chunk boundaries (L = 13 and 7: not multiples of C).
  for (std::int64_t l : {13, 7})
    for (std::int64_t s = 0; s <= 3; ++s)
      v.push_back({l, s, true, KvExchange::kRing, 0, TttAttention::kTiled, {2, 3}});
  v.push_back({12, 1, false, KvExchange::kAllGather, 0, TttAttention::kTiled, {3, 1}});
  v.push_back({13, 3, true, KvExchange::kRing, 0, TttAttention::kTiled, {1, 2}, /*empty_row=*/true});
  // The dense reference kernel; its diagonal pair in query chunks of 1-3 rows (the first
  // ones see no block-0 key).
  for (std::int64_t s = 0; s <= 3; ++s) v.push_back({13, s, true, KvExchange::kRing, 0, TttAttention::kLocal});
  v.push_back({13, 2, true, KvExchange::kRing, 2, TttAttention::kLocal});
  v.push_back({12, 3, false, KvExchange::kRing, 3, TttAttention::kLocal});
  v.push_back({13, 1, false, KvExchange::kAllGather, 1, TttAttention::kLocal});
  v.push_back({13, 3, true, KvExchange::kRing, 0, TttAttention::kLocal, {}, /*empty_row=*/true});
  // LibTorch's fused kernels per pair, where this build has them (trainer/attention/ttt_fused.h): pairs
  // at offsets whose first queries see only part of the key chunk (a plain call on the keys
  // they all see plus a causal square), documents crossing chunks, an empty row.
  if (trainer::ttt_fused_available()) {
    for (std::int64_t l : lengths)
      for (std::int64_t s = 0; s <= 3; ++s) v.push_back({l, s, l != 12, KvExchange::kRing, 0, TttAttention::kFused});
    v.push_back({13, 2, true, KvExchange::kAllGather, 0, TttAttention::kFused});
    v.push_back({13, 3, true, KvExchange::kRing, 0, TttAttention::kFused, {}, /*empty_row=*/true});
  }
  return v;
}

struct AttnInputs {
  at::Tensor q, key_valid, docs, d_out;
  std::vector<at::Tensor> ks, vs;
};

AttnInputs make_inputs(const AttnCase& c, std::uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  auto randn = [&](std::vector<std::int64_t> shape) {
    return at::empty(shape, at::kFloat).normal_(0.0, 1.0, gen);
  };
  const std::int64_t l = c.length;
  AttnInputs in;
  in.q = randn({kB, kHeads, l, kDim});
  for (std::int64_t i = 0; i <= c.step; ++i) {
    in.ks.push_back(randn({kB, kKvHeads, l, kDim}));
    in.vs.push_back(randn({kB, kKvHeads, l, kDim}));
  }
  // Row 1 ends in padding; row 0 has a hole.
  in.key_valid = at::ones({kB, l}, at::kBool);
  in.key_valid[1].narrow(0, l - 3, 3).fill_(false);
  in.key_valid[0][4] = false;
  if (c.empty_row) in.key_valid[1].fill_(false);
  if (c.docs) {
    in.docs = at::zeros({kB, l}, at::kLong);
    in.docs[0].narrow(0, l / 2, l - l / 2).fill_(1);
    in.docs[1].narrow(0, l / 3, l - l / 3).fill_(1);
    in.docs[1].narrow(0, 2 * l / 3, l - 2 * l / 3).fill_(2);
  }
  in.d_out = randn({kB, kHeads, l, kDim});
  return in;
}

// Output and gradients (q, k blocks, v blocks) of the single-rank reference.
std::vector<at::Tensor> reference_attention(const AttnCase& c, const AttnInputs& in) {
  const at::Tensor q = in.q.clone().requires_grad_(true);
  std::vector<at::Tensor> ks, vs;
  for (const auto& k : in.ks) ks.push_back(k.clone().requires_grad_(true));
  for (const auto& v : in.vs) vs.push_back(v.clone().requires_grad_(true));
  const at::Tensor out = trainer::ttt_attention_dense({q, ks, vs, in.key_valid, c.step, kScale, in.docs});
  (out * in.d_out).sum().backward();
  std::vector<at::Tensor> r{out.detach(), q.grad()};
  for (const auto& k : ks) r.push_back(k.grad());
  for (const auto& v : vs) r.push_back(v.grad());
  return r;
}

// The same on this rank's chunk through ring_ttt_attention.
std::vector<at::Tensor> ring_attention_run(const dist::Group& cp, const AttnCase& c, const AttnInputs& in) {
  const auto chunk = trainer::cp_chunk(c.length, cp.size(), cp.rank());
  auto local = [&](const at::Tensor& t, int dim) {
    return t.defined() ? t.narrow(dim, chunk.begin, chunk.size()).contiguous() : t;
  };
  const at::Tensor q = local(in.q, 2).requires_grad_(true);
  std::vector<at::Tensor> ks, vs;
  for (const auto& k : in.ks) ks.push_back(local(k, 2).requires_grad_(true));
  for (const auto& v : in.vs) vs.push_back(local(v, 2).requires_grad_(true));
  trainer::RingOptions ro;
  ro.exchange = c.exchange;
  ro.query_chunk_rows = c.query_chunk_rows;
  ro.pair_kernel = c.kernel;
  ro.tiles = c.tiles;
  const at::Tensor out = trainer::ring_ttt_attention(
      cp, c.length, {q, ks, vs, local(in.key_valid, 1), c.step, kScale, local(in.docs, 1)}, ro);
  (out * local(in.d_out, 2)).sum().backward();
  std::vector<at::Tensor> r{out.detach(), q.grad()};
  for (const auto& k : ks) r.push_back(k.grad());
  for (const auto& v : vs) r.push_back(v.grad());
  return r;
}

void check_attention_chunk(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want,
                           const trainer::SequenceChunk& chunk) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    CAPTURE(i);  // 0 out, 1 dq, then dk blocks, then dv blocks
    const at::Tensor w = want[i].narrow(2, chunk.begin, chunk.size());
    // Relative to the whole tensor's scale: a rank's slice of a gradient can be exactly 0
    // (one visible key) while the dense reference holds rounding noise there (~3e-7 with
    // OpenBLAS, whose blocked sums differ from the reference BLAS).
    const double scale = want[i].abs().max().item<double>();
    CHECK_MESSAGE(close(got[i], w, 1e-5, 1e-5 * scale), diff_text(got[i], w));
  }
}

// The attention case's name for CAPTURE.
std::string case_text(const AttnCase& c) {
  return "L=" + std::to_string(c.length) + " s=" + std::to_string(c.step) + (c.docs ? " docs" : "") +
         (c.exchange == KvExchange::kAllGather ? " all-gather" : " ring") +
         (c.kernel == TttAttention::kLocal   ? " local, query chunks " + std::to_string(c.query_chunk_rows)
          : c.kernel == TttAttention::kTiled ? " tiled " + std::to_string(c.tiles.query_rows) + "x" +
                                                   std::to_string(c.tiles.key_rows)
                                             : " " + std::string(trainer::ttt_attention_name(c.kernel))) +
         (c.empty_row ? " empty row" : "");
}

std::int64_t steps_of(int i) { return 1 + i % 4; }

// Packed rows as the pack collator writes them: several documents back to back, positions
// restarting at 0 in each, the row's tail padding with document -1. Row 0 holds three
// documents (7, L-10, 3 tokens), row 1 two (9, L-12) and 3 padding tokens; lengths 16 and
// 13 (not a multiple of 2 or 4), so on 2 and 4 ranks documents cross chunk boundaries.
std::int64_t packed_length(int i) { return i == 0 ? 16 : 13; }
trainer::TttBatch packed_batch(const trainer::DraftConfig& c, std::int64_t length, std::uint64_t seed) {
  trainer::TttBatch b = trainer::fixtures::random_batch(c, 2, length, {length, length - 3}, seed);
  const std::vector<std::vector<std::int64_t>> docs = {{7, length - 10, 3}, {9, length - 12}};
  b.document_ids = at::full({2, length}, -1, at::kLong);
  b.position_ids = at::zeros({2, length}, at::kLong);
  for (std::int64_t r = 0; r < 2; ++r) {
    std::int64_t first = 0;
    for (std::size_t d = 0; d < docs[static_cast<std::size_t>(r)].size(); ++d) {
      const std::int64_t n = docs[static_cast<std::size_t>(r)][d];
      b.document_ids[r].narrow(0, first, n).fill_(static_cast<std::int64_t>(d));
      b.position_ids[r].narrow(0, first, n).copy_(at::arange(n, at::kLong));
      // Each document's first two tokens are not scored, as in its own row.
      b.loss_mask[r].narrow(0, first, std::min<std::int64_t>(2, n)).zero_();
      first += n;
    }
  }
  return b;
}

// The same rows with the documents forgotten: one sequence per row, positions 0..L-1.
trainer::TttBatch without_documents(trainer::TttBatch b) {
  b.document_ids = at::Tensor();
  b.position_ids = at::Tensor();
  return b;
}

// check_same_run's comparisons as one verdict, for the must-fail twin.
bool same_run(const ModelRun& got, const ModelRun& want) {
  if (!close(got.loss, want.loss) || got.stats.correct != want.stats.correct) return false;
  for (std::size_t i = 0; i < want.grads.size(); ++i)
    if (!close(got.grads[i], want.grads[i])) return false;
  return true;
}
std::int64_t length_of(int i) { return i < 4 ? 16 : 13; }  // 13: not a multiple of 2 or 4

// Every case on this rank; rank files attn_<i>_<rank>.pt and model_<i>.pt.
ScenarioRegistration ring_job("ring", [] {
  const int cp_size = env_int("EAGLEKIT_TEST_CP", 1);
  const auto mesh = dist::Mesh::from_environment(cp_size, worker_group_options());
  const std::string dir = job_dir();
  const std::string rank = std::to_string(mesh.rank());
  if (mesh.dp_size() == 1) {
    const auto cases = attention_cases(cp_size);
    for (std::size_t i = 0; i < cases.size(); ++i) {
      const auto in = make_inputs(cases[i], 100 + i);
      save_tensors(dir + "/attn_" + std::to_string(i) + "_" + rank + ".pt",
                   ring_attention_run(mesh.cp(), cases[i], in));
    }
  }
  const ModelSetup m;
  for (int i = 0; i < 8; ++i) {
    const auto batch = model_batch(m.config, length_of(i), 500 + i);
    // Alternate the gradient sync mode and the kv exchange.
    trainer::RingOptions ro;
    ro.exchange = i == 5 ? KvExchange::kAllGather : KvExchange::kRing;
    const ModelRun run = mesh_run(mesh, m, steps_of(i), batch, /*overlap=*/i % 2 == 0, ro);
    if (mesh.is_main()) save_tensors(dir + "/model_" + std::to_string(i) + ".pt", run.to_tensors());
  }
  // A two-layer draft: each layer's own kept keys/values go round the ring.
  const ModelSetup deep(2);
  const ModelRun run = mesh_run(mesh, deep, 3, model_batch(deep.config, 13, 600), /*overlap=*/true, {});
  if (mesh.is_main()) save_tensors(dir + "/model_deep.pt", run.to_tensors());
  // The same with --recompute (docs/ttt.md, recomputation): the layers rerun in backward,
  // beside the ring's own backward exchanges and the gradient-sync hooks.
  ModelSetup deep_recompute(2);
  deep_recompute.recompute = true;
  const ModelRun rerun = mesh_run(mesh, deep_recompute, 3, model_batch(deep.config, 13, 600), /*overlap=*/true, {});
  if (mesh.is_main()) save_tensors(dir + "/model_deep_recompute.pt", rerun.to_tensors());
  // Packed documents (document_ids and position_ids through the chunks, the boundary rolls
  // and the ring attention's document mask), 3 TTT steps.
  for (int i = 0; i < 2; ++i) {
    const ModelRun run = mesh_run(mesh, m, 3, packed_batch(m.config, packed_length(i), 520 + i), /*overlap=*/i == 0);
    if (mesh.is_main()) save_tensors(dir + "/packed_" + std::to_string(i) + ".pt", run.to_tensors());
  }
});

void check_ring_job(int cp_size) {
  TempDir d("ring");
  JobOptions jo;
  jo.env["EAGLEKIT_TEST_CP"] = std::to_string(cp_size);
  const JobResult r = run_job(cp_size, "ring", d.path(), jo);
  INFO(r.all_logs());
  REQUIRE(r.launch.exit_code == 0);

  const auto cases = attention_cases(cp_size);
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const AttnCase& c = cases[i];
    const std::string what = case_text(c);
    CAPTURE(what);
    const auto want = reference_attention(c, make_inputs(c, 100 + i));
    for (int rank = 0; rank < cp_size; ++rank) {
      CAPTURE(rank);
      const auto got = load_tensors(d / ("attn_" + std::to_string(i) + "_" + std::to_string(rank) + ".pt"));
      check_attention_chunk(got, want, trainer::cp_chunk(c.length, cp_size, rank));
      if (c.empty_row) {
        // Batch row 1 sees nothing: output 0 there, and every tensor finite.
        CHECK(got[0].select(0, 1).abs().max().item<float>() == 0.0f);
        for (const auto& t : got) CHECK(at::isfinite(t).all().item<bool>());
      }
    }
  }

  const ModelSetup m;
  const auto names = m.fresh_draft().named_parameters();
  for (int i = 0; i < 8; ++i) {
    CAPTURE(steps_of(i));
    CAPTURE(length_of(i));
    const auto batch = model_batch(m.config, length_of(i), 500 + i);
    const ModelRun want = single_process_run(m, steps_of(i), batch);
    const ModelRun got = ModelRun::from_tensors(load_tensors(d / ("model_" + std::to_string(i) + ".pt")));
    check_same_run(got, want, names);
  }
  {
    INFO("two-layer draft, S = 3, L = 13");
    const ModelSetup deep(2);
    const auto deep_names = deep.fresh_draft().named_parameters();
    REQUIRE(deep_names.size() == names.size() + 9);
    const ModelRun want = single_process_run(deep, 3, model_batch(deep.config, 13, 600));
    check_same_run(ModelRun::from_tensors(load_tensors(d / "model_deep.pt")), want, deep_names);
    INFO("the same with --recompute");
    check_same_run(ModelRun::from_tensors(load_tensors(d / "model_deep_recompute.pt")), want, deep_names);
  }
  for (int i = 0; i < 2; ++i) {
    CAPTURE(packed_length(i));
    const auto batch = packed_batch(m.config, packed_length(i), 520 + i);
    const ModelRun want = single_process_run(m, 3, batch);
    const ModelRun got = ModelRun::from_tensors(load_tensors(d / ("packed_" + std::to_string(i) + ".pt")));
    check_same_run(got, want, names);
    // The must-fail: the same rows with their documents ignored (attention across document
    // boundaries, positions running on) give other losses and gradients.
    CHECK_FALSE(same_run(got, single_process_run(m, 3, without_documents(batch))));
  }
}

}  // namespace

namespace {

// --- The block-0 tile pieces (trainer/attention/ttt_tiles.h) on chunk pairs -------------------------

struct PieceRun {
  at::Tensor out, dq, dk, dv;  // [B, heads, L, D], [B, heads, L, D], [B, kv_heads, L, D] x 2
};

// Block 0 of step `step` over `chunks` query chunks x `chunks` key chunks (cp_chunk layout)
// by tile_forward, merged by log-sum-exp per query chunk, and the gradients of
// sum(out * d_out) by tile_backward per pair against the merged out / lse, as the ring does
// (docs/context-parallel.md, "Pair kernels"). key_shift is added to every key chunk's
// global offset: 0 is right, anything else must fail.
PieceRun tiles_over_chunks(const AttnInputs& in, std::int64_t step, int chunks, std::int64_t key_shift,
                           trainer::TttFlashTiles t) {
  namespace tl = trainer::tiles;
  const std::int64_t l = in.q.size(2);
  const tl::TileShape shape{step, t.query_rows, t.key_rows};
  auto cut = [&](const at::Tensor& x, int dim, const trainer::SequenceChunk& c) {
    return x.defined() ? x.narrow(dim, c.begin, c.size()) : x;
  };
  auto keys_of = [&](int src) {
    const auto c = trainer::cp_chunk(l, chunks, src);
    return tl::tile_keys(cut(in.ks[0], 2, c), cut(in.vs[0], 2, c), cut(in.key_valid, 1, c), cut(in.docs, 1, c),
                         c.begin + key_shift);
  };
  PieceRun r;
  r.dk = at::zeros_like(in.ks[0]);
  r.dv = at::zeros_like(in.vs[0]);
  std::vector<at::Tensor> outs, dq_chunks;
  for (int rank = 0; rank < chunks; ++rank) {
    const auto c = trainer::cp_chunk(l, chunks, rank);
    const tl::TileQueries tq = tl::tile_queries(cut(in.q, 2, c), kKvHeads, kScale, cut(in.docs, 1, c), c.begin);
    std::optional<trainer::AttentionPartial> acc;
    for (int src = 0; src < chunks; ++src) {
      const tl::TilePartial p = tl::tile_forward(shape, tq, keys_of(src));
      const trainer::AttentionPartial part{tl::tiles_to_heads(p.out), tl::tiles_to_heads(p.lse)};
      acc = acc ? trainer::merge_partials(*acc, part) : part;
    }
    const at::Tensor d_out = cut(in.d_out, 2, c);
    const at::Tensor d_out_t = tl::tiles_from_heads(d_out, kKvHeads);
    const at::Tensor delta = tl::tiles_from_heads((d_out * acc->out).sum(-1), kKvHeads);
    const at::Tensor lse = tl::tiles_from_heads(acc->lse, kKvHeads);
    at::Tensor dqs = at::zeros_like(tq.qs);
    for (int src = 0; src < chunks; ++src) {
      const auto kc = trainer::cp_chunk(l, chunks, src);
      at::Tensor dk = r.dk.narrow(2, kc.begin, kc.size()), dv = r.dv.narrow(2, kc.begin, kc.size());
      tl::tile_backward(shape, tq, keys_of(src), d_out_t, delta, lse, dqs, dk, dv);
    }
    outs.push_back(acc->out);
    dq_chunks.push_back(tl::tiles_to_heads(dqs).mul_(kScale));
  }
  r.out = at::cat(outs, 2);
  r.dq = at::cat(dq_chunks, 2);
  return r;
}

// The same through the fused kernels' pair pieces (trainer/attention/ttt_fused.h).
PieceRun fused_over_chunks(const AttnInputs& in, std::int64_t step, int chunks, std::int64_t key_shift) {
  const std::int64_t l = in.q.size(2);
  auto cut = [&](const at::Tensor& x, int dim, const trainer::SequenceChunk& c) {
    return x.defined() ? x.narrow(dim, c.begin, c.size()) : x;
  };
  auto pair_of = [&](const trainer::SequenceChunk& qc, int src) {
    const auto kc = trainer::cp_chunk(l, chunks, src);
    return trainer::fused::Pair{cut(in.q, 2, qc), cut(in.ks[0], 2, kc), cut(in.vs[0], 2, kc),
                                cut(in.key_valid, 1, kc), cut(in.docs, 1, qc), cut(in.docs, 1, kc),
                                qc.begin, kc.begin + key_shift, nullptr, nullptr};  // read here
  };
  PieceRun r;
  r.dk = at::zeros_like(in.ks[0]);
  r.dv = at::zeros_like(in.vs[0]);
  std::vector<at::Tensor> outs, dq_chunks;
  for (int rank = 0; rank < chunks; ++rank) {
    const auto c = trainer::cp_chunk(l, chunks, rank);
    std::optional<trainer::AttentionPartial> acc;
    for (int src = 0; src < chunks; ++src) {
      const trainer::fused::Partial p = trainer::fused::block0_forward(pair_of(c, src), step, kScale);
      const trainer::AttentionPartial part{p.out, p.lse};
      acc = acc ? trainer::merge_partials(*acc, part) : part;
    }
    at::Tensor dq = at::zeros_like(acc->out);
    for (int src = 0; src < chunks; ++src) {
      const auto kc = trainer::cp_chunk(l, chunks, src);
      at::Tensor dk = r.dk.narrow(2, kc.begin, kc.size()), dv = r.dv.narrow(2, kc.begin, kc.size());
      trainer::fused::block0_backward(pair_of(c, src), step, kScale, cut(in.d_out, 2, c), acc->out, acc->lse, dq,
                                      dk, dv);
    }
    outs.push_back(acc->out);
    dq_chunks.push_back(dq);
  }
  r.out = at::cat(outs, 2);
  r.dq = at::cat(dq_chunks, 2);
  return r;
}

bool same_pieces(const PieceRun& got, const PieceRun& want) {
  bool ok = true;
  for (const auto& [g, w] : {std::pair{got.out, want.out}, {got.dq, want.dq}, {got.dk, want.dk}, {got.dv, want.dv}}) {
    const double scale = w.abs().max().item<double>();
    ok = ok && close(g, w, 1e-5, 1e-5 * scale);
  }
  return ok;
}

// --- Memory per rank: the tiled pairs against the dense pair's scores ---------------------

constexpr std::int64_t kMemHeads = 8, kMemKvHeads = 4, kMemDim = 32, kMemStep = 1;
const std::vector<std::int64_t> kMemLengths{2048, 4096};

// The allocator peak of one forward + backward of ring_ttt_attention on this rank, per
// length and kernel (tiled, dense), on one thread so that the probe sees every allocation.
ScenarioRegistration ring_memory_job("ring_memory", [] {
  const auto mesh = dist::Mesh::from_environment(env_int("EAGLEKIT_TEST_CP", 2), worker_group_options());
  at::set_num_threads(1);
  std::vector<double> peaks;
  for (const std::int64_t length : kMemLengths) {
    const auto chunk = trainer::cp_chunk(length, mesh.cp_size(), mesh.cp_rank());
    auto gen = at::detail::createCPUGenerator(7 + static_cast<std::uint64_t>(mesh.rank()));
    auto randn = [&](std::vector<std::int64_t> shape) { return at::empty(shape, at::kFloat).normal_(0.0, 1.0, gen); };
    const at::Tensor q0 = randn({1, kMemHeads, chunk.size(), kMemDim});
    const at::Tensor d_out = randn({1, kMemHeads, chunk.size(), kMemDim});
    std::vector<at::Tensor> k0, v0;
    for (std::int64_t i = 0; i <= kMemStep; ++i) {
      k0.push_back(randn({1, kMemKvHeads, chunk.size(), kMemDim}));
      v0.push_back(randn({1, kMemKvHeads, chunk.size(), kMemDim}));
    }
    const at::Tensor valid = at::ones({1, chunk.size()}, at::kBool);
    for (const TttAttention kernel : {TttAttention::kTiled, TttAttention::kLocal}) {
      const at::Tensor q = q0.clone().requires_grad_(true);
      std::vector<at::Tensor> ks, vs;
      for (const auto& k : k0) ks.push_back(k.clone().requires_grad_(true));
      for (const auto& v : v0) vs.push_back(v.clone().requires_grad_(true));
      trainer::RingOptions ro;
      ro.pair_kernel = kernel;
      mesh.world().barrier();
      std::int64_t peak = 0;
      {
        trainer::CpuAllocationProbe probe;
        {
          const at::Tensor out = trainer::ring_ttt_attention(
              mesh.cp(), length, {q, ks, vs, valid, kMemStep, 1.0 / std::sqrt(double(kMemDim))}, ro);
          (out * d_out).sum().backward();
        }
        peak = probe.peak_bytes();
      }
      peaks.push_back(static_cast<double>(peak));
    }
  }
  save_tensors(job_dir() + "/memory_" + std::to_string(mesh.rank()) + ".pt", {at::tensor(peaks, at::kDouble)});
});

}  // namespace

TEST_CASE("ring: chunks follow [r*L/C, (r+1)*L/C) and shard_batch slices every tensor") {
  struct Row {
    std::int64_t length;
    int c;
    std::vector<std::int64_t> begins;
  };
  for (const Row& row : {Row{12, 4, {0, 3, 6, 9, 12}}, Row{13, 4, {0, 3, 6, 9, 13}}, Row{7, 4, {0, 1, 3, 5, 7}},
                         Row{5, 2, {0, 2, 5}}, Row{9, 1, {0, 9}}}) {
    for (int r = 0; r < row.c; ++r) {
      const auto ch = trainer::cp_chunk(row.length, row.c, r);
      CHECK(ch.begin == row.begins[static_cast<std::size_t>(r)]);
      CHECK(ch.end == row.begins[static_cast<std::size_t>(r) + 1]);
    }
  }
  CHECK_THROWS_WITH_AS(trainer::cp_chunk(3, 4, 0),
                       "a sequence of 3 rows cannot be split over 4 context-parallel ranks", UsageError);
  CHECK_THROWS_WITH_AS(trainer::cp_chunk(8, 2, 2), "cp rank 2 of 2 is not a rank", UsageError);

  const ModelSetup m;
  const auto b = model_batch(m.config, 13, 1);
  const auto s = trainer::shard_batch(b, 4, 3);
  CHECK(s.input_ids.equal(b.input_ids.narrow(1, 9, 4)));
  CHECK(s.hidden_states.equal(b.hidden_states.narrow(1, 9, 4)));
  CHECK(s.aux_hidden_states.equal(b.aux_hidden_states.narrow(1, 9, 4)));
  CHECK(s.loss_mask.equal(b.loss_mask.narrow(1, 9, 4)));
  CHECK(s.attention_mask.equal(b.attention_mask.narrow(1, 9, 4)));
  CHECK_FALSE(s.document_ids.defined());
}

TEST_CASE("ring: one-rank ring attention equals the dense reference, output and gradients") {
  const dist::Group solo;
  int i = 0;
  // The tiled and fused pair kernels plan from the keys' host copy the ring reads once per
  // call with its key metadata: no pair, forward or backward reads key_valid again.
  const std::int64_t reads = trainer::tiles::host_keys_reads();
  for (const AttnCase& c : attention_cases(4)) {
    const std::string what = case_text(c);
    CAPTURE(what);
    const auto in = make_inputs(c, 900 + i++);
    check_attention_chunk(ring_attention_run(solo, c, in), reference_attention(c, in), {0, c.length});
  }
  CHECK(trainer::tiles::host_keys_reads() == reads);
}

TEST_CASE("ring: --ttt-attention on a cp group runs fused for fused and auto with the fused kernels, tiled otherwise") {
  // ring_pair_kernel is what make_sequence_context (train and evaluate with --cp > 1) puts
  // into RingOptions::pair_kernel: local runs the tiled pairs, never the dense reference.
  const bool fused = trainer::ttt_fused_available();
  CHECK(trainer::ring_pair_kernel(TttAttention::kAuto) == (fused ? TttAttention::kFused : TttAttention::kTiled));
  CHECK(trainer::ring_pair_kernel(TttAttention::kLocal) == TttAttention::kTiled);
  CHECK(trainer::ring_pair_kernel(TttAttention::kTiled) == TttAttention::kTiled);
  CHECK(trainer::ring_pair_kernel(TttAttention::kFused) == TttAttention::kFused);
  // kAuto left in RingOptions runs the same kernel: the same bits, forward and backward.
  const dist::Group solo;
  AttnCase c{13, 2, true, KvExchange::kRing, 0, TttAttention::kAuto};
  const auto in = make_inputs(c, 41);
  const auto got = ring_attention_run(solo, c, in);
  c.kernel = trainer::ring_pair_kernel(TttAttention::kAuto);
  const auto want = ring_attention_run(solo, c, in);
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) CHECK(got[i].equal(want[i]));
}

TEST_CASE("ring: rows with no visible key give 0 and finite gradients, never NaN") {
  const dist::Group solo;
  for (const std::int64_t rows : {0, 2, -1}) {
    CAPTURE(rows);  // -1: the tiled kernel, else the dense one with query chunks of `rows`
    AttnCase c{6, 2, false, KvExchange::kRing, std::max<std::int64_t>(rows, 0),
               rows < 0 ? TttAttention::kTiled : TttAttention::kLocal, {2, 2}};
    auto in = make_inputs(c, 5);
    in.key_valid.fill_(false);
    const auto got = ring_attention_run(solo, c, in);
    CHECK(got[0].abs().max().item<float>() == 0.0f);
    for (const auto& t : got) CHECK(at::isfinite(t).all().item<bool>());
  }
}

TEST_CASE("ring: RingContext on one rank is the single-rank context; misuse is reported") {
  const ModelSetup m;
  const auto batch = model_batch(m.config, 11, 3);
  const ModelRun want = single_process_run(m, 3, batch);
  const auto mesh = dist::Mesh::single();
  const ModelRun got = mesh_run(mesh, m, 3, batch, true);
  check_same_run(got, want, m.fresh_draft().named_parameters());

  trainer::RingContext ctx{dist::Group(), dist::Group()};
  CHECK(ctx.global_offset() == 0);
  CHECK(ctx.global_length(11) == 11);
  CHECK_THROWS_WITH_AS(trainer::cp_shift(dist::Group(), at::zeros({2}), 1),
                       "cp_shift: x must be [B, n, ...] with n >= 1", UsageError);
  const at::Tensor q = at::zeros({1, 2, 4, 2});
  const std::vector<at::Tensor> kv{at::zeros({1, 1, 4, 2})};
  CHECK_THROWS_WITH_AS(trainer::ring_ttt_attention(dist::Group(), 4, {q, kv, kv, at::ones({1, 4}, at::kBool), 1, 1.0}),
                       "ring attention: step 1 needs 2 key/value blocks, got 1/1", UsageError);
  CHECK_THROWS_WITH_AS(trainer::ring_ttt_attention(dist::Group(), 5, {q, kv, kv, at::ones({1, 4}, at::kBool), 0, 1.0}),
                       "ring attention: rank 0 holds 4 rows, but its chunk of 5 rows has 5", UsageError);
}

TEST_CASE("ring: CP=2 on 2 processes equals one rank (attention, loss, accuracy, every gradient; packed documents)") {
  check_ring_job(2);
}

TEST_CASE("ring: CP=4 on 4 processes equals one rank (attention, loss, accuracy, every gradient; packed documents)") {
  check_ring_job(4);
}

TEST_CASE("ring: the block-0 tile pieces on chunk pairs at offsets equal the dense attention; a wrong key offset does not") {
  // Step 0 is block 0 alone: the pieces over 1, 2, 3 and 4 chunks (L = 13: uneven chunks),
  // padding, packed documents crossing the chunk boundaries, GQA, against ttt_attention_dense.
  for (const trainer::TttFlashTiles t : {trainer::TttFlashTiles{128, 256}, trainer::TttFlashTiles{2, 3}}) {
    CAPTURE(t.query_rows);
    const AttnCase c{13, 0, true, KvExchange::kRing};
    const AttnInputs in = make_inputs(c, 77);
    const auto ref = reference_attention(c, in);  // out, dq, dk0, dv0
    const PieceRun want{ref[0], ref[1], ref[2], ref[3]};
    for (const int chunks : {1, 2, 3, 4}) {
      CAPTURE(chunks);
      CHECK(same_pieces(tiles_over_chunks(in, 0, chunks, 0, t), want));
    }
    // The must-fail: each key chunk one position off (its keys judged by another key's
    // causal mask) gives values and gradients beyond the tolerance.
    CHECK_FALSE(same_pieces(tiles_over_chunks(in, 0, 3, 1, t), want));
  }
  // Steps 1..3: the shifted diagonal at offsets, pairs against the one whole-sequence pair
  // at offset 0 (ttt_attention_flash's block 0, which tests/trainer/test_ttt_flash.cpp checks
  // against the dense reference).
  for (std::int64_t step = 1; step <= 3; ++step) {
    CAPTURE(step);
    const AttnInputs in = make_inputs({13, step, true, KvExchange::kRing}, 80 + static_cast<std::uint64_t>(step));
    const PieceRun whole = tiles_over_chunks(in, step, 1, 0, {2, 3});
    for (const int chunks : {2, 4}) CHECK(same_pieces(tiles_over_chunks(in, step, chunks, 0, {3, 2}), whole));
    CHECK_FALSE(same_pieces(tiles_over_chunks(in, step, 2, -1, {3, 2}), whole));
  }
}

TEST_CASE("ring: the fused kernels' pair pieces at offsets equal the dense attention; a wrong key offset does not") {
  if (!trainer::ttt_fused_available()) {
    // Debian's LibTorch 1.13: the pieces say why they cannot run.
    const AttnInputs in = make_inputs({13, 0, true, KvExchange::kRing}, 77);
    CHECK_THROWS_AS(fused_over_chunks(in, 0, 2, 0), UsageError);
    return;
  }
  // Step 0: over 1..4 chunks (L = 13: uneven chunks), padding, packed documents crossing the
  // chunk boundaries, GQA, against ttt_attention_dense.
  const AttnCase c{13, 0, true, KvExchange::kRing};
  const AttnInputs in = make_inputs(c, 77);
  const auto ref = reference_attention(c, in);
  const PieceRun want{ref[0], ref[1], ref[2], ref[3]};
  for (const int chunks : {1, 2, 3, 4}) {
    CAPTURE(chunks);
    CHECK(same_pieces(fused_over_chunks(in, 0, chunks, 0), want));
  }
  CHECK_FALSE(same_pieces(fused_over_chunks(in, 0, 3, 1), want));
  // Steps 1..3: the shifted diagonal at offsets (first queries of a chunk that see part of
  // the previous chunk), against the tile pieces over the same chunks.
  for (std::int64_t step = 1; step <= 3; ++step) {
    CAPTURE(step);
    const AttnInputs ins = make_inputs({13, step, true, KvExchange::kRing}, 80 + static_cast<std::uint64_t>(step));
    const PieceRun whole = tiles_over_chunks(ins, step, 1, 0, {2, 3});
    for (const int chunks : {1, 2, 3, 4}) {
      CAPTURE(chunks);
      CHECK(same_pieces(fused_over_chunks(ins, step, chunks, 0), whole));
    }
    CHECK_FALSE(same_pieces(fused_over_chunks(ins, step, 2, -1), whole));
  }
}

TEST_CASE("ring: CP=2 on 2 processes, memory: a tiled pair holds one tile of scores, its peak per rank O(L/C), far below the dense pair's scores") {
  TempDir d("ring_memory");
  JobOptions jo;
  jo.env["EAGLEKIT_TEST_CP"] = "2";
  const JobResult r = run_job(2, "ring_memory", d.path(), jo);
  INFO(r.all_logs());
  REQUIRE(r.launch.exit_code == 0);
  // 2 ranks, 8 heads / 4 kv heads x 32, step 1, batch 1, float32. Rank 1's pair with rank
  // 0's chunk has B x heads x (L/2)^2 scores: 32 MiB at L = 2048, 128 MiB at L = 4096.
  // Measured (one thread), rank 1: tiled 23.2 / 46.4 MiB, dense 109.7 / 411.4 MiB at
  // L = 2048 / 4096 (rank 0, the diagonal pair alone: tiled the same, dense 135.3 MiB at 4096). The tiled
  // peak is O(L/C) (q, out, lse, the chunks in flight, gradients: ~23 chunk-sized tensors
  // of 2 MiB at 4096, plus one tile of 1 MiB); the dense one follows the scores.
  auto mib = [](double b) { return b / (1 << 20); };
  for (int rank = 0; rank < 2; ++rank) {
    CAPTURE(rank);
    const at::Tensor peaks = load_tensors(d / ("memory_" + std::to_string(rank) + ".pt"))[0];
    REQUIRE(peaks.numel() == 4);
    const double tiled_short = peaks[0].item<double>(), dense_short = peaks[1].item<double>();
    const double tiled = peaks[2].item<double>(), dense = peaks[3].item<double>();
    const double scores = 1.0 * kMemHeads * (kMemLengths[1] / 2) * (kMemLengths[1] / 2) * 4;
    MESSAGE("rank " << rank << " peak at L = 2048 / 4096: tiled " << mib(tiled_short) << " / " << mib(tiled)
                    << " MiB, dense " << mib(dense_short) << " / " << mib(dense) << " MiB; dense pair scores at 4096 "
                    << mib(scores) << " MiB");
    CHECK(tiled < scores / 2);
    CHECK(tiled < 2.5 * tiled_short);  // twice the length: about twice the bytes
    if (rank == 1) {
      CHECK(dense > scores);              // the off-diagonal pair's whole score matrix
      CHECK(dense > 3.5 * dense_short);   // quadratic
      CHECK(dense > 8 * tiled);
    }
  }
}
