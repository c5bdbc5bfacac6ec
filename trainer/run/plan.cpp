#include "trainer/run/plan.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <sstream>
#include <unordered_set>

#include "formats/error.h"
#include "formats/registry.h"
#include "lib/clock.h"
#include "lib/loader.h"
#include "trainer/io/export.h"
#include "trainer/io/metrics_log.h"
#include "trainer/model/architecture_rows.h"
#include "trainer/model/base_model.h"
#include "trainer/model/dflash.h"
#include "trainer/model/draft_model.h"
#include "trainer/run/optim.h"
#include "trainer/run/threads.h"
#include "lib/malloc_policy.h"
#include "lib/wait_policy.h"

namespace eaglekit::trainer {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

std::string ids_text(const std::vector<std::int64_t>& ids) {
  std::string s;
  for (auto id : ids) s += (s.empty() ? "" : ",") + std::to_string(id);
  return s;
}

std::string gib(double bytes) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(bytes < 1e9 ? 3 : 1) << bytes / (1024.0 * 1024.0 * 1024.0) << " GiB";
  return os.str();
}

// Trainable parameters of the draft, as its architecture lists them (trainer/model/architecture.h).
std::int64_t draft_parameters(const DraftConfig& c) {
  std::int64_t n = 0;
  for (const ParameterShape& p : draft_architecture(c.architecture).parameters(c)) n += p.numel();
  return n;
}

// Activations one micro-batch keeps for backward, float32, per TTT step: per decoder layer
// the row's inputs and norms (about 8H per token), q/k/v and the attention output, the
// MLP's gate, up and product (3I), and per head the masked scores and probabilities over
// the L keys of block 0 (2L); the draft logits and their softmax (2Vd); plus once the
// target distribution over Vd and the transient target logits over V.
double activation_bytes(const DraftConfig& c, std::int64_t rows, std::int64_t length, std::int64_t steps) {
  const double tokens = static_cast<double>(rows) * static_cast<double>(length);
  const double qkv = static_cast<double>((c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim);
  const double per_layer = 8.0 * c.hidden_size + qkv + c.num_attention_heads * c.head_dim +
                           3.0 * c.intermediate_size + 2.0 * c.num_attention_heads * static_cast<double>(length);
  const double per_token_step = static_cast<double>(c.num_hidden_layers) * per_layer + 2.0 * c.draft_vocab_size;
  const double once = static_cast<double>(c.draft_vocab_size + c.vocab_size);
  return 4.0 * tokens * (per_token_step * static_cast<double>(steps) + once);
}

// Floating-point operations of the whole run on one rank. Per row token and TTT step, the
// draft's matmuls forward and backward (6 per parameter; lm_head over Vd included) and the
// attention over the block-0 keys before it (QK^T and PV, about L/2 keys on average, 4 flops
// per key and query channel forward, twice that backward); once per row token the base's
// lm_head over V for the targets (forward only). Norms, softmax, the loss and the data are
// left out: they make the real run slower, never faster.
double run_flops(const DraftConfig& c, std::int64_t parameters, double row_tokens, std::int64_t row_length,
                 std::int64_t steps) {
  const double qd = static_cast<double>(c.num_attention_heads * c.head_dim);
  const double attention = 12.0 * static_cast<double>(c.num_hidden_layers) * qd * (row_length / 2.0);
  const double per_token = static_cast<double>(steps) * (6.0 * static_cast<double>(parameters) + attention) +
                           2.0 * static_cast<double>(c.hidden_size) * static_cast<double>(c.vocab_size);
  return row_tokens * per_token;
}

// DFlash (the block unroll, docs/dflash.md): a row of L tokens trains B = min(anchors, L -
// block) blocks of `block` tokens each. Every layer keeps, per context token, its k and v
// (2 n_kv d) and the context itself (H, after fc and hidden_norm, 2H); per block token what a
// TTT layer keeps plus the scores and probabilities over the context keys (at most L) and its
// block's own (2 n_h (L + block)); then
// per block token the logits over the base's whole vocabulary, their softmax and the teacher's
// (3V; DFlash has no draft vocabulary).
std::int64_t dflash_blocks(std::int64_t length, std::int64_t block, std::int64_t anchors) {
  return std::max<std::int64_t>(1, std::min<std::int64_t>(anchors, length - block));
}

double dflash_activation_bytes(const DraftConfig& c, std::int64_t rows, std::int64_t length, std::int64_t anchors) {
  const double block_tokens = static_cast<double>(dflash_blocks(length, c.block_size, anchors) * c.block_size);
  const double layers = static_cast<double>(c.num_hidden_layers);
  const double kv = 2.0 * static_cast<double>(c.num_key_value_heads * c.head_dim);
  const double qkv = static_cast<double>((c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim);
  const double per_context_token = 2.0 * c.hidden_size + layers * kv;
  const double per_block_token = layers * (8.0 * c.hidden_size + qkv + c.num_attention_heads * c.head_dim +
                                           3.0 * c.intermediate_size +
                                           2.0 * c.num_attention_heads * static_cast<double>(length + c.block_size)) +
                                 3.0 * static_cast<double>(c.vocab_size);
  return 4.0 * static_cast<double>(rows) *
         (static_cast<double>(length) * per_context_token + block_tokens * per_block_token);
}

// DFlash's FLOPs on one rank: per block token the decoder layers' matmuls forward and backward
// (6 per layer parameter), the attention over the context before its anchor (L/2 on average)
// and its block (12 n_h d per key and layer, forward and backward), the base's lm_head forward
// and backward to its input (4 H V, no weight gradient) and the teacher's lm_head (2 H V,
// forward only); per row token, fc and each layer's k and v projections of the context (6 per
// parameter).
double dflash_flops(const DraftConfig& c, double rows, std::int64_t length, std::int64_t anchors) {
  const double h = static_cast<double>(c.hidden_size);
  const double layers = static_cast<double>(c.num_hidden_layers);
  const double qd = static_cast<double>(c.num_attention_heads * c.head_dim);
  const double kvd = static_cast<double>(c.num_key_value_heads * c.head_dim);
  const double fc = static_cast<double>(c.aux_width()) * h;
  const double layer = h * (qd + 2.0 * kvd) + qd * h + 3.0 * h * static_cast<double>(c.intermediate_size);
  const double block_tokens = static_cast<double>(dflash_blocks(length, c.block_size, anchors) * c.block_size);
  const double keys = static_cast<double>(length) / 2.0 + static_cast<double>(c.block_size);
  const double per_block_token = 6.0 * layers * layer + 12.0 * layers * qd * keys + 6.0 * h * c.vocab_size;
  const double per_context_token = 6.0 * (fc + layers * 2.0 * h * kvd);
  return rows * (block_tokens * per_block_token + static_cast<double>(length) * per_context_token);
}

}  // namespace

double measure_cpu_matmul_flops_per_s(bool bfloat16) {
  constexpr std::int64_t n = 512;
  const c10::ScalarType dtype = bfloat16 ? at::kBFloat16 : at::kFloat;
  const at::Tensor a = at::rand({n, n}).to(dtype), b = at::rand({n, n}).to(dtype);
  at::Tensor c = at::mm(a, b);
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  int reps = 0;
  double seconds = 0;
  do {
    c = at::mm(a, b);
    ++reps;
    seconds = seconds_since(t0);
  } while (seconds < 0.2 && reps < 1000);
  return seconds > 0 ? 2.0 * n * n * n * reps / seconds : 0;
}

namespace {

// MemAvailable of /proc/meminfo in bytes; < 0 when it cannot be read.
double host_available_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream fields(line.substr(13));
    double kib = -1;
    fields >> kib;  // "MemAvailable:   123456 kB"
    return kib >= 0 ? kib * 1024.0 : -1;
  }
  return -1;
}

}  // namespace

