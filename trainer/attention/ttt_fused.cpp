#include "trainer/attention/ttt_fused.h"

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/version.h>

#include <algorithm>
#include <limits>
#include <string>

#include "formats/error.h"
#include "trainer/attention/ttt_tiles.h"

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5)
#define EAGLEKIT_FUSED_SDPA 1
#endif

namespace eaglekit::trainer {

bool ttt_fused_available(std::string* why) {
#ifdef EAGLEKIT_FUSED_SDPA
  (void)why;
  return true;
#else
  if (why)
    *why = "this build's LibTorch is " + std::string(TORCH_VERSION) +
           ", and the fused scaled-dot-product kernels that return the log-sum-exp need LibTorch >= 2.5 "
           "(build against PyTorch 2.x: scripts/setup --torch2)";
  return false;
#endif
}

#ifdef EAGLEKIT_FUSED_SDPA

namespace {


using tiles::finite_or_lowest;
using tiles::kNegInf;
using tiles::shift_down;
using tiles::shift_up;

// One kernel call of a pair's block 0: batch rows [b0, b0 + nb), local query rows
// [q0, q0 + nq), local key rows [k0, k0 + nk). causal: query q0 + a sees keys k0 .. k0 + a
// (then nq == nk, where the kernels' top-left and bottom-right alignments agree); otherwise
// every query sees every key. first: no earlier call covers these rows (the result is
// written, not merged).
struct Call {
  std::int64_t b0 = 0, nb = 0, q0 = 0, nq = 0, k0 = 0, nk = 0;
  bool causal = false, first = true;
};

// Runs of equal document ids in one row: [begin, end) pairs (one run without ids).
std::vector<std::pair<std::int64_t, std::int64_t>> runs_of(const std::int64_t* d, std::int64_t n) {
  std::vector<std::pair<std::int64_t, std::int64_t>> r;
  for (std::int64_t o = 0; o < n;) {
    std::int64_t e = o + 1;
    if (d)
      while (e < n && d[e] == d[o]) ++e;
    else
      e = n;
    r.emplace_back(o, e);
    o = e;
  }
  return r;
}

// The calls that cover block 0 of a pair (see the header: runs of valid keys, causal squares
// and plain calls), from key_valid and the document ids on the host. offset: qo - ko - step,
// so that local query a sees local key j iff j <= a + offset.
std::vector<Call> plan_calls(const at::Tensor& valid, const at::Tensor& docs_q, const at::Tensor& docs_k,
                             std::int64_t nq, std::int64_t offset) {
  const std::int64_t b = valid.size(0), nk = valid.size(1);
  const bool* v = valid.data_ptr<bool>();
  const std::int64_t* dq = docs_q.defined() ? docs_q.data_ptr<std::int64_t>() : nullptr;
  const std::int64_t* dk = docs_k.defined() ? docs_k.data_ptr<std::int64_t>() : nullptr;
  std::vector<Call> calls;
  std::vector<Call> row;  // this row's calls
  std::vector<Call> prev_row;
  std::vector<char> covered;
  auto flush_row = [&](std::int64_t r) {
    // A row whose calls equal the previous row's joins its calls (rows r - 1 and r batched).
    bool same = r > 0 && row.size() == prev_row.size();
    for (std::size_t i = 0; same && i < row.size(); ++i) {
      const Call &x = row[i], &y = prev_row[i];
      same = x.q0 == y.q0 && x.nq == y.nq && x.k0 == y.k0 && x.nk == y.nk && x.causal == y.causal;
    }
    if (same && !row.empty()) {
      for (std::size_t i = 0; i < row.size(); ++i) calls[calls.size() - row.size() + i].nb += 1;
    } else {
      calls.insert(calls.end(), row.begin(), row.end());
    }
    prev_row = row;
    row.clear();
  };
  for (std::int64_t r = 0; r < b; ++r) {
    covered.assign(static_cast<std::size_t>(nq), 0);
    auto add = [&](std::int64_t q0, std::int64_t n, std::int64_t k0, std::int64_t m, bool causal) {
      if (n <= 0 || m <= 0) return;
      bool fresh = true;
      for (std::int64_t a = q0; a < q0 + n; ++a) fresh = fresh && !covered[static_cast<std::size_t>(a)];
      std::fill(covered.begin() + q0, covered.begin() + q0 + n, 1);
      row.push_back({r, 1, q0, n, k0, m, causal, fresh});
    };
    const auto qruns = runs_of(dq ? dq + r * nq : nullptr, nq);
    const auto kruns = runs_of(dk ? dk + r * nk : nullptr, nk);
    for (const auto& [qa0, qa1] : qruns) {
      for (const auto& [kj0, kj1] : kruns) {
        if (dq && dq[r * nq + qa0] != dk[r * nk + kj0]) continue;  // another document
        // Each run [first, last) of consecutive valid keys of this document.
        for (std::int64_t first = kj0; first < kj1;) {
          if (!v[r * nk + first]) {
            ++first;
            continue;
          }
          std::int64_t last = first + 1;
          while (last < kj1 && v[r * nk + last]) ++last;
          // Query a sees keys [first, min(last, a + offset + 1)).
          const std::int64_t all_from = std::max(qa0, last - offset - 1);  // these see the whole run
          const std::int64_t a0 = std::max(qa0, first - offset);           // the first that sees a key
          const std::int64_t a1 = std::min(qa1, all_from);
          if (a0 < a1) {
            const std::int64_t seen = a0 + offset + 1 - first;  // keys visible to query a0 (>= 1)
            add(a0, a1 - a0, first, seen - 1, false);           // the keys every one of them sees
            add(a0, a1 - a0, first + seen - 1, a1 - a0, true);  // then one more per query
          }
          add(all_from, qa1 - all_from, first, last - first, false);
          first = last;
        }
      }
    }
    flush_row(r);
  }
  return calls;
}

// The slices of one call: queries [nb, heads, nq, ...], keys [nb, kv_heads, nk, ...].
at::Tensor q_of(const Call& c, const at::Tensor& x) { return x.narrow(0, c.b0, c.nb).narrow(2, c.q0, c.nq); }
at::Tensor k_of(const Call& c, const at::Tensor& x) { return x.narrow(0, c.b0, c.nb).narrow(2, c.k0, c.nk); }

// CUDA's kernels need as many kv heads as query heads.
at::Tensor repeat_heads(const at::Tensor& x, std::int64_t rep) { return rep == 1 ? x : x.repeat_interleave(rep, 1); }
at::Tensor sum_heads(const at::Tensor& x, std::int64_t rep) {
  if (rep == 1) return x;
  return x.view({x.size(0), x.size(1) / rep, rep, x.size(2), x.size(3)}).sum(2);
}

// The memory-efficient kernel pads its log-sum-exp rows to a multiple of this (PyTorch's
// kAlignLSE); its backward takes them so.
constexpr std::int64_t kEfficientLseAlign = 32;

bool cuda_flash(const at::Tensor& q) { return q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16; }

// Forward of one call: out [nb, heads, nq, D] in q's dtype and lse [nb, heads, nq] float32.
std::pair<at::Tensor, at::Tensor> kernel_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 bool causal, double scale) {
  if (q.device().is_cpu()) {
    auto r = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, c10::nullopt, scale);
    return {std::get<0>(r), std::get<1>(r)};
  }
  const std::int64_t rep = q.size(1) / k.size(1);
  if (cuda_flash(q)) {
    auto r = at::_scaled_dot_product_flash_attention(q, repeat_heads(k, rep), repeat_heads(v, rep), 0.0, causal,
                                                     false, scale);
    return {std::get<0>(r), std::get<1>(r)};
  }
  auto r = at::_scaled_dot_product_efficient_attention(q, repeat_heads(k, rep), repeat_heads(v, rep), c10::nullopt,
                                                       true, 0.0, causal, scale);
  return {std::get<0>(r), std::get<1>(r).narrow(2, 0, q.size(2))};
}

