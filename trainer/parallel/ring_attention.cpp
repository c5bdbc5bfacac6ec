#include "trainer/parallel/ring_attention.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "formats/error.h"
#include "trainer/attention/ttt_fused.h"
#include "trainer/attention/ttt_tiles.h"
#include "trainer/parallel/autograd_node.h"

namespace eaglekit::trainer {

namespace {

const double kNegInf = -std::numeric_limits<double>::infinity();

// Message tags, so that the different exchanges between one pair of ranks never match
// each other's messages.
constexpr int kTagKv = 11;
constexpr int kTagDkv = 12;
constexpr int kTagShift = 13;

using torch::autograd::Node;
using torch::autograd::variable_list;

// y[:, p] = x[:, p + delta] along `dim` for p in [0, rows), zero where p + delta is not a
// row of x.
at::Tensor rows_from(const at::Tensor& x, std::int64_t delta, std::int64_t rows, std::int64_t dim) {
  const std::int64_t n = x.size(dim);
  const std::int64_t lo = std::max<std::int64_t>(0, -delta);
  const std::int64_t hi = std::min<std::int64_t>(rows, n - delta);
  std::vector<std::int64_t> shape = x.sizes().vec();
  if (hi <= lo) {
    shape[dim] = rows;
    return at::zeros(shape, x.options());
  }
  if (lo == 0 && hi == rows && rows == n && delta == 0) return x;
  std::vector<at::Tensor> parts;
  if (lo > 0) {
    shape[dim] = lo;
    parts.push_back(at::zeros(shape, x.options()));
  }
  parts.push_back(x.narrow(dim, lo + delta, hi - lo));
  if (hi < rows) {
    shape[dim] = rows - hi;
    parts.push_back(at::zeros(shape, x.options()));
  }
  return parts.size() == 1 ? parts[0] : at::cat(parts, dim);
}

at::Tensor safe_max(const at::Tensor& m) {
  const at::Tensor d = m.detach();
  return at::where(at::isfinite(d), d, at::zeros_like(d));
}

// Keys of every rank's chunk as seen by attention: which are real, and their documents.
struct KeyMeta {
  std::vector<at::Tensor> valid;  // per rank: [B, n_r] bool
  std::vector<at::Tensor> docs;   // per rank: [B, n_r] int64; empty without documents
  // per rank: both on the host, for the tiled and fused pair kernels' plans (read once per
  // call, forward and backward, not per pair)
  std::vector<std::shared_ptr<const tiles::HostKeys>> host;
};

KeyMeta gather_key_meta(const dist::Group& cp, const std::vector<std::int64_t>& sizes,
                        const at::Tensor& key_valid, const at::Tensor& document_ids) {
  const std::int64_t n_max = *std::max_element(sizes.begin(), sizes.end());
  at::Tensor local = key_valid.to(at::kLong).unsqueeze(0);
  if (document_ids.defined())
    local = at::cat({local, document_ids.to(key_valid.device(), at::kLong).unsqueeze(0)}, 0);
  // all_gather needs one shape: pad every chunk to the longest.
  local = rows_from(local, 0, n_max, 2).contiguous();
  const at::Tensor all = cp.all_gather(local);  // [C, 1 or 2, B, n_max]
  const at::Tensor all_host = all.to(at::kCPU);    // the one device-to-host copy of the call
  KeyMeta m;
  for (int r = 0; r < cp.size(); ++r) {
    const std::int64_t n = sizes[static_cast<std::size_t>(r)];
    const at::Tensor mine = all.select(0, r).narrow(2, 0, n);
    m.valid.push_back(mine.select(0, 0) != 0);
    if (document_ids.defined()) m.docs.push_back(mine.select(0, 1));
    const at::Tensor mine_host = all_host.select(0, r).narrow(2, 0, n);
    m.host.push_back(tiles::host_keys_of_host(mine_host.select(0, 0) != 0,
                                              document_ids.defined() ? mine_host.select(0, 1) : at::Tensor()));
  }
  return m;
}

// The softmax attention of this rank's query rows (global rows [q_begin, q_begin + nq))
// against one chunk of keys (global rows [k_begin, k_begin + nk) of every block 0..step),
// with the TTT mask: block 0 densely (j <= q - s), blocks i >= 1 as the one key per query
// at q - (s - i). With block0 false, the chain keys alone (TttAttention::kTiled computes
// block 0 by tiles). nullopt when the mask leaves nothing in this pair. Differentiable.
std::optional<AttentionPartial> pair_partial(const at::Tensor& q, const std::vector<at::Tensor>& ks,
                                             const std::vector<at::Tensor>& vs,
                                             const at::Tensor& valid_k, const at::Tensor& docs_q,
                                             const at::Tensor& docs_k, std::int64_t q_begin,
                                             std::int64_t k_begin, std::int64_t length,
                                             std::int64_t step, double scale, bool block0 = true) {
  const std::int64_t b = q.size(0), heads = q.size(1), nq = q.size(2), d = q.size(3);
  const std::int64_t kv_heads = ks[0].size(1), rep = heads / kv_heads, nk = ks[0].size(2);
  const bool docs = docs_q.defined();

  at::Tensor s0, m;
  // Block 0 is visible iff some key j of the chunk has j <= q - s for some query q.
  if (block0 && tiles::pair_reaches(q_begin, nq, k_begin, step)) {
    at::Tensor allowed = ttt_mask(length, step, q_begin, q_begin + nq, k_begin, k_begin + nk, q.device())
                             .unsqueeze(0) &
                         valid_k.unsqueeze(1);
    if (docs) allowed = allowed & (docs_q.unsqueeze(2) == docs_k.unsqueeze(1));
    const at::Tensor qg = q.reshape({b, kv_heads, rep * nq, d});
    // The mask as an additive bias (0 or -inf, per row, not per head) and the scale in one
    // pass over the scores, forward and backward: bias + scale * raw is bitwise the product
    // where allowed (a separate mul and masked_fill cost three passes forward, three back).
    const at::Tensor bias = at::zeros(allowed.sizes(), q.options().dtype(at::kFloat))
                                .masked_fill_(allowed.logical_not(), kNegInf)
                                .view({b, 1, 1, nq, nk});
    s0 = at::add(bias, at::matmul(qg, ks[0].transpose(-1, -2)).to(at::kFloat).view({b, kv_heads, rep, nq, nk}), scale);
    m = std::get<0>(s0.max(-1));
  }

  std::vector<at::Tensor> chain_scores, chain_values;
  at::Tensor q5;
  const auto long_opts = at::TensorOptions().dtype(at::kLong).device(q.device());
  for (std::int64_t i = 1; i <= step; ++i) {
    // Query row p (local) sees key row p + delta of this chunk, when there is one.
    const std::int64_t delta = (q_begin - k_begin) - (step - i);
    if (delta >= nk || delta + nq <= 0) continue;
    if (!q5.defined()) q5 = q.reshape({b, kv_heads, rep, nq, d}).to(at::kFloat);
    const at::Tensor p = at::arange(nq, long_opts);
    at::Tensor ok = ((p + delta >= 0) & (p + delta < nk)).unsqueeze(0) & rows_from(valid_k, delta, nq, 1);
    if (docs) ok = ok & (docs_q == rows_from(docs_k, delta, nq, 1));
    const at::Tensor k_i = rows_from(ks[i], delta, nq, 2).to(at::kFloat);
    at::Tensor sc = (q5 * k_i.unsqueeze(2)).sum(-1).mul(scale);
    sc = sc.masked_fill(ok.logical_not().unsqueeze(1).unsqueeze(1), kNegInf);
    m = m.defined() ? at::maximum(m, sc) : sc;
    chain_scores.push_back(sc);
    chain_values.push_back(rows_from(vs[i], delta, nq, 2));
  }
  if (!s0.defined() && chain_scores.empty()) return std::nullopt;

  const at::Tensor mx = safe_max(m);
  at::Tensor den, out;
  if (s0.defined()) {
    const at::Tensor e0 = at::exp(s0 - mx.unsqueeze(-1));
    den = e0.sum(-1);
    out = at::matmul(e0.view({b, kv_heads, rep * nq, nk}).to(vs[0].scalar_type()), vs[0])
              .to(at::kFloat)
              .view({b, kv_heads, rep, nq, d});
  } else {
    den = at::zeros_like(mx);
    out = at::zeros({b, kv_heads, rep, nq, d}, q.options().dtype(at::kFloat));
  }
  for (std::size_t c = 0; c < chain_scores.size(); ++c) {
    const at::Tensor e = at::exp(chain_scores[c] - mx);
    den = den + e;
    out = out + e.unsqueeze(-1) * chain_values[c].to(at::kFloat).unsqueeze(2);
  }
  const at::Tensor has_key = den > 0;
  const at::Tensor den_safe = at::where(has_key, den, at::ones_like(den));
  out = out / den_safe.unsqueeze(-1);
  const at::Tensor lse = at::where(has_key, mx + at::log(den_safe), at::full_like(den, kNegInf));
  return AttentionPartial{out.view({b, heads, nq, d}), lse.view({b, heads, nq})};
}

// Everything the ring needs besides the tensors, shared by forward and backward.
struct RingGeometry {
  dist::Group cp;
  RingOptions options;
  std::int64_t step = 0;
  std::int64_t length = 0;             // L
  std::vector<std::int64_t> begins;    // per rank: first global row
  std::vector<std::int64_t> sizes;     // per rank: rows
  double scale = 1.0;
  KeyMeta meta;
  at::Tensor docs_q;  // this rank's document ids, or undefined

