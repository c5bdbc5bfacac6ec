#include "trainer/ttt_flash.h"

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <limits>
#include <string>

#include "formats/error.h"

namespace eaglekit::trainer {

namespace {

const double kNegInf = -std::numeric_limits<double>::infinity();
const double kLowest = std::numeric_limits<float>::lowest();

// Layout. Query heads sharing a kv head are consecutive (h = kv * rep + r), and a query tile
// is the rows [q0, q0 + t) of all rep heads of a kv head: q is held as [B, kv_heads, L, rep, D]
// so that a tile is a view [B, kv_heads, t * rep, D] (row = position * rep + r) and its
// scores against a key tile come from one batched matmul over (B, kv_heads), without copying
// keys per head. Row statistics (max, sum, log-sum-exp) are [B, kv_heads, L, rep].
struct Geometry {
  std::int64_t b = 0, heads = 0, kv_heads = 0, rep = 0, l = 0, d = 0;
  std::int64_t step = 0;
  std::int64_t query_rows = 0, key_rows = 0;
  double scale = 1.0;
};

// The inputs in the kernel's layout, float32; rebuilt in backward from the saved inputs.
struct Prepared {
  at::Tensor qs;                     // q * scale, [B, kv_heads, L, rep, D]
  at::Tensor k0, v0;                 // block 0, [B, kv_heads, L, D]
  std::vector<at::Tensor> k_chain;   // block i = c + 1 shifted down by s - i rows: row q holds
  std::vector<at::Tensor> v_chain;   //   the key of position q - (s - i), [B, kv_heads, L, D]
  std::vector<at::Tensor> chain_ok;  // whether query q may see that key, [B, L] bool
  at::Tensor valid;                  // key_valid, [B, L] bool
  at::Tensor docs;                   // document_ids [B, L] int64, or undefined
  // invalid_prefix[j]: the number of (row, position < j) pairs whose key is not valid, so a
  // key range is entirely valid (no mask needed) or entirely invalid (skipped) at a glance.
  std::vector<std::int64_t> invalid_prefix;
};

// Rows moved towards higher positions by `shift` along dim; the first `shift` rows are zero.
at::Tensor shift_down(const at::Tensor& x, std::int64_t shift, std::int64_t dim) {
  const std::int64_t n = x.size(dim);
  if (shift == 0) return x;
  if (shift >= n) return at::zeros_like(x);
  return at::cat({at::zeros_like(x.narrow(dim, 0, shift)), x.narrow(dim, 0, n - shift)}, dim);
}

// The adjoint of shift_down: rows moved towards lower positions, the last `shift` rows zero.
at::Tensor shift_up(const at::Tensor& x, std::int64_t shift, std::int64_t dim) {
  const std::int64_t n = x.size(dim);
  if (shift == 0) return x;
  if (shift >= n) return at::zeros_like(x);
  return at::cat({x.narrow(dim, shift, n - shift), at::zeros_like(x.narrow(dim, 0, shift))}, dim);
}

// -inf (a row that has seen no allowed key) replaced by the lowest finite float, so that
// subtracting it is safe: the row's scores are all -inf and stay -inf (exp gives 0).
at::Tensor finite_or_lowest(const at::Tensor& m) { return at::clamp_min(m, kLowest); }

Prepared prepare(const Geometry& g, const at::Tensor& q, at::TensorList ks, at::TensorList vs,
                 const at::Tensor& key_valid, const at::Tensor& document_ids) {
  Prepared p;
  p.qs = q.to(at::kFloat).mul(g.scale).view({g.b, g.kv_heads, g.rep, g.l, g.d}).permute({0, 1, 3, 2, 4}).contiguous();
  p.k0 = ks[0].to(at::kFloat).contiguous();
  p.v0 = vs[0].to(at::kFloat).contiguous();
  p.valid = key_valid.to(at::kBool);
  if (document_ids.defined()) p.docs = document_ids.to(at::kLong);
  const at::Tensor positions = at::arange(g.l, q.options().dtype(at::kLong));
  for (std::int64_t i = 1; i <= g.step; ++i) {
    const std::int64_t shift = g.step - i;
    p.k_chain.push_back(shift_down(ks[i].to(at::kFloat), shift, 2));
    p.v_chain.push_back(shift_down(vs[i].to(at::kFloat), shift, 2));
    at::Tensor ok = (positions >= shift).unsqueeze(0) & shift_down(p.valid, shift, 1);
    if (p.docs.defined()) ok = ok & (p.docs == shift_down(p.docs, shift, 1));
    p.chain_ok.push_back(ok);
  }
  const at::Tensor counts = p.valid.logical_not().sum(0).cumsum(0).to(at::kCPU, at::kLong).contiguous();
  p.invalid_prefix.assign(static_cast<std::size_t>(g.l + 1), 0);
  std::copy(counts.data_ptr<std::int64_t>(), counts.data_ptr<std::int64_t>() + g.l, p.invalid_prefix.begin() + 1);
  return p;
}

std::int64_t invalid_in(const Prepared& p, std::int64_t k0, std::int64_t n) {
  return p.invalid_prefix[static_cast<std::size_t>(k0 + n)] - p.invalid_prefix[static_cast<std::size_t>(k0)];
}

// The additive mask (0 or -inf) of block-0 scores of query positions [q0, q0 + t) against key
// positions [k0, k0 + n), broadcastable to the tile's scores viewed as [B, kv_heads, t, rep, n];
// undefined when every pair of the tile is allowed (below the shifted diagonal, all keys
// valid, one document).
at::Tensor tile_bias(const Geometry& g, const Prepared& p, std::int64_t q0, std::int64_t t, std::int64_t k0,
                     std::int64_t n) {
  const bool causal = k0 + n - 1 > q0 - g.step;  // some key j > q - s for the tile's first query
  const bool invalid = invalid_in(p, k0, n) > 0;
  if (!causal && !invalid && !p.docs.defined()) return {};
  at::Tensor allowed;  // [1 or B, 1 or t, n]
  auto both = [&](const at::Tensor& a) { allowed = allowed.defined() ? allowed & a : a; };
  if (causal) {
    const auto opts = p.valid.options().dtype(at::kLong);
    both((at::arange(k0, k0 + n, opts).unsqueeze(0) <= at::arange(q0 - g.step, q0 - g.step + t, opts).unsqueeze(1))
             .unsqueeze(0));
  }
  if (invalid) both(p.valid.narrow(1, k0, n).unsqueeze(1));
  if (p.docs.defined()) both(p.docs.narrow(1, q0, t).unsqueeze(2) == p.docs.narrow(1, k0, n).unsqueeze(1));
  return at::zeros(allowed.sizes(), p.qs.options())
      .masked_fill_(allowed.logical_not(), kNegInf)
      .view({allowed.size(0), 1, allowed.size(1), 1, n});
}

// Calls f(q0, t, k0, n) for every tile pair of block 0 that holds an allowed score: query tile
// [q0, q0 + t) against the key tiles of [0, q0 + t - s) (keys j <= q - s; tiles past the
// shifted diagonal are never visited) that hold a valid key. first_key is true for the first
// visited key tile of a query tile.
template <typename F>
void for_each_tile(const Geometry& g, const Prepared& p, F&& f) {
  for (std::int64_t q0 = 0; q0 < g.l; q0 += g.query_rows) {
    const std::int64_t t = std::min(g.query_rows, g.l - q0);
    const std::int64_t kn = std::clamp<std::int64_t>(q0 + t - g.step, 0, g.l);
    bool first_key = true;
    for (std::int64_t k0 = 0; k0 < kn; k0 += g.key_rows) {
      const std::int64_t n = std::min(g.key_rows, kn - k0);
      if (invalid_in(p, k0, n) == g.b * n) continue;  // no valid key in this tile
      f(q0, t, k0, n, first_key);
      first_key = false;
    }
  }
}

// Raw scores of one tile pair with the mask applied: [B, kv_heads, t * rep, n].
at::Tensor tile_scores(const Geometry& g, const Prepared& p, const at::Tensor& q_tile, std::int64_t q0,
                       std::int64_t t, std::int64_t k0, std::int64_t n) {
  at::Tensor s = at::matmul(q_tile, p.k0.narrow(2, k0, n).transpose(-1, -2));
  const at::Tensor bias = tile_bias(g, p, q0, t, k0, n);
  if (bias.defined()) s.view({g.b, g.kv_heads, t, g.rep, n}).add_(bias);
  return s;
}

at::Tensor rows_of(const Geometry& g, const at::Tensor& x, std::int64_t q0, std::int64_t t) {
  // [B, kv_heads, L, rep, ...] -> the view [B, kv_heads, t * rep, ...] of positions [q0, q0 + t).
  std::vector<std::int64_t> shape{g.b, g.kv_heads, t * g.rep};
  for (std::int64_t i = 4; i < x.dim(); ++i) shape.push_back(x.size(i));
  return x.narrow(2, q0, t).view(shape);
}

// Chain scores [B, kv_heads, L, rep, s] (scaled; -inf where the chain key is not visible).
at::Tensor chain_scores(const Geometry& g, const Prepared& p) {
  std::vector<at::Tensor> cs;
  for (std::size_t c = 0; c < p.k_chain.size(); ++c) {
    at::Tensor sc = (p.qs * p.k_chain[c].unsqueeze(3)).sum(-1);
    cs.push_back(sc.masked_fill_(p.chain_ok[c].logical_not().view({g.b, 1, g.l, 1}), kNegInf));
  }
  return at::stack(cs, -1);
}

struct Result {
  at::Tensor out;  // [B, kv_heads, L, rep, D]
  at::Tensor lse;  // [B, kv_heads, L, rep]; -inf for rows with no visible key
};

Result forward_raw(const Geometry& g, const Prepared& p) {
  const auto fopts = p.qs.options();
  Result r{at::zeros({g.b, g.kv_heads, g.l, g.rep, g.d}, fopts),
           at::full({g.b, g.kv_heads, g.l, g.rep}, kNegInf, fopts)};

  // Block 0, one query tile at a time: running max m, running sum and the unnormalised output,
  // rescaled by exp(m_old - m_new) whenever a key tile raises the max.
  at::Tensor q_tile, m, sum, acc;
  auto finish_query_tile = [&](std::int64_t q0, std::int64_t t) {
    if (!m.defined()) return;
    const at::Tensor has = sum > 0;
    rows_of(g, r.out, q0, t).copy_(acc / at::where(has, sum, at::ones_like(sum)).unsqueeze(-1));
    rows_of(g, r.lse, q0, t).copy_(at::where(has, finite_or_lowest(m) + at::log(sum), at::full_like(sum, kNegInf)));
    m = at::Tensor();
  };
  std::int64_t open_q0 = -1, open_t = 0;
  for_each_tile(g, p, [&](std::int64_t q0, std::int64_t t, std::int64_t k0, std::int64_t n, bool first_key) {
    if (first_key) {
      finish_query_tile(open_q0, open_t);
      open_q0 = q0;
      open_t = t;
      q_tile = rows_of(g, p.qs, q0, t);
    }
    at::Tensor s = tile_scores(g, p, q_tile, q0, t, k0, n);
    const at::Tensor tile_max = at::amax(s, -1);
    const at::Tensor m_new = m.defined() ? at::maximum(m, tile_max) : tile_max;
    const at::Tensor shift = finite_or_lowest(m_new);
    s.sub_(shift.unsqueeze(-1)).exp_();  // the tile's probabilities, unnormalised
    const at::Tensor pv = at::matmul(s, p.v0.narrow(2, k0, n));
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
  if (g.step == 0) return r;

  // The chain keys, one per query and block, merged with block 0 by log-sum-exp.
  const at::Tensor c = chain_scores(g, p);
  const at::Tensor top = finite_or_lowest(at::maximum(r.lse, at::amax(c, -1)));
  const at::Tensor w0 = (r.lse - top).exp_();
  const at::Tensor w = (c - top.unsqueeze(-1)).exp_();
  const at::Tensor total = w0 + w.sum(-1);
  at::Tensor num = r.out * w0.unsqueeze(-1);
  for (std::size_t i = 0; i < p.v_chain.size(); ++i)
    num.add_(w.select(-1, static_cast<std::int64_t>(i)).unsqueeze(-1) * p.v_chain[i].unsqueeze(3));
  const at::Tensor has = total > 0;
  const at::Tensor total_safe = at::where(has, total, at::ones_like(total));
  return {num / total_safe.unsqueeze(-1), at::where(has, top + at::log(total_safe), at::full_like(total, kNegInf))};
}

// Gradients of q (scaled layout), block 0's k and v, and each chain's shifted k and v, given
// dO and the forward's out / lse (all in the kernel layout). P is recomputed per tile from
// the saved log-sum-exp: P = exp(S - lse); dS = P * (dP - rowsum(dO * O)).
struct Grads {
  at::Tensor dqs, dk0, dv0;
  std::vector<at::Tensor> dk_chain, dv_chain;
};

// delta: rowsum(dO * O), [B, kv_heads, L, rep].
Grads backward_raw(const Geometry& g, const Prepared& p, const at::Tensor& d_out, const at::Tensor& delta,
                   const at::Tensor& lse) {
  const at::Tensor lse0 = finite_or_lowest(lse);  // rows without keys: every score is -inf anyway
  Grads gr{at::zeros_like(p.qs), at::zeros_like(p.k0), at::zeros_like(p.v0), {}, {}};
  at::Tensor q_tile, do_tile, lse_tile, delta_tile, dq_tile;
  for_each_tile(g, p, [&](std::int64_t q0, std::int64_t t, std::int64_t k0, std::int64_t n, bool first_key) {
    if (first_key) {
      q_tile = rows_of(g, p.qs, q0, t);
      do_tile = rows_of(g, d_out, q0, t);
      lse_tile = rows_of(g, lse0, q0, t).unsqueeze(-1);
      delta_tile = rows_of(g, delta, q0, t).unsqueeze(-1);
      dq_tile = rows_of(g, gr.dqs, q0, t);
    }
    const at::Tensor k = p.k0.narrow(2, k0, n), v = p.v0.narrow(2, k0, n);
    at::Tensor prob = tile_scores(g, p, q_tile, q0, t, k0, n);
    prob.sub_(lse_tile).exp_();
    gr.dv0.narrow(2, k0, n).add_(at::matmul(prob.transpose(-1, -2), do_tile));
    at::Tensor ds = at::matmul(do_tile, v.transpose(-1, -2));
    ds.sub_(delta_tile).mul_(prob);
    dq_tile.add_(at::matmul(ds, k));
    gr.dk0.narrow(2, k0, n).add_(at::matmul(ds.transpose(-1, -2), q_tile));
  });
  if (g.step == 0) return gr;
  const at::Tensor prob = (chain_scores(g, p) - lse0.unsqueeze(-1)).exp_();  // [B, kv_heads, L, rep, s]
  for (std::size_t c = 0; c < p.k_chain.size(); ++c) {
    const at::Tensor pc = prob.select(-1, static_cast<std::int64_t>(c));
    gr.dv_chain.push_back((pc.unsqueeze(-1) * d_out).sum(3));
    const at::Tensor ds = pc * ((d_out * p.v_chain[c].unsqueeze(3)).sum(-1) - delta);
    gr.dqs.add_(ds.unsqueeze(-1) * p.k_chain[c].unsqueeze(3));
    gr.dk_chain.push_back((ds.unsqueeze(-1) * p.qs).sum(3));
  }
  return gr;
}

Geometry geometry_of(const at::Tensor& q, const at::Tensor& k0, std::int64_t step, double scale,
                     std::int64_t query_rows, std::int64_t key_rows) {
  Geometry g;
  g.b = q.size(0);
  g.heads = q.size(1);
  g.l = q.size(2);
  g.d = q.size(3);
  g.kv_heads = k0.size(1);
  g.rep = g.heads / g.kv_heads;
  g.step = step;
  g.scale = scale;
  g.query_rows = query_rows;
  g.key_rows = key_rows;
  return g;
}

// [B, kv_heads, L, rep, ...] <-> [B, heads, L, ...].
at::Tensor to_heads(const Geometry& g, const at::Tensor& x) {
  if (x.dim() == 5) return x.permute({0, 1, 3, 2, 4}).reshape({g.b, g.heads, g.l, g.d});
  return x.permute({0, 1, 3, 2}).reshape({g.b, g.heads, g.l});
}
at::Tensor from_heads(const Geometry& g, const at::Tensor& x) {
  return x.reshape({g.b, g.kv_heads, g.rep, g.l, g.d}).permute({0, 1, 3, 2, 4}).contiguous();
}

// The autograd node. Inputs: q, the k blocks, the v blocks (differentiable), key_valid and
// document_ids (not); the rest are settings.
class TttFlashFunction : public torch::autograd::Function<TttFlashFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, at::TensorList ks,
                            at::TensorList vs, const at::Tensor& key_valid,
                            const c10::optional<at::Tensor>& document_ids, std::int64_t step, double scale,
                            std::int64_t query_rows, std::int64_t key_rows) {
    // float32 throughout, also when called under autocast.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const at::Tensor docs = document_ids.value_or(at::Tensor());
    const Geometry g = geometry_of(q, ks[0], step, scale, query_rows, key_rows);
    Result r;
    {
      const Prepared p = prepare(g, q, ks, vs, key_valid, docs);
      r = forward_raw(g, p);
    }
    const at::Tensor out = to_heads(g, r.out);
    std::vector<at::Tensor> saved{q};
    saved.insert(saved.end(), ks.begin(), ks.end());
    saved.insert(saved.end(), vs.begin(), vs.end());
    saved.push_back(out);
    saved.push_back(r.lse);
    ctx->save_for_backward(saved);
    ctx->saved_data["key_valid"] = key_valid;
    ctx->saved_data["docs"] = docs;
    ctx->saved_data["step"] = step;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["query_rows"] = query_rows;
    ctx->saved_data["key_rows"] = key_rows;
    return out.to(q.scalar_type());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto saved = ctx->get_saved_variables();
    const std::int64_t step = ctx->saved_data["step"].toInt();
    const auto blocks = static_cast<std::size_t>(step + 1);
    const at::Tensor& q = saved[0];
    const at::TensorList ks(saved.data() + 1, blocks), vs(saved.data() + 1 + blocks, blocks);
    const at::Tensor& out = saved[1 + 2 * blocks];
    const at::Tensor& lse = saved[2 + 2 * blocks];
    const Geometry g = geometry_of(q, ks[0], step, ctx->saved_data["scale"].toDouble(),
                                   ctx->saved_data["query_rows"].toInt(), ctx->saved_data["key_rows"].toInt());
    const Prepared p =
        prepare(g, q, ks, vs, ctx->saved_data["key_valid"].toTensor(), ctx->saved_data["docs"].toTensor());
    const at::Tensor d_out = grad_out[0].to(at::kFloat);
    const at::Tensor delta =
        (d_out * out).sum(-1).view({g.b, g.kv_heads, g.rep, g.l}).permute({0, 1, 3, 2}).contiguous();
    const Grads gr = backward_raw(g, p, from_heads(g, d_out), delta, lse);

    torch::autograd::variable_list result{to_heads(g, gr.dqs.mul_(g.scale)).to(q.scalar_type())};
    result.push_back(gr.dk0.to(ks[0].scalar_type()));
    for (std::int64_t i = 1; i <= step; ++i)
      result.push_back(shift_up(gr.dk_chain[static_cast<std::size_t>(i - 1)], step - i, 2).to(ks[i].scalar_type()));
    result.push_back(gr.dv0.to(vs[0].scalar_type()));
    for (std::int64_t i = 1; i <= step; ++i)
      result.push_back(shift_up(gr.dv_chain[static_cast<std::size_t>(i - 1)], step - i, 2).to(vs[i].scalar_type()));
    result.resize(result.size() + 6);  // key_valid, document_ids and the settings
    return result;
  }
};

void check_inputs(const at::Tensor& q, const std::vector<at::Tensor>& k_blocks,
                  const std::vector<at::Tensor>& v_blocks, const at::Tensor& key_valid,
                  const at::Tensor& document_ids, std::int64_t step) {
  if (q.dim() != 4) throw UsageError("TTT flash attention: q must be [B, heads, L, D]");
  if (step < 0 || static_cast<std::int64_t>(k_blocks.size()) != step + 1 || v_blocks.size() != k_blocks.size())
    throw UsageError("TTT flash attention: step " + std::to_string(step) + " needs " + std::to_string(step + 1) +
                     " key/value blocks, got " + std::to_string(k_blocks.size()) + "/" +
                     std::to_string(v_blocks.size()));
  for (std::size_t i = 0; i < k_blocks.size(); ++i) {
    for (const at::Tensor* t : {&k_blocks[i], &v_blocks[i]}) {
      if (t->dim() != 4 || t->size(0) != q.size(0) || t->size(2) != q.size(2) || t->size(3) != q.size(3) ||
          t->size(1) < 1 || q.size(1) % t->size(1) != 0 || t->size(1) != k_blocks[0].size(1))
        throw UsageError("TTT flash attention: key/value block shape " + c10::str(t->sizes()) +
                         " does not fit q " + c10::str(q.sizes()));
    }
  }
  const std::vector<std::int64_t> bl{q.size(0), q.size(2)};
  if (!key_valid.defined() || key_valid.sizes() != at::IntArrayRef(bl))
    throw UsageError("TTT flash attention: key_valid must be [B, L] = " + c10::str(at::IntArrayRef(bl)));
  if (document_ids.defined() && document_ids.sizes() != at::IntArrayRef(bl))
    throw UsageError("TTT flash attention: document_ids must be [B, L] = " + c10::str(at::IntArrayRef(bl)));
}

}  // namespace

at::Tensor ttt_attention_flash(const at::Tensor& q, const std::vector<at::Tensor>& k_blocks,
                               const std::vector<at::Tensor>& v_blocks, const at::Tensor& key_valid,
                               std::int64_t step, double scale, const at::Tensor& document_ids,
                               TttFlashTiles tiles) {
  check_inputs(q, k_blocks, v_blocks, key_valid, document_ids, step);
  const std::int64_t query_rows = tiles.query_rows > 0 ? tiles.query_rows : kTttFlashQueryRows;
  const std::int64_t key_rows = tiles.key_rows > 0 ? tiles.key_rows : kTttFlashKeyRows;
  const c10::optional<at::Tensor> docs =
      document_ids.defined() ? c10::optional<at::Tensor>(document_ids) : c10::nullopt;
  return TttFlashFunction::apply(q, at::TensorList(k_blocks), at::TensorList(v_blocks), key_valid, docs, step,
                                 scale, query_rows, key_rows);
}

}  // namespace eaglekit::trainer
