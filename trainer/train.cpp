#include "trainer/train.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <signal.h>
#include <sys/resource.h>
#include <tbb/blocked_range.h>
#include <tbb/combinable.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <variant>

#include "formats/atomic_file.h"
#include "formats/format.h"
#include "lib/dataset.h"
#include "lib/loader.h"
#include "trainer/base_model.h"
#include "trainer/checkpoint.h"
#include "trainer/config.h"
#include "trainer/data_parallel.h"
#include "trainer/distributed.h"
#include "trainer/draft_model.h"
#include "trainer/evaluate.h"
#include "trainer/export.h"
#include "trainer/tensorboard.h"
#include "trainer/vocab.h"

namespace eaglekit::trainer {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr double kPi = 3.14159265358979323846;

// This process's peak resident memory (the host side: CUDA memory is the allocator's).
double peak_rss_mb() {
  rusage u{};
  return ::getrusage(RUSAGE_SELF, &u) == 0 ? static_cast<double>(u.ru_maxrss) / 1024.0 : 0.0;
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// CPU time of the whole process (every thread: LibTorch's and the loader's).
double process_cpu_seconds() { return static_cast<double>(std::clock()) / CLOCKS_PER_SEC; }

json number(double x) {
  if (!std::isfinite(x)) return nullptr;
  return x;
}

// --- SIGINT/SIGTERM: a flag read at step boundaries ------------------------------------

volatile std::sig_atomic_t g_stop_signal = 0;

extern "C" void on_stop_signal(int sig) { g_stop_signal = sig; }

// Installed for the duration of a run. SA_RESETHAND: a second ^C kills the process the
// usual way, for when the checkpoint itself hangs.
class SignalGuard {
 public:
  SignalGuard() {
    g_stop_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESETHAND;
    ::sigaction(SIGINT, &sa, &old_int_);
    ::sigaction(SIGTERM, &sa, &old_term_);
  }
  ~SignalGuard() {
    ::sigaction(SIGINT, &old_int_, nullptr);
    ::sigaction(SIGTERM, &old_term_, nullptr);
  }
  SignalGuard(const SignalGuard&) = delete;
  SignalGuard& operator=(const SignalGuard&) = delete;

 private:
  struct sigaction old_int_ {};
  struct sigaction old_term_ {};
};

// --- options as a table: JSON in and out from one list ---------------------------------

using FieldRef = std::variant<std::string*, std::int64_t*, std::uint64_t*, int*, double*, bool*,
                              std::vector<std::int64_t>*>;

std::vector<std::pair<const char*, FieldRef>> fields(TrainOptions& o) {
  return {
      {"data", &o.data},
      {"index", &o.index},
      {"quarantine", &o.quarantine},
      {"eval_fraction", &o.eval_fraction},
      {"mode", &o.mode},
      {"shuffle", &o.shuffle},
      {"base", &o.base},
      {"init_draft", &o.init_draft},
      {"draft_vocab_size", &o.draft_vocab_size},
      {"d2t", &o.d2t},
      {"aux_layer_ids", &o.aux_layer_ids},
      {"modelopt_norm", &o.modelopt_norm},
      {"allow_unservable", &o.allow_unservable},
      {"ttt_steps", &o.ttt_steps},
      {"loss_decay", &o.loss_decay},
      {"max_length", &o.max_length},
      {"batch_size", &o.batch_size},
      {"grad_accum", &o.grad_accum},
      {"lr", &o.lr},
      {"warmup_steps", &o.warmup_steps},
      {"schedule", &o.schedule},
      {"weight_decay", &o.weight_decay},
      {"grad_clip", &o.grad_clip},
      {"adam_beta1", &o.adam_beta1},
      {"adam_beta2", &o.adam_beta2},
      {"adam_eps", &o.adam_eps},
      {"epochs", &o.epochs},
      {"max_steps", &o.max_steps},
      {"seed", &o.seed},
      {"dtype", &o.dtype},
      {"device", &o.device},
      {"out", &o.out},
      {"eval_every", &o.eval_every},
      {"save_every", &o.save_every},
      {"log_every", &o.log_every},
      {"resume", &o.resume},
      {"resume_from", &o.resume_from},
      {"export_dtype", &o.export_dtype},
      {"tensorboard", &o.tensorboard},
      {"no_tensorboard", &o.no_tensorboard},
      {"jobs", &o.jobs},
      {"threads", &o.threads},
      {"prefetch", &o.prefetch},
      {"cp_size", &o.cp_size},
      {"progress", &o.progress},
  };
}

std::int64_t effective_epochs(const TrainOptions& o) {
  if (o.epochs > 0) return o.epochs;
  return o.max_steps > 0 ? 0 : 1;
}

// A small float64 CPU tensor summed over a group (moved to `device` for NCCL).
at::Tensor reduce_sum(const dist::Group& group, const at::Tensor& cpu, c10::Device device) {
  if (group.size() == 1) return cpu;
  at::Tensor t = cpu.contiguous();
  if (group.backend() == dist::Backend::kNccl) t = t.to(device);
  group.all_reduce_sum(t);
  return t.to(at::kCPU);
}

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const auto total = static_cast<std::int64_t>(s + 0.5);
  std::ostringstream os;
  if (total >= 3600) os << total / 3600 << "h" << (total % 3600) / 60 << "m";
  else if (total >= 60) os << total / 60 << "m" << total % 60 << "s";
  else os << total << "s";
  return os.str();
}

std::string rate_text(double x) {
  std::ostringstream os;
  os.precision(3);
  if (x >= 1e6) os << x / 1e6 << "M";
  else if (x >= 1e3) os << x / 1e3 << "k";
  else os << x;
  return os.str();
}

// Keeps the lines of a resumed run's metrics.jsonl up to its checkpoint's step (a run that
// died after its last checkpoint logged steps that will be trained again).
void trim_metrics(const std::string& path, std::int64_t step) {
  std::ifstream in(path);
  if (!in) return;
  std::string kept, line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    try {
      const json j = json::parse(line);
      if (j.contains("step") && j["step"].is_number_integer() && j["step"].get<std::int64_t>() > step) continue;
    } catch (const nlohmann::json::exception&) {
      continue;  // a torn last line
    }
    kept += line + "\n";
  }
  in.close();
  write_file_atomic(path, kept.data(), kept.size());  // a kill here must not lose the log
}