// Backward of one call given the final out (q's dtype) and lse (float32, finite).
std::tuple<at::Tensor, at::Tensor, at::Tensor> kernel_backward(const at::Tensor& d_out, const at::Tensor& q,
                                                               const at::Tensor& k, const at::Tensor& v,
                                                               const at::Tensor& out, const at::Tensor& lse,
                                                               bool causal, double scale) {
  if (q.device().is_cpu())
    return at::_scaled_dot_product_flash_attention_for_cpu_backward(d_out, q, k, v, out, lse, 0.0, causal,
                                                                    c10::nullopt, scale);
  const std::int64_t rep = q.size(1) / k.size(1);
  // Without dropout the kernels read no random state: zeros stand for the philox seed/offset.
  const at::Tensor seed = at::zeros({}, at::kLong), offset = at::zeros({}, at::kLong);
  at::Tensor dq, dk, dv;
  if (cuda_flash(q)) {
    std::tie(dq, dk, dv) = at::_scaled_dot_product_flash_attention_backward(
        d_out, q, repeat_heads(k, rep), repeat_heads(v, rep), out, lse.contiguous(), at::Tensor(), at::Tensor(),
        q.size(2), k.size(2), 0.0, causal, seed, offset, scale);
  } else {
    const std::int64_t rows = (q.size(2) + kEfficientLseAlign - 1) / kEfficientLseAlign * kEfficientLseAlign;
    at::Tensor lse_padded = at::zeros({lse.size(0), lse.size(1), rows}, lse.options());
    lse_padded.narrow(2, 0, lse.size(2)).copy_(lse);
    auto r = at::_scaled_dot_product_efficient_attention_backward(
        d_out, q, repeat_heads(k, rep), repeat_heads(v, rep), at::Tensor(), out, lse_padded, seed, offset, 0.0,
        {true, true, true, false}, causal, scale);
    dq = std::get<0>(r);
    dk = std::get<1>(r);
    dv = std::get<2>(r);
  }
  return {dq, sum_heads(dk, rep), sum_heads(dv, rep)};
}