std::string flops_text(double flops) {
  const char* units[] = {"", "k", "M", "G", "T", "P", "E"};
  int u = 0;
  while (flops >= 1000 && u < 6) {
    flops /= 1000;
    ++u;
  }
  std::ostringstream os;
  os << std::setprecision(3) << flops << " " << units[u] << "FLOP";
  return os.str();
}

namespace {

std::string text_of(double x) {
  std::ostringstream os;
  os << x;
  return os.str();
}

// The mesh sizes of a plan: world_size ranks (at least --cp), cp of them per group.
void plan_mesh(RunPlan& p, int world_size, int cp_size) {
  p.cp_size = cp_size;
  p.world_size = std::max(world_size, cp_size);
  if (p.world_size % p.cp_size != 0)
    throw UsageError("--cp " + std::to_string(cp_size) + " does not divide the world size " +
                     std::to_string(p.world_size));
  p.dp_size = p.world_size / p.cp_size;
  p.decisions.push_back({"mesh", std::to_string(p.world_size) + " rank(s): dp " + std::to_string(p.dp_size) + " x cp " +
                                     std::to_string(p.cp_size),
                         (world_size > 1 ? "the launch's world size" : std::string("a single process")) + ", --cp " +
                             std::to_string(cp_size)});
}

// LibTorch's thread count as the process started, before a run sets its own.
int libtorch_default_threads() {
  static const int initial = at::get_num_threads();
  return initial;
}

// The run's LibTorch threads (trainer/run/threads.h): the number, and whether it adapts.
void plan_threads(RunPlan& p, const RunOptions& o, bool can_adapt) {
  const ThreadChoice c = default_threads(o.threads, libtorch_default_threads());
  p.threads = c.threads;
  p.adapt_threads = can_adapt && o.adapt_threads;
  std::string value = std::to_string(c.threads);
  std::string why = c.why;
  if (p.adapt_threads) {
    value += ", fewer while the cores are busy";
    why += "; --adapt-threads: a count is kept only where it measured faster, and the float rounding follows it "
           "(not bit-reproducible)";
  }
  p.decisions.push_back({"threads", value, why});
  const WaitPolicy w = current_wait_policy();
  p.wait_policy = w.value;
  p.decisions.push_back({"openmp waiting", w.value, w.why});
  const MallocPolicy m = current_malloc_policy();
  p.malloc_policy = m.value;
  p.decisions.push_back({"freed memory", m.value, m.why});
}

// A loader of dp rank 0 that reads nothing but the first record's metadata (and, in longest
// and pack mode, the token counts the index lacks): the run's record shape and batches per
// epoch, as every rank's loader has them.
struct Probe {
  RecordShape shape;
  std::int64_t micro_batches = 0;
};
Probe probe_loader(const RunPlan& p, const std::optional<SamplerState>& resume_at) {
  LoaderOptions lo = loader_options(p.options, 0, p.dp_size, 0, p.cp_size);
  lo.sampler.epochs = 1;
  lo.prefetch = 1;
  lo.jobs = 1;
  lo.pinned = 0;  // a plan touches no device
  Loader loader(p.train_data->dataset, p.train_data->samples, lo);
  if (resume_at) loader.restore(*resume_at);  // the steps of the epoch the run resumes in
  return {loader.shape(), loader.steps_in_epoch()};
}

// The norm form the run takes (run_setup.h plan_hidden_states_norm), as a decision. Under
// auto, records whose form neither they nor their layout give are measured through the
// base's head (its embeddings, lm_head and final norm are read for that, on the CPU): those
// of the train split (evaluate: its split), else of the eval split.
void plan_norm(RunPlan& p, const std::vector<SampleRef>& samples) {
  const NormMeasure measure = [&p]() {
    std::vector<SampleRef> unknown;
    const Dataset* dataset = nullptr;
    for (const SelectedData* d : {p.train_data.get(), p.eval_data.get()}) {
      if (!d) continue;
      for (const auto& s : d->samples)
        if (!s.hidden_states_prenorm && !s.layout_prenorm) unknown.push_back(s);
      if (!unknown.empty()) {
        dataset = &d->dataset;
        break;
      }
    }
    if (!dataset) return NormMeasurement{"unclear", "no record to measure", 0, 0, 0, 0};
    BaseLoadOptions bo;
    bo.final_norm = true;
    const BaseModel base = load_base_model(p.options.base, bo);
    return measure_norm_form(*dataset, unknown, base);
  };
  p.norm = plan_hidden_states_norm(p.options.hidden_states_norm, samples, measure);
  const NormPlan& n = p.norm;
  std::string sources;
  for (const auto& s : n.source) sources += (sources.empty() ? "" : ", ") + s;
  const bool all_known = n.unstated == 0 && (n.layout_norm || n.layout_pre + n.layout_post == 0) &&
                         n.stated_pre + n.stated_post + n.layout_pre + n.layout_post > 0;
  const std::string value = all_known ? (n.layout_pre + n.layout_post > 0 ? "each record's stated or layout's form"
                                                                          : "each record's stated form")
                                      : n.default_pre ? "pre-norm" : "post-norm";
  p.decisions.push_back({"norm form", value + " (" + sources + ")", n.said});
}

// Records of stored target distributions train the soft cross-entropy only: every other
// --loss compares with the base's logits (losses.h), which the cache does not hold.
void check_stored_target_loss(const RunPlan& p) {
  if (!p.stored_targets || is_soft_ce(p.ttt.loss_terms)) return;
  throw UsageError("--loss " + loss_spec_text(p.ttt.loss_terms) + " is computed from the base's logits (" +
                   "log p over the draft vocabulary); the records store the target's probabilities (NeMo's cache, " +
                   p.stored_targets->source + "), rounded to its dtype" +
                   (p.stored_targets->topk > 0 ? " and zero outside the top k" : "") +
                   ", so only kl (the soft cross-entropy, what NeMo trains with) takes them: drop --loss");
}

std::string draft_vocab_why(const RunPlan& p) {
  const TrainOptions& o = p.options;
  if (p.draft_kind == DraftOrigin::Kind::kResume) return "the resumed checkpoint's draft";
  if (p.draft_kind == DraftOrigin::Kind::kInit) return "the --init-draft's (its lm_head rows follow its d2t)";
  if (p.stored_targets)
    return "selected_token_ids of " + p.stored_targets->source +
           " (d2t[i] = selected_token_ids[i] - i): the vocabulary its stored target distributions are over";
  if (!o.d2t.empty()) return "--d2t " + o.d2t;
  if (p.draft.count_d2t)
    return "--draft-vocab-size " + std::to_string(o.draft_vocab_size) +
           ": the most frequent tokens of the train split, counted when the run opens (no --d2t)";
  return "the base's whole vocabulary (no --draft-vocab-size or --d2t)";
}

// The draft's architecture row and its norms, in words ("EAGLE 3.1: fc_norm per aux layer,
// norm_output; 1 decoder layer").
std::string architecture_text(const DraftConfig& c) {
  std::string norms;
  auto add = [&norms](const std::string& n) { norms += (norms.empty() ? "" : ", ") + n; };
  if (c.fc_norm) add("fc_norm per aux layer");
  if (c.norm_before_fc) add("norm_before_fc (one norm over the fc input)");
  if (c.norm_output) add("norm_output");
  if (c.norm_before_residual) add("norm_before_residual");
  if (c.modelopt_norm) add("ModelOpt's norm form");
  return std::string(draft_architecture(c.architecture).title()) + (norms.empty() ? "" : ": " + norms) + "; " +
         std::to_string(c.num_hidden_layers) + " decoder layer" + (c.num_hidden_layers == 1 ? "" : "s");
}

std::string architecture_why(const RunPlan& p) {
  const TrainOptions& o = p.options;
  if (p.draft_kind != DraftOrigin::Kind::kFresh) return "the draft's own (" + p.draft.source + ")";
  if (o.draft_arch == DraftArch::kDFlash) return "--draft-arch dflash";
  if (o.draft_arch != DraftArch::kAuto)
    return "--draft-arch " + std::string(name_in(kDraftArchNames, o.draft_arch)) +
           (o.fc_norm != FcNorm::kAuto || o.norm_output != Switch::kAuto ? " with --fc-norm/--norm-output as given"
                                                                          : " and its default norms");
  if (o.fc_norm != FcNorm::kAuto || o.norm_output != Switch::kAuto)
    return "--fc-norm/--norm-output ask for EAGLE 3.1's norms";
  return "EAGLE-3, the default for a fresh draft (--draft-arch eagle3.1 trains EAGLE 3.1)";
}

// The draft's config as the figures and decisions show it.
// A DFlash draft (RunPlan::block): the block unroll's options, the decision that says them
// and where its target layers come from (docs/dflash.md).
void plan_dflash(RunPlan& p) {
  if (!p.block()) return;
  const TrainOptions& o = p.options;
  const DraftConfig& c = p.draft.config;
  if (p.stored_targets)
    throw UsageError("a DFlash draft trains against the base's whole vocabulary through its lm_head; the records "
                     "store the target's distribution over a draft vocabulary instead (NeMo's cache, " +
                     p.stored_targets->source + "): train an EAGLE draft on them");
  if (!o.loss.empty())
    throw UsageError("--loss chooses the TTT unroll's loss; DFlash's is its own: --dflash-weights and --dflash-distill");
  if (p.cp_size > 1)
    throw UsageError("DFlash does not run under context parallelism (--cp " + std::to_string(p.cp_size) +
                     "): each block attends to the whole context before its anchor, which no rank holds; use data "
                     "parallelism (--cp 1)");
  p.dflash.num_anchors = o.dflash_anchors;
  p.dflash.weighting = o.dflash_weights == DFlashWeights::kDecay ? DFlashWeighting::kDecay : DFlashWeighting::kDpace;
  p.dflash.dpace_alpha = o.dpace_alpha;
  p.dflash.decay_gamma = o.dflash_decay;
  p.dflash.self_distillation = o.dflash_distill != Switch::kOff;
  p.dflash.autocast = autocast_type(o.compute_dtype);
  p.dflash.prenorm_hidden_states = p.norm.default_pre;
  std::ostringstream alpha, gamma;
  alpha << o.dpace_alpha;
  gamma << o.dflash_decay;
  const std::string weights = o.dflash_weights == DFlashWeights::kDpace ? "D-PACE weights (alpha " + alpha.str() + ")"
                              : o.dflash_decay > 0 ? "decay weights exp(-(k-1)/" + gamma.str() + ")"
                                                   : "every block position alike";
  p.decisions.push_back(
      {"dflash",
       "block " + std::to_string(c.block_size) + ", mask token " + std::to_string(c.mask_token_id) + "; up to " +
           std::to_string(o.dflash_anchors) + " blocks per sequence; " + weights + "; teacher: " +
           (p.dflash.self_distillation ? "the base's distribution (self-logit distillation)" : "the dumped token"),
       "ModelOpt 0.47's defaults where not set (block 8, 512 anchors, D-PACE alpha 0.5, self-logit distillation); "
       "anchors drawn inside the loss mask, seeded by --seed, the epoch and the conversation id (a resumed or "
       "data-parallel run draws the same; in packed rows each document draws as a row of its own and sees only "
       "itself)"});
  if (!c.aux_layer_ids.empty()) {
    std::vector<std::int64_t> base_ids;
    for (auto id : c.aux_layer_ids) base_ids.push_back(id - 1);
    std::string line = "DFlash target layers: base layers " + ids_text(base_ids) + " (the dump's aux layers, HF ids " +
                       ids_text(c.aux_layer_ids) + ")";
    if (p.base.num_hidden_layers >= c.num_hidden_layers) {
      const auto modelopt = dflash_default_target_layers(p.base.num_hidden_layers, c.num_hidden_layers);
      line += modelopt == base_ids ? ", ModelOpt's default for this draft and base"
                                   : "; ModelOpt's default for a " + std::to_string(c.num_hidden_layers) +
                                         "-layer draft on this " + std::to_string(p.base.num_hidden_layers) +
                                         "-layer base would be " + ids_text(modelopt) + ", which this dump does not hold";
    }
    p.notes.push_back(line);
  }
}

void describe_draft(RunPlan& p, const std::string& draft_why) {
  const DraftConfig& c = p.draft.config;
  p.draft_config_json = draft_config_json(c);
  {
    const json j = json::parse(p.draft_config_json);
    std::ostringstream r;
    r << "theta " << j.value("rope_theta", 0.0);
    if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) r << ", rope_scaling " << j["rope_scaling"].dump();
    p.rope = r.str();
  }
  p.parameters = draft_parameters(c);
  p.decisions.push_back({"draft", p.draft.source, draft_why});
  p.decisions.push_back({"architecture", architecture_text(c) + ", " + std::to_string(p.parameters) + " parameters",
                         architecture_why(p)});
  p.decisions.push_back({"aux ids", ids_text(c.aux_layer_ids), p.draft.aux_layer_ids_source});
  p.decisions.push_back({"draft vocab", std::to_string(c.draft_vocab_size) + " of " + std::to_string(c.vocab_size),
                         draft_vocab_why(p)});
  p.decisions.push_back({"rope", p.rope,
                         p.draft_kind == DraftOrigin::Kind::kFresh
                             ? "rope_theta and rope_scaling of " + p.options.base +
                                   "/config.json, carried into the draft's config"
                             : "the draft's config.json"});
}