  int rank() const { return cp.rank(); }
  int size() const { return cp.size(); }
  int next() const { return (rank() + 1) % size(); }
  int prev() const { return (rank() + size() - 1) % size(); }
  int src(int it) const { return (rank() - it + size()) % size(); }
  // Chunks after this rank's own hold only keys j > q - s and chain keys j > q: nothing.
  bool visible(int src) const { return src <= rank(); }
  std::int64_t rows(int r) const { return sizes[static_cast<std::size_t>(r)]; }
  std::int64_t n_max() const { return *std::max_element(sizes.begin(), sizes.end()); }
};

// A packed chunk: the k blocks then the v blocks of one rank, [2 (s+1), B, kv_heads, n_r, D].
at::Tensor empty_chunk(const at::Tensor& like, std::int64_t rows, c10::ScalarType dtype) {
  std::vector<std::int64_t> shape = like.sizes().vec();
  shape[3] = rows;
  return at::empty(shape, like.options().dtype(dtype));
}

std::vector<at::Tensor> unpack_blocks(const at::Tensor& packed, std::int64_t first, std::int64_t count) {
  std::vector<at::Tensor> out;
  for (std::int64_t i = 0; i < count; ++i) out.push_back(packed.select(0, first + i));
  return out;
}

// pair_partial in chunks of `rows` query rows when the key chunk reaches past the first
// chunk's queries (the diagonal pair): every key of every block a query row q sees has a
// global index <= q, so each query chunk needs only the keys below its last row + 1 (about
// half of a diagonal pair's scores are never computed). Rows are independent softmaxes, so
// the chunks' outputs and log-sum-exps are concatenated; a chunk that sees nothing gives 0
// and -inf, as merge_partials expects.
std::optional<AttentionPartial> pair_partial_chunked(const at::Tensor& q, const std::vector<at::Tensor>& ks,
                                                     const std::vector<at::Tensor>& vs,
                                                     const at::Tensor& valid_k, const at::Tensor& docs_q,
                                                     const at::Tensor& docs_k, std::int64_t q_begin,
                                                     std::int64_t k_begin, std::int64_t length,
                                                     std::int64_t step, double scale, std::int64_t rows) {
  const std::int64_t nq = q.size(2), nk = ks[0].size(2);
  if (rows <= 0) rows = ttt_query_chunk_rows(nq);
  if (rows >= nq || q_begin + rows - k_begin >= nk)
    return pair_partial(q, ks, vs, valid_k, docs_q, docs_k, q_begin, k_begin, length, step, scale);
  auto narrow_all = [](const std::vector<at::Tensor>& xs, std::int64_t n) {
    std::vector<at::Tensor> out;
    for (const auto& x : xs) out.push_back(x.narrow(2, 0, n));
    return out;
  };
  const auto float_opts = q.options().dtype(at::kFloat);
  std::vector<at::Tensor> outs, lses;
  bool any = false;
  for (std::int64_t q0 = 0; q0 < nq; q0 += rows) {
    const std::int64_t t = std::min(rows, nq - q0);
    const std::int64_t kn = std::clamp<std::int64_t>(q_begin + q0 + t - k_begin, 0, nk);
    std::optional<AttentionPartial> part;
    if (kn > 0) {
      part = pair_partial(q.narrow(2, q0, t), narrow_all(ks, kn), narrow_all(vs, kn), valid_k.narrow(1, 0, kn),
                          docs_q.defined() ? docs_q.narrow(1, q0, t) : at::Tensor(),
                          docs_k.defined() ? docs_k.narrow(1, 0, kn) : at::Tensor(), q_begin + q0, k_begin,
                          length, step, scale);
    }
    if (part) {
      any = true;
      outs.push_back(part->out);
      lses.push_back(part->lse);
    } else {
      outs.push_back(at::zeros({q.size(0), q.size(1), t, q.size(3)}, float_opts));
      lses.push_back(at::full({q.size(0), q.size(1), t}, kNegInf, float_opts));
    }
  }
  if (!any) return std::nullopt;
  return AttentionPartial{at::cat(outs, 2), at::cat(lses, 2)};
}

// The dense pair (TttAttention::kLocal): block 0 and the chain keys in one partial.
std::optional<AttentionPartial> dense_from_packed(const RingGeometry& g, const at::Tensor& q,
                                                  const at::Tensor& packed, int src) {
  const std::int64_t blocks = g.step + 1;
  const auto s = static_cast<std::size_t>(src);
  const at::Tensor docs_k = g.meta.docs.empty() ? at::Tensor() : g.meta.docs[s];
  return pair_partial_chunked(q, unpack_blocks(packed, 0, blocks), unpack_blocks(packed, blocks, blocks),
                              g.meta.valid[s], g.docs_q, docs_k, g.begins[static_cast<std::size_t>(g.rank())],
                              g.begins[s], g.length, g.step, g.scale, g.options.query_chunk_rows);
}

// The chain keys (blocks 1..s) of a pair alone, for TttAttention::kTiled: O(rows * s).
std::optional<AttentionPartial> chain_from_packed(const RingGeometry& g, const at::Tensor& q,
                                                  const at::Tensor& packed, int src) {
  if (g.step == 0) return std::nullopt;
  const std::int64_t blocks = g.step + 1;
  const auto s = static_cast<std::size_t>(src);
  const at::Tensor docs_k = g.meta.docs.empty() ? at::Tensor() : g.meta.docs[s];
  return pair_partial(q, unpack_blocks(packed, 0, blocks), unpack_blocks(packed, blocks, blocks), g.meta.valid[s],
                      g.docs_q, docs_k, g.begins[static_cast<std::size_t>(g.rank())], g.begins[s], g.length,
                      g.step, g.scale, /*block0=*/false);
}

// TttAttention::kTiled (trainer/attention/ttt_tiles.h): the step and tile sizes.
tiles::TileShape tile_shape(const RingGeometry& g) {
  const TttFlashTiles& t = g.options.tiles;
  return {g.step, t.query_rows > 0 ? t.query_rows : kTttFlashQueryRows,
          t.key_rows > 0 ? t.key_rows : kTttFlashKeyRows};
}

// This rank's queries in the tile layout, built once per forward or backward.
tiles::TileQueries tile_queries_of(const RingGeometry& g, const at::Tensor& q, std::int64_t kv_heads) {
  return tiles::tile_queries(q, kv_heads, g.scale, g.docs_q, g.begins[static_cast<std::size_t>(g.rank())]);
}

// Block 0 of src's chunk as tile keys, or nullopt when no query of this rank reaches it.
std::optional<tiles::TileKeys> tile_keys_of(const RingGeometry& g, const at::Tensor& packed, int src) {
  const auto s = static_cast<std::size_t>(src);
  if (!tiles::pair_reaches(g.begins[static_cast<std::size_t>(g.rank())], g.rows(g.rank()), g.begins[s], g.step))
    return std::nullopt;
  return tiles::tile_keys(packed.select(0, 0), packed.select(0, g.step + 1), g.meta.valid[s],
                          g.meta.docs.empty() ? at::Tensor() : g.meta.docs[s], g.begins[s], g.meta.host[s]);
}

// TttAttention::kFused: src's block 0 against this rank's queries, or nullopt when no query
// reaches it.
std::optional<fused::Pair> fused_pair_of(const RingGeometry& g, const at::Tensor& q, const at::Tensor& packed,
                                         int src) {
  const auto s = static_cast<std::size_t>(src);
  const std::int64_t qo = g.begins[static_cast<std::size_t>(g.rank())];
  if (!tiles::pair_reaches(qo, g.rows(g.rank()), g.begins[s], g.step)) return std::nullopt;
  const at::Tensor docs_k = g.meta.docs.empty() ? at::Tensor() : g.meta.docs[s];
  return fused::Pair{q,         packed.select(0, 0), packed.select(0, g.step + 1),
                     g.meta.valid[s], g.docs_q, docs_k, qo, g.begins[s],
                     g.meta.host[static_cast<std::size_t>(g.rank())], g.meta.host[s]};
}

// One pair's partial with the configured kernel (tq: defined for kTiled). Without autograd.
std::optional<AttentionPartial> pair_from_packed(const RingGeometry& g, const at::Tensor& q,
                                                 const tiles::TileQueries& tq, const at::Tensor& packed, int src) {
  if (g.options.pair_kernel == TttAttention::kLocal) return dense_from_packed(g, q, packed, src);
  std::optional<AttentionPartial> acc;
  if (g.options.pair_kernel == TttAttention::kFused) {
    if (const auto pair = fused_pair_of(g, q, packed, src)) {
      fused::Partial b0 = fused::block0_forward(*pair, g.step, g.scale);
      acc = AttentionPartial{std::move(b0.out), std::move(b0.lse)};
    }
  } else if (const auto keys = tile_keys_of(g, packed, src)) {
    const tiles::TilePartial b0 = tiles::tile_forward(tile_shape(g), tq, *keys);
    acc = AttentionPartial{tiles::tiles_to_heads(b0.out), tiles::tiles_to_heads(b0.lse)};
  }
  if (auto chain = chain_from_packed(g, q, packed, src))
    acc = acc ? merge_partials(*acc, *chain) : std::move(*chain);
  return acc;
}

void merge_into(std::optional<AttentionPartial>& acc, std::optional<AttentionPartial> part) {
  if (!part) return;
  acc = acc ? merge_partials(*acc, *part) : std::move(*part);
}

// Every rank's packed chunk, padded to the longest for all_gather: [C, 2 (s+1), B, kv, n_max, D].
at::Tensor gather_chunks(const RingGeometry& g, const at::Tensor& packed) {
  return g.cp.all_gather(rows_from(packed, 0, g.n_max(), 3).contiguous());
}

at::Tensor gathered_chunk(const RingGeometry& g, const at::Tensor& all, int src) {
  return all.select(0, src).narrow(3, 0, g.rows(src));
}

// Forward without autograd: out [B, heads, n, D] float32 and lse [B, heads, n].
AttentionPartial ring_forward(const RingGeometry& g, const at::Tensor& q, const at::Tensor& packed) {
  std::optional<AttentionPartial> acc;
  const tiles::TileQueries tq = g.options.pair_kernel == TttAttention::kTiled
                                    ? tile_queries_of(g, q, packed.size(2))
                                    : tiles::TileQueries{};
  if (g.options.exchange == KvExchange::kAllGather) {
    const at::Tensor all = gather_chunks(g, packed);
    for (int src = 0; src < g.size(); ++src)
      if (g.visible(src)) merge_into(acc, pair_from_packed(g, q, tq, gathered_chunk(g, all, src), src));
  } else {
    at::Tensor cur = packed;
    for (int it = 0; it < g.size(); ++it) {
      const int src = g.src(it);
      // The next chunk travels while this one is used.
      dist::Group::Pending ex;
      at::Tensor nxt;
      if (it + 1 < g.size()) {
        nxt = empty_chunk(packed, g.rows(g.src(it + 1)), packed.scalar_type());
        ex = g.cp.start_exchange(cur, g.next(), nxt, g.prev(), kTagKv);
      }
      if (g.visible(src)) merge_into(acc, pair_from_packed(g, q, tq, cur, src));
      ex.wait();
      cur = nxt;
    }
  }
  if (!acc) {
    const auto sizes = q.sizes();
    return {at::zeros(sizes, q.options().dtype(at::kFloat)),
            at::full({sizes[0], sizes[1], sizes[2]}, kNegInf, q.options().dtype(at::kFloat))};
  }
  return *acc;
}

// Recomputes one pair with autograd (kLocal: the whole pair; kTiled: its chain keys, block 0
// is TiledBackward's) and returns (dq, dpacked) of the final output's gradient through it.
// The final output is sum_p w_p out_p over disjoint partials p with w_p = exp(lse_p - lse),
// so d/d out_p = w_p dO and d/d lse_p = w_p <dO, out_p - out>.
std::pair<at::Tensor, at::Tensor> pair_backward(const RingGeometry& g, const at::Tensor& q,
                                                const at::Tensor& packed, int src,
                                                const at::Tensor& d_out, const at::Tensor& out,
                                                const at::Tensor& lse) {
  c10::AutoGradMode grad_on(true);
  const at::Tensor qq = q.detach().requires_grad_(true);
  const at::Tensor kv = packed.detach().requires_grad_(true);
  const auto part = g.options.pair_kernel == TttAttention::kLocal ? dense_from_packed(g, qq, kv, src)
                                                                     : chain_from_packed(g, qq, kv, src);
  if (!part) return {};
  const at::Tensor w = at::where(at::isinf(part->lse), at::zeros_like(lse), at::exp(part->lse.detach() - lse));
  const at::Tensor g_out = d_out * w.unsqueeze(-1);
  const at::Tensor g_lse = w * (d_out * (part->out.detach() - out)).sum(-1);
  const auto grads = torch::autograd::grad({part->out, part->lse}, {qq, kv}, {g_out, g_lse},
                                           /*retain_graph=*/false, /*create_graph=*/false,
                                           /*allow_unused=*/true);
  return {grads[0], grads[1]};
}

// The block-0 gradients of TttAttention::kTiled, pair by pair: the flash backward of
// trainer/attention/ttt_tiles.h against the final (merged) out and lse, which recomputes each tile
// (docs/context-parallel.md, "Pair kernels").
struct TiledBackward {
  tiles::TileShape shape;
  tiles::TileQueries tq;
  at::Tensor d_out, delta, lse;  // the tile layout
  at::Tensor dqs;                // d(q * scale), the tile layout