std::vector<Call> plan_of(const fused::Pair& p, std::int64_t step) {
  const std::shared_ptr<const tiles::HostKeys> k = p.host_k ? p.host_k : tiles::host_keys(p.key_valid, p.docs_k);
  const std::shared_ptr<const tiles::HostKeys> q =
      p.host_q ? p.host_q
               : (p.docs_q.defined() ? tiles::host_keys(at::ones_like(p.docs_q, at::kBool), p.docs_q) : nullptr);
  return plan_calls(k->valid, q ? q->docs : at::Tensor(), k->docs, p.q.size(2), p.qo - p.ko - step);
}

}  // namespace

namespace fused {

Partial block0_forward(const Pair& p, std::int64_t step, double scale) {
  const at::Tensor& q = p.q;
  const at::Tensor k = p.k.to(q.scalar_type()), v = p.v.to(q.scalar_type());
  const auto f32 = q.options().dtype(at::kFloat);
  Partial r{at::zeros({q.size(0), q.size(1), q.size(2), q.size(3)}, f32),
            at::full({q.size(0), q.size(1), q.size(2)}, kNegInf, f32)};
  for (const Call& c : plan_of(p, step)) {
    const auto [o, l] = kernel_forward(q_of(c, q), k_of(c, k), k_of(c, v), c.causal, scale);
    at::Tensor out = q_of(c, r.out), lse = q_of(c, r.lse);
    if (c.first) {
      out.copy_(o);
      lse.copy_(l);
      continue;
    }
    // Merge with what earlier calls gave these rows (another run of keys), by log-sum-exp.
    const at::Tensor top = finite_or_lowest(at::maximum(lse, l));
    const at::Tensor w0 = (lse - top).exp_(), w1 = (l - top).exp_();
    const at::Tensor total = w0 + w1;
    out.copy_((out * w0.unsqueeze(-1) + o.to(at::kFloat) * w1.unsqueeze(-1)) / total.unsqueeze(-1));
    lse.copy_(top + at::log(total));
  }
  return r;
}

void block0_backward(const Pair& p, std::int64_t step, double scale, const at::Tensor& d_out, const at::Tensor& out,
                     const at::Tensor& lse, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
  const at::ScalarType dt = p.q.scalar_type();
  const at::Tensor k = p.k.to(dt), v = p.v.to(dt), out_k = out.to(dt), d_out_k = d_out.to(dt);
  // A row with no visible key at all has lse -inf: any finite value above every score gives
  // it P = exp(S - lse) = 0 in the kernel.
  const at::Tensor lse_k = lse.masked_fill(lse.isneginf(), std::numeric_limits<float>::max());
  for (const Call& c : plan_of(p, step)) {
    const auto [gq, gk, gv] = kernel_backward(q_of(c, d_out_k), q_of(c, p.q), k_of(c, k), k_of(c, v),
                                              q_of(c, out_k), q_of(c, lse_k), c.causal, scale);
    q_of(c, dq).add_(gq);
    k_of(c, dk).add_(gk);
    k_of(c, dv).add_(gv);
  }
}

}  // namespace fused