// Padding: in pad mode every row is max_length long whatever its record's length.
void plan_padding(RunPlan& p) {
  const TrainOptions& o = p.options;
  std::vector<std::int64_t> lengths;
  for (const auto& s : p.train_data->samples) lengths.push_back(std::min(s.tokens, o.max_length));
  std::sort(lengths.begin(), lengths.end());
  p.median_tokens = lengths.empty() ? 0 : lengths[lengths.size() / 2];
  if (o.mode == CollateMode::kPad && p.train_samples > 0) {
    const double rows_tokens = static_cast<double>(p.train_samples) * static_cast<double>(o.max_length);
    p.padding_share = 1.0 - static_cast<double>(p.tokens_per_epoch) / rows_tokens;
    if (p.padding_share >= 0.5) {
      std::ostringstream w;
      w << "--mode pad at --max-length " << o.max_length << " spends " << static_cast<int>(100 * p.padding_share + 0.5)
        << "% of every step on padding (the median train record has " << p.median_tokens
        << " tokens); --mode pack fills rows with several records, about "
        << std::max<std::int64_t>(1, static_cast<std::int64_t>(rows_tokens / std::max<double>(1, p.tokens_per_epoch)))
        << "x fewer rows for the same samples, and scores the same";
      p.warnings.push_back(w.str());
    }
  }
}