// The draft's d2t for a fresh run: --d2t, else counted over the train split when the
// draft vocabulary is smaller, else the identity.
at::Tensor fresh_d2t(const TrainOptions& o, const BaseConfig& base, const SelectedData& data,
                     const std::function<void(const std::string&)>& say) {
  if (!o.d2t.empty()) {
    at::Tensor d2t = load_d2t(o.d2t);
    if (o.draft_vocab_size > 0 && d2t.size(0) != o.draft_vocab_size) {
      throw UsageError("--d2t " + o.d2t + " holds " + std::to_string(d2t.size(0)) +
                       " entries but --draft-vocab-size is " + std::to_string(o.draft_vocab_size));
    }
    return d2t;
  }
  const std::int64_t vd = o.draft_vocab_size > 0 ? o.draft_vocab_size : base.vocab_size;
  if (vd > base.vocab_size) {
    throw UsageError("--draft-vocab-size " + std::to_string(vd) + " exceeds the base vocabulary (" +
                     std::to_string(base.vocab_size) + ")");
  }
  if (vd == base.vocab_size) return identity_d2t(base.vocab_size);
  const auto t0 = Clock::now();
  const auto counts = count_tokens(data.dataset, data.samples, base.vocab_size, o.jobs);
  say("draft vocabulary: the " + std::to_string(vd) + " most frequent of " + std::to_string(base.vocab_size) +
      " tokens, counted over the train split in " + std::to_string(seconds_since(t0)).substr(0, 4) + " s");
  return d2t_from_counts(counts, vd);
}

// A copy of `draft` whose config differs only in `config` (aux ids, norm form).
DraftModel with_config(const DraftModel& draft, const DraftConfig& config) {
  DraftModel out(config, draft.d2t().to(at::kCPU), at::Tensor());
  for (const auto& [name, value] : draft.named_parameters()) out.load_parameter(name, value);
  return out;
}

}  // namespace

// --- schedule --------------------------------------------------------------------------

std::string_view schedule_name(Schedule s) {
  switch (s) {
    case Schedule::kCosine: return "cosine";
    case Schedule::kLinear: return "linear";
    case Schedule::kConstant: return "constant";
  }
  return "?";
}

std::optional<Schedule> parse_schedule(std::string_view name) {
  if (name == "cosine") return Schedule::kCosine;
  if (name == "linear") return Schedule::kLinear;
  if (name == "constant") return Schedule::kConstant;
  return std::nullopt;
}

double learning_rate(double lr, Schedule schedule, std::int64_t warmup_steps, std::int64_t total_steps,
                     std::int64_t step) {
  if (warmup_steps > 0 && step < warmup_steps)
    return lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  if (schedule == Schedule::kConstant) return lr;
  const double span = static_cast<double>(std::max<std::int64_t>(1, total_steps - warmup_steps));
  const double progress = std::clamp(static_cast<double>(step - warmup_steps) / span, 0.0, 1.0);
  if (schedule == Schedule::kLinear) return lr * (1.0 - progress);
  return lr * 0.5 * (1.0 + std::cos(kPi * progress));
}

// --- AdamW -----------------------------------------------------------------------------

AdamW::AdamW(std::vector<std::pair<std::string, at::Tensor>> params, Options options)
    : params_(std::move(params)), options_(options) {
  at::NoGradGuard no_grad;
  for (const auto& [name, p] : params_) {
    exp_avg_.push_back(at::zeros_like(p, p.options().dtype(at::kFloat)));
    exp_avg_sq_.push_back(at::zeros_like(p, p.options().dtype(at::kFloat)));
    decay_.push_back(p.dim() >= 2);
  }
}

void AdamW::step(double lr) {
  at::NoGradGuard no_grad;
  ++steps_;
  const double b1 = options_.beta1, b2 = options_.beta2;
  const double bias1 = 1.0 - std::pow(b1, static_cast<double>(steps_));
  const double bias2_sqrt = std::sqrt(1.0 - std::pow(b2, static_cast<double>(steps_)));
  for (std::size_t i = 0; i < params_.size(); ++i) {
    at::Tensor p = params_[i].second;
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    if (decay_[i] && options_.weight_decay != 0) p.mul_(1.0 - lr * options_.weight_decay);
    exp_avg_[i].mul_(b1).add_(g, 1.0 - b1);
    exp_avg_sq_[i].mul_(b2).addcmul_(g, g, 1.0 - b2);
    const at::Tensor denom = (exp_avg_sq_[i].sqrt() / bias2_sqrt).add_(options_.eps);
    p.addcdiv_(exp_avg_[i], denom, -lr / bias1);
  }
}

void AdamW::zero_grad() {
  for (auto& [name, p] : params_) {
    if (p.grad().defined()) p.mutable_grad().reset();
  }
}

std::vector<std::pair<std::string, at::Tensor>> AdamW::state() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    out.emplace_back("exp_avg." + params_[i].first, exp_avg_[i].detach().to(at::kCPU).clone());
    out.emplace_back("exp_avg_sq." + params_[i].first, exp_avg_sq_[i].detach().to(at::kCPU).clone());
  }
  return out;
}