namespace {

// The chain keys of a whole-sequence call: per block i = 1..s the key of position q - (s - i),
// and whether query q may see it.
struct Chain {
  std::int64_t b = 0, heads = 0, kv_heads = 0, rep = 0, l = 0, d = 0, step = 0;
  double scale = 1.0;
  std::vector<at::Tensor> k, v;   // [B, kv_heads, L, D] float32, shifted down by s - i
  std::vector<at::Tensor> ok;     // [B, L] bool
};

Chain chain_of(const at::Tensor& q, at::TensorList ks, at::TensorList vs, const at::Tensor& key_valid,
               const at::Tensor& docs, std::int64_t step, double scale) {
  Chain c;
  c.b = q.size(0);
  c.heads = q.size(1);
  c.l = q.size(2);
  c.d = q.size(3);
  c.kv_heads = ks[0].size(1);
  c.rep = c.heads / c.kv_heads;
  c.step = step;
  c.scale = scale;
  const at::Tensor valid = key_valid.to(q.device(), at::kBool);
  const at::Tensor docs_dev = docs.defined() ? docs.to(q.device(), at::kLong) : at::Tensor();
  const at::Tensor positions = at::arange(c.l, q.options().dtype(at::kLong));
  for (std::int64_t i = 1; i <= step; ++i) {
    const std::int64_t shift = step - i;
    c.k.push_back(shift_down(ks[i].to(at::kFloat), shift, 2));
    c.v.push_back(shift_down(vs[i].to(at::kFloat), shift, 2));
    at::Tensor ok = (positions >= shift).unsqueeze(0) & shift_down(valid, shift, 1);
    if (docs_dev.defined()) ok = ok & (docs_dev == shift_down(docs_dev, shift, 1));
    c.ok.push_back(ok);
  }
  return c;
}

// [B, heads, L, ...] per kv head: [B, kv_heads, rep, L, ...] (a view of a contiguous x).
at::Tensor per_kv(const at::Tensor& x, const Chain& c) {
  std::vector<std::int64_t> shape{c.b, c.kv_heads, c.rep, c.l};
  if (x.dim() == 4) shape.push_back(x.size(3));
  return x.reshape(shape);
}

// Chain scores [B, heads, L, s] (scaled; -inf where the chain key is not visible).
at::Tensor chain_scores(const Chain& c, const at::Tensor& q32) {
  std::vector<at::Tensor> cs;
  for (std::size_t i = 0; i < c.k.size(); ++i) {
    at::Tensor sc = (per_kv(q32, c) * c.k[i].unsqueeze(2)).sum(-1).mul_(c.scale).view({c.b, c.heads, c.l});
    cs.push_back(sc.masked_fill_(c.ok[i].logical_not().unsqueeze(1), kNegInf));
  }
  return at::stack(cs, -1);
}

fused::Pair whole_sequence(const at::Tensor& q, const at::Tensor& k0, const at::Tensor& v0,
                           const at::Tensor& key_valid, const at::Tensor& docs,
                           std::shared_ptr<const tiles::HostKeys> host) {
  return {q, k0, v0, key_valid, docs, docs, 0, 0, host, host};
}

class TttFusedFunction : public torch::autograd::Function<TttFusedFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, at::TensorList ks,
                            at::TensorList vs, const at::Tensor& key_valid,
                            const c10::optional<at::Tensor>& document_ids, const c10::optional<at::Tensor>& host_valid,
                            const c10::optional<at::Tensor>& host_docs, std::int64_t step, double scale) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const at::Tensor docs = document_ids.value_or(at::Tensor());
    const std::shared_ptr<const tiles::HostKeys> host =
        host_valid ? tiles::host_keys_of_host(*host_valid, host_docs.value_or(at::Tensor()))
                   : tiles::host_keys(key_valid, docs);
    fused::Partial r = fused::block0_forward(whole_sequence(q, ks[0], vs[0], key_valid, docs, host), step, scale);
    at::Tensor out = r.out, lse = r.lse;
    if (step > 0) {
      // The chain keys, one per query and block, merged with block 0 by log-sum-exp.
      const Chain c = chain_of(q, ks, vs, key_valid, docs, step, scale);
      const at::Tensor sc = chain_scores(c, q.to(at::kFloat));
      const at::Tensor top = finite_or_lowest(at::maximum(lse, at::amax(sc, -1)));
      const at::Tensor w0 = (lse - top).exp_();
      const at::Tensor w = (sc - top.unsqueeze(-1)).exp_();
      const at::Tensor total = w0 + w.sum(-1);
      at::Tensor num = out * w0.unsqueeze(-1);
      for (std::size_t i = 0; i < c.v.size(); ++i)
        per_kv(num, c).add_(per_kv(w.select(-1, static_cast<std::int64_t>(i)), c).unsqueeze(-1) *
                            c.v[i].unsqueeze(2));
      const at::Tensor has = total > 0;
      const at::Tensor total_safe = at::where(has, total, at::ones_like(total));
      out = num / total_safe.unsqueeze(-1);
      lse = at::where(has, top + at::log(total_safe), at::full_like(total, kNegInf));
    }
    std::vector<at::Tensor> saved{q};
    saved.insert(saved.end(), ks.begin(), ks.end());
    saved.insert(saved.end(), vs.begin(), vs.end());
    saved.push_back(out);
    saved.push_back(lse);
    ctx->save_for_backward(saved);
    ctx->saved_data["key_valid"] = key_valid;
    ctx->saved_data["docs"] = docs;
    ctx->saved_data["host_valid"] = host->valid;
    ctx->saved_data["host_docs"] = host->docs;
    ctx->saved_data["step"] = step;
    ctx->saved_data["scale"] = scale;
    return out.to(q.scalar_type());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto saved = ctx->get_saved_variables();
    const std::int64_t step = ctx->saved_data["step"].toInt();
    const double scale = ctx->saved_data["scale"].toDouble();
    const auto blocks = static_cast<std::size_t>(step + 1);
    const at::Tensor& q = saved[0];
    const at::TensorList ks(saved.data() + 1, blocks), vs(saved.data() + 1 + blocks, blocks);
    const at::Tensor& out = saved[1 + 2 * blocks];
    const at::Tensor& lse = saved[2 + 2 * blocks];
    const at::Tensor key_valid = ctx->saved_data["key_valid"].toTensor();
    const at::Tensor docs = ctx->saved_data["docs"].toTensor();
    const at::Tensor d_out = grad_out[0].to(at::kFloat);

    // Block 0 through the kernel's backward, with the final out and lse: its probabilities
    // exp(S - lse) are then those of the softmax over every visible key, and its
    // rowsum(dO * O) that softmax's.
    const auto f32 = q.options().dtype(at::kFloat);
    at::Tensor dq = at::zeros(q.sizes(), f32);
    at::Tensor dk0 = at::zeros(ks[0].sizes(), f32), dv0 = at::zeros(vs[0].sizes(), f32);
    const std::shared_ptr<const tiles::HostKeys> host = tiles::host_keys_of_host(
        ctx->saved_data["host_valid"].toTensor(), ctx->saved_data["host_docs"].toTensor());
    fused::block0_backward(whole_sequence(q, ks[0], vs[0], key_valid, docs, host), step, scale, d_out, out, lse, dq,
                           dk0, dv0);

    std::vector<at::Tensor> dk_chain, dv_chain;
    if (step > 0) {
      const Chain c = chain_of(q, ks, vs, key_valid, docs, step, scale);
      const at::Tensor q32 = q.to(at::kFloat);
      const at::Tensor delta = (d_out * out).sum(-1);  // [B, heads, L]
      const at::Tensor prob = (chain_scores(c, q32) - finite_or_lowest(lse).unsqueeze(-1)).exp_();
      for (std::size_t i = 0; i < c.k.size(); ++i) {
        const at::Tensor pc = prob.select(-1, static_cast<std::int64_t>(i));  // [B, heads, L]
        dv_chain.push_back(per_kv(pc.unsqueeze(-1) * d_out, c).sum(2));
        const at::Tensor dp = (per_kv(d_out, c) * c.v[i].unsqueeze(2)).sum(-1).view({c.b, c.heads, c.l});
        const at::Tensor ds = pc * (dp - delta) * scale;
        per_kv(dq, c).add_(per_kv(ds, c).unsqueeze(-1) * c.k[i].unsqueeze(2));
        dk_chain.push_back(per_kv(ds.unsqueeze(-1) * q32, c).sum(2));
      }
    }

    torch::autograd::variable_list result{dq.to(q.scalar_type()), dk0.to(ks[0].scalar_type())};
    for (std::int64_t i = 1; i <= step; ++i)
      result.push_back(shift_up(dk_chain[static_cast<std::size_t>(i - 1)], step - i, 2).to(ks[i].scalar_type()));
    result.push_back(dv0.to(vs[0].scalar_type()));
    for (std::int64_t i = 1; i <= step; ++i)
      result.push_back(shift_up(dv_chain[static_cast<std::size_t>(i - 1)], step - i, 2).to(vs[i].scalar_type()));
    result.resize(result.size() + 6);  // key_valid, document_ids, their host copies, step, scale
    return result;
  }
};

}  // namespace