  TiledBackward(const RingGeometry& g, const at::Tensor& q, std::int64_t kv_heads, const at::Tensor& d_out_heads,
                const at::Tensor& out, const at::Tensor& lse_heads)
      : shape(tile_shape(g)),
        tq(tile_queries_of(g, q, kv_heads)),
        d_out(tiles::tiles_from_heads(d_out_heads, kv_heads)),
        delta(tiles::tiles_from_heads((d_out_heads * out).sum(-1), kv_heads)),
        lse(tiles::tiles_from_heads(lse_heads, kv_heads)),
        dqs(at::zeros_like(tq.qs)) {}

  // Adds src's block-0 key/value gradients to dpacked (its [2 (s+1), B, kv, n, D] float32 slot).
  void pair(const RingGeometry& g, const at::Tensor& packed, int src, const at::Tensor& dpacked) {
    const auto keys = tile_keys_of(g, packed, src);
    if (!keys) return;
    at::Tensor dk = dpacked.select(0, 0), dv = dpacked.select(0, g.step + 1);
    tiles::tile_backward(shape, tq, *keys, d_out, delta, lse, dqs, dk, dv);
  }

  // d q in [B, heads, n, D].
  at::Tensor dq(double scale) const { return tiles::tiles_to_heads(dqs).mul_(scale); }
};

// Autograd node of ring_ttt_attention: inputs q, k_0..k_s, v_0..v_s.
struct RingAttentionBackward : public Node {
  RingGeometry geom;
  at::Tensor q, packed;  // detached inputs (packed: stack of k blocks then v blocks)
  at::Tensor out, lse;   // float32 result of the forward
  c10::ScalarType q_dtype = at::kFloat, kv_dtype = at::kFloat;