// Memory: the estimate, and against what this host has free for a CPU run.
void plan_memory(RunPlan& p) {
  const TrainOptions& o = p.options;
  const BaseConfig& bc = p.base;
  p.state_bytes = 16.0 * static_cast<double>(p.parameters);
  p.base_bytes = 4.0 * static_cast<double>(bc.vocab_size * bc.hidden_size) * (bc.tie_word_embeddings ? 1 : 2);
  const std::int64_t length = (o.max_length + p.cp_size - 1) / p.cp_size;
  p.activation_bytes = p.block() ? dflash_activation_bytes(p.draft.config, o.batch_size, length, o.dflash_anchors)
                                 : activation_bytes(p.draft.config, o.batch_size, length, o.ttt_steps);
  if (o.device != "cpu") return;
  p.available_bytes = host_available_bytes();
  p.available_source = "MemAvailable of this host";
  const double needed = p.total_bytes() * p.world_size;  // every rank on this host
  if (p.available_bytes >= 0 && needed > p.available_bytes) {
    std::ostringstream w;
    w << "the estimated peak memory, " << gib(needed)
      << (p.world_size > 1 ? " for " + std::to_string(p.world_size) + " ranks on this host" : std::string())
      << ", exceeds the " << gib(p.available_bytes) << " this host has available (" << p.available_source
      << "): lower --batch-size or --max-length (--grad-accum keeps the rows per step), or use --recompute or "
         "--ttt-attention tiled";
    p.warnings.push_back(w.str());
  }
}

// With --resume: the checkpoint's metadata, refused when it was saved by another world size
// or cp. Without: UsageError when --out holds a checkpoint a fresh run would silently mix with.
std::optional<CheckpointInfo> plan_resume(const RunPlan& p) {
  const TrainOptions& o = p.options;
  if (!o.resume) {
    if (auto existing = find_latest_checkpoint(o.out)) {
      throw UsageError("--out " + o.out + " already holds " + fs::path(*existing).filename().string() +
                       "; pass --resume to continue that run, or choose another --out");
    }
    return std::nullopt;
  }
  CheckpointInfo info = read_checkpoint_info(resolve_resume(o.resume_from.empty() ? o.out : o.resume_from));
  const TrainerState& st = info.state;
  if (st.world_size != p.world_size || st.cp_size != p.cp_size) {
    throw UsageError("--resume: " + info.dir + " was saved by " + std::to_string(st.world_size) + " ranks with cp " +
                     std::to_string(st.cp_size) + "; resume with the same world size and cp (now " +
                     std::to_string(p.world_size) + " ranks, cp " + std::to_string(p.cp_size) + ")");
  }
  return info;
}

// The steps the schedule spans. A resumed run with the saved run's stopping rule continues
// its schedule exactly; another one re-plans it over the new length, and the learning rate
// jumps: said, with both values.
void plan_steps(RunPlan& p, const std::optional<CheckpointInfo>& resumed) {
  const TrainOptions& o = p.options;
  p.rows_per_step = o.batch_size * o.grad_accum * p.dp_size;
  p.steps_per_epoch = o.steps_per_epoch(p.micro_batches_per_epoch);
  p.total_steps = o.total_steps(p.micro_batches_per_epoch);
  std::string why;
  if (o.max_steps > 0 && o.max_steps == p.total_steps) {
    why = "--max-steps " + std::to_string(o.max_steps);
  } else {
    why = std::to_string(p.epochs) + " epoch(s) (" + (o.epochs > 0 ? "--epochs" : std::string("the default")) + ") of " +
          std::to_string(p.steps_per_epoch) + " optimizer steps: " + std::to_string(p.micro_batches_per_epoch) +
          " micro-batches of " + std::to_string(o.batch_size) + " rows per dp rank, --grad-accum " +
          std::to_string(o.grad_accum);
  }
  if (resumed) {
    const TrainerState& st = resumed->state;
    const std::int64_t step = st.step;
    TrainOptions saved;
    saved.apply_json(resumed->options_json, resumed->dir + "/train_options.json");
    if (saved.optimizer != o.optimizer) {  // the checkpoint holds the other optimizer's state
      throw UsageError("--resume: " + resumed->dir + " was trained with --optimizer " +
                       std::string(name_in(kOptimizerNames, saved.optimizer)) + "; resume with it (now " +
                       std::string(name_in(kOptimizerNames, o.optimizer)) + ")");
    }
    std::vector<std::string> changed;
    auto differs = [&](const char* flag, auto was, auto now) {
      if (was == now) return;
      std::ostringstream os;
      os << flag << " " << was << " -> " << now;
      changed.push_back(os.str());
    };
    differs("--max-steps", saved.max_steps, o.max_steps);
    differs("--epochs", saved.epochs, o.epochs);
    differs("--grad-accum", saved.grad_accum, o.grad_accum);
    differs("--batch-size", saved.batch_size, o.batch_size);
    const bool same_length = changed.empty();
    differs("--lr", saved.lr, o.lr);
    differs("--warmup-steps", saved.warmup_steps, o.warmup_steps);
    differs("--schedule", schedule_name(saved.schedule), schedule_name(o.schedule));
    if (same_length && st.schedule_total_steps > 0) {
      p.total_steps = st.schedule_total_steps;
      why = "the resumed checkpoint's schedule (the same --max-steps, --epochs, --grad-accum and --batch-size)";
    } else {
      why += "; re-planned on resume (" + changed.front() + ")";
    }
    const double lr_saved = learning_rate(saved.lr, saved.schedule, saved.warmup_steps, st.schedule_total_steps, step);
    const double lr_now = learning_rate(o.lr, o.schedule, o.warmup_steps, p.total_steps, step);
    char lrs[96];
    std::snprintf(lrs, sizeof lrs, "%.3g", lr_now);
    std::string line = std::string(schedule_name(o.schedule)) + " schedule over " + std::to_string(p.total_steps) +
                       " steps, step " + std::to_string(step + 1) + " at lr " + lrs;
    if (changed.empty()) {
      p.schedule_said.push_back("learning-rate schedule continues: " + line);
    } else {
      std::string what;
      for (const auto& c : changed) what += (what.empty() ? "" : ", ") + c;
      std::snprintf(lrs, sizeof lrs, "%.3g", lr_saved);
      p.schedule_said.push_back("learning-rate schedule changed on resume (" + what + "): " + line +
                                (same_length ? "" : ", re-planned from step 0") + "; the saved run's schedule (" +
                                std::to_string(st.schedule_total_steps) + " steps) had " + lrs +
                                " there. Resume with the saved options to continue it unchanged");
    }
  }
  p.decisions.push_back({"steps", std::to_string(p.total_steps) + " optimizer steps of " +
                                      std::to_string(p.rows_per_step) + " rows",
                         why});
  p.schedule = schedule_text(o.lr, o.schedule, o.warmup_steps, p.total_steps);
  if (const std::string w = schedule_warning(o.lr, o.schedule, o.warmup_steps, p.total_steps); !w.empty())
    p.warnings.push_back(w);
}

