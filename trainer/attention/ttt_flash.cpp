#include "trainer/attention/ttt_flash.h"

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <limits>
#include <string>

#include "formats/error.h"
#include "trainer/attention/ttt_tiles.h"

namespace eaglekit::trainer {

namespace {

using tiles::finite_or_lowest;
using tiles::kNegInf;
using tiles::shift_down;
using tiles::shift_up;

// The kernel's layout is trainer/attention/ttt_tiles.h's: queries [B, kv_heads, L, rep, D], row
// statistics [B, kv_heads, L, rep]. Block 0 is its one pair (queries and keys of the whole
// sequence, both at offset 0); the chain keys are handled here.
struct Geometry {
  std::int64_t b = 0, heads = 0, kv_heads = 0, rep = 0, l = 0, d = 0;
  tiles::TileShape shape;  // step and tile sizes
  double scale = 1.0;
  std::int64_t step() const { return shape.step; }
};

// The inputs in the kernel's layout, float32; rebuilt in backward from the saved inputs.
struct Prepared {
  tiles::TileQueries queries;        // q * scale, [B, kv_heads, L, rep, D]; document ids
  tiles::TileKeys keys;              // block 0, [B, kv_heads, L, D]; key_valid; document ids
  std::vector<at::Tensor> k_chain;   // block i = c + 1 shifted down by s - i rows: row q holds
  std::vector<at::Tensor> v_chain;   //   the key of position q - (s - i), [B, kv_heads, L, D]
  std::vector<at::Tensor> chain_ok;  // whether query q may see that key, [B, L] bool
};

Prepared prepare(const Geometry& g, const at::Tensor& q, at::TensorList ks, at::TensorList vs,
                 const at::Tensor& key_valid, const at::Tensor& document_ids,
                 std::shared_ptr<const tiles::HostKeys> host) {
  Prepared p;
  p.queries = tiles::tile_queries(q, g.kv_heads, g.scale, document_ids, 0);
  p.keys = tiles::tile_keys(ks[0], vs[0], key_valid, document_ids, 0, std::move(host));
  const at::Tensor& valid = p.keys.valid;
  const at::Tensor& docs = p.keys.docs;
  const at::Tensor positions = at::arange(g.l, q.options().dtype(at::kLong));
  for (std::int64_t i = 1; i <= g.step(); ++i) {
    const std::int64_t shift = g.step() - i;
    p.k_chain.push_back(shift_down(ks[i].to(at::kFloat), shift, 2));
    p.v_chain.push_back(shift_down(vs[i].to(at::kFloat), shift, 2));
    at::Tensor ok = (positions >= shift).unsqueeze(0) & shift_down(valid, shift, 1);
    if (docs.defined()) ok = ok & (docs == shift_down(docs, shift, 1));
    p.chain_ok.push_back(ok);
  }
  return p;
}

// Chain scores [B, kv_heads, L, rep, s] (scaled; -inf where the chain key is not visible).
at::Tensor chain_scores(const Geometry& g, const Prepared& p) {
  std::vector<at::Tensor> cs;
  for (std::size_t c = 0; c < p.k_chain.size(); ++c) {
    at::Tensor sc = (p.queries.qs * p.k_chain[c].unsqueeze(3)).sum(-1);
    cs.push_back(sc.masked_fill_(p.chain_ok[c].logical_not().view({g.b, 1, g.l, 1}), kNegInf));
  }
  return at::stack(cs, -1);
}

struct Result {
  at::Tensor out;  // [B, kv_heads, L, rep, D]
  at::Tensor lse;  // [B, kv_heads, L, rep]; -inf for rows with no visible key
};

Result forward_raw(const Geometry& g, const Prepared& p) {
  // Block 0 by tiles (trainer/attention/ttt_tiles.h).
  const tiles::TilePartial b0 = tiles::tile_forward(g.shape, p.queries, p.keys);
  Result r{b0.out, b0.lse};
  if (g.step() == 0) return r;

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
  Grads gr{at::zeros_like(p.queries.qs), at::zeros_like(p.keys.k), at::zeros_like(p.keys.v), {}, {}};
  tiles::tile_backward(g.shape, p.queries, p.keys, d_out, delta, lse, gr.dqs, gr.dk0, gr.dv0);
  if (g.step() == 0) return gr;
  const at::Tensor& qs = p.queries.qs;
  const at::Tensor lse0 = finite_or_lowest(lse);  // rows without keys: every score is -inf anyway
  const at::Tensor prob = (chain_scores(g, p) - lse0.unsqueeze(-1)).exp_();  // [B, kv_heads, L, rep, s]
  for (std::size_t c = 0; c < p.k_chain.size(); ++c) {
    const at::Tensor pc = prob.select(-1, static_cast<std::int64_t>(c));
    gr.dv_chain.push_back((pc.unsqueeze(-1) * d_out).sum(3));
    const at::Tensor ds = pc * ((d_out * p.v_chain[c].unsqueeze(3)).sum(-1) - delta);
    gr.dqs.add_(ds.unsqueeze(-1) * p.k_chain[c].unsqueeze(3));
    gr.dk_chain.push_back((ds.unsqueeze(-1) * qs).sum(3));
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
  g.shape = {step, query_rows, key_rows};
  g.scale = scale;
  return g;
}

// The host copies of key_valid and document_ids as saved for backward (CPU tensors; the
// invalid-key prefix is recomputed from them on the host, which costs no device copy).
std::shared_ptr<const tiles::HostKeys> host_of(torch::autograd::AutogradContext* ctx) {
  return tiles::host_keys_of_host(ctx->saved_data["host_valid"].toTensor(), ctx->saved_data["host_docs"].toTensor());
}

// The autograd node. Inputs: q, the k blocks, the v blocks (differentiable), key_valid and
// document_ids and their host copies (not); the rest are settings.
class TttFlashFunction : public torch::autograd::Function<TttFlashFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, at::TensorList ks,
                            at::TensorList vs, const at::Tensor& key_valid,
                            const c10::optional<at::Tensor>& document_ids, const c10::optional<at::Tensor>& host_valid,
                            const c10::optional<at::Tensor>& host_docs, std::int64_t step, double scale,
                            std::int64_t query_rows, std::int64_t key_rows) {
    // float32 throughout, also when called under autocast.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const at::Tensor docs = document_ids.value_or(at::Tensor());
    const Geometry g = geometry_of(q, ks[0], step, scale, query_rows, key_rows);
    const std::shared_ptr<const tiles::HostKeys> host =
        host_valid ? tiles::host_keys_of_host(*host_valid, host_docs.value_or(at::Tensor()))
                   : tiles::host_keys(key_valid, docs);
    Result r;
    {
      const Prepared p = prepare(g, q, ks, vs, key_valid, docs, host);
      r = forward_raw(g, p);
    }
    const at::Tensor out = tiles::tiles_to_heads(r.out);
    std::vector<at::Tensor> saved{q};
    saved.insert(saved.end(), ks.begin(), ks.end());
    saved.insert(saved.end(), vs.begin(), vs.end());
    saved.push_back(out);
    saved.push_back(r.lse);
    ctx->save_for_backward(saved);
    ctx->saved_data["key_valid"] = key_valid;
    ctx->saved_data["docs"] = docs;
    ctx->saved_data["host_valid"] = host->valid;
    ctx->saved_data["host_docs"] = host->docs;
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
    const Prepared p = prepare(g, q, ks, vs, ctx->saved_data["key_valid"].toTensor(),
                               ctx->saved_data["docs"].toTensor(), host_of(ctx));
    const at::Tensor d_out = grad_out[0].to(at::kFloat);
    const at::Tensor delta = tiles::tiles_from_heads((d_out * out).sum(-1), g.kv_heads);
    const Grads gr = backward_raw(g, p, tiles::tiles_from_heads(d_out, g.kv_heads), delta, lse);

    torch::autograd::variable_list result{tiles::tiles_to_heads(gr.dqs.mul_(g.scale)).to(q.scalar_type())};
    result.push_back(gr.dk0.to(ks[0].scalar_type()));
    for (std::int64_t i = 1; i <= step; ++i)
      result.push_back(shift_up(gr.dk_chain[static_cast<std::size_t>(i - 1)], step - i, 2).to(ks[i].scalar_type()));
    result.push_back(gr.dv0.to(vs[0].scalar_type()));
    for (std::int64_t i = 1; i <= step; ++i)
      result.push_back(shift_up(gr.dv_chain[static_cast<std::size_t>(i - 1)], step - i, 2).to(vs[i].scalar_type()));
    result.resize(result.size() + 8);  // key_valid, document_ids, their host copies and the settings
    return result;
  }
};

}  // namespace

at::Tensor ttt_attention_flash(const TttAttentionInputs& in, TttFlashTiles tiles, const tiles::HostKeys* host) {
  tiles::check_attention_args("TTT flash attention", in);
  const auto& [q, k_blocks, v_blocks, key_valid, step, scale, document_ids] = in;
  const std::int64_t query_rows = tiles.query_rows > 0 ? tiles.query_rows : kTttFlashQueryRows;
  const std::int64_t key_rows = tiles.key_rows > 0 ? tiles.key_rows : kTttFlashKeyRows;
  const auto opt = [](const at::Tensor& t) { return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt; };
  return TttFlashFunction::apply(q, at::TensorList(k_blocks), at::TensorList(v_blocks), key_valid, opt(document_ids),
                                 host ? opt(host->valid) : c10::nullopt, host ? opt(host->docs) : c10::nullopt, step,
                                 scale, query_rows, key_rows);
}

}  // namespace eaglekit::trainer