  std::string name() const override { return "RingTttAttentionBackward"; }

  variable_list apply(variable_list&& grads) override {
    const RingGeometry& g = geom;
    const std::int64_t blocks = g.step + 1;
    at::Tensor d_out = grads[0].defined() ? grads[0].to(at::kFloat) : at::zeros_like(out);
    at::Tensor dq = at::zeros(q.sizes(), q.options().dtype(at::kFloat));
    at::Tensor dkv;
    std::optional<TiledBackward> tiled;
    if (g.options.pair_kernel == TttAttention::kTiled) tiled.emplace(g, q, packed.size(2), d_out, out, lse);
    // One visible pair: its block-0 tiles (kTiled) or fused kernels (kFused), and its
    // autograd-recomputed part.
    auto pair_grads = [&](const at::Tensor& chunk, int src, at::Tensor& into) {
      if (tiled) tiled->pair(g, chunk, src, into);
      if (g.options.pair_kernel == TttAttention::kFused) {
        if (const auto pair = fused_pair_of(g, q, chunk, src)) {
          at::Tensor dk = into.select(0, 0), dv = into.select(0, g.step + 1);
          fused::block0_backward(*pair, g.step, g.scale, d_out, out, lse, dq, dk, dv);
        }
      }
      const auto r = pair_backward(g, q, chunk, src, d_out, out, lse);
      if (r.first.defined()) dq.add_(r.first.to(at::kFloat));
      if (r.second.defined()) into.add_(r.second.to(at::kFloat));
    };
    if (g.options.exchange == KvExchange::kAllGather) {
      const at::Tensor all = gather_chunks(g, packed);
      at::Tensor dall = at::zeros(all.sizes(), all.options().dtype(at::kFloat));
      for (int src = 0; src < g.size(); ++src) {
        if (!g.visible(src)) continue;
        at::Tensor slot = dall.select(0, src).narrow(3, 0, g.rows(src));
        pair_grads(gathered_chunk(g, all, src), src, slot);
      }
      g.cp.all_reduce_sum(dall);
      dkv = dall.select(0, g.rank()).narrow(3, 0, g.rows(g.rank()));
    } else {
      // The gradient of a chunk travels with it and reaches its owner one hop after the
      // last use.
      at::Tensor cur = packed;
      dkv = at::zeros(packed.sizes(), packed.options().dtype(at::kFloat));
      for (int it = 0; it < g.size(); ++it) {
        const int src = g.src(it);
        dist::Group::Pending ex;
        at::Tensor nxt;
        if (it + 1 < g.size()) {
          nxt = empty_chunk(packed, g.rows(g.src(it + 1)), packed.scalar_type());
          ex = g.cp.start_exchange(cur, g.next(), nxt, g.prev(), kTagKv);
        }
        if (g.visible(src)) pair_grads(cur, src, dkv);
        ex.wait();
        // After the last iteration the incoming gradient is our own chunk's.
        at::Tensor dkv_in = empty_chunk(packed, g.rows(g.src(it + 1)), at::kFloat);
        g.cp.exchange(dkv, g.next(), dkv_in, g.prev(), kTagDkv);
        dkv = dkv_in;
        cur = nxt;
      }
    }
    if (tiled) dq.add_(tiled->dq(g.scale));
    variable_list result;
    result.push_back(dq.to(q_dtype));
    for (std::int64_t i = 0; i < 2 * blocks; ++i) result.push_back(dkv.select(0, i).to(kv_dtype));
    return result;
  }

