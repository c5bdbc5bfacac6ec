// trainer/ring_attention.h: context-parallel TTT attention, boundary rows and the unroll on
// cp ranks, against the single-rank computation: in process (a group of one) and over
// 2 and 4 real processes, for TTT steps 0..3 (S = 1..4), lengths that are and are not
// multiples of the cp size, padding and packed documents (attention alone, and the whole
// unroll on packed rows: document_ids and position_ids through every chunk).
#include "trainer/ring_attention.h"

#include <cmath>

#include "tests/trainer/dist_harness.h"

using namespace eaglekit;
using namespace eaglekit::test;
using trainer::KvExchange;

namespace {

constexpr std::int64_t kB = 2, kHeads = 4, kKvHeads = 2, kDim = 8;
const double kScale = 1.0 / std::sqrt(static_cast<double>(kDim));

struct AttnCase {
  std::int64_t length;
  std::int64_t step;
  bool docs;
  KvExchange exchange;
  std::int64_t query_chunk_rows = 0;  // RingOptions::query_chunk_rows (0: the default)
};

std::vector<AttnCase> attention_cases(int cp) {
  std::vector<AttnCase> v;
  std::vector<std::int64_t> lengths{12, 13};
  if (cp == 4) lengths.push_back(7);  // chunks of 1-2 rows: chains cross several ranks
  for (std::int64_t l : lengths)
    for (std::int64_t s = 0; s <= 3; ++s) v.push_back({l, s, l == 13, KvExchange::kRing});
  v.push_back({13, 2, true, KvExchange::kAllGather});
  v.push_back({12, 3, false, KvExchange::kAllGather});
  // The diagonal pair in query chunks of 1-3 rows (the first ones see no block-0 key).
  v.push_back({13, 2, true, KvExchange::kRing, 2});
  v.push_back({12, 3, false, KvExchange::kRing, 3});
  v.push_back({13, 1, false, KvExchange::kAllGather, 1});
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
  const at::Tensor out = trainer::ttt_attention_dense(q, ks, vs, in.key_valid, c.step, kScale, in.docs);
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
  const at::Tensor out = trainer::ring_ttt_attention(cp, c.length, q, ks, vs, local(in.key_valid, 1), c.step,
                                                     kScale, local(in.docs, 1), ro);
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
    CAPTURE(c.length);
    CAPTURE(c.step);
    CAPTURE(c.query_chunk_rows);
    CAPTURE(c.docs);
    CAPTURE(static_cast<int>(c.exchange));
    const auto want = reference_attention(c, make_inputs(c, 100 + i));
    for (int rank = 0; rank < cp_size; ++rank) {
      CAPTURE(rank);
      const auto got = load_tensors(d / ("attn_" + std::to_string(i) + "_" + std::to_string(rank) + ".pt"));
      check_attention_chunk(got, want, trainer::cp_chunk(c.length, cp_size, rank));
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
  for (const AttnCase& c : attention_cases(4)) {
    CAPTURE(c.length);
    CAPTURE(c.step);
    CAPTURE(c.query_chunk_rows);
    CAPTURE(c.docs);
    const auto in = make_inputs(c, 900 + i++);
    check_attention_chunk(ring_attention_run(solo, c, in), reference_attention(c, in), {0, c.length});
  }
}

TEST_CASE("ring: rows with no visible key give 0 and finite gradients, never NaN") {
  const dist::Group solo;
  for (const std::int64_t rows : {0, 2}) {
    CAPTURE(rows);
    AttnCase c{6, 2, false, KvExchange::kRing, rows};
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
  CHECK_THROWS_WITH_AS(trainer::ring_ttt_attention(dist::Group(), 4, q, kv, kv, at::ones({1, 4}, at::kBool), 1, 1.0),
                       "ring attention: step 1 needs 2 key/value blocks, got 1/1", UsageError);
  CHECK_THROWS_WITH_AS(trainer::ring_ttt_attention(dist::Group(), 5, q, kv, kv, at::ones({1, 4}, at::kBool), 0, 1.0),
                       "ring attention: rank 0 holds 4 rows, but its chunk of 5 rows has 5", UsageError);
}

TEST_CASE("ring: CP=2 on 2 processes equals one rank (attention, loss, accuracy, every gradient; packed documents)") {
  check_ring_job(2);
}

TEST_CASE("ring: CP=4 on 4 processes equals one rank (attention, loss, accuracy, every gradient; packed documents)") {
  check_ring_job(4);
}
