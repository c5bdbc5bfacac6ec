#include "trainer/unroll/dflash.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>

#include "formats/error.h"
#include "trainer/model/draft_net.h"
#include "trainer/model/rotary.h"
#include "trainer/unroll/autocast.h"

namespace eaglekit::trainer {

namespace {

std::uint64_t splitmix64(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// A uniform draw in [0, n) (Lemire's multiply-shift; the bias is below 2^-40 for any n here).
std::int64_t below(std::uint64_t& state, std::int64_t n) {
  return static_cast<std::int64_t>((static_cast<unsigned __int128>(splitmix64(state)) * static_cast<std::uint64_t>(n)) >> 64);
}

}  // namespace

std::uint64_t dflash_row_seed(std::uint64_t seed, std::uint64_t epoch, const std::string& conversation_id) {
  std::uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a of the id
  for (unsigned char ch : conversation_id) h = (h ^ ch) * 0x100000001b3ULL;
  std::uint64_t state = seed ^ (epoch * 0xd1b54a32d192ed03ULL) ^ h;
  return splitmix64(state);
}

DFlashAnchors dflash_anchors(const at::Tensor& loss_mask, std::int64_t block_size, std::int64_t num_anchors,
                             const std::vector<std::uint64_t>& row_seeds) {
  std::vector<std::vector<std::uint64_t>> seeds;
  for (std::uint64_t s : row_seeds) seeds.push_back({s});
  return dflash_anchors(loss_mask, at::Tensor(), at::Tensor(), block_size, num_anchors, seeds);
}

std::int64_t dflash_most_valid(const at::Tensor& loss_mask, const at::Tensor& document_ids, const at::Tensor& position_ids,
                               std::int64_t block_size) {
  if (!loss_mask.defined() || loss_mask.dim() != 2) throw UsageError("DFlash anchors: loss_mask must be [B, L]");
  std::vector<std::vector<std::uint64_t>> seeds(static_cast<std::size_t>(loss_mask.size(0)));
  if (document_ids.defined()) {
    const std::int64_t docs = loss_mask.numel() > 0 ? document_ids.max().item<std::int64_t>() + 1 : 0;
    for (auto& row : seeds) row.assign(static_cast<std::size_t>(std::max<std::int64_t>(docs, 0)), 0);
  } else {
    for (auto& row : seeds) row.assign(1, 0);
  }
  std::int64_t most = 0;
  dflash_anchors(loss_mask, document_ids, position_ids, block_size, 1, seeds, 0, &most);
  return most;
}

DFlashAnchors dflash_anchors(const at::Tensor& loss_mask, const at::Tensor& document_ids, const at::Tensor& position_ids,
                             std::int64_t block_size, std::int64_t num_anchors,
                             const std::vector<std::vector<std::uint64_t>>& document_seeds, std::int64_t most_valid,
                             std::int64_t* most_out) {
  if (!loss_mask.defined() || loss_mask.dim() != 2) throw UsageError("DFlash anchors: loss_mask must be [B, L]");
  if (block_size < 1 || num_anchors < 1) throw UsageError("DFlash anchors: block_size and num_anchors must be positive");
  const std::int64_t b = loss_mask.size(0), n = loss_mask.size(1);
  if (static_cast<std::int64_t>(document_seeds.size()) != b)
    throw UsageError("DFlash anchors: " + std::to_string(document_seeds.size()) + " row seeds for " + std::to_string(b) + " rows");
  const bool packed = document_ids.defined();
  if (packed && (document_ids.sizes() != loss_mask.sizes() || !position_ids.defined() ||
                 position_ids.sizes() != loss_mask.sizes()))
    throw UsageError("DFlash anchors: packed rows need document_ids and position_ids of the loss mask's shape " +
                     c10::str(loss_mask.sizes()));
  const at::Tensor lm = loss_mask.to(at::kCPU, at::kFloat).contiguous();
  const float* m = lm.data_ptr<float>();
  at::Tensor docs_t, pos_t;
  if (packed) {
    docs_t = document_ids.to(at::kCPU, at::kLong).contiguous();
    pos_t = position_ids.to(at::kCPU, at::kLong).contiguous();
  }
  const std::int64_t* docs = packed ? docs_t.data_ptr<std::int64_t>() : nullptr;
  const std::int64_t* pos = packed ? pos_t.data_ptr<std::int64_t>() : nullptr;
  // The last anchor (a position in its document) whose block fits in a row of its own.
  const std::int64_t last = std::max<std::int64_t>(n - block_size, 0);
  struct Doc {
    std::int64_t id = 0;
    std::vector<std::int64_t> valid;  // row columns
  };
  std::vector<std::vector<Doc>> rows(static_cast<std::size_t>(b));
  std::int64_t most = 0;
  for (std::int64_t r = 0; r < b; ++r) {
    std::vector<Doc>& row = rows[static_cast<std::size_t>(r)];
    if (!packed) row.push_back(Doc{});
    for (std::int64_t col = 0; col < n; ++col) {
      const std::int64_t d = packed ? docs[r * n + col] : 0;
      if (d < 0) continue;  // padding
      if (packed && (row.empty() || row.back().id != d)) {
        for (const Doc& seen : row)
          if (seen.id == d)
            throw UsageError("DFlash anchors: document " + std::to_string(d) + " of row " + std::to_string(r) +
                             " is not contiguous");
        row.push_back(Doc{d, {}});
      }
      const std::int64_t p = packed ? pos[r * n + col] : col;
      if (p <= last && m[r * n + col] > 0.5f) row.back().valid.push_back(col);
    }
    for (const Doc& doc : row) {
      if (doc.id >= static_cast<std::int64_t>(document_seeds[static_cast<std::size_t>(r)].size()))
        throw UsageError("DFlash anchors: no seed for document " + std::to_string(doc.id) + " of row " + std::to_string(r));
      most = std::max<std::int64_t>(most, static_cast<std::int64_t>(doc.valid.size()));
    }
  }
  if (most_out) *most_out = most;
  if (most_valid > 0 && most_valid < most)
    throw UsageError("DFlash anchors: the global batch's most valid anchors (" + std::to_string(most_valid) +
                     ") is below this batch's (" + std::to_string(most) + ")");
  most = std::max(most, most_valid);
  const std::int64_t per_doc = std::min(num_anchors, most - 1);
  DFlashAnchors out;
  if (per_doc <= 0) {  // nothing to learn in this batch (ModelOpt's empty case)
    out.positions = at::zeros({b, 1}, at::kLong);
    out.keep = at::zeros({b, 1}, at::kBool);
    return out;
  }
  std::vector<std::vector<std::int64_t>> picks(static_cast<std::size_t>(b));
  std::int64_t cols = 1;
  for (std::int64_t r = 0; r < b; ++r) {
    std::vector<std::int64_t>& pick = picks[static_cast<std::size_t>(r)];
    for (Doc& doc : rows[static_cast<std::size_t>(r)]) {
      std::vector<std::int64_t>& v = doc.valid;
      const std::int64_t count = static_cast<std::int64_t>(v.size()), take = std::min(count, per_doc);
      std::uint64_t state = document_seeds[static_cast<std::size_t>(r)][static_cast<std::size_t>(doc.id)];
      for (std::int64_t i = 0; i < take; ++i)
        std::swap(v[static_cast<std::size_t>(i)], v[static_cast<std::size_t>(i + below(state, count - i))]);
      pick.insert(pick.end(), v.begin(), v.begin() + take);
    }
    std::sort(pick.begin(), pick.end());
    cols = std::max<std::int64_t>(cols, static_cast<std::int64_t>(pick.size()));
  }
  out.positions = at::zeros({b, cols}, at::kLong);
  out.keep = at::zeros({b, cols}, at::kBool);
  std::int64_t* out_pos = out.positions.data_ptr<std::int64_t>();
  bool* keep = out.keep.data_ptr<bool>();
  for (std::int64_t r = 0; r < b; ++r) {
    const std::vector<std::int64_t>& pick = picks[static_cast<std::size_t>(r)];
    for (std::size_t i = 0; i < pick.size(); ++i) {
      out_pos[r * cols + static_cast<std::int64_t>(i)] = pick[i];
      keep[r * cols + static_cast<std::int64_t>(i)] = true;
    }
  }
  return out;
}

at::Tensor dpace_weights(const at::Tensor& confidences, double alpha, const at::Tensor& valid) {
  if (!(alpha > 0.0 && alpha <= 1.0)) throw UsageError("D-PACE alpha must be in (0, 1], got " + std::to_string(alpha));
  at::NoGradGuard no_grad;
  const at::Tensor keep = valid.to(at::kBool);
  at::Tensor q = alpha + (1.0 - alpha) * confidences.to(at::kFloat);
  q = at::where(keep, q, at::ones_like(q));
  const at::Tensor c = at::cumprod(q, -1) * keep.to(at::kFloat);
  const at::Tensor inclusive = at::cumsum(c, -1);
  return (inclusive.narrow(-1, inclusive.size(-1) - 1, 1) - inclusive + c).to(confidences.scalar_type());
}

at::Tensor dflash_loss(const at::Tensor& weighted_loss, double weight_sum) {
  if (!(weight_sum > 1.0)) return weighted_loss * 0.0;
  return weighted_loss / (weight_sum + 1e-6);
}

struct DFlashUnroll::Impl {
  DraftModel draft;
  DFlashOptions options;
  at::Tensor embed_tokens;  // [V, H] frozen
  at::Tensor lm_head;       // [V, H] frozen
  at::Tensor final_norm;    // [H] float32, when the base has it
  double final_norm_eps = 1e-6;
};

DFlashUnroll::DFlashUnroll(const BaseModel& base, DraftModel draft, DFlashOptions options)
    : impl_(std::make_unique<Impl>(Impl{std::move(draft), options, {}, {}, {}, 1e-6})) {
  const DraftConfig& c = impl_->draft.config();
  impl_->draft.block_net();  // UsageError unless a block drafter
  if (base.embed_tokens.size(0) != c.vocab_size || base.embed_tokens.size(1) != c.hidden_size)
    throw UsageError("the base's embeddings are " + c10::str(base.embed_tokens.sizes()) + ", the DFlash draft needs [" +
                     std::to_string(c.vocab_size) + ", " + std::to_string(c.hidden_size) + "]");
  if (options.num_anchors < 1) throw UsageError("DFlash: num_anchors must be positive");
  if (options.decay_gamma < 0) throw UsageError("DFlash: the decay gamma must be >= 0");
  dpace_weights(at::ones({1}), options.dpace_alpha, at::ones({1}));  // checks alpha
  const c10::Device device = impl_->draft.device();
  impl_->embed_tokens = base.embed_tokens.detach().to(device);
  impl_->lm_head = base.lm_head.detach().to(device);
  if (options.prenorm_hidden_states && !base.final_norm.defined())
    throw UsageError("pre-norm hidden states need the base's final norm weight (model.norm.weight)");
  if (base.final_norm.defined()) {
    impl_->final_norm = base.final_norm.detach().to(device, at::kFloat);
    impl_->final_norm_eps = base.config.rms_norm_eps;
  }
}

DFlashUnroll::~DFlashUnroll() = default;
DFlashUnroll::DFlashUnroll(DFlashUnroll&&) noexcept = default;
DFlashUnroll& DFlashUnroll::operator=(DFlashUnroll&&) noexcept = default;
DraftModel& DFlashUnroll::draft() { return impl_->draft; }
const DFlashOptions& DFlashUnroll::options() const { return impl_->options; }

DFlashResult DFlashUnroll::forward(const TttBatch& batch, const DFlashAnchors& anchors) {
  DraftModel& draft = impl_->draft;
  const DraftConfig& c = draft.config();
  const DFlashOptions& o = impl_->options;
  const BlockNet& net = draft.block_net();
  const std::int64_t bs = c.block_size;
  const c10::Device device = draft.device();
  const c10::ScalarType dtype = draft.dtype();

  if (!batch.input_ids.defined() || batch.input_ids.dim() != 2) throw UsageError("DFlash batch: input_ids must be [B, L]");
  const std::int64_t b = batch.input_ids.size(0), n = batch.input_ids.size(1);
  auto check = [&](const at::Tensor& t, const char* name, std::vector<std::int64_t> shape) {
    if (!t.defined() || t.sizes() != at::IntArrayRef(shape))
      throw UsageError(std::string("DFlash batch: ") + name + " has shape " +
                       (t.defined() ? c10::str(t.sizes()) : std::string("(none)")) + ", expected " +
                       c10::str(at::IntArrayRef(shape)));
  };
  check(batch.loss_mask, "loss_mask", {b, n});
  check(batch.hidden_states, "hidden_states", {b, n, c.hidden_size});
  check(batch.aux_hidden_states, "aux_hidden_states", {b, n, c.aux_width()});
  const bool packed = batch.document_ids.defined();
  if (packed) {
    check(batch.document_ids, "document_ids", {b, n});
    check(batch.position_ids, "position_ids", {b, n});
  }
  if (!anchors.positions.defined() || anchors.positions.dim() != 2 || anchors.positions.size(0) != b ||
      !anchors.keep.defined() || anchors.keep.sizes() != anchors.positions.sizes())
    throw UsageError("DFlash batch: anchors must be [B, N] positions and keep for the batch's " + std::to_string(b) + " rows");
  if (n < 1) throw UsageError("DFlash batch: empty sequence");

  std::optional<AutocastGuard> autocast;
  if (o.autocast) autocast.emplace(device.type(), *o.autocast);
  const auto long_opts = at::TensorOptions().dtype(at::kLong).device(device);
  const std::int64_t blocks = anchors.positions.size(1), q_len = blocks * bs;
  const at::Tensor ids = batch.input_ids.to(device, at::kLong);
  const at::Tensor anchor = anchors.positions.to(device, at::kLong);
  const at::Tensor keep = anchors.keep.to(device, at::kBool);
  const at::Tensor offsets = at::arange(bs, long_opts);
  const at::Tensor label = anchor.unsqueeze(-1) + offsets.view({1, 1, bs});  // [B, N, bs]: the token each slot predicts
  const at::Tensor safe = label.clamp_max(n - 1).view({b, q_len});
  // Packed rows: each token's document, each block's (its anchor's) and each token's
  // position in its document; a row of its own is document 0 at positions 0, 1, ...
  at::Tensor docs, anchor_doc, positions;
  if (packed) {
    docs = batch.document_ids.to(device, at::kLong);
    anchor_doc = docs.gather(1, anchor.clamp(0, n - 1));
    positions = batch.position_ids.to(device, at::kLong);
  } else {
    positions = at::arange(n, long_opts).unsqueeze(0).expand({b, n});
  }
  // A block's positions past its row's end, or past its document's, do not count.
  at::Tensor in_bounds = label < n;
  if (packed) in_bounds = in_bounds & (docs.gather(1, safe).view({b, blocks, bs}) == anchor_doc.unsqueeze(-1));
  const at::Tensor target_ids = ids.gather(1, safe).view({b, blocks, bs});
  // The context a block sees ends before its anchor, so no block sees a position at or after
  // the batch's last kept anchor: the context stops there (the same function; a padded batch
  // of short rows skips most of its context).
  const std::int64_t ctx_len = std::clamp<std::int64_t>(
      (anchors.positions.to(at::kCPU, at::kLong) * anchors.keep.to(at::kCPU, at::kLong)).max().item<std::int64_t>(), 1, n);

  at::Tensor emb, teacher_p, rope_positions;
  {
    at::NoGradGuard no_grad;
    // The block's tokens: the anchor's own token, then mask_token_id (all of it for a block not kept).
    at::Tensor block_ids = at::full({b, blocks, bs}, c.mask_token_id, long_opts);
    block_ids.select(2, 0).copy_(at::where(keep, ids.gather(1, anchor.clamp(0, n - 1)), at::full_like(anchor, c.mask_token_id)));
    emb = at::embedding(impl_->embed_tokens, block_ids.view({b, q_len})).to(dtype);
    if (o.self_distillation) {
      // The teacher for the token at anchor + k is the base's distribution after token
      // anchor + k - 1: lm_head of that hidden state (after the final norm when pre-norm).
      at::Tensor hs = batch.hidden_states.to(device).gather(
          1, (safe - 1).clamp_min(0).unsqueeze(-1).expand({b, q_len, c.hidden_size}));
      at::Tensor pre;
      if (batch.hidden_states_prenorm.defined()) {
        check(batch.hidden_states_prenorm, "hidden_states_prenorm", {b, n});
        const at::Tensor f = batch.hidden_states_prenorm.to(device, at::kLong).gather(1, (safe - 1).clamp_min(0));
        pre = o.prenorm_hidden_states ? f != 0 : f == 1;
      }
      const bool any_pre = pre.defined() ? pre.any().item<bool>() : o.prenorm_hidden_states;
      if (any_pre) {
        if (!impl_->final_norm.defined())
          throw UsageError("DFlash batch: records state pre-norm hidden states but the base was loaded without its "
                           "final norm weight (model.norm.weight)");
        const at::Tensor x = hs.to(at::kFloat);
        const at::Tensor normed = x * at::rsqrt(x.pow(2).mean(-1, true) + impl_->final_norm_eps) * impl_->final_norm;
        hs = pre.defined() ? at::where(pre.unsqueeze(-1), normed, x) : normed;
      }
      const at::Tensor teacher = at::matmul(hs.to(impl_->lm_head.scalar_type()), impl_->lm_head.t()).to(at::kFloat);
      teacher_p = at::softmax(teacher, -1);
    }
    // RoPE: the context at its positions in its document, the block at its anchor's plus 0, 1, ...
    const at::Tensor block_positions = positions.gather(1, anchor.clamp(0, n - 1)).unsqueeze(-1) + offsets.view({1, 1, bs});
    rope_positions = at::cat({positions.narrow(1, 0, ctx_len), block_positions.view({b, q_len})}, 1);
  }
  const RotaryTable rope_all = rope_table(c, rope_positions);
  const RotaryTable rope_ctx{rope_all.cos.narrow(1, 0, ctx_len), rope_all.sin.narrow(1, 0, ctx_len)};
  const RotaryTable rope_q{rope_all.cos.narrow(1, ctx_len, q_len), rope_all.sin.narrow(1, ctx_len, q_len)};

  // Block j's queries see the context strictly before its anchor (in its anchor's document)
  // and the whole block j (the last bs columns), nothing when the block is not kept.
  at::Tensor allowed;
  {
    const at::Tensor anchor_q = anchor.repeat_interleave(bs, 1);  // [B, Q]
    const at::Tensor keep_q = keep.repeat_interleave(bs, 1).unsqueeze(-1);
    at::Tensor ctx_ok = at::arange(ctx_len, long_opts).view({1, 1, ctx_len}) < anchor_q.unsqueeze(-1);
    if (packed) {
      ctx_ok = ctx_ok & (docs.narrow(1, 0, ctx_len).unsqueeze(1) == anchor_doc.repeat_interleave(bs, 1).unsqueeze(-1));
    }
    allowed = at::cat({ctx_ok & keep_q, keep_q.expand({b, q_len, bs})}, 2);
  }

  const at::Tensor context = net.context(batch.aux_hidden_states.narrow(1, 0, ctx_len).to(device, dtype));
  at::Tensor x = emb;
  for (std::int64_t i = 0; i < net.num_layers(); ++i) x = net.layer(x, context, rope_q, rope_ctx, allowed, bs, i);
  const at::Tensor out = net.final_norm(x);
  const at::Tensor logits = at::matmul(out, impl_->lm_head.to(out.scalar_type()).t()).to(at::kFloat).view({b, blocks, bs, -1});
  const at::Tensor logp = at::log_softmax(logits, -1);
  const at::Tensor hard = -logp.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1);  // [B, N, bs]
  const at::Tensor per_token =
      o.self_distillation ? -(teacher_p.view({b, blocks, bs, -1}) * logp).sum(-1) : hard;