void AdamW::load_state(const std::vector<std::pair<std::string, at::Tensor>>& tensors, std::int64_t steps,
                       const std::string& where) {
  std::map<std::string, at::Tensor> by_name(tensors.begin(), tensors.end());
  at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    for (auto* slot : {&exp_avg_[i], &exp_avg_sq_[i]}) {
      const std::string name = (slot == &exp_avg_[i] ? "exp_avg." : "exp_avg_sq.") + params_[i].first;
      const auto it = by_name.find(name);
      if (it == by_name.end()) throw FormatError(where, std::nullopt, name, "missing optimizer state");
      if (it->second.sizes() != slot->sizes()) {
        throw FormatError(where, std::nullopt, name,
                          "shape " + c10::str(it->second.sizes()) + ", the parameter has " + c10::str(slot->sizes()));
      }
      slot->copy_(it->second);
    }
  }
  steps_ = steps;
}

double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> norms;
  for (const auto& p : params)
    if (p.grad().defined()) norms.push_back(p.grad().detach().to(at::kFloat).norm());
  if (norms.empty()) return 0.0;
  const double total = at::stack(norms).norm().item<double>();
  if (max_norm > 0 && std::isfinite(total)) {
    const double coef = max_norm / (total + 1e-6);
    if (coef < 1.0)
      for (const auto& p : params)
        if (p.grad().defined()) p.grad().mul_(coef);
  }
  return total;
}

// --- options ---------------------------------------------------------------------------

std::string TrainOptions::to_json() const {
  json j;
  for (const auto& [key, ref] : fields(const_cast<TrainOptions&>(*this)))
    std::visit([&, k = key](auto* p) { j[k] = *p; }, ref);
  return j.dump(2) + "\n";
}

void TrainOptions::apply_json(const std::string& json_text, const std::string& where) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    throw UsageError(where + ": not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw UsageError(where + ": expected a JSON object of options");
  auto table = fields(*this);
  for (const auto& [raw_key, value] : j.items()) {
    std::string key = raw_key;
    std::replace(key.begin(), key.end(), '-', '_');
    const auto it = std::find_if(table.begin(), table.end(), [&](const auto& f) { return key == f.first; });
    if (it == table.end()) throw UsageError(where + ": unknown option '" + raw_key + "'");
    auto bad = [&, k = raw_key](const char* expected) {
      return UsageError(where + ": option '" + k + "' must be " + expected + ", not " + value.dump());
    };
    std::visit(
        [&](auto* p) {
          using T = std::remove_pointer_t<decltype(p)>;
          if constexpr (std::is_same_v<T, std::string>) {
            if (!value.is_string()) throw bad("a string");
            *p = value.get<std::string>();
          } else if constexpr (std::is_same_v<T, bool>) {
            if (!value.is_boolean()) throw bad("true or false");
            *p = value.get<bool>();
          } else if constexpr (std::is_same_v<T, double>) {
            if (!value.is_number()) throw bad("a number");
            *p = value.get<double>();
          } else if constexpr (std::is_same_v<T, std::vector<std::int64_t>>) {
            if (!value.is_array()) throw bad("a list of integers");
            p->clear();
            for (const auto& x : value) {
              if (!x.is_number_integer()) throw bad("a list of integers");
              p->push_back(x.get<std::int64_t>());
            }
          } else if constexpr (std::is_same_v<T, std::uint64_t>) {
            if (!value.is_number_integer() || value.get<std::int64_t>() < 0) throw bad("a non-negative integer");
            *p = value.get<std::uint64_t>();
          } else {
            if (!value.is_number_integer()) throw bad("an integer");
            *p = static_cast<T>(value.get<std::int64_t>());
          }
        },
        it->second);
  }
}

void TrainOptions::check() const {
  if (data.empty()) throw UsageError("--data is required (the conversations)");
  if (index.empty()) throw UsageError("--index is required (build one with eaglekit index)");
  if (base.empty()) throw UsageError("--base is required (the base model folder)");
  if (out.empty()) throw UsageError("--out is required (the output folder)");
  if (!parse_collate_mode(mode)) throw UsageError("--mode must be pad, longest or pack, not '" + mode + "'");
  if (!parse_schedule(schedule))
    throw UsageError("--schedule must be cosine, linear or constant, not '" + schedule + "'");
  if (eval_fraction < 0 || eval_fraction >= 1) throw UsageError("--eval-fraction must be in [0, 1)");
  if (ttt_steps < 1) throw UsageError("--ttt-steps must be at least 1");
  if (!(loss_decay > 0)) throw UsageError("--loss-decay must be positive");
  if (max_length < 2) throw UsageError("--max-length must be at least 2");
  if (batch_size < 1) throw UsageError("--batch-size must be at least 1");
  if (grad_accum < 1) throw UsageError("--grad-accum must be at least 1");
  if (!(lr > 0) || !std::isfinite(lr)) throw UsageError("--lr must be a positive number");
  if (warmup_steps < 0) throw UsageError("--warmup-steps must not be negative");
  if (weight_decay < 0) throw UsageError("--weight-decay must not be negative");
  if (!(adam_beta1 >= 0 && adam_beta1 < 1) || !(adam_beta2 >= 0 && adam_beta2 < 1))
    throw UsageError("Adam betas must be in [0, 1)");
  if (!(adam_eps > 0)) throw UsageError("Adam eps must be positive");
  if (epochs < 0) throw UsageError("--epochs must not be negative");
  if (max_steps < 0) throw UsageError("--max-steps must not be negative");
  if (log_every < 1) throw UsageError("--log-every must be at least 1");
  if (draft_vocab_size < 0) throw UsageError("--draft-vocab-size must not be negative");
  if (cp_size < 1) throw UsageError("--cp must be at least 1");
  if (prefetch < 1) throw UsageError("--prefetch must be at least 1");
  if (jobs < 0 || threads < 0) throw UsageError("--jobs and --threads must not be negative");
  parse_autocast_dtype(dtype);
  if (!export_dtype.empty()) parse_float_dtype(export_dtype);
  parse_device(device);
}

