#include "trainer/attention/ttt_tiles.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <string>

#include "formats/error.h"

namespace eaglekit::trainer::tiles {

namespace {

const double kLowest = std::numeric_limits<float>::lowest();

std::int64_t invalid_in(const TileKeys& k, std::int64_t k0, std::int64_t n) {
  const std::vector<std::int64_t>& prefix = k.host->invalid_prefix;
  return prefix[static_cast<std::size_t>(k0 + n)] - prefix[static_cast<std::size_t>(k0)];
}

// The additive mask (0 or -inf) of block-0 scores of local query rows [q0, q0 + t) against
// local key rows [k0, k0 + n), broadcastable to the tile's scores viewed as
// [B, kv_heads, t, rep, n]; undefined when every pair of the tile is allowed (below the
// shifted diagonal, all keys valid, one document).
at::Tensor tile_bias(const TileShape& shape, const TileQueries& q, const TileKeys& k, std::int64_t q0,
                     std::int64_t t, std::int64_t k0, std::int64_t n) {
  const std::int64_t gq0 = q.offset + q0, gk0 = k.offset + k0;  // global positions
  const bool causal = gk0 + n - 1 > gq0 - shape.step;  // some key j > q - s for the tile's first query
  const bool invalid = invalid_in(k, k0, n) > 0;
  if (!causal && !invalid && !q.docs.defined()) return {};
  at::Tensor allowed;  // [1 or B, 1 or t, n]
  auto both = [&](const at::Tensor& a) { allowed = allowed.defined() ? allowed & a : a; };
  if (causal) {
    const auto opts = k.valid.options().dtype(at::kLong);
    both((at::arange(gk0, gk0 + n, opts).unsqueeze(0) <=
          at::arange(gq0 - shape.step, gq0 - shape.step + t, opts).unsqueeze(1))
             .unsqueeze(0));
  }
  if (invalid) both(k.valid.narrow(1, k0, n).unsqueeze(1));
  if (q.docs.defined()) both(q.docs.narrow(1, q0, t).unsqueeze(2) == k.docs.narrow(1, k0, n).unsqueeze(1));
  return at::zeros(allowed.sizes(), q.qs.options())
      .masked_fill_(allowed.logical_not(), kNegInf)
      .view({allowed.size(0), 1, allowed.size(1), 1, n});
}

// Calls f(q0, t, k0, n, first_key) for every tile pair that holds an allowed score: query
// tile [q0, q0 + t) against the key tiles of the keys j <= q - s of its last query (tiles
// past the shifted diagonal are never visited) that hold a valid key. first_key is true for
// the first visited key tile of a query tile.
template <typename F>
void for_each_tile(const TileShape& shape, const TileQueries& q, const TileKeys& k, F&& f) {
  const std::int64_t nq = q.rows(), nk = k.rows(), b = k.valid.size(0);
  for (std::int64_t q0 = 0; q0 < nq; q0 += shape.query_rows) {
    const std::int64_t t = std::min(shape.query_rows, nq - q0);
    // Local key rows j with k.offset + j <= q.offset + q0 + t - 1 - s.
    const std::int64_t kn = std::clamp<std::int64_t>(q.offset + q0 + t - shape.step - k.offset, 0, nk);
    bool first_key = true;
    for (std::int64_t k0 = 0; k0 < kn; k0 += shape.key_rows) {
      const std::int64_t n = std::min(shape.key_rows, kn - k0);
      if (invalid_in(k, k0, n) == b * n) continue;  // no valid key in this tile
      f(q0, t, k0, n, first_key);
      first_key = false;
    }
  }
}

// The view [B, kv_heads, t * rep, ...] of local rows [q0, q0 + t) of x [B, kv_heads, n, rep, ...].
at::Tensor rows_of(const at::Tensor& x, std::int64_t q0, std::int64_t t) {
  std::vector<std::int64_t> shape{x.size(0), x.size(1), t * x.size(3)};
  for (std::int64_t i = 4; i < x.dim(); ++i) shape.push_back(x.size(i));
  return x.narrow(2, q0, t).view(shape);
}

// Raw scores of one tile pair with the mask applied: [B, kv_heads, t * rep, n].
at::Tensor tile_scores(const TileShape& shape, const TileQueries& q, const TileKeys& k, const at::Tensor& q_tile,
                       std::int64_t q0, std::int64_t t, std::int64_t k0, std::int64_t n) {
  at::Tensor s = at::matmul(q_tile, k.k.narrow(2, k0, n).transpose(-1, -2));
  const at::Tensor bias = tile_bias(shape, q, k, q0, t, k0, n);
  if (bias.defined()) s.view({s.size(0), s.size(1), t, q.qs.size(3), n}).add_(bias);
  return s;
}

}  // namespace

at::Tensor finite_or_lowest(const at::Tensor& m) { return at::clamp_min(m, kLowest); }

at::Tensor shift_down(const at::Tensor& x, std::int64_t shift, std::int64_t dim) {
  const std::int64_t n = x.size(dim);
  if (shift == 0) return x;
  if (shift >= n) return at::zeros_like(x);
  return at::cat({at::zeros_like(x.narrow(dim, 0, shift)), x.narrow(dim, 0, n - shift)}, dim);
}

at::Tensor shift_up(const at::Tensor& x, std::int64_t shift, std::int64_t dim) {
  const std::int64_t n = x.size(dim);
  if (shift == 0) return x;
  if (shift >= n) return at::zeros_like(x);
  return at::cat({x.narrow(dim, shift, n - shift), at::zeros_like(x.narrow(dim, 0, shift))}, dim);
}

void check_attention_args(const char* who, const TttAttentionInputs& in) {
  const auto& [q, k_blocks, v_blocks, key_valid, step, scale, document_ids] = in;
  if (q.dim() != 4) throw UsageError(std::string(who) + ": q must be [B, heads, L, D]");
  if (step < 0 || static_cast<std::int64_t>(k_blocks.size()) != step + 1 || v_blocks.size() != k_blocks.size())
    throw UsageError(std::string(who) + ": step " + std::to_string(step) + " needs " + std::to_string(step + 1) +
                     " key/value blocks, got " + std::to_string(k_blocks.size()) + "/" +
                     std::to_string(v_blocks.size()));
  for (std::size_t i = 0; i < k_blocks.size(); ++i) {
    for (const at::Tensor* t : {&k_blocks[i], &v_blocks[i]}) {
      if (t->dim() != 4 || t->size(0) != q.size(0) || t->size(2) != q.size(2) || t->size(3) != q.size(3) ||
          t->size(1) < 1 || q.size(1) % t->size(1) != 0 || t->size(1) != k_blocks[0].size(1))
        throw UsageError(std::string(who) + ": key/value block shape " + c10::str(t->sizes()) +
                         " does not fit q " + c10::str(q.sizes()));
    }
  }
  const std::vector<std::int64_t> bl{q.size(0), q.size(2)};
  if (!key_valid.defined() || key_valid.sizes() != at::IntArrayRef(bl))
    throw UsageError(std::string(who) + ": key_valid must be [B, L] = " + c10::str(at::IntArrayRef(bl)));
  if (document_ids.defined() && document_ids.sizes() != at::IntArrayRef(bl))
    throw UsageError(std::string(who) + ": document_ids must be [B, L] = " + c10::str(at::IntArrayRef(bl)));
}

TileQueries tile_queries(const at::Tensor& q, std::int64_t kv_heads, double scale, const at::Tensor& docs,
                         std::int64_t offset) {
  const std::int64_t b = q.size(0), heads = q.size(1), n = q.size(2), d = q.size(3);
  TileQueries t;
  t.qs = q.to(at::kFloat).mul(scale).view({b, kv_heads, heads / kv_heads, n, d}).permute({0, 1, 3, 2, 4}).contiguous();
  if (docs.defined()) t.docs = docs.to(at::kLong);
  t.offset = offset;
  return t;
}

namespace {
std::atomic<std::int64_t> g_host_keys_reads{0};
}  // namespace

std::shared_ptr<const HostKeys> host_keys(const at::Tensor& valid, const at::Tensor& docs) {
  g_host_keys_reads.fetch_add(1, std::memory_order_relaxed);
  if (valid.device().is_cpu()) return host_keys_of_host(valid, docs);
  // One copy for both: [1 or 2, B, n] int64.
  at::Tensor both = valid.to(at::kLong).unsqueeze(0);
  if (docs.defined()) both = at::cat({both, docs.to(valid.device(), at::kLong).unsqueeze(0)}, 0);
  both = both.to(at::kCPU);
  return host_keys_of_host(both.select(0, 0).ne(0), docs.defined() ? both.select(0, 1) : at::Tensor());
}

std::shared_ptr<const HostKeys> host_keys_of_host(const at::Tensor& valid, const at::Tensor& docs) {
  auto h = std::make_shared<HostKeys>();
  h->valid = valid.to(at::kCPU, at::kBool).contiguous();
  if (docs.defined()) h->docs = docs.to(at::kCPU, at::kLong).contiguous();
  const std::int64_t b = h->valid.size(0), n = h->valid.size(1);
  const bool* v = h->valid.data_ptr<bool>();
  h->invalid_prefix.assign(static_cast<std::size_t>(n + 1), 0);
  for (std::int64_t j = 0; j < n; ++j) {
    std::int64_t invalid = 0;
    for (std::int64_t r = 0; r < b; ++r) invalid += v[r * n + j] ? 0 : 1;
    h->invalid_prefix[static_cast<std::size_t>(j + 1)] = h->invalid_prefix[static_cast<std::size_t>(j)] + invalid;
  }
  return h;
}

std::int64_t host_keys_reads() { return g_host_keys_reads.load(std::memory_order_relaxed); }

TileKeys tile_keys(const at::Tensor& k, const at::Tensor& v, const at::Tensor& valid, const at::Tensor& docs,
                   std::int64_t offset, std::shared_ptr<const HostKeys> host) {
  TileKeys t;
  t.k = k.to(at::kFloat).contiguous();
  t.v = v.to(at::kFloat).contiguous();
  t.valid = valid.to(at::kBool);
  if (docs.defined()) t.docs = docs.to(at::kLong);
  t.offset = offset;
  t.host = host ? std::move(host) : host_keys(t.valid, t.docs);
  return t;
}

bool pair_reaches(std::int64_t qo, std::int64_t nq, std::int64_t ko, std::int64_t step) {
  return ko <= qo + nq - 1 - step;
}

TilePartial tile_forward(const TileShape& shape, const TileQueries& q, const TileKeys& k) {
  const auto sizes = q.qs.sizes();
  TilePartial r{at::zeros(sizes, q.qs.options()),
                at::full({sizes[0], sizes[1], sizes[2], sizes[3]}, kNegInf, q.qs.options())};

  // One query tile at a time: running max m, running sum and the unnormalised output,
  // rescaled by exp(m_old - m_new) whenever a key tile raises the max.
  at::Tensor q_tile, m, sum, acc;
  auto finish_query_tile = [&](std::int64_t q0, std::int64_t t) {
    if (!m.defined()) return;
    const at::Tensor has = sum > 0;
    rows_of(r.out, q0, t).copy_(acc / at::where(has, sum, at::ones_like(sum)).unsqueeze(-1));
    rows_of(r.lse, q0, t).copy_(at::where(has, finite_or_lowest(m) + at::log(sum), at::full_like(sum, kNegInf)));
    m = at::Tensor();
  };
  std::int64_t open_q0 = -1, open_t = 0;
  for_each_tile(shape, q, k, [&](std::int64_t q0, std::int64_t t, std::int64_t k0, std::int64_t n, bool first_key) {
    if (first_key) {
      finish_query_tile(open_q0, open_t);
      open_q0 = q0;
      open_t = t;
      q_tile = rows_of(q.qs, q0, t);
    }
    at::Tensor s = tile_scores(shape, q, k, q_tile, q0, t, k0, n);
    const at::Tensor tile_max = at::amax(s, -1);
    const at::Tensor m_new = m.defined() ? at::maximum(m, tile_max) : tile_max;
    const at::Tensor shift = finite_or_lowest(m_new);
    s.sub_(shift.unsqueeze(-1)).exp_();  // the tile's probabilities, unnormalised
    const at::Tensor pv = at::matmul(s, k.v.narrow(2, k0, n));
    if (!m.defined()) {
      sum = s.sum(-1);
      acc = pv;
    } else {
      const at::Tensor alpha = (m - shift).exp_();
      sum.mul_(alpha).add_(s.sum(-1));
      acc.mul_(alpha.unsqueeze(-1)).add_(pv);
    }
    m = m_new;
  });
  finish_query_tile(open_q0, open_t);
  return r;
}

void tile_backward(const TileShape& shape, const TileQueries& q, const TileKeys& k, const at::Tensor& d_out,
                   const at::Tensor& delta, const at::Tensor& lse, at::Tensor& dqs, at::Tensor& dk, at::Tensor& dv) {
  const at::Tensor lse0 = finite_or_lowest(lse);  // rows without keys: every score is -inf anyway
  at::Tensor q_tile, do_tile, lse_tile, delta_tile, dq_tile;
  for_each_tile(shape, q, k, [&](std::int64_t q0, std::int64_t t, std::int64_t k0, std::int64_t n, bool first_key) {
    if (first_key) {
      q_tile = rows_of(q.qs, q0, t);
      do_tile = rows_of(d_out, q0, t);
      lse_tile = rows_of(lse0, q0, t).unsqueeze(-1);
      delta_tile = rows_of(delta, q0, t).unsqueeze(-1);
      dq_tile = rows_of(dqs, q0, t);
    }
    const at::Tensor kt = k.k.narrow(2, k0, n), vt = k.v.narrow(2, k0, n);
    at::Tensor prob = tile_scores(shape, q, k, q_tile, q0, t, k0, n);
    prob.sub_(lse_tile).exp_();
    dv.narrow(2, k0, n).add_(at::matmul(prob.transpose(-1, -2), do_tile));
    at::Tensor ds = at::matmul(do_tile, vt.transpose(-1, -2));
    ds.sub_(delta_tile).mul_(prob);
    dq_tile.add_(at::matmul(ds, kt));
    dk.narrow(2, k0, n).add_(at::matmul(ds.transpose(-1, -2), q_tile));
  });
}

at::Tensor tiles_from_heads(const at::Tensor& x, std::int64_t kv_heads) {
  const std::int64_t b = x.size(0), heads = x.size(1), n = x.size(2);
  if (x.dim() == 4)
    return x.reshape({b, kv_heads, heads / kv_heads, n, x.size(3)}).permute({0, 1, 3, 2, 4}).contiguous();
  return x.reshape({b, kv_heads, heads / kv_heads, n}).permute({0, 1, 3, 2}).contiguous();
}

at::Tensor tiles_to_heads(const at::Tensor& x) {
  const std::int64_t b = x.size(0), kv = x.size(1), n = x.size(2), rep = x.size(3);
  if (x.dim() == 5) return x.permute({0, 1, 3, 2, 4}).reshape({b, kv * rep, n, x.size(4)});
  return x.permute({0, 1, 3, 2}).reshape({b, kv * rep, n});
}

}  // namespace eaglekit::trainer::tiles