  void release_variables() override {
    q.reset();
    packed.reset();
    out.reset();
    lse.reset();
    geom.meta = {};
    geom.docs_q.reset();
  }
};

void check_ring_inputs(const TttAttentionInputs& in) {
  const auto& [q, k_blocks, v_blocks, key_valid, step, scale, document_ids] = in;
  if (q.dim() != 4) throw UsageError("ring attention: q must be [B, heads, n, D]");
  if (step < 0 || static_cast<std::int64_t>(k_blocks.size()) != step + 1 ||
      v_blocks.size() != k_blocks.size())
    throw UsageError("ring attention: step " + std::to_string(step) + " needs " +
                     std::to_string(step + 1) + " key/value blocks, got " +
                     std::to_string(k_blocks.size()) + "/" + std::to_string(v_blocks.size()));
  for (std::size_t i = 0; i < k_blocks.size(); ++i) {
    for (const at::Tensor* t : {&k_blocks[i], &v_blocks[i]}) {
      if (t->dim() != 4 || t->size(0) != q.size(0) || t->size(2) != q.size(2) ||
          t->size(3) != q.size(3) || t->size(1) < 1 || q.size(1) % t->size(1) != 0 ||
          t->sizes() != k_blocks[0].sizes() || t->scalar_type() != k_blocks[0].scalar_type())
        throw UsageError("ring attention: key/value block shape " + c10::str(t->sizes()) +
                         " does not fit q " + c10::str(q.sizes()));
    }
  }
  const std::vector<std::int64_t> bn{q.size(0), q.size(2)};
  if (!key_valid.defined() || key_valid.sizes() != at::IntArrayRef(bn))
    throw UsageError("ring attention: key_valid must be [B, n] = " + c10::str(at::IntArrayRef(bn)));
  if (document_ids.defined() && document_ids.sizes() != at::IntArrayRef(bn))
    throw UsageError("ring attention: document_ids must be [B, n] = " + c10::str(at::IntArrayRef(bn)));
}

// ---------------------------------------------------------------------------------------
// Boundary rows

at::Tensor shift_raw(const dist::Group& cp, const at::Tensor& x, int shift) {
  const int c = cp.size(), r = cp.rank();
  const std::int64_t n = x.size(1);
  const bool is_bool = x.scalar_type() == at::kBool;
  const at::Tensor xs = is_bool ? x.to(at::kByte) : x;
  // shift +1: our last row goes to the next rank, the previous rank's last row comes in;
  // shift -1: the mirror image. The ring wraps, and the row that wrapped is zeroed.
  const at::Tensor edge = (shift > 0 ? xs.narrow(1, n - 1, 1) : xs.narrow(1, 0, 1)).contiguous();
  at::Tensor incoming = at::empty_like(edge);
  const int to = shift > 0 ? (r + 1) % c : (r + c - 1) % c;
  const int from = shift > 0 ? (r + c - 1) % c : (r + 1) % c;
  cp.exchange(edge, to, incoming, from, kTagShift);
  if ((shift > 0 && r == 0) || (shift < 0 && r == c - 1)) incoming.zero_();
  at::Tensor y = shift > 0 ? at::cat({incoming, xs.narrow(1, 0, n - 1)}, 1)
                           : at::cat({xs.narrow(1, 1, n - 1), incoming}, 1);
  return is_bool ? y.to(at::kBool) : y;
}

struct ShiftBackward : public Node {
  dist::Group cp;
  int shift = 0;
  std::string name() const override { return "CpShiftBackward"; }
  variable_list apply(variable_list&& grads) override {
    // The adjoint of a zero-filled shift is the opposite shift.
    return {shift_raw(cp, grads[0].contiguous(), -shift)};
  }
};

}  // namespace

// ---------------------------------------------------------------------------------------
// Public functions

SequenceChunk cp_chunk(std::int64_t length, int cp_size, int cp_rank) {
  if (cp_size < 1 || cp_rank < 0 || cp_rank >= cp_size)
    throw UsageError("cp rank " + std::to_string(cp_rank) + " of " + std::to_string(cp_size) +
                     " is not a rank");
  if (length < cp_size)
    throw UsageError("a sequence of " + std::to_string(length) + " rows cannot be split over " +
                     std::to_string(cp_size) + " context-parallel ranks");
  return {cp_rank * length / cp_size, (cp_rank + 1) * length / cp_size};
}

TttBatch shard_batch(const TttBatch& full, int cp_size, int cp_rank) {
  if (!full.input_ids.defined() || full.input_ids.dim() != 2)
    throw UsageError("shard_batch: input_ids must be [B, L]");
  const std::int64_t length = full.input_ids.size(1);
  const SequenceChunk c = cp_chunk(length, cp_size, cp_rank);
  auto cut = [&](const at::Tensor& t) -> at::Tensor {
    if (!t.defined()) return t;
    if (t.dim() < 2 || t.size(1) != length)
      throw UsageError("shard_batch: per-token tensor " + c10::str(t.sizes()) +
                       " does not have the batch's length " + std::to_string(length));
    return t.narrow(1, c.begin, c.size()).contiguous();
  };
  TttBatch b;
  b.input_ids = cut(full.input_ids);
  b.attention_mask = cut(full.attention_mask);
  b.loss_mask = cut(full.loss_mask);
  b.hidden_states = cut(full.hidden_states);
  b.aux_hidden_states = cut(full.aux_hidden_states);
  b.document_ids = cut(full.document_ids);
  b.position_ids = cut(full.position_ids);
  b.hidden_states_prenorm = cut(full.hidden_states_prenorm);
  b.target_probs = cut(full.target_probs);  // p[t] is local to t: no boundary row needed
  return b;
}

TttAttention ring_pair_kernel(TttAttention attention) {
  const bool fused = attention == TttAttention::kFused || (attention == TttAttention::kAuto && ttt_fused_available());
  return fused ? TttAttention::kFused : TttAttention::kTiled;
}

at::Tensor ring_ttt_attention(const dist::Group& cp, std::int64_t length, const TttAttentionInputs& in,
                              const RingOptions& options) {
  check_ring_inputs(in);
  const auto& [q, k_blocks, v_blocks, key_valid, step, scale, document_ids] = in;
  RingGeometry g;
  g.cp = cp;
  g.options = options;
  if (options.pair_kernel == TttAttention::kAuto) g.options.pair_kernel = ring_pair_kernel(TttAttention::kAuto);
  g.step = step;
  g.length = length;
  g.scale = scale;
  for (int r = 0; r < cp.size(); ++r) {
    const SequenceChunk c = cp_chunk(length, cp.size(), r);
    g.begins.push_back(c.begin);
    g.sizes.push_back(c.size());
  }
  if (q.size(2) != g.rows(cp.rank()))
    throw UsageError("ring attention: rank " + std::to_string(cp.rank()) + " holds " +
                     std::to_string(q.size(2)) + " rows, but its chunk of " + std::to_string(length) +
                     " rows has " + std::to_string(g.rows(cp.rank())));
  g.meta = gather_key_meta(cp, g.sizes, key_valid.to(q.device()), document_ids);
  if (document_ids.defined()) g.docs_q = document_ids.to(q.device(), at::kLong);

  std::vector<at::Tensor> inputs{q};
  inputs.insert(inputs.end(), k_blocks.begin(), k_blocks.end());
  inputs.insert(inputs.end(), v_blocks.begin(), v_blocks.end());
  bool needs_grad = false;
  if (c10::GradMode::is_enabled())
    for (const auto& t : inputs) needs_grad = needs_grad || t.requires_grad();

  at::Tensor packed;
  AttentionPartial res;
  {
    c10::NoGradGuard no_grad;
    std::vector<at::Tensor> blocks;
    for (auto it = inputs.begin() + 1; it != inputs.end(); ++it) blocks.push_back(it->detach());
    packed = at::stack(blocks).contiguous();
    res = ring_forward(g, q.detach(), packed);
  }
  // A fresh tensor even when q is float32, so that the history set below never reaches
  // the saved copy.
  at::Tensor out = res.out.to(q.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
  if (needs_grad) {
    auto node = make_node<RingAttentionBackward>();
    node->geom = std::move(g);
    node->q = q.detach();
    node->packed = packed;
    node->out = res.out;
    node->lse = res.lse;
    node->q_dtype = q.scalar_type();
    node->kv_dtype = k_blocks[0].scalar_type();
    node->set_next_edges(torch::autograd::collect_next_edges(inputs));
    torch::autograd::set_history(out, node);
  }
  return out;
}

at::Tensor cp_shift(const dist::Group& cp, const at::Tensor& x, int shift) {
  if (shift != 1 && shift != -1) throw UsageError("cp_shift: shift must be +1 or -1");
  if (x.dim() < 2 || x.size(1) < 1) throw UsageError("cp_shift: x must be [B, n, ...] with n >= 1");
  at::Tensor y;
  {
    c10::NoGradGuard no_grad;
    y = shift_raw(cp, x.detach().contiguous(), shift);
  }
  if (torch::autograd::compute_requires_grad(x)) {
    auto node = make_node<ShiftBackward>();
    node->cp = cp;
    node->shift = shift;
    node->set_next_edges(torch::autograd::collect_next_edges(x));
    torch::autograd::set_history(y, node);
  }
  return y;
}

// ---------------------------------------------------------------------------------------
// RingContext

RingContext::RingContext(dist::Group cp, dist::Group normalizer, RingOptions options)
    : cp_(std::move(cp)), normalizer_(std::move(normalizer)), options_(options) {}

RingContext::RingContext(const dist::Mesh& mesh, RingOptions options)
    : RingContext(mesh.cp(), mesh.world(), options) {}

void RingContext::set_global_length(std::int64_t length) {
  cp_chunk(length, cp_.size(), cp_.rank());  // validates
  length_ = length;
}

std::int64_t RingContext::chunk_rows(std::int64_t local_length) const {
  if (length_ < 0)
    throw UsageError("RingContext: set_global_length() must be called before the forward pass");
  const SequenceChunk c = cp_chunk(length_, cp_.size(), cp_.rank());
  if (local_length != c.size())
    throw UsageError("RingContext: this rank holds " + std::to_string(local_length) +
                     " rows, but its chunk of a " + std::to_string(length_) + "-row sequence has " +
                     std::to_string(c.size()));
  return c.size();
}

std::int64_t RingContext::global_offset() const {
  if (cp_.size() == 1) return 0;
  if (length_ < 0)
    throw UsageError("RingContext: set_global_length() must be called before the forward pass");
  return cp_chunk(length_, cp_.size(), cp_.rank()).begin;
}

std::int64_t RingContext::global_length(std::int64_t local_length) const {
  if (cp_.size() == 1) return local_length;
  chunk_rows(local_length);
  return length_;
}

at::Tensor RingContext::shift_right(const at::Tensor& x) {
  if (cp_.size() == 1) return local_.shift_right(x);
  chunk_rows(x.size(1));
  return cp_shift(cp_, x, +1);
}

at::Tensor RingContext::shift_left(const at::Tensor& x) {
  if (cp_.size() == 1) return local_.shift_left(x);
  chunk_rows(x.size(1));
  return cp_shift(cp_, x, -1);
}

at::Tensor RingContext::attention(const TttAttentionInputs& in) {
  if (cp_.size() == 1) return local_.attention(in);
  chunk_rows(in.q.size(2));
  return ring_ttt_attention(cp_, length_, in, options_);
}

at::Tensor RingContext::sum_across(const at::Tensor& x) {
  at::Tensor y = x.detach().clone().contiguous();
  normalizer_.all_reduce_sum(y);
  return y;
}

}  // namespace eaglekit::trainer