  // The positions that count: a kept block, inside the sequence, after the anchor, in the loss mask.
  const at::Tensor lm = batch.loss_mask.to(device, at::kFloat).gather(1, safe).view({b, blocks, bs});
  const at::Tensor counted =
      keep.unsqueeze(-1).to(at::kFloat) * in_bounds.to(at::kFloat) * (offsets > 0).to(at::kFloat).view({1, 1, bs}) * lm;
  at::Tensor weights = counted;
  if (o.weighting == DFlashWeighting::kDpace) {
    at::Tensor dp = at::ones_like(counted);
    dp.narrow(2, 1, bs - 1).copy_(dpace_weights(at::exp(-hard.detach().narrow(2, 1, bs - 1)), o.dpace_alpha,
                                                counted.narrow(2, 1, bs - 1)));
    weights = counted * dp;
  } else if (o.decay_gamma > 0) {
    weights = counted * at::exp(-(offsets - 1).clamp_min(0).to(at::kFloat) / o.decay_gamma).view({1, 1, bs});
  }
  DFlashResult r;
  r.weighted_loss = (per_token * weights).sum();
  r.weight_sum = weights.sum().item<double>();

  {  // per block position 1..bs-1
    at::NoGradGuard no_grad;
    const at::Tensor m = counted.narrow(2, 1, bs - 1).to(at::kDouble);
    const at::Tensor right = (logits.argmax(-1) == target_ids).narrow(2, 1, bs - 1).to(at::kDouble);
    const at::Tensor hit = m * right;
    // The block was right at every earlier counted position (1 at position 1).
    const at::Tensor chain = at::cat({at::ones_like(hit.narrow(2, 0, 1)), at::cumprod(hit, 2).narrow(2, 0, bs - 2)}, 2);
    const std::vector<std::int64_t> rows_blocks{0, 1};  // summed over rows and blocks, per position
    const at::Tensor rows = at::stack({(per_token.detach().narrow(2, 1, bs - 1).to(at::kDouble) * m).sum(rows_blocks),
                                       m.sum(rows_blocks), hit.sum(rows_blocks), (hit * chain).sum(rows_blocks),
                                       (m * chain).sum(rows_blocks)})
                                .cpu();
    r.stats = TttStats::from_tensor(rows);
  }
  return r;
}

}  // namespace eaglekit::trainer
