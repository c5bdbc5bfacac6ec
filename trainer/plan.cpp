#include "trainer/plan.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <optional>
#include <sstream>

#include "formats/error.h"
#include "lib/loader.h"
#include "trainer/checkpoint.h"
#include "trainer/config.h"
#include "trainer/run_setup.h"
#include "trainer/draft_setup.h"
#include "trainer/draft_model.h"
#include "trainer/export.h"
#include "trainer/optim.h"
#include "trainer/train.h"
#include "trainer/metrics_log.h"
#include "trainer/vocab.h"

namespace eaglekit::trainer {

namespace {

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

// Trainable parameters of the draft (trainer/draft_model.h): fc, the first decoder layer on
// 2H-wide q/k/v inputs with its three norms, N - 1 plain layers on H with two norms each,
// the final norm and lm_head over Vd.
std::int64_t draft_parameters(const DraftConfig& c) {
  const std::int64_t h = c.hidden_size, qd = c.num_attention_heads * c.head_dim, kvd = c.num_key_value_heads * c.head_dim;
  const std::int64_t first = 2 * h * (qd + 2 * kvd) + qd * h + 3 * h * c.intermediate_size + 3 * h;
  const std::int64_t plain = h * (qd + 2 * kvd) + qd * h + 3 * h * c.intermediate_size + 2 * h;
  return c.aux_width() * h + first + (c.num_hidden_layers - 1) * plain + h + c.draft_vocab_size * h;
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
    seconds = std::chrono::duration<double>(Clock::now() - t0).count();
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

TrainPlan plan_training(const TrainOptions& o, int world_size) {
  o.check();
  TrainPlan p;
  p.cp_size = o.cp_size;
  p.world_size = std::max(world_size, o.cp_size);
  if (p.world_size % p.cp_size != 0)
    throw UsageError("--cp " + std::to_string(o.cp_size) + " does not divide the world size " +
                     std::to_string(p.world_size));
  p.dp_size = p.world_size / p.cp_size;

  BaseConfig bc = load_base_config(o.base);
  p.notes = bc.defaults_applied;
  for (auto& n : p.notes) n = o.base + "/config.json: " + n;
  p.vocab_size = bc.vocab_size;

  DataSelection sel = o;
  sel.split = "train";
  const SelectedData train = select_data(sel);
  if (train.samples.empty()) throw UsageError("the train split is empty (" + train.summary + ")");
  sel.split = "eval";
  const SelectedData eval = select_data(sel);
  p.eval_samples = static_cast<std::int64_t>(eval.samples.size());
  {
    std::vector<SampleRef> all = train.samples;
    all.insert(all.end(), eval.samples.begin(), eval.samples.end());
    const NormPlan norm = plan_hidden_states_norm(o.hidden_states_norm, all);
    for (const auto& w : norm.warnings) p.notes.push_back("warning: " + w);
    p.notes.push_back(norm.said);
  }
  p.summary = train.summary;
  p.train_samples = static_cast<std::int64_t>(train.samples.size());
  for (const auto& s : train.samples) p.tokens_per_epoch += std::min(s.tokens, o.max_length);

  LoaderOptions lo = loader_options(o, 0, p.dp_size, 0, p.cp_size);
  lo.sampler.epochs = 1;
  lo.prefetch = 1;
  lo.jobs = 1;
  Loader loader(train.dataset, train.samples, lo);
  const RecordShape shape = loader.shape();
  p.hidden = shape.hidden;
  p.aux_layers = aux_layers_of(shape, bc, o.base);

  // The draft: decided by the code train runs (decide_draft), so that a plan accepts what
  // train accepts and says what train would say. --init-draft is read whole, as train does.
  DraftOrigin origin;
  std::optional<DraftConfig> origin_config;
  std::optional<DraftModel> init;
  if (o.resume) {
    origin.kind = DraftOrigin::Kind::kResume;
    origin.dir = resolve_resume(o.resume_from.empty() ? o.out : o.resume_from);
    origin_config = load_draft_config(origin.dir);
    origin.config = &*origin_config;
  } else if (!o.init_draft.empty()) {
    origin = init_draft_origin(o.init_draft, init);
  }
  const DraftDecision decision = decide_draft(o, bc, shape, origin);
  const DraftConfig& c = decision.config;
  p.draft_source = decision.source;
  p.aux_layer_ids_source = decision.aux_layer_ids_source;
  for (const auto& line : decision.said) p.notes.push_back(line);
  p.aux_layer_ids = c.aux_layer_ids;
  p.draft_vocab_size = c.draft_vocab_size;
  p.draft_config_json = draft_config_json(c);
  {
    const json j = json::parse(p.draft_config_json);
    std::ostringstream r;
    r << "theta " << j.value("rope_theta", 0.0);
    if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) r << ", rope_scaling " << j["rope_scaling"].dump();
    p.rope = r.str();
  }
  p.parameters = draft_parameters(c);
  p.draft_layers = c.num_hidden_layers;

  p.rows_per_step = o.batch_size * o.grad_accum * p.dp_size;
  p.steps_per_epoch = o.steps_per_epoch(loader.steps_in_epoch());
  p.total_steps = o.total_steps(loader.steps_in_epoch());
  p.schedule = schedule_text(o.lr, o.schedule, o.warmup_steps, p.total_steps);
  if (const std::string w = schedule_warning(o.lr, o.schedule, o.warmup_steps, p.total_steps); !w.empty())
    p.warnings.push_back(w);

  // Padding: in pad mode every row is max_length long whatever its record's length.
  {
    std::vector<std::int64_t> lengths;
    for (const auto& s : train.samples) lengths.push_back(std::min(s.tokens, o.max_length));
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

  p.state_bytes = 16.0 * static_cast<double>(p.parameters);
  p.base_bytes = 4.0 * static_cast<double>(bc.vocab_size * bc.hidden_size) * (bc.tie_word_embeddings ? 1 : 2);
  const std::int64_t length = (o.max_length + p.cp_size - 1) / p.cp_size;
  p.activation_bytes = activation_bytes(c, o.batch_size, length, o.ttt_steps);

  // Time: FLOPs per rank, and on the CPU the measured rate of a matmul as the bound.
  {
    std::int64_t row_length = o.max_length;
    if (o.mode == CollateMode::kLongest) row_length = std::max<std::int64_t>(1, p.median_tokens);
    row_length = (row_length + p.cp_size - 1) / p.cp_size;
    const double rows = static_cast<double>(p.total_steps) * static_cast<double>(o.batch_size * o.grad_accum);
    p.flops = run_flops(c, p.parameters, rows * static_cast<double>(row_length), row_length, o.ttt_steps);
    const bool bf16 = o.compute_dtype == ComputeDType::kBFloat16;
    const std::string what = flops_text(p.flops) + " per rank (a model of the draft's matmuls forward and backward, "
                             "attention and the base's lm_head; README, Training)";
    if (o.device == "cpu") {
      if (o.threads > 0) at::set_num_threads(o.threads);  // as train would run
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
  }

  // Memory: the estimate against what this host has free, for a CPU run.
  if (o.device == "cpu") {
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
  if (o.device != "cpu" && !at::hasCUDA())
    p.notes.push_back("--device " + o.device + ": not checked here (this LibTorch has no CUDA device); train checks it");
  return p;
}

std::string TrainPlan::to_text() const {
  std::ostringstream os;
  for (const auto& n : notes) os << "note: " << n << "\n";
  for (const auto& w : warnings) os << "warning: " << w << "\n";
  os << "data:        " << summary << "\n";
  os << "split:       " << train_samples << " train, " << eval_samples << " eval samples; " << tokens_per_epoch
     << " train tokens per epoch\n";
  os << "dump:        hidden " << hidden << ", " << aux_layers << " aux layers\n";
  os << "draft:       " << draft_source << "; " << draft_layers << " decoder layer" << (draft_layers == 1 ? "" : "s")
     << ", " << parameters << " trainable parameters, draft vocab "
     << draft_vocab_size << " of " << vocab_size << "\n";
  os << "aux ids:     " << ids_text(aux_layer_ids) << " (" << aux_layer_ids_source << ")\n";
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
  os << "config.json of final/:\n" << draft_config_json;
  return os.str();
}

std::string TrainPlan::to_json() const {
  json j;
  j["summary"] = summary;
  j["train_samples"] = train_samples;
  j["eval_samples"] = eval_samples;
  j["tokens_per_epoch"] = tokens_per_epoch;
  j["hidden"] = hidden;
  j["aux_layers"] = aux_layers;
  j["draft_source"] = draft_source;
  j["aux_layer_ids"] = aux_layer_ids;
  j["aux_layer_ids_source"] = aux_layer_ids_source;
  j["rope"] = rope;
  j["draft_vocab_size"] = draft_vocab_size;
  j["vocab_size"] = vocab_size;
  j["parameters"] = parameters;
  j["draft_layers"] = draft_layers;
  j["world_size"] = world_size;
  j["dp_size"] = dp_size;
  j["cp_size"] = cp_size;
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
  j["notes"] = notes;
  j["warnings"] = warnings;
  return j.dump();
}

}  // namespace eaglekit::trainer