// The train and eval splits, and whether evaluation runs. An empty split is an error
// (select_data); the eval split is read when evaluation runs, and else for its count when it
// has any.
void plan_splits(RunPlan& p) {
  const TrainOptions& o = p.options;
  DataSelection sel = o;  // every data option (match_by included), then each split
  sel.split = "train";
  auto train = std::make_shared<SelectedData>(select_data(sel));
  if (train->samples.empty()) throw UsageError("the train split is empty (" + train->summary + ")");
  std::shared_ptr<SelectedData> eval;
  if (o.eval_every >= 0 || o.eval_fraction > 0) {
    sel.split = "eval";
    eval = std::make_shared<SelectedData>(select_data(sel));
  }
  p.summary = train->summary;
  p.train_samples = static_cast<std::int64_t>(train->samples.size());
  p.eval_samples = eval ? static_cast<std::int64_t>(eval->samples.size()) : 0;
  for (const auto& s : train->samples) p.tokens_per_epoch += std::min(s.tokens, o.max_length);
  p.decisions.push_back({"split", std::to_string(p.train_samples) + " train, " + std::to_string(p.eval_samples) +
                                      " eval samples",
                         "--eval-fraction " + text_of(o.eval_fraction) + " of the matched conversations evaluate"});
  if (o.eval_every >= 0) {
    p.eval_data = eval;
    p.decisions.push_back({"evaluation",
                           o.eval_every > 0 ? "every " + std::to_string(o.eval_every) + " steps and at the end"
                                            : "at the end",
                           "--eval-every " + std::to_string(o.eval_every)});
  } else {
    p.decisions.push_back({"evaluation", "none", "--eval-every " + std::to_string(o.eval_every)});
  }
  p.train_data = train;
}

// The files behind records of stored target distributions (RunPlan::StoredTargets): every
// file the samples of `data` read from, which must all state one draft vocabulary
// (FileFacts::target_vocabulary: NeMo's cache, or an .eks converted from one).
void read_stored_targets(const SelectedData& data, std::optional<RunPlan::StoredTargets>& st) {
  std::vector<bool> seen(data.dataset.files.size(), false);
  for (const SampleRef& s : data.samples) {
    if (s.file >= seen.size() || seen[s.file]) continue;
    seen[s.file] = true;
    const std::string& path = data.dataset.files[s.file];
    const std::optional<TargetVocabulary> tv = open_reader(path)->facts().target_vocabulary;
    if (!tv)
      throw UsageError(path + ": records of stored target distributions (NeMo's cache) and of hidden states "
                       "cannot train in one run; index them apart");
    if (!st) {
      st.emplace();
      st->source = path;
      st->selected = tv->selected;
      st->target_vocab = static_cast<std::int64_t>(0);
    } else if (tv->selected != st->selected) {
      throw UsageError(path + ": its selected_token_ids differ from those of " + st->source +
                       "; a run trains one draft vocabulary, so its caches must share one");
    }
    st->topk = std::max(st->topk, tv->topk);
    const std::int64_t v = tv->target_vocab_size;
    if (st->target_vocab != 0 && st->target_vocab != v)
      throw UsageError(path + ": target_vocab_size " + std::to_string(v) + " differs from " + st->source + "'s " +
                       std::to_string(st->target_vocab));
    st->target_vocab = v;
  }
}

// The aux layer ids the files of the splits state (FileFacts::aux_layer_ids), which must
// agree; only formats whose files may state facts are opened. Empty when none states any.
// Each file is counted once over both splits (`seen`, by path): those stating none in
// `silent`, the first of them named in `silent_example`.
struct StatedAuxCount {
  std::unordered_set<std::string> seen;
  std::size_t stating = 0;
  std::size_t silent = 0;
  std::string silent_example;
};

void read_stated_aux_ids(const SelectedData& data, DataFacts& facts, StatedAuxCount& count) {
  // A split's samples repeat its files' indices: skip those by index, and look a path up in
  // `count.seen` (the other split's files) once per file.
  std::vector<bool> in_split(data.dataset.files.size(), false);
  for (const SampleRef& s : data.samples) {
    if (s.file >= in_split.size() || in_split[s.file]) continue;
    in_split[s.file] = true;
    const std::string& path = data.dataset.files[s.file];
    if (!count.seen.insert(path).second) continue;
    const Format f = s.file < data.dataset.file_formats.size() ? data.dataset.file_formats[s.file]
                                                                 : detect_file_format(path);
    const FormatRow* row = format_row(f);
    const std::vector<std::int64_t> ids =
        row && row->states_facts ? open_reader(path)->facts().aux_layer_ids : std::vector<std::int64_t>{};
    if (ids.empty()) {
      if (count.silent++ == 0) count.silent_example = path;
      continue;
    }
    const std::string named = "the " + std::string(row->noun) + " " + path;
    if (facts.aux_layer_ids.empty()) {
      facts.aux_layer_ids = ids;
      facts.aux_source = named;
    } else if (ids != facts.aux_layer_ids) {
      throw UsageError(named + " states aux layers " + ids_text(ids) + " but " + facts.aux_source + " states " +
                       ids_text(facts.aux_layer_ids) + ": the records of one run must come from the same base "
                       "layers; index them apart");
    }
    ++count.stating;
  }
}

// DataFacts::aux_layer_ids from the splits of a plan, with a note of where they come from,
// and one when other files of the run state no layers (their records are taken as the same).
void plan_stated_aux_ids(RunPlan& p, DataFacts& facts) {
  StatedAuxCount count;
  read_stated_aux_ids(*p.train_data, facts, count);
  if (p.eval_data) read_stated_aux_ids(*p.eval_data, facts, count);
  if (count.stating > 1)
    facts.aux_source += " (and " + std::to_string(count.stating - 1) + " more files stating the same)";
  if (!facts.aux_layer_ids.empty() && count.silent > 0)
    p.notes.push_back(std::to_string(count.silent) + " record file" + (count.silent == 1 ? "" : "s") + " (" +
                      count.silent_example + (count.silent == 1 ? ") states" : ", ...) state") +
                      " no aux layers; the run takes theirs to be " + ids_text(facts.aux_layer_ids) + ", as " +
                      facts.aux_source + " states: if they were dumped from other layers, train them apart");
}

