#include "trainer/unroll/ttt.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "formats/error.h"
#include "trainer/attention/ttt_flash.h"
#include "trainer/attention/ttt_fused.h"
#include "trainer/attention/ttt_tiles.h"
#include "trainer/model/cpu_kernels.h"
#include "trainer/model/recompute.h"
#include "trainer/model/soft_ce.h"
#include "trainer/unroll/autocast.h"

namespace eaglekit::trainer {

namespace {

constexpr double kLossEps = 1e-5;  // docs/ttt.md, loss per step: ce_s / (N_s + 1e-5)
const double kNegInf = -std::numeric_limits<double>::infinity();

// Named ranges for LibTorch's autograd profiler (bench/bench_train_step reads them), one
// open at a time: begin() closes the previous one. Nearly free when no profiler runs.
class ProfileScope {
 public:
  void begin(const char* name) {
    guard_.reset();
    guard_.emplace(at::RecordScope::USER_SCOPE);
    if (guard_->isActive()) guard_->before(name);
  }

 private:
  std::optional<at::RecordFunction> guard_;
};

// Rows shifted towards higher positions by d along dim 2 ([B, heads, L, D]) or dim 1
// ([B, L]); the first d rows are zero.
at::Tensor shift_rows(const at::Tensor& x, std::int64_t d, std::int64_t dim) {
  const std::int64_t n = x.size(dim);
  if (d == 0) return x;
  if (d >= n) return at::zeros_like(x);
  return at::cat({at::zeros_like(x.narrow(dim, 0, d)), x.narrow(dim, 0, n - d)}, dim);
}

// A finite row maximum to subtract before exp (0 where a row has no allowed key), outside
// the autograd graph: it cancels mathematically.
at::Tensor safe_max(const at::Tensor& m) {
  const at::Tensor d = m.detach();
  return at::where(at::isfinite(d), d, at::zeros_like(d));
}

void check_qkv(const at::Tensor& q, const std::vector<at::Tensor>& k_blocks,
               const std::vector<at::Tensor>& v_blocks, std::int64_t step) {
  if (q.dim() != 4) throw UsageError("TTT attention: q must be [B, heads, L, D]");
  if (static_cast<std::int64_t>(k_blocks.size()) != step + 1 || v_blocks.size() != k_blocks.size())
    throw UsageError("TTT attention: step " + std::to_string(step) + " needs " +
                     std::to_string(step + 1) + " key/value blocks, got " + std::to_string(k_blocks.size()));
  for (const auto& k : k_blocks) {
    if (k.dim() != 4 || k.size(0) != q.size(0) || k.size(2) != q.size(2) || k.size(3) != q.size(3) ||
        q.size(1) % k.size(1) != 0)
      throw UsageError("TTT attention: key block shape " + c10::str(k.sizes()) +
                       " does not fit q " + c10::str(q.sizes()));
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Mask

bool ttt_allowed(std::int64_t length, std::int64_t step, std::int64_t q, std::int64_t j) {
  if (j >= 0 && j <= q - step) return true;
  for (std::int64_t i = 1; i <= step; ++i) {
    if (j == i * length + q - (step - i) && j >= i * length) return true;
  }
  return false;
}

at::Tensor ttt_mask(std::int64_t length, std::int64_t step, std::int64_t q_begin, std::int64_t q_end,
                    std::int64_t k_begin, std::int64_t k_end, c10::Device device) {
  const auto opts = at::TensorOptions().dtype(at::kLong).device(device);
  const at::Tensor q = at::arange(q_begin, q_end, opts).unsqueeze(1);
  const at::Tensor j = at::arange(k_begin, k_end, opts).unsqueeze(0);
  const at::Tensor block = at::div(j, length, "floor");
  const at::Tensor pos = j - block * length;
  const at::Tensor base = (block == 0) & (pos <= q - step);
  // Block i >= 1: the key of position q - (s - i), when that position exists.
  const at::Tensor chain = (block >= 1) & (block <= step) & (pos == q - (step - block));
  return base | chain;
}

at::Tensor ttt_mask(std::int64_t length, std::int64_t step, c10::Device device) {
  return ttt_mask(length, step, 0, length, 0, length * (step + 1), device);
}

const at::Tensor& TttMaskCache::block0(std::int64_t length, std::int64_t step, c10::Device device) {
  const auto key = std::make_tuple(length, step, static_cast<int>(device.type()), static_cast<int>(device.index()));
  auto it = masks_.find(key);
  if (it == masks_.end()) it = masks_.emplace(key, ttt_mask(length, step, 0, length, 0, length, device)).first;
  return it->second;
}

// ---------------------------------------------------------------------------------------
// Attention primitives

AttentionPartial attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& allowed, double scale) {
  const std::int64_t b = q.size(0), heads = q.size(1), lq = q.size(2), d = q.size(3);
  const std::int64_t kv_heads = k.size(1), lk = k.size(2), rep = heads / kv_heads;
  // Query heads sharing a kv head are consecutive: fold them into the row dimension so the
  // keys are never copied per head.
  const at::Tensor qg = q.reshape({b, kv_heads, rep * lq, d});
  at::Tensor scores = at::matmul(qg, k.transpose(-1, -2)).to(at::kFloat).mul(scale).view({b, kv_heads, rep, lq, lk});
  at::Tensor mask = allowed;
  while (mask.dim() < 3) mask = mask.unsqueeze(0);
  scores = scores.masked_fill(mask.logical_not().unsqueeze(1).unsqueeze(1), kNegInf);
  const at::Tensor m = safe_max(std::get<0>(scores.max(-1)));
  const at::Tensor e = at::exp(scores - m.unsqueeze(-1));
  const at::Tensor den = e.sum(-1);
  at::Tensor out = at::matmul(e.view({b, kv_heads, rep * lq, lk}).to(v.scalar_type()), v).to(at::kFloat);
  const at::Tensor has_key = den > 0;
  const at::Tensor den_safe = at::where(has_key, den, at::ones_like(den));
  out = out.view({b, kv_heads, rep, lq, d}) / den_safe.unsqueeze(-1);
  const at::Tensor lse = at::where(has_key, m + at::log(den_safe), at::full_like(den, kNegInf));
  return {out.view({b, heads, lq, d}), lse.view({b, heads, lq})};
}

AttentionPartial merge_partials(const AttentionPartial& a, const AttentionPartial& b) {
  const at::Tensor m = safe_max(at::maximum(a.lse, b.lse));
  const at::Tensor wa = at::exp(a.lse - m), wb = at::exp(b.lse - m);
  const at::Tensor total = wa + wb;
  const at::Tensor has_key = total > 0;
  const at::Tensor total_safe = at::where(has_key, total, at::ones_like(total));
  AttentionPartial r;
  r.out = (a.out * wa.unsqueeze(-1) + b.out * wb.unsqueeze(-1)) / total_safe.unsqueeze(-1);
  r.lse = at::where(has_key, m + at::log(total_safe), at::full_like(total, kNegInf));
  return r;
}

at::Tensor ttt_attention_dense(const TttAttentionInputs& in) {
  const auto& [q, k_blocks, v_blocks, key_valid, step, scale, document_ids] = in;
  check_qkv(q, k_blocks, v_blocks, step);
  const std::int64_t l = q.size(2);
  const at::Tensor k = at::cat(k_blocks, 2), v = at::cat(v_blocks, 2);
  at::Tensor allowed = ttt_mask(l, step, q.device()).unsqueeze(0) &
                       key_valid.to(at::kBool).repeat({1, step + 1}).unsqueeze(1);
  if (document_ids.defined()) {
    allowed = allowed & (document_ids.unsqueeze(2) == document_ids.repeat({1, step + 1}).unsqueeze(1));
  }
  return attend(q, k, v, allowed, scale).out.to(q.scalar_type());
}

std::int64_t ttt_query_chunk_rows(std::int64_t length) {
  // Query chunk c of T rows sees block-0 keys [0, (c + 1) T - s) only, so n chunks compute
  // (n + 1) / (2 n) of the dense L x L scores; chunks of at least 128 rows keep the per-chunk
  // operator overhead small, and at most 8 chunks bound the number of kernel launches.
  constexpr std::int64_t kMinRows = 128, kMaxChunks = 8;
  const std::int64_t chunks = std::clamp<std::int64_t>((length + kMinRows - 1) / kMinRows, 1, kMaxChunks);
  return (length + chunks - 1) / chunks;
}

at::Tensor ttt_attention_local(const TttAttentionInputs& in, TttMaskCache* cache, std::int64_t query_chunk_rows) {
  const auto& [q, k_blocks, v_blocks, key_valid, step, scale, document_ids] = in;
  check_qkv(q, k_blocks, v_blocks, step);
  const std::int64_t b = q.size(0), heads = q.size(1), l = q.size(2), d = q.size(3);
  const std::int64_t kv_heads = k_blocks[0].size(1), rep = heads / kv_heads;
  const at::Tensor valid = key_valid.to(at::kBool);
  const auto float_opts = q.options().dtype(at::kFloat);
  // Query heads sharing a kv head are consecutive: [B, kv_heads, rep, L, D].
  const at::Tensor q5 = q.reshape({b, kv_heads, rep, l, d});

  // Blocks i >= 1: exactly one key per query, the draft chain's own position q - (s - i).
  // Raw scores [B, kv_heads, rep, L, s] (float32), whether each is allowed [B, L, s], values.
  at::Tensor chain_scores, chain_ok;
  std::vector<at::Tensor> chain_values;
  if (step > 0) {
    const at::Tensor qf = q5.to(at::kFloat);
    const at::Tensor positions = at::arange(l, at::TensorOptions().dtype(at::kLong).device(q.device()));
    std::vector<at::Tensor> scores, ok;
    for (std::int64_t i = 1; i <= step; ++i) {
      const std::int64_t shift = step - i;
      const at::Tensor k_i = shift_rows(k_blocks[i], shift, 2).to(at::kFloat);
      at::Tensor allowed = (positions >= shift).unsqueeze(0) & shift_rows(valid, shift, 1);
      if (document_ids.defined()) allowed = allowed & (document_ids == shift_rows(document_ids, shift, 1));
      scores.push_back((qf * k_i.unsqueeze(2)).sum(-1));
      ok.push_back(allowed);
      chain_values.push_back(shift_rows(v_blocks[i], shift, 2).to(at::kFloat).unsqueeze(2));
    }
    chain_scores = at::stack(scores, -1);
    chain_ok = at::stack(ok, -1);
  }

  // Block 0: the base features, a causal mask shifted by the step (j <= q - s).
  const at::Tensor& causal0 = cache ? cache->block0(l, step, q.device()) : ttt_mask(l, step, 0, l, 0, l, q.device());
  const at::Tensor& k0 = k_blocks[0];
  const at::Tensor& v0 = v_blocks[0];
  const std::int64_t rows = query_chunk_rows > 0 ? query_chunk_rows : ttt_query_chunk_rows(l);

  // One softmax per query chunk over its block-0 keys and its s chain keys side by side.
  // Disallowed keys get -inf (exp gives exactly 0); a row with no allowed key at all gets a
  // finite row (no NaN, forward or backward) and its output is multiplied by 0.
  std::vector<at::Tensor> outs;
  for (std::int64_t q0 = 0; q0 < l; q0 += rows) {
    const std::int64_t t = std::min(rows, l - q0);
    const std::int64_t kn = std::clamp<std::int64_t>(q0 + t - step, 0, l);  // keys j <= q - s < q0 + t - s
    std::vector<at::Tensor> raw, allowed;
    if (kn > 0) {
      const at::Tensor qc = q5.narrow(3, q0, t).reshape({b, kv_heads, rep * t, d});
      raw.push_back(at::matmul(qc, k0.narrow(2, 0, kn).transpose(-1, -2)).to(at::kFloat).view({b, kv_heads, rep, t, kn}));
      at::Tensor a0 = causal0.narrow(0, q0, t).narrow(1, 0, kn).unsqueeze(0) & valid.narrow(1, 0, kn).unsqueeze(1);
      if (document_ids.defined())
        a0 = a0 & (document_ids.narrow(1, q0, t).unsqueeze(2) == document_ids.narrow(1, 0, kn).unsqueeze(1));
      allowed.push_back(a0);
    }
    if (step > 0) {
      raw.push_back(chain_scores.narrow(3, q0, t));
      allowed.push_back(chain_ok.narrow(1, q0, t));
    }
    if (raw.empty()) {
      outs.push_back(at::zeros({b, kv_heads, rep, t, d}, float_opts));
      continue;
    }
    const at::Tensor ok = allowed.size() == 1 ? allowed[0] : at::cat(allowed, -1);  // [B, t, kn + s]
    const at::Tensor has_key = ok.any(-1);                                          // [B, t]
    const at::Tensor bias = at::zeros(ok.sizes(), float_opts)
                                .masked_fill_(ok.logical_not() & has_key.unsqueeze(-1), kNegInf)
                                .view({b, 1, 1, t, ok.size(-1)});
    // bias + scale * raw: the scaling and the mask in one pass; softmax fwd/bwd are fused.
    const at::Tensor p = at::softmax(at::add(bias, raw.size() == 1 ? raw[0] : at::cat(raw, -1), scale), -1);
    std::vector<at::Tensor> parts;
    if (kn > 0 && step > 0) {
      parts = at::split_with_sizes(p, {kn, step}, -1);
    } else {
      parts = {kn > 0 ? p : at::Tensor(), step > 0 ? p : at::Tensor()};
    }
    at::Tensor out = kn > 0 ? at::matmul(parts[0].reshape({b, kv_heads, rep * t, kn}).to(v0.scalar_type()),
                                         v0.narrow(2, 0, kn))
                                  .to(at::kFloat)
                                  .view({b, kv_heads, rep, t, d})
                            : at::zeros({b, kv_heads, rep, t, d}, float_opts);
    for (std::int64_t c = 0; c < step; ++c)
      out = out + parts[1].select(-1, c).unsqueeze(-1) * chain_values[static_cast<std::size_t>(c)].narrow(3, q0, t);
    outs.push_back(out * has_key.to(at::kFloat).view({b, 1, 1, t, 1}));
  }
  const at::Tensor out = outs.size() == 1 ? outs[0] : at::cat(outs, 3);
  return out.view({b, heads, l, d}).to(q.scalar_type());
}

// ---------------------------------------------------------------------------------------
// Single-rank sequence layout

at::Tensor SingleRankContext::shift_right(const at::Tensor& x) { return shift_rows(x, 1, 1); }

at::Tensor SingleRankContext::shift_left(const at::Tensor& x) {
  const std::int64_t n = x.size(1);
  if (n <= 1) return at::zeros_like(x);
  return at::cat({x.narrow(1, 1, n - 1), at::zeros_like(x.narrow(1, 0, 1))}, 1);
}

at::Tensor SingleRankContext::attention(const TttAttentionInputs& in) {
  // docs/ttt.md, "Two implementations" and "Fused kernels": auto is the fused kernels where
  // this build has them; else, on the CPU, the O(L)-memory tiles from the length where
  // bench/bench_ttt_attention measures them no slower than the local path; not on a GPU,
  // where their tile loop has not been measured.
  if (kind_ == TttAttention::kFused || (kind_ == TttAttention::kAuto && ttt_fused_available()))
    return ttt_attention_fused(in, host_keys(in.key_valid, in.document_ids).get());
  const bool tiled = kind_ == TttAttention::kTiled ||
                     (kind_ == TttAttention::kAuto && in.q.device().is_cpu() && in.q.size(2) >= kTttFlashMinLength);
  if (tiled) return ttt_attention_flash(in, {}, host_keys(in.key_valid, in.document_ids).get());
  return ttt_attention_local(in, &masks_);
}

std::shared_ptr<const tiles::HostKeys> SingleRankContext::host_keys(const at::Tensor& key_valid,
                                                                    const at::Tensor& document_ids) {
  // The same tensors as the last call, unchanged since: every step and layer of one forward
  // pass the unroll's key_valid and document_ids. Holding them keeps their identity unique.
  const auto same = [](const at::Tensor& a, const at::Tensor& b, std::uint32_t version) {
    return a.defined() == b.defined() && (!a.defined() || (a.is_same(b) && a._version() == version));
  };
  if (!host_ || !same(key_valid, host_valid_, host_valid_version_) ||
      !same(document_ids, host_docs_, host_docs_version_)) {
    host_ = tiles::host_keys(key_valid, document_ids);
    host_valid_ = key_valid;
    host_docs_ = document_ids;
    host_valid_version_ = key_valid._version();
    host_docs_version_ = document_ids.defined() ? document_ids._version() : 0;
  }
  return host_;
}

// ---------------------------------------------------------------------------------------
// Stats

TttStats::TttStats(std::int64_t steps)
    : ce_sum(steps, 0.0), mask_sum(steps, 0.0), correct(steps, 0.0), cond_correct(steps, 0.0),
      cond_total(steps, 0.0) {}

TttStats& TttStats::operator+=(const TttStats& o) {
  if (o.steps() != steps()) {
    throw UsageError("cannot add TTT statistics of " + std::to_string(o.steps()) + " steps to " +
                     std::to_string(steps()) + " steps");
  }
  for (std::size_t s = 0; s < ce_sum.size(); ++s) {
    ce_sum[s] += o.ce_sum[s];
    mask_sum[s] += o.mask_sum[s];
    correct[s] += o.correct[s];
    cond_correct[s] += o.cond_correct[s];
    cond_total[s] += o.cond_total[s];
  }
  return *this;
}

namespace {
std::vector<double> ratio(const std::vector<double>& num, const std::vector<double>& den) {
  std::vector<double> r(num.size(), 0.0);
  for (std::size_t i = 0; i < num.size(); ++i) r[i] = den[i] > 0 ? num[i] / den[i] : 0.0;
  return r;
}
double acceptance(const std::vector<double>& acc) {
  double total = 1.0, prod = 1.0;
  for (double a : acc) {
    prod *= a;
    total += prod;
  }
  return total;
}
}  // namespace

std::vector<double> TttStats::loss_per_step() const { return ratio(ce_sum, mask_sum); }

double TttStats::loss(double decay) const {
  if (decay == 0.0) {
    double ce = 0.0, n = 0.0;
    for (std::size_t s = 0; s < ce_sum.size(); ++s) {
      ce += ce_sum[s];
      n += mask_sum[s];
    }
    return n > 0 ? ce / n : 0.0;
  }
  double total = 0.0, w = 1.0;
  for (double l : loss_per_step()) {
    total += w * l;
    w *= decay;
  }
  return total;
}

std::vector<double> TttStats::acc() const { return ratio(correct, mask_sum); }
std::vector<double> TttStats::cond_acc() const { return ratio(cond_correct, cond_total); }
double TttStats::est_ar() const { return acceptance(acc()); }
double TttStats::est_ar_conditional() const { return acceptance(cond_acc()); }

at::Tensor TttStats::to_tensor() const {
  at::Tensor t = at::zeros({5, steps()}, at::kDouble);
  auto a = t.accessor<double, 2>();
  for (std::int64_t s = 0; s < steps(); ++s) {
    a[0][s] = ce_sum[s];
    a[1][s] = mask_sum[s];
    a[2][s] = correct[s];
    a[3][s] = cond_correct[s];
    a[4][s] = cond_total[s];
  }
  return t;
}

TttStats TttStats::from_tensor(const at::Tensor& t) {
  if (t.dim() != 2 || t.size(0) != 5) throw UsageError("TTT statistics tensor must be [5, S]");
  const at::Tensor c = t.to(at::kCPU, at::kDouble).contiguous();
  auto a = c.accessor<double, 2>();
  TttStats s(t.size(1));
  for (std::int64_t i = 0; i < s.steps(); ++i) {
    s.ce_sum[i] = a[0][i];
    s.mask_sum[i] = a[1][i];
    s.correct[i] = a[2][i];
    s.cond_correct[i] = a[3][i];
    s.cond_total[i] = a[4][i];
  }
  return s;
}

at::Tensor ttt_loss(const at::Tensor& ce_sum, const at::Tensor& normalizer, double decay) {
  const std::int64_t steps = ce_sum.size(0);
  const at::Tensor weights =
      at::pow(decay, at::arange(steps, at::TensorOptions().dtype(at::kDouble))).to(ce_sum.device(), at::kFloat);
  return (weights * ce_sum / (normalizer.to(ce_sum.device(), at::kFloat) + kLossEps)).sum();
}

// ---------------------------------------------------------------------------------------
// The unroll

struct TttUnroll::Impl {
  Impl(DraftModel d, TttOptions o) : draft(std::move(d)), options(o) {}
  DraftModel draft;
  TttOptions options;
  at::Tensor embed_tokens;  // [V, H] frozen, on the draft's device
  at::Tensor target_head;   // [Vd, H] frozen
  at::Tensor final_norm;    // [H] float32, defined when the hidden states are pre-norm
  double final_norm_eps = 1e-6;
  SingleRankContext local{options.attention};
};

TttUnroll::TttUnroll(const BaseModel& base, DraftModel draft, TttOptions options)
    : impl_(std::make_unique<Impl>(std::move(draft), options)) {
  const DraftConfig& c = impl_->draft.config();
  if (options.steps < 1) throw UsageError("--ttt-steps must be at least 1");
  if (!base.embed_tokens.defined() || !base.lm_head.defined())
    throw UsageError("the base model has no embed_tokens / lm_head");
  if (base.embed_tokens.dim() != 2 || base.embed_tokens.size(0) != c.vocab_size ||
      base.embed_tokens.size(1) != c.hidden_size || base.lm_head.sizes() != base.embed_tokens.sizes()) {
    throw UsageError("the base model's embeddings " + c10::str(base.embed_tokens.sizes()) + " / lm_head " +
                     c10::str(base.lm_head.sizes()) + " do not match the draft (vocab_size " +
                     std::to_string(c.vocab_size) + ", hidden_size " + std::to_string(c.hidden_size) + ")");
  }
  at::NoGradGuard no_grad;
  const c10::Device device = impl_->draft.device();
  impl_->embed_tokens = base.embed_tokens.detach().to(device);
  // In the draft's dtype (float32), not the base's: with a bf16 base the target logits went
  // through LibTorch's scalar bf16 CPU matmul (no BLAS), about 40% of a training step's CPU,
  // and were rounded to bf16 before the softmax.
  impl_->target_head =
      base.lm_head.detach().to(device).index_select(0, impl_->draft.draft_to_target()).to(impl_->draft.dtype());
  if (options.prenorm_hidden_states && !base.final_norm.defined())
    throw UsageError("--hidden-states-norm pre: the base in " + (base.path.empty() ? std::string("memory") : base.path) +
                     " holds no final norm weight (model.norm.weight); it is needed to turn pre-norm hidden "
                     "states into the base's logits");
  // Held whenever the base has it: records that state pre-norm need it whatever the default.
  if (base.final_norm.defined()) {
    impl_->final_norm = base.final_norm.detach().to(device, at::kFloat);
    impl_->final_norm_eps = base.config.rms_norm_eps;
  }
}

TttUnroll::~TttUnroll() = default;
TttUnroll::TttUnroll(TttUnroll&&) noexcept = default;
TttUnroll& TttUnroll::operator=(TttUnroll&&) noexcept = default;

DraftModel& TttUnroll::draft() { return impl_->draft; }
const TttOptions& TttUnroll::options() const { return impl_->options; }
const at::Tensor& TttUnroll::target_head() const { return impl_->target_head; }

TttResult TttUnroll::forward(const TttBatch& batch, SequenceContext* context) {
  SequenceContext& cx = context ? *context : impl_->local;
  DraftModel& draft = impl_->draft;
  const DraftConfig& c = draft.config();
  const std::int64_t steps = impl_->options.steps;
  const c10::Device device = draft.device();
  const c10::ScalarType dtype = draft.dtype();

  if (!batch.input_ids.defined() || batch.input_ids.dim() != 2)
    throw UsageError("TTT batch: input_ids must be [B, L]");
  const std::int64_t b = batch.input_ids.size(0), n = batch.input_ids.size(1);
  auto check = [&](const at::Tensor& t, const char* name, std::vector<std::int64_t> shape) {
    if (!t.defined() || t.sizes() != at::IntArrayRef(shape))
      throw UsageError(std::string("TTT batch: ") + name + " has shape " +
                       (t.defined() ? c10::str(t.sizes()) : std::string("(none)")) + ", expected " +
                       c10::str(at::IntArrayRef(shape)));
  };
  check(batch.attention_mask, "attention_mask", {b, n});
  check(batch.loss_mask, "loss_mask", {b, n});
  // A stored target distribution (NeMo's cache) takes the place of the last hidden states.
  const bool stored_p = batch.target_probs.defined();
  if (stored_p) {
    check(batch.target_probs, "target_probs", {b, n, c.draft_vocab_size});
    if (!is_soft_ce(impl_->options.loss_terms))
      throw UsageError("TTT batch: --loss " + loss_spec_text(impl_->options.loss_terms) +
                       " compares with the base's logits; the batch carries the stored target distribution "
                       "(NeMo's cache), which trains only kl (the soft cross-entropy)");
  } else {
    check(batch.hidden_states, "hidden_states", {b, n, c.hidden_size});
  }
  check(batch.aux_hidden_states, "aux_hidden_states", {b, n, c.aux_width()});
  const bool packed = batch.document_ids.defined();
  if (packed) {
    check(batch.document_ids, "document_ids", {b, n});
    check(batch.position_ids, "position_ids", {b, n});
  }
  if (n < 1) throw UsageError("TTT batch: empty sequence");

  std::optional<AutocastGuard> autocast;
  if (impl_->options.autocast) autocast.emplace(device.type(), *impl_->options.autocast);
  ProfileScope scope;
  scope.begin("ttt.inputs");

  const auto long_opts = at::TensorOptions().dtype(at::kLong).device(device);
  const at::Tensor ids = batch.input_ids.to(device, at::kLong);
  const at::Tensor docs = packed ? batch.document_ids.to(device, at::kLong) : at::Tensor();
  // Positions: RoPE angles and "this position exists at step s" (position >= s).
  const at::Tensor positions = packed ? batch.position_ids.to(device, at::kLong)
                                      : at::arange(cx.global_offset(), cx.global_offset() + n, long_opts);
  const RotaryTable rope = rope_table(c, positions);

  // Key t stands for token t + 1 (emb is rolled left), so it is real when token t + 1 is.
  at::Tensor next_same_doc;
  at::Tensor key_valid = cx.shift_left(batch.attention_mask.to(device) != 0);
  if (packed) {
    next_same_doc = cx.shift_left(docs) == docs;
    key_valid = key_valid & next_same_doc;
  }
  at::Tensor emb;
  at::Tensor p_target, target_argmax, loss_weight;
  at::Tensor target_logits_kept;  // for a loss other than the soft cross-entropy
  {
    at::NoGradGuard no_grad;
    emb = at::embedding(impl_->embed_tokens, cx.shift_left(ids)).to(dtype);
    if (stored_p) {
      // The producer's target distribution, row t = p[t] already (docs/ttt.md): no shift.
      p_target = batch.target_probs.to(device, at::kFloat);
      target_argmax = p_target.argmax(-1);
    } else {
      // Target at position t: the base distribution of hidden state t + 1 over the draft vocab.
      // Pre-norm tokens first go through the base's final RMSNorm, in float32 (docs/draft.md,
      // pre- and post-norm dumps): every token when the run's default is pre, else those
      // whose record states pre-norm (a stated form wins over the default).
      at::Tensor hs = batch.hidden_states.to(device);
      const bool default_pre = impl_->options.prenorm_hidden_states;
      at::Tensor pre;  // [B, L] bool; undefined: every token takes default_pre
      if (batch.hidden_states_prenorm.defined()) {
        check(batch.hidden_states_prenorm, "hidden_states_prenorm", {b, n});
        const at::Tensor f = batch.hidden_states_prenorm.to(device, at::kLong);
        pre = default_pre ? f != 0 : f == 1;
      }
      // Whether some token is pre-norm is read from the device only when the answer can fail
      // the batch (no final norm); otherwise the norm is applied where pre says, without a sync.
      const bool any_pre = pre.defined() ? (impl_->final_norm.defined() || pre.any().item<bool>()) : default_pre;
      if (any_pre) {
        if (!impl_->final_norm.defined())
          throw UsageError("TTT batch: records state pre-norm hidden states but the base was loaded without its "
                           "final norm weight (model.norm.weight)");
        const at::Tensor x = hs.to(at::kFloat);
        const at::Tensor normed = x * at::rsqrt(x.pow(2).mean(-1, true) + impl_->final_norm_eps) * impl_->final_norm;
        hs = pre.defined() ? at::where(pre.unsqueeze(-1), normed, x) : normed;
      }
      at::Tensor hs_next = cx.shift_left(hs);
      const at::Tensor target_logits =
          at::matmul(hs_next.to(impl_->target_head.scalar_type()), impl_->target_head.t()).to(at::kFloat);
      p_target = at::softmax(target_logits, -1);
      if (!is_soft_ce(impl_->options.loss_terms)) target_logits_kept = target_logits;
      target_argmax = target_logits.argmax(-1);
    }
    loss_weight = cx.shift_left(batch.loss_mask.to(device).to(at::kFloat));
    if (packed) loss_weight = loss_weight * next_same_doc.to(at::kFloat);
  }
  // The architecture's network (trainer/model/draft_net.h) computes everything but the attention.
  const TttNet& net = draft.ttt_net();
  const at::Tensor emb_normed = net.norm_embeddings(emb);
  at::Tensor hidden = net.fc(batch.aux_hidden_states.to(device, dtype));

  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  // Each decoder layer keeps its own keys/values of every step (docs/ttt.md, deeper drafts).
  const std::int64_t layers = net.num_layers();
  std::vector<std::vector<at::Tensor>> k_blocks(static_cast<std::size_t>(layers)),
      v_blocks(static_cast<std::size_t>(layers));
  std::vector<at::Tensor> ce, mask_sums, counts;
  const std::int64_t loss_chunk = impl_->options.loss_chunk_rows < 0
                                      ? auto_loss_chunk_rows(b * n, c.draft_vocab_size)
                                      : impl_->options.loss_chunk_rows;
  // What autocast would run lm_head in (the chunked loss casts explicitly).
  const c10::ScalarType compute_dtype = impl_->options.autocast.value_or(dtype);
  // Recomputation only matters when backward will run (docs/ttt.md, "Recomputation"); the
  // pieces rerun in backward, outside this function's autocast region, so they carry it.
  const bool recompute_layers = impl_->options.recompute && at::GradMode::is_enabled();
  const std::vector<at::Tensor> params = recompute_layers ? draft.parameters() : std::vector<at::Tensor>{};
  auto under_autocast = [autocast_dtype = impl_->options.autocast, device](auto piece) -> RecomputeFn {
    return [autocast_dtype, device, piece](const std::vector<at::Tensor>& x) {
      std::optional<AutocastGuard> ac;
      if (autocast_dtype) ac.emplace(device.type(), *autocast_dtype);
      return piece(x);
    };
  };
  at::Tensor chain_ok = at::ones({b, n}, long_opts.dtype(at::kBool));
  at::Tensor prev_out;
  for (std::int64_t s = 0; s < steps; ++s) {
    if (s > 0) hidden = cx.shift_right(prev_out);
    at::Tensor out = hidden;
    for (std::int64_t layer = 0; layer < layers; ++layer) {
      const auto li = static_cast<std::size_t>(layer);
      scope.begin("ttt.qkv");
      Qkv qkv;
      if (recompute_layers) {
        const std::vector<at::Tensor> r = recompute(under_autocast([draft, rope, layer](const std::vector<at::Tensor>& x) {
                                                      Qkv y = draft.ttt_net().qkv(x[0], x[1], rope, layer);
                                                      return std::vector<at::Tensor>{y.q, y.k, y.v};
                                                    }),
                                                    {emb_normed, out}, params);
        qkv = Qkv{r[0], r[1], r[2]};
      } else {
        qkv = net.qkv(emb_normed, out, rope, layer);
      }
      k_blocks[li].push_back(qkv.k);
      v_blocks[li].push_back(qkv.v);
      scope.begin("ttt.attention");
      const at::Tensor attn = cx.attention({qkv.q, k_blocks[li], v_blocks[li], key_valid, s, scale, docs});
      scope.begin("ttt.layer");
      if (recompute_layers) {
        out = recompute(under_autocast([draft, layer](const std::vector<at::Tensor>& x) {
                          return std::vector<at::Tensor>{draft.ttt_net().finish_layer(x[0], x[1], layer)};
                        }),
                        {out, attn}, params)[0];
      } else {
        out = net.finish_layer(out, attn, layer);
      }
    }
    scope.begin("ttt.lm_head_loss");
    // Draft position t predicts the target at t + 1, from step s on (docs/ttt.md: logp[:, s:L-1]).
    const at::Tensor weight = loss_weight * (positions >= s).to(at::kFloat);
    const at::Tensor normed = net.final_norm(out);
    at::Tensor draft_argmax;
    if (target_logits_kept.defined()) {
      // --loss other than kl (trainer/unroll/losses.h): the step's whole logits, in float32.
      const at::Tensor logits = at::linear(normed, net.lm_head_weight()).to(at::kFloat);
      const at::Tensor per = per_position_loss(logits.reshape({b * n, c.draft_vocab_size}),
                                               target_logits_kept.reshape({b * n, c.draft_vocab_size}),
                                               impl_->options.loss_terms);
      ce.push_back((weight.reshape({b * n}) * per).sum());
      at::NoGradGuard no_grad;
      draft_argmax = logits.argmax(-1);
    } else if (loss_chunk > 0) {
      // lm_head and the loss a chunk of rows at a time, never the step's whole logits.
      const SoftCeResult r = chunked_soft_ce(normed.reshape({b * n, c.hidden_size}),
                                             net.lm_head_weight(), p_target.reshape({b * n, c.draft_vocab_size}),
                                             weight.reshape({b * n}), loss_chunk, compute_dtype);
      ce.push_back(r.ce_sum);
      draft_argmax = r.argmax.view({b, n});
    } else if (compute_dtype == at::kFloat && cpu_kernels::takes(out) && cpu_kernels::takes(net.lm_head_weight())) {
      // The same loss in one pass per direction over the logits (trainer/model/cpu_kernels.h).
      const SoftCeResult r = cpu_kernels::soft_ce(normed.reshape({b * n, c.hidden_size}),
                                                  net.lm_head_weight(), p_target.reshape({b * n, c.draft_vocab_size}),
                                                  weight.reshape({b * n}));
      ce.push_back(r.ce_sum);
      draft_argmax = r.argmax.view({b, n});
    } else {
      const at::Tensor logits = at::linear(normed, net.lm_head_weight()).to(at::kFloat);
      const at::Tensor logp = at::log_softmax(logits, -1);
      ce.push_back(-(weight * (p_target * logp).sum(-1)).sum());
      at::NoGradGuard no_grad;
      draft_argmax = logits.argmax(-1);
    }
    mask_sums.push_back(weight.sum());
    {
      scope.begin("ttt.metrics");
      at::NoGradGuard no_grad;
      const at::Tensor counted = weight != 0;
      const at::Tensor right = (draft_argmax == target_argmax) & counted;
      counts.push_back(right.sum());
      counts.push_back((right & chain_ok).sum());
      counts.push_back((counted & chain_ok).sum());
      // The chain starting at base position u is at t = u + s in step s.
      chain_ok = cx.shift_right(chain_ok & right);
    }
    // The next step's hidden input (EAGLE 3.1's norm_output: the final norm's output).
    prev_out = net.norm_output() ? normed : out;
  }
  autocast.reset();
  scope.begin("ttt.stats");

  TttResult r;
  r.ce_sum = at::stack(ce);
  r.mask_sum = at::stack(mask_sums).detach();
  r.loss = ttt_loss(r.ce_sum, cx.sum_across(r.mask_sum), impl_->options.loss_decay);
  const at::Tensor host = at::cat({r.ce_sum.detach().to(at::kDouble).unsqueeze(0),
                                   r.mask_sum.to(at::kDouble).unsqueeze(0),
                                   at::stack(counts).to(at::kDouble).view({steps, 3}).t()},
                                  0)
                              .cpu();
  r.stats = TttStats::from_tensor(host);
  return r;
}

}  // namespace eaglekit::trainer