at::Tensor ttt_attention_fused(const TttAttentionInputs& in, const tiles::HostKeys* host) {
  tiles::check_attention_args("TTT fused attention", in);
  const auto& [q, k_blocks, v_blocks, key_valid, step, scale, document_ids] = in;
  const auto opt = [](const at::Tensor& t) { return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt; };
  return TttFusedFunction::apply(q, at::TensorList(k_blocks), at::TensorList(v_blocks), key_valid, opt(document_ids),
                                 host ? opt(host->valid) : c10::nullopt, host ? opt(host->docs) : c10::nullopt, step,
                                 scale);
}

#else  // LibTorch < 2.5

at::Tensor ttt_attention_fused(const TttAttentionInputs&, const tiles::HostKeys*) {
  std::string why;
  ttt_fused_available(&why);
  throw UsageError("TTT fused attention is not available: " + why);
}

namespace fused {

Partial block0_forward(const Pair&, std::int64_t, double) {
  std::string why;
  ttt_fused_available(&why);
  throw UsageError("ring attention: the fused pair kernel is not available: " + why);
}

void block0_backward(const Pair&, std::int64_t, double, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     at::Tensor&, at::Tensor&, at::Tensor&) {
  block0_forward({}, 0, 0.0);
}

}  // namespace fused

#endif

}  // namespace eaglekit::trainer