// RunPlan::stored_targets from the splits, checked against the base and the options; the
// decisions a person reads about the targets. Only when the records store distributions.
void plan_stored_targets(RunPlan& p) {
  if (p.shape.target_probs_width <= 0) return;
  const TrainOptions& o = p.options;
  std::optional<RunPlan::StoredTargets> st;
  read_stored_targets(*p.train_data, st);
  if (p.eval_data) read_stored_targets(*p.eval_data, st);
  if (!st) throw UsageError("no record file of the split could be opened to read its draft vocabulary");
  const auto vd = static_cast<std::int64_t>(st->selected.size());
  if (vd != p.shape.target_probs_width)
    throw UsageError(st->source + ": selected_token_ids lists " + std::to_string(vd) + " tokens but the records' "
                     "target_probs are " + std::to_string(p.shape.target_probs_width) + " wide");
  {
    std::vector<bool> used(static_cast<std::size_t>(st->target_vocab), false);
    for (std::int64_t i = 0; i < vd; ++i) {
      const std::int64_t id = st->selected[static_cast<std::size_t>(i)];
      if (used[static_cast<std::size_t>(id)])
        throw UsageError(st->source + ": selected_token_ids lists target id " + std::to_string(id) +
                         " twice (draft id " + std::to_string(i) + "); a draft vocabulary maps each draft id to "
                         "a distinct target id");
      used[static_cast<std::size_t>(id)] = true;
    }
  }
  if (st->target_vocab != p.base.vocab_size)
    throw UsageError(st->source + ": target_vocab_size " + std::to_string(st->target_vocab) +
                     " is not the vocabulary of the base in " + o.base + " (" + std::to_string(p.base.vocab_size) +
                     "): the cache was made with another target model");
  if (o.hidden_states_norm != HiddenStatesNorm::kAuto)
    throw UsageError("--hidden-states-norm " + std::string(name_in(kHiddenStatesNormNames, o.hidden_states_norm)) +
                     " names the form of last hidden states; the records store the target's distribution instead "
                     "(NeMo's cache, " + st->source + "): drop it");
  p.stored_targets = std::move(st);
  const RunPlan::StoredTargets& t = *p.stored_targets;
  p.decisions.push_back(
      {"targets",
       "the cache's stored distribution over its " + std::to_string(vd) + " draft tokens (" + t.source + ")" +
           (t.topk > 0 ? ", top " + std::to_string(t.topk) + " of them per position" : std::string()),
       "the records carry NeMo's target_probs instead of a last hidden state: target p[t] is target_probs[t] itself "
       "(no base lm_head runs), the loss mask is NeMo's position_mask (loss_mask and the target's argmax inside the "
       "draft vocabulary), the draft vocabulary is the cache's selected_token_ids" +
           (t.topk > 0 ? std::string("; with top k NeMo renormalised the k kept values to sum 1, so the mass "
                                     "outside them (the tail) is lost for good and the draft learns the truncated "
                                     "distribution")
                       : std::string())});
  p.decisions.push_back({"norm form", "not used",
                         "the records hold no last hidden state (NeMo's cache), so no norm is applied to one"});
  if (t.topk > 0)
    p.notes.push_back("targets: top " + std::to_string(t.topk) + " of " + std::to_string(vd) +
                      " draft tokens per position (" + t.source + "), renormalised by NeMo: the tail mass is lost");
}

}  // namespace

at::Tensor RunPlan::StoredTargets::d2t() const {
  at::Tensor d = at::empty({static_cast<std::int64_t>(selected.size())}, at::kLong);
  auto* p = d.data_ptr<std::int64_t>();
  for (std::size_t i = 0; i < selected.size(); ++i) p[i] = selected[i] - static_cast<std::int64_t>(i);
  return d;
}

RunPlan resolve(const TrainOptions& o, int world_size) {
  o.check();
  RunPlan p;
  p.options = o;
  p.epochs = o.effective_epochs();
  plan_mesh(p, world_size, o.cp_size);
  plan_threads(p, o, /*can_adapt=*/true);
  const std::optional<CheckpointInfo> resumed = plan_resume(p);
  if (resumed) p.resume_step = resumed->state.step;

  plan_splits(p);
  // The record layout first: records of stored target distributions have no norm form.
  const Probe probe = probe_loader(p, resumed ? std::optional<SamplerState>(resumed->state.sampler) : std::nullopt);
  p.shape = probe.shape;
  p.micro_batches_per_epoch = probe.micro_batches;
  if (p.shape.target_probs_width <= 0) {
    std::vector<SampleRef> read = p.train_data->samples;  // the records the run reads
    if (p.eval_data) read.insert(read.end(), p.eval_data->samples.begin(), p.eval_data->samples.end());
    plan_norm(p, read);
    for (const auto& w : p.norm.warnings) p.notes.push_back("warning: " + w);
    p.notes.push_back(p.norm.said);
  }
  if (std::string l = no_loss_mask_line(p.train_data->samples, o.max_length); !l.empty()) p.notes.push_back(l);
  if (std::string l = joined_loss_mask_line(p.train_data->dataset.loss_masks, p.train_data->samples); !l.empty())
    p.notes.push_back(l);
  p.base = load_base_config(o.base);
  for (const auto& d : p.base.defaults_applied) p.notes.push_back(o.base + "/config.json: " + d);
  p.decisions.push_back({"base", "hidden " + std::to_string(p.base.hidden_size) + ", " +
                                     std::to_string(p.base.num_hidden_layers) + " layers, vocab " +
                                     std::to_string(p.base.vocab_size),
                         o.base + "/config.json (its weights are read when the run opens)"});
  plan_stored_targets(p);
  p.hidden = p.shape.hidden;
  p.aux_layers = aux_layers_of(p.shape, p.base, o.base);

  // The draft (draft_setup.h decide_draft). --init-draft is read whole: its layout and d2t
  // are facts of its weights (open_run reads it again, see RunPlan::loaded_draft).
  DraftOrigin origin;
  std::optional<DraftModel> init;
  std::string why;
  if (resumed) {
    origin.kind = DraftOrigin::Kind::kResume;
    origin.dir = resumed->dir;
    origin.config = &resumed->config;
    why = "--resume: the checkpoint's draft, optimizer, sampler and random state continue from step " +
          std::to_string(resumed->state.step);
  } else if (!o.init_draft.empty()) {
    origin = init_draft_origin(o.init_draft, init);
    why = "--init-draft: its weights, trained further";
  } else {
    why = "neither --resume nor --init-draft: built from the base's config, " +
          (o.draft_layers > 0 ? "--draft-layers " + std::to_string(o.draft_layers)
           : o.draft_arch == DraftArch::kDFlash
               ? std::string("one decoder layer per target layer of the dump (DFlash's default; --draft-layers N to choose)")
               : std::string("1 decoder layer (the default; --draft-layers N for more)"));
  }
  DataFacts facts;
  if (p.stored_targets) {
    facts.d2t = p.stored_targets->d2t();
    facts.d2t_source = "selected_token_ids of " + p.stored_targets->source;
  }
  plan_stated_aux_ids(p, facts);
  p.draft = decide_draft(o, p.base, p.shape, origin, facts);
  for (const auto& line : p.draft.said) p.notes.push_back(line);
  p.draft_kind = origin.kind;
  p.draft_dir = origin.dir;
  if (init) {
    p.loaded_layout = origin.layout;
    if (p.draft.config_changed) why += "; its config changed here (aux layer ids or --modelopt-norm)";
  }
  describe_draft(p, why);

  p.ttt.steps = o.ttt_steps;
  p.ttt.loss_decay = o.loss_decay;
  p.ttt.loss_terms = parse_loss_spec(o.loss);
  check_stored_target_loss(p);
  if (!p.block()) p.decisions.push_back({"loss", loss_spec_text(p.ttt.loss_terms),
                         o.loss.empty() ? "kl, the default: forward KL to the base's distribution, computed as the soft "
                                          "cross-entropy (the same gradient; the reported loss includes the targets' "
                                          "entropy); --loss chooses another (rkl, js, tv, nla, lk-hybrid, ce or a mix)"
                                        : "--loss " + o.loss});
  p.decisions.push_back({"optimizer", optimizer_text(o),
                         o.optimizer == OptimizerKind::kAdamW
                             ? "adamw, the default (speculators 0.9's CLI defaults to muon: --optimizer muon)"
                             : "--optimizer muon"});
  p.ttt.autocast = autocast_type(o.compute_dtype);
  p.ttt.prenorm_hidden_states = p.norm.default_pre;
  p.ttt.loss_chunk_rows = o.loss_chunk_tokens;
  p.ttt.recompute = o.recompute;
  p.ttt.attention = o.ttt_attention;
  plan_dflash(p);

  plan_steps(p, resumed);
  plan_padding(p);
  plan_memory(p);
  return p;
}