// --- vocabulary ------------------------------------------------------------------------

std::vector<std::int64_t> count_tokens(const Dataset& dataset, const std::vector<SampleRef>& samples,
                                       std::int64_t vocab_size, int jobs) {
  if (vocab_size <= 0) throw UsageError("vocabulary size must be positive");
  std::map<std::uint32_t, std::vector<const SampleRef*>> by_file;
  for (const auto& s : samples) by_file[s.file].push_back(&s);
  std::vector<std::pair<std::uint32_t, std::vector<const SampleRef*>>> groups(by_file.begin(), by_file.end());
  tbb::combinable<TokenCounts> partial([&] { return TokenCounts(vocab_size); });
  tbb::task_arena arena(jobs > 0 ? jobs : tbb::task_arena::automatic);
  arena.execute([&] {
    tbb::parallel_for(tbb::blocked_range<std::size_t>(0, groups.size(), 1),
                      [&](const tbb::blocked_range<std::size_t>& range) {
                        TokenCounts& counts = partial.local();
                        for (std::size_t g = range.begin(); g != range.end(); ++g) {
                          const std::string& path = dataset.files.at(groups[g].first);
                          const auto reader = open_reader(path);
                          for (const SampleRef* s : groups[g].second) {
                            // Views into the mapping for .pt/safetensors: only the ids' pages are touched.
                            const Record r = reader->read(s->record);
                            counts.add(r.input_ids, path + "#" + s->conversation_id);
                          }
                        }
                      });
  });
  TokenCounts total(vocab_size);
  partial.combine_each([&](const TokenCounts& c) { total.merge(c); });
  return total.counts();
}

std::string VocabReport::to_json() const {
  json j;
  j["vocab_size"] = vocab_size;
  j["draft_vocab_size"] = draft_vocab_size;
  j["samples"] = samples;
  j["tokens"] = tokens;
  j["distinct"] = distinct;
  j["coverage"] = coverage;
  j["seconds"] = seconds;
  return j.dump();
}

VocabReport build_vocab(const VocabOptions& o) {
  const auto t0 = Clock::now();
  if (o.data.empty()) throw UsageError("--data is required");
  if (o.index.empty()) throw UsageError("--index is required (build one with eaglekit index)");
  if (o.out.empty()) throw UsageError("--out is required (the d2t.pt to write)");
  if (o.draft_vocab_size <= 0) throw UsageError("--draft-vocab-size is required and must be positive");
  std::int64_t v = o.vocab_size;
  if (v <= 0) {
    if (o.base.empty()) throw UsageError("give --base (its config.json has vocab_size) or --vocab-size");
    v = load_base_config(o.base).vocab_size;
  }
  if (o.draft_vocab_size > v) {
    throw UsageError("--draft-vocab-size " + std::to_string(o.draft_vocab_size) +
                     " exceeds the vocabulary size " + std::to_string(v));
  }
  DataSelection sel;
  sel.data = o.data;
  sel.index = o.index;
  sel.quarantine = o.quarantine;
  sel.split = o.split;
  sel.eval_fraction = o.eval_fraction;
  const SelectedData data = select_data(sel);
  const auto counts = count_tokens(data.dataset, data.samples, v, o.jobs);
  const at::Tensor d2t = d2t_from_counts(counts, o.draft_vocab_size);
  save_d2t(o.out, d2t);

  VocabReport r;
  r.vocab_size = v;
  r.draft_vocab_size = o.draft_vocab_size;
  r.samples = static_cast<std::int64_t>(data.samples.size());
  for (std::int64_t c : counts) {
    r.tokens += c;
    r.distinct += c > 0;
  }
  const auto ids = (d2t + at::arange(o.draft_vocab_size, at::kLong)).contiguous();
  const std::int64_t* p = ids.data_ptr<std::int64_t>();
  std::int64_t covered = 0;
  for (std::int64_t i = 0; i < o.draft_vocab_size; ++i) covered += counts[static_cast<std::size_t>(p[i])];
  r.coverage = r.tokens > 0 ? static_cast<double>(covered) / static_cast<double>(r.tokens) : 0.0;
  r.summary = data.summary;
  r.seconds = seconds_since(t0);
  return r;
}

// --- the loop --------------------------------------------------------------------------

TrainResult run_training(const TrainOptions& opts, const dist::Mesh* mesh_arg, const TrainHooks& hooks) {
  const dist::Mesh single = dist::Mesh::single();
  const dist::Mesh& mesh = mesh_arg ? *mesh_arg : single;
  const bool main_rank = mesh.is_main();
  const int world = mesh.world_size();
  auto say = [&](const std::string& msg) {
    if (main_rank) std::cerr << "train: " << msg << "\n";
  };

  opts.check();
  if (opts.cp_size != mesh.cp_size())
    throw UsageError("--cp " + std::to_string(opts.cp_size) + " does not match the mesh (cp " +
                     std::to_string(mesh.cp_size()) + ")");
  const Schedule schedule = *parse_schedule(opts.schedule);
  c10::Device device = parse_device(opts.device);
  if (device.is_cuda() && world > 1) device = c10::Device(c10::kCUDA, mesh.local_rank());
  const std::optional<c10::ScalarType> autocast = parse_autocast_dtype(opts.dtype);
  if (opts.threads > 0) at::set_num_threads(opts.threads);
  const std::int64_t steps_s = opts.ttt_steps;
  const std::int64_t epochs = effective_epochs(opts);

  // --- resume? ---
  std::optional<LoadedCheckpoint> resumed;
  if (opts.resume) {
    resumed.emplace(load_checkpoint(resolve_resume(opts.resume_from.empty() ? opts.out : opts.resume_from)));
    const TrainerState& st = resumed->checkpoint.state;
    if (st.world_size != world || st.cp_size != mesh.cp_size()) {
      throw UsageError("--resume: " + resumed->dir + " was saved by " + std::to_string(st.world_size) +
                       " ranks with cp " + std::to_string(st.cp_size) + "; resume with the same world size and cp (now " +
                       std::to_string(world) + " ranks, cp " + std::to_string(mesh.cp_size()) + ")");
    }
    say("resuming from " + resumed->dir + " (step " + std::to_string(st.step) + ")");
  } else if (main_rank) {
    if (auto existing = find_latest_checkpoint(opts.out)) {
      throw UsageError("--out " + opts.out + " already holds " + fs::path(*existing).filename().string() +
                       "; pass --resume to continue that run, or choose another --out");
    }
  }
  at::manual_seed(opts.seed);

  // --- data ---
  DataSelection sel;
  sel.data = opts.data;
  sel.index = opts.index;
  sel.quarantine = opts.quarantine;
  sel.split = "train";
  sel.eval_fraction = opts.eval_fraction;
  SelectedData train_data = select_data(sel);
  if (train_data.samples.empty()) throw UsageError("the train split is empty (" + train_data.summary + ")");
  say(train_data.summary);
  std::optional<SelectedData> eval_data;
  if (opts.eval_every >= 0) {
    sel.split = "eval";
    eval_data = select_data(sel);
    if (eval_data->samples.empty()) {
      say("the eval split is empty: no evaluation (raise --eval-fraction to get one)");
      eval_data.reset();
    }
  }

  LoaderOptions lo;
  lo.collate.mode = *parse_collate_mode(opts.mode);
  lo.collate.max_length = opts.max_length;
  lo.collate.cp_rank = mesh.cp_rank();
  lo.collate.cp_size = mesh.cp_size();
  lo.sampler.batch_size = opts.batch_size;
  lo.sampler.rank = mesh.dp_rank();
  lo.sampler.world_size = mesh.dp_size();
  lo.sampler.shuffle = opts.shuffle;
  lo.sampler.seed = opts.seed;
  lo.sampler.epochs = epochs;
  lo.jobs = opts.jobs;
  lo.prefetch = opts.prefetch;
  Loader loader(train_data.dataset, train_data.samples, lo);
  const RecordShape shape = loader.shape();

  // --- base and draft ---
  BaseLoadOptions bo;
  bo.device = device;
  const BaseModel base = load_base_model(opts.base, bo);
  const BaseConfig& bc = base.config;
  for (const auto& d : bc.defaults_applied) say(opts.base + "/config.json: " + d);
  if (shape.hidden != bc.hidden_size) {
    throw UsageError("the data's hidden states are " + std::to_string(shape.hidden) + " wide but the base in " +
                     opts.base + " has hidden_size " + std::to_string(bc.hidden_size));
  }
  if (shape.aux_width % shape.hidden != 0) {
    throw UsageError("the data's aux width " + std::to_string(shape.aux_width) + " is not a multiple of hidden " +
                     std::to_string(shape.hidden));
  }
  const std::int64_t aux_layers = shape.aux_width / shape.hidden;

  std::optional<DraftModel> draft_holder;
  if (resumed) {
    draft_holder.emplace(resumed->draft);
  } else if (!opts.init_draft.empty()) {
    DraftModel init = load_draft(opts.init_draft);
    DraftConfig c = init.config();
    bool changed = false;
    if (!opts.aux_layer_ids.empty() && opts.aux_layer_ids != c.aux_layer_ids) {
      c.aux_layer_ids = opts.aux_layer_ids;
      changed = true;
    }
    if (opts.modelopt_norm && !c.modelopt_norm) {
      c.modelopt_norm = true;
      changed = true;
    }
    if (opts.draft_vocab_size > 0 && opts.draft_vocab_size != c.draft_vocab_size) {
      throw UsageError("--draft-vocab-size " + std::to_string(opts.draft_vocab_size) + " differs from --init-draft's (" +
                       std::to_string(c.draft_vocab_size) + ")");
    }
    if (!opts.d2t.empty() && !at::equal(load_d2t(opts.d2t).to(at::kLong), init.d2t().to(at::kCPU))) {
      throw UsageError("--d2t " + opts.d2t + " differs from the d2t of --init-draft " + opts.init_draft +
                       " (its lm_head rows belong to its own d2t)");
    }
    c.check();
    draft_holder.emplace(changed ? with_config(init, c) : init);
    say("starting from the draft in " + opts.init_draft);
  } else {
    DraftOptions dopts;
    const at::Tensor d2t = fresh_d2t(opts, bc, train_data, say);
    dopts.draft_vocab_size = d2t.size(0);
    dopts.num_aux_layers = aux_layers;
    dopts.aux_layer_ids = opts.aux_layer_ids;
    dopts.modelopt_norm = opts.modelopt_norm;
    const DraftConfig c = draft_config_from_base(bc, dopts);
    if (opts.aux_layer_ids.empty() && !c.aux_layer_ids.empty()) {
      std::string ids;
      for (auto id : c.aux_layer_ids) ids += (ids.empty() ? "" : ",") + std::to_string(id);
      say("aux layer ids " + ids + ": EAGLE-3's default for a " + std::to_string(bc.num_hidden_layers) +
          "-layer base (HF hidden_states indices 2, N/2, N-3); pass --aux-layer-ids if the dump used others");
    }
    draft_holder.emplace(c, d2t, base.lm_head.to(at::kCPU), opts.seed);
  }
  DraftModel draft = *draft_holder;
  draft_holder.reset();
  {
    const DraftConfig& c = draft.config();
    if (c.hidden_size != bc.hidden_size || c.vocab_size != bc.vocab_size) {
      throw UsageError("the draft (hidden " + std::to_string(c.hidden_size) + ", vocab " + std::to_string(c.vocab_size) +
                       ") does not fit the base (hidden " + std::to_string(bc.hidden_size) + ", vocab " +
                       std::to_string(bc.vocab_size) + ")");
    }
    if (c.aux_width() != shape.aux_width || c.target_hidden_size != shape.hidden) {
      throw UsageError("the draft's fc reads " + std::to_string(c.num_aux_layers) + " x " +
                       std::to_string(c.target_hidden_size) + " aux features, the data has " +
                       std::to_string(aux_layers) + " x " + std::to_string(shape.hidden));
    }
    // Before any step: final/ is for a server, and no server computes some drafts.
    check_servable(c, opts.allow_unservable, "train");
    if (c.aux_layer_ids.empty()) {
      throw UsageError("--aux-layer-ids is required: the data has " + std::to_string(aux_layers) +
                       " aux layers and the export must name them (the ids the dump used; EAGLE-3's default "
                       "2,N/2,N-3 applies only to 3 layers of a base with at least 6)");
    }
  }
  draft.to(device, at::kFloat);
  draft.train(true);
  TttOptions to;
  to.steps = steps_s;
  to.loss_decay = opts.loss_decay;
  to.autocast = autocast;
  TttUnroll unroll(base, draft, to);
  const auto named = draft.named_parameters();
  std::vector<at::Tensor> params;
  for (const auto& np : named) params.push_back(np.second);
  std::int64_t param_count = 0;
  for (const auto& p : params) param_count += p.numel();

  if (world > 1 && !resumed) broadcast_parameters(mesh.world(), params, 0);
  AdamW::Options ao;
  ao.beta1 = opts.adam_beta1;
  ao.beta2 = opts.adam_beta2;
  ao.eps = opts.adam_eps;
  ao.weight_decay = opts.weight_decay;
  AdamW optimizer(named, ao);
  TrainResult result;
  result.summary = train_data.summary;
  std::int64_t step = 0;
  double tokens_total = 0;
  std::int64_t total_steps = 0;
  if (resumed) {
    const TrainerState& st = resumed->checkpoint.state;
    optimizer.load_state(resumed->checkpoint.optimizer, st.optimizer_steps, resumed->dir + "/optimizer.safetensors");
    restore_rng_state(resumed->checkpoint.rng);
    loader.restore(st.sampler);
    step = st.step;
    tokens_total = st.tokens;
    result.resumed_from = resumed->dir;
    // Same stopping rule as the saved run: the schedule continues exactly.
    TrainOptions saved;
    saved.apply_json(resumed->checkpoint.options_json, resumed->dir + "/train_options.json");
    if (saved.max_steps == opts.max_steps && saved.epochs == opts.epochs && saved.grad_accum == opts.grad_accum &&
        saved.batch_size == opts.batch_size)
      total_steps = st.schedule_total_steps;
  }
  if (total_steps <= 0) {
    const std::int64_t per_epoch = (loader.steps_in_epoch() + opts.grad_accum - 1) / opts.grad_accum;
    total_steps = epochs > 0 ? per_epoch * epochs : opts.max_steps;
    if (opts.max_steps > 0) total_steps = std::min(total_steps, opts.max_steps);
  }
  result.start_step = step;
  std::optional<GradientSync> sync;
  if (world > 1) sync.emplace(mesh.world(), params);
  const std::unique_ptr<SequenceContext> context = make_sequence_context(mesh);

  say("draft: " + std::to_string(param_count) + " parameters, hidden " + std::to_string(draft.config().hidden_size) +
      ", draft vocab " + std::to_string(draft.config().draft_vocab_size) + "; " + std::to_string(total_steps) +
      " optimizer steps of " + std::to_string(opts.batch_size * opts.grad_accum * mesh.dp_size()) + " rows on " +
      std::to_string(world) + " rank(s), " + std::to_string(at::get_num_threads()) + " threads, device " +
      device.str());

  // --- output ---
  std::ofstream metrics;
  const std::string metrics_path = (fs::path(opts.out) / "metrics.jsonl").string();
  if (main_rank) {
    std::error_code ec;
    fs::create_directories(opts.out, ec);
    if (ec) throw IoError(opts.out + ": cannot create folder: " + ec.message());
    if (resumed) trim_metrics(metrics_path, step);
    metrics.open(metrics_path, resumed ? std::ios::app : std::ios::trunc);
    if (!metrics) throw IoError(metrics_path + ": cannot open for writing");
  }
  // TensorBoard: every number of a metrics line as a scalar, train/KEY or eval/KEY, and
  // per-TTT-step lists as KEY/stepS (docs/tensorboard.md). A resumed run adds a new file.
  std::unique_ptr<EventFileWriter> events;
  if (main_rank && !opts.no_tensorboard)
    events = std::make_unique<EventFileWriter>(opts.tensorboard.empty() ? (fs::path(opts.out) / "tensorboard").string()
                                                                      : opts.tensorboard);
  auto emit = [&](const json& j) {
    if (!main_rank) return;
    const std::string line = j.dump();
    metrics << line << "\n";
    metrics.flush();
    if (events) {
      const std::string prefix = j.value("split", "train") + "/";
      std::vector<std::pair<std::string, double>> scalars;
      for (const auto& [k, v] : j.items()) {
        if (k == "step" || k == "split") continue;
        if (v.is_number()) scalars.emplace_back(prefix + k, v.get<double>());
        if (v.is_array())
          for (std::size_t s = 0; s < v.size(); ++s)
            if (v[s].is_number()) scalars.emplace_back(prefix + k + "/step" + std::to_string(s), v[s].get<double>());
      }
      events->add_scalars(j.value("step", std::int64_t{0}), scalars);
    }
    if (hooks.on_metrics) hooks.on_metrics(line);
  };

  auto checkpoint = [&]() {
    if (main_rank) {
      Checkpoint ck;
      ck.state.step = step;
      ck.state.sampler = loader.state();
      ck.state.epoch = ck.state.sampler.epoch;
      ck.state.optimizer_steps = optimizer.steps();
      ck.state.schedule_total_steps = total_steps;
      ck.state.tokens = tokens_total;
      ck.state.world_size = world;
      ck.state.cp_size = mesh.cp_size();
      ck.optimizer = optimizer.state();
      ck.rng = capture_rng_state();
      ck.options_json = opts.to_json();
      result.last_checkpoint = save_checkpoint(opts.out, draft, ck);
    }
    if (world > 1) mesh.world().barrier();
  };

  std::int64_t last_eval_step = -1;
  auto run_eval = [&]() {
    if (!eval_data) return;
    LoaderOptions elo = lo;
    elo.sampler.shuffle = false;
    elo.sampler.epochs = 1;
    Loader eval_loader(eval_data->dataset, eval_data->samples, elo);
    const auto t0 = Clock::now();
    const TttStats stats = evaluate_loader(unroll, eval_loader, &mesh);
    json j;
    j["split"] = "eval";
    j["step"] = step;
    j["epoch"] = loader.state().epoch;
    const json metrics = json::parse(stats_json(stats, opts.loss_decay));
    for (const auto& [k, v] : metrics.items()) j[k] = v;
    j["seconds"] = seconds_since(t0);
    emit(j);
    result.eval_stats = stats;
    last_eval_step = step;
  };

  // --- the loop ---
  SignalGuard signals;
  const bool show_progress = opts.progress && main_rank && ::isatty(2) == 1;
  TttStats run_stats(steps_s), window(steps_s);
  double window_tokens = 0, window_time = 0, window_wait = 0, window_cpu = 0;
  double run_tokens = 0, run_time = 0, run_wait = 0;
  std::int64_t window_steps = 0;
  double grad_norm = 0, lr = 0;
  std::uint64_t epoch_of_step = loader.state().epoch;
  auto last_draw = Clock::now() - std::chrono::seconds(1);
  const std::string last_good_hint = result.resumed_from.empty() ? std::string("none yet") : result.resumed_from;
  bool saved_at_step = false;
  const auto loop_start = Clock::now();

  auto log_window = [&]() {
    if (window_steps == 0) return;
    json j;
    j["step"] = step;
    j["epoch"] = epoch_of_step;
    j["lr"] = lr;
    const json metrics = json::parse(stats_json(window, opts.loss_decay));
    for (const auto& [k, v] : metrics.items()) j[k] = v;
    j["grad_norm"] = number(grad_norm);
    j["tokens_per_s"] = window_time > 0 ? window_tokens / window_time : 0.0;
    j["loader_wait_ms"] = 1000.0 * window_wait / static_cast<double>(window_steps);
    j["data_wait_share"] = window_time > 0 ? window_wait / window_time : 0.0;
    j["step_ms"] = 1000.0 * window_time / static_cast<double>(window_steps);
    j["cpu_ms"] = 1000.0 * window_cpu / static_cast<double>(window_steps);
    j["elapsed_s"] = seconds_since(loop_start);
    j["peak_rss_mb"] = peak_rss_mb();
    emit(j);
    window = TttStats(steps_s);
    window_tokens = window_time = window_wait = window_cpu = 0;
    window_steps = 0;
  };

  for (;;) {
    if (opts.max_steps > 0 && step >= opts.max_steps) break;
    const auto t0 = Clock::now();
    const double cpu0 = process_cpu_seconds();
    const double wait0 = loader.stats().wait_s;
    std::vector<Batch> micro;
    bool finished = false;
    while (static_cast<std::int64_t>(micro.size()) < opts.grad_accum) {
      std::optional<Batch> b = loader.next();
      if (!b) {
        finished = epochs > 0 && loader.state().epoch >= static_cast<std::uint64_t>(epochs);
        break;
      }
      micro.push_back(std::move(*b));
    }
    if (micro.empty()) {
      if (finished) break;
      continue;  // an epoch ended on a step boundary; the next call starts the next one
    }
    const double waited = loader.stats().wait_s - wait0;
    epoch_of_step = micro.back().epoch;

    // The normalizer of this step: mask sums over every micro-batch of every rank.
    at::Tensor sums = at::zeros({steps_s + 1}, at::kDouble);
    for (const Batch& b : micro) {
      sums.narrow(0, 0, steps_s).add_(loss_mask_sums(b, steps_s));
      sums[steps_s] += static_cast<double>(b.tokens);
    }
    sums = reduce_sum(mesh.world(), sums, device);
    const at::Tensor normalizer = sums.narrow(0, 0, steps_s).to(device, at::kFloat);
    const double step_tokens = sums[steps_s].item<double>();

    optimizer.zero_grad();
    TttStats local(steps_s);
    std::int64_t last_real = -1;
    for (std::size_t i = 0; i < micro.size(); ++i)
      if (micro[i].rows() > 0) last_real = static_cast<std::int64_t>(i);
    for (std::size_t i = 0; i < micro.size(); ++i) {
      const Batch& b = micro[i];
      if (b.rows() == 0) continue;
      prepare_context(context.get(), b);
      if (sync && static_cast<std::int64_t>(i) == last_real) sync->prepare();
      TttResult r = unroll.forward(to_ttt_batch(b), context.get());
      ttt_loss(r.ce_sum, normalizer, opts.loss_decay).backward();
      local += r.stats;
    }
    if (sync) sync->finish();

    // Metrics of the global batch, and whether any rank was asked to stop.
    at::Tensor flat = at::cat({local.to_tensor().reshape({-1}), at::full({1}, g_stop_signal != 0 ? 1.0 : 0.0, at::kDouble)});
    flat = reduce_sum(mesh.world(), flat, device);
    const TttStats step_stats = TttStats::from_tensor(flat.narrow(0, 0, 5 * steps_s).reshape({5, steps_s}));
    bool stop = flat[5 * steps_s].item<double>() > 0;

    const double loss = step_stats.loss(opts.loss_decay);
    grad_norm = clip_grad_norm(params, opts.grad_clip);
    if (!std::isfinite(loss) || !std::isfinite(grad_norm)) {
      if (show_progress) std::cerr << "\n";
      auto name = [](double x) { return std::string(std::isnan(x) ? "NaN" : x > 0 ? "+inf" : "-inf"); };
      const std::string what = !std::isfinite(loss) ? "the loss is " + name(loss) : "the gradient norm is " + name(grad_norm);
      throw TrainingError("training stopped at step " + std::to_string(step + 1) + " (epoch " +
                          std::to_string(epoch_of_step) + "): " + what +
                          "; nothing was saved after it, the last good checkpoint is " +
                          (result.last_checkpoint.empty() ? last_good_hint : result.last_checkpoint) +
                          ". Try a lower --lr, more --warmup-steps or --grad-clip, or check the data "
                          "(eaglekit validate)");
    }
    lr = learning_rate(opts.lr, schedule, opts.warmup_steps, total_steps, step);
    optimizer.step(lr);
    ++step;
    saved_at_step = false;

    const double dt = seconds_since(t0);
    tokens_total += step_tokens;
    window += step_stats;
    run_stats += step_stats;
    window_tokens += step_tokens;
    window_time += dt;
    window_wait += waited;
    window_cpu += process_cpu_seconds() - cpu0;
    ++window_steps;
    run_tokens += step_tokens;
    run_time += dt;
    run_wait += waited;

    if (hooks.after_step && !hooks.after_step(step, draft)) stop = true;
    const bool last = opts.max_steps > 0 && step >= opts.max_steps;
    if (step % opts.log_every == 0 || stop || last) log_window();
    if (show_progress && (seconds_since(last_draw) > 0.25 || stop)) {
      last_draw = Clock::now();
      const double rate = run_time > 0 ? static_cast<double>(step - result.start_step) / run_time : 0;
      const double eta = rate > 0 && total_steps > step ? static_cast<double>(total_steps - step) / rate : 0;
      const auto acc = step_stats.acc();
      std::ostringstream line;
      line.precision(4);
      line << "\rtrain step " << step << "/" << total_steps << "  loss " << loss << "  acc0 "
           << (acc.empty() ? 0.0 : acc[0]) << "  " << rate_text(run_time > 0 ? run_tokens / run_time : 0)
           << " tok/s  ETA " << format_duration(eta) << "   ";
      std::cerr << line.str() << std::flush;
    }
    if (stop) {
      if (show_progress) std::cerr << "\n";
      checkpoint();
      saved_at_step = true;
      result.interrupted = true;
      say(std::string("stopped") + (g_stop_signal ? " by signal " + std::to_string(g_stop_signal) : "") +
          " at step " + std::to_string(step) + "; checkpoint " + result.last_checkpoint +
          " (continue with --resume)");
      break;
    }
    if (opts.save_every > 0 && step % opts.save_every == 0) {
      checkpoint();
      saved_at_step = true;
    }
    if (opts.eval_every > 0 && step % opts.eval_every == 0) run_eval();
  }
  if (show_progress && !result.interrupted) std::cerr << "\n";

  result.steps = step;
  result.epoch = loader.state().epoch;
  result.train_stats = run_stats;
  result.seconds = run_time;
  result.tokens_per_s = run_time > 0 ? run_tokens / run_time : 0;
  result.data_wait_share = run_time > 0 ? run_wait / run_time : 0;
  if (result.interrupted) return result;

  log_window();
  if (!saved_at_step) checkpoint();
  if (opts.eval_every >= 0 && last_eval_step != step) run_eval();
  if (main_rank) {
    result.final_dir = (fs::path(opts.out) / "final").string();
    ExportOptions eo;
    eo.serving = true;
    eo.allow_unservable = opts.allow_unservable;
    std::vector<std::string> warnings;
    eo.dtype = serving_export_dtype(opts.export_dtype, draft.config(), warnings);
    for (const auto& w : warnings) say("final/: " + w);
    // Into a temp folder first: final/ appears complete (config.json with model.safetensors)
    // or not at all, and a rerun replaces an older one in one step.
    const std::string tmp = (fs::path(opts.out) / (".final.tmp-" + std::to_string(::getpid()))).string();
    std::error_code ec;
    fs::remove_all(tmp, ec);
    try {
      export_draft(draft, tmp, eo);
      replace_folder_atomic(tmp, result.final_dir);
    } catch (...) {
      fs::remove_all(tmp, ec);
      throw;
    }
    say("done: " + std::to_string(step) + " steps; final draft in " + result.final_dir);
  }
  if (world > 1) mesh.world().barrier();
  return result;
}

}  // namespace eaglekit::trainer