namespace {

// EvaluateOptions::from_run: the TTT steps and length the draft was trained with, unless set.
std::vector<std::string> inherit_run_options(EvaluateOptions& o, const std::string& draft_dir) {
  std::vector<std::string> said;
  for (const std::string& key : o.from_run) {
    std::int64_t* value = key == "ttt_steps" ? &o.ttt_steps : key == "max_length" ? &o.max_length : nullptr;
    if (!value) throw UsageError("evaluate cannot take '" + key + "' from the training run");
    std::string flag = "--" + key;
    std::replace(flag.begin(), flag.end(), '_', '-');
    if (const auto run = trained_with(draft_dir, key)) {
      *value = run->first;
      said.push_back(flag + " " + std::to_string(*value) + ": what the draft was trained with (" + run->second + ")");
    } else {
      said.push_back(flag + " " + std::to_string(*value) + ": the default (no train_options.json of the draft's run)");
    }
  }
  return said;
}

}  // namespace

RunPlan resolve(const EvaluateOptions& options, int world_size) {
  EvaluateOptions o = options;
  o.check();
  RunPlan p;
  p.purpose = RunPlan::Purpose::kEvaluate;
  plan_mesh(p, world_size, o.cp_size);
  plan_threads(p, o, /*can_adapt=*/false);

  // A folder with checkpoints but no config.json: its newest checkpoint.
  std::string draft_dir = o.draft;
  if (!fs::exists(fs::path(draft_dir) / "config.json")) {
    if (auto latest = find_latest_checkpoint(draft_dir)) draft_dir = *latest;
  }
  p.notes = inherit_run_options(o, draft_dir);
  o.check();  // again: the values read from the run's file
  // The groups evaluate shares with train; the optimizer's stay at their defaults, unused.
  static_cast<DataSelection&>(p.options) = o;
  static_cast<BatchOptions&>(p.options) = o;
  static_cast<ModelOptions&>(p.options) = o;
  static_cast<RunOptions&>(p.options) = o;
  p.epochs = 1;

  auto data = std::make_shared<SelectedData>(select_data(o));
  if (data->samples.empty())
    throw UsageError("the " + o.split + " split is empty (" + data->summary + "); try --split all");
  p.summary = data->summary;
  p.train_samples = static_cast<std::int64_t>(data->samples.size());
  for (const auto& s : data->samples) p.tokens_per_epoch += std::min(s.tokens, o.max_length);
  p.decisions.push_back({"split", std::to_string(p.train_samples) + " samples", "--split " + o.split});
  p.train_data = data;
  if (std::string l = no_loss_mask_line(data->samples, o.max_length); !l.empty()) p.notes.push_back(l);
  if (std::string l = joined_loss_mask_line(data->dataset.loss_masks, data->samples); !l.empty()) p.notes.push_back(l);

  p.base = load_base_config(o.base);
  DraftSource source;
  auto draft = std::make_shared<const DraftModel>(load_draft(draft_dir, &source));
  const DraftConfig& dc = draft->config();
  if (dc.hidden_size != p.base.hidden_size || dc.vocab_size != p.base.vocab_size) {
    throw UsageError("the draft in " + draft_dir + " (hidden " + std::to_string(dc.hidden_size) + ", vocab " +
                     std::to_string(dc.vocab_size) + ") does not fit the base in " + o.base + " (hidden " +
                     std::to_string(p.base.hidden_size) + ", vocab " + std::to_string(p.base.vocab_size) + ")");
  }
  const Probe probe = probe_loader(p, std::nullopt);
  p.shape = probe.shape;
  p.micro_batches_per_epoch = probe.micro_batches;
  if (p.shape.target_probs_width <= 0) plan_norm(p, data->samples);
  plan_stored_targets(p);  // the draft's d2t is compared with the cache's when the run opens
  if (p.shape.aux_width != dc.aux_width() || p.shape.hidden != dc.target_hidden_size) {
    throw UsageError("the data has hidden size " + std::to_string(p.shape.hidden) + " and aux width " +
                     std::to_string(p.shape.aux_width) + ", the draft expects " +
                     std::to_string(dc.target_hidden_size) + " and " + std::to_string(dc.aux_width()));
  }
  p.hidden = p.shape.hidden;
  p.aux_layers = p.shape.hidden > 0 ? p.shape.aux_width / p.shape.hidden : 0;
  p.draft_kind = DraftOrigin::Kind::kInit;
  p.draft_dir = draft_dir;
  p.draft.config = dc;
  p.draft.source = draft_dir + " (" + source.layout + ")";
  p.draft.aux_layer_ids_source = "the draft's config";
  {
    DataFacts facts;
    plan_stated_aux_ids(p, facts);
    if (!facts.aux_layer_ids.empty() && !dc.aux_layer_ids.empty() && facts.aux_layer_ids != dc.aux_layer_ids)
      throw UsageError("the draft in " + draft_dir + " reads aux layers " + ids_text(dc.aux_layer_ids) +
                       " but the data holds " + ids_text(facts.aux_layer_ids) + ", as " + facts.aux_source +
                       " states them: its scores would measure it on other layers' states");
    if (!facts.aux_layer_ids.empty()) p.draft.aux_layer_ids_source += ", as " + facts.aux_source + " states them";
  }
  p.loaded_draft = draft;
  p.loaded_layout = source.layout;
  p.decisions.push_back({"draft", p.draft.source, "--draft " + o.draft});

  p.ttt.steps = o.ttt_steps;
  p.ttt.loss_decay = o.loss_decay;
  p.ttt.loss_terms = parse_loss_spec(o.loss);
  check_stored_target_loss(p);
  p.ttt.autocast = autocast_type(o.compute_dtype);
  p.ttt.prenorm_hidden_states = p.norm.default_pre;
  p.ttt.attention = o.ttt_attention;
  plan_dflash(p);
  p.steps_per_epoch = p.total_steps = p.micro_batches_per_epoch;
  return p;
}

void estimate_time(RunPlan& p) {
  const TrainOptions& o = p.options;
  // FLOPs per rank, and on the CPU the measured rate of a matmul as the bound.
  std::int64_t row_length = o.max_length;
  if (o.mode == CollateMode::kLongest) row_length = std::max<std::int64_t>(1, p.median_tokens);
  row_length = (row_length + p.cp_size - 1) / p.cp_size;
  const double rows = static_cast<double>(p.total_steps) * static_cast<double>(o.batch_size * o.grad_accum);
  p.flops = p.block() ? dflash_flops(p.draft.config, rows, row_length, o.dflash_anchors)
                      : run_flops(p.draft.config, p.parameters, rows * static_cast<double>(row_length), row_length,
                                  o.ttt_steps);
  const bool bf16 = o.compute_dtype == ComputeDType::kBFloat16;
  const std::string what =
      flops_text(p.flops) + " per rank (a model of the draft's matmuls forward and backward, attention and the base's "
                            "lm_head; " +
      (p.block() ? "DFlash's blocks: trainer/run/plan.cpp, dflash_flops)" : "docs/benchmarks.md, Counting FLOPs)");
  if (o.device == "cpu") {
    at::set_num_threads(p.threads);  // as the run would
    p.measured_flops_per_s = measure_cpu_matmul_flops_per_s(bf16);
    if (p.measured_flops_per_s > 0) {
      p.eta_s = p.flops / p.measured_flops_per_s;
      std::ostringstream os;
      os << "a lower bound: " << what << " at the " << std::setprecision(3) << p.measured_flops_per_s / 1e9
         << " GFLOP/s a " << (bf16 ? "bfloat16" : "float32") << " 512x512 matmul reached on this host with "
         << at::get_num_threads() << " thread(s); norms, softmax, the loss and the data loader make the run "
         << "slower";
      p.eta_basis = os.str();
    } else {
      p.eta_basis = "not estimated: the matmul timing failed; " + what;
    }
  } else {
    p.eta_basis = "not estimated: a dry run does not open --device " + o.device + " to time it; the run is " + what +
                  "; divide by the FLOP/s the device reaches in practice";
  }
  if (o.device != "cpu" && !at::hasCUDA())
    p.notes.push_back("--device " + o.device + ": not checked here (this LibTorch has no CUDA device); train checks it");
}

std::string RunPlan::to_text() const {
  std::ostringstream os;
  for (const auto& n : notes) os << "note: " << n << "\n";
  for (const auto& n : schedule_said) os << "note: " << n << "\n";
  for (const auto& w : warnings) os << "warning: " << w << "\n";
  os << "data:        " << summary << "\n";
  os << "split:       " << train_samples << " train, " << eval_samples << " eval samples; " << tokens_per_epoch
     << " train tokens per epoch\n";
  os << "dump:        hidden " << hidden << ", " << aux_layers << " aux layers\n";
  const DraftConfig& c = draft.config;
  os << "draft:       " << draft.source << "; " << draft_architecture(c.architecture).title() << ", "
     << c.num_hidden_layers << " decoder layer" << (c.num_hidden_layers == 1 ? "" : "s") << ", " << parameters << " trainable parameters, draft vocab "
     << c.draft_vocab_size << " of " << c.vocab_size << "\n";
  os << "aux ids:     " << ids_text(c.aux_layer_ids) << " (" << draft.aux_layer_ids_source << ")\n";
  os << "rope:        " << rope << "\n";
  os << "mesh:        " << world_size << " rank(s): dp " << dp_size << " x cp " << cp_size << "\n";
  os << "steps:       " << total_steps << " optimizer steps (" << steps_per_epoch << " per epoch) of " << rows_per_step
     << " rows\n";
  os << "lr:          " << schedule << "\n";
  os << "memory/rank: about " << gib(total_bytes()) << " (estimate: draft state " << gib(state_bytes) << ", base "
     << gib(base_bytes) << ", activations of one micro-batch " << gib(activation_bytes) << ")";
  if (available_bytes >= 0) os << "; " << gib(available_bytes) << " available (" << available_source << ")";
  os << "\n";
  os << "eta:         " << (eta_s >= 0 ? "at least " + format_duration(eta_s) + " (" + eta_basis + ")" : eta_basis)
     << "\n";
  os << "decisions:\n";
  for (const auto& d : decisions) os << "  " << d.name << ": " << d.value << "\n    why: " << d.why << "\n";
  os << "config.json of final/:\n" << draft_config_json;
  return os.str();
}

std::string RunPlan::to_json() const {
  json j;
  j["summary"] = summary;
  j["train_samples"] = train_samples;
  j["eval_samples"] = eval_samples;
  j["tokens_per_epoch"] = tokens_per_epoch;
  j["hidden"] = hidden;
  j["aux_layers"] = aux_layers;
  j["draft_source"] = draft.source;
  j["aux_layer_ids"] = draft.config.aux_layer_ids;
  j["aux_layer_ids_source"] = draft.aux_layer_ids_source;
  j["rope"] = rope;
  j["draft_vocab_size"] = draft.config.draft_vocab_size;
  j["vocab_size"] = draft.config.vocab_size;
  j["parameters"] = parameters;
  j["draft_layers"] = draft.config.num_hidden_layers;
  j["draft_architecture"] = draft.config.architecture;
  j["world_size"] = world_size;
  j["dp_size"] = dp_size;
  j["cp_size"] = cp_size;
  j["threads"] = threads;
  j["adapt_threads"] = adapt_threads;
  j["omp_wait_policy"] = wait_policy;
  j["malloc_policy"] = malloc_policy;
  j["rows_per_step"] = rows_per_step;
  j["steps_per_epoch"] = steps_per_epoch;
  j["total_steps"] = total_steps;
  j["schedule"] = schedule;
  j["median_tokens"] = median_tokens;
  j["padding_share"] = padding_share;
  j["memory_estimate_bytes"] = {{"draft_state", state_bytes},
                                {"base", base_bytes},
                                {"activations", activation_bytes},
                                {"total", total_bytes()}};
  j["memory_available_bytes"] = available_bytes >= 0 ? json(available_bytes) : json(nullptr);
  j["flops"] = flops;
  j["measured_flops_per_s"] = measured_flops_per_s > 0 ? json(measured_flops_per_s) : json(nullptr);
  j["eta_seconds"] = eta_s >= 0 ? json(eta_s) : json(nullptr);
  j["eta_basis"] = eta_basis;
  j["draft_config"] = json::parse(draft_config_json);
  std::vector<std::string> all_notes = notes;
  all_notes.insert(all_notes.end(), schedule_said.begin(), schedule_said.end());
  j["notes"] = all_notes;
  const bool defaulted = norm.unstated > 0 || (!norm.layout_norm && norm.layout_pre + norm.layout_post > 0);
  j["norm_form"] = {{"records_not_known", defaulted ? json(norm.default_pre ? "pre" : "post") : json(nullptr)},
                    {"source", norm.source},
                    {"stated_pre", norm.stated_pre},
                    {"stated_post", norm.stated_post},
                    {"layout_pre", norm.layout_pre},
                    {"layout_post", norm.layout_post},
                    {"not_known", norm.unstated},
                    {"measured", norm.measured.empty() ? json(nullptr) : json(norm.measured)},
                    {"said", norm.said}};
  j["warnings"] = warnings;
  json ds = json::array();
  for (const auto& d : decisions) ds.push_back({{"name", d.name}, {"value", d.value}, {"why", d.why}});
  j["decisions"] = ds;
  return j.dump();
}

}  // namespace eaglekit::trainer
