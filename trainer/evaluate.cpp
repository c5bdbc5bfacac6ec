#include "trainer/evaluate.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <ATen/Context.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iomanip>
#include <sstream>

#include "formats/error.h"
#include "lib/progress.h"
#include "trainer/base_model.h"
#include "trainer/checkpoint.h"
#include "trainer/data_parallel.h"
#include "trainer/distributed.h"
#include "trainer/export.h"
#include "trainer/ring_attention.h"

namespace eaglekit::trainer {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// JSON numbers cannot be NaN/Inf: those become null.
nlohmann::ordered_json number(double x) {
  if (!std::isfinite(x)) return nullptr;
  return x;
}

nlohmann::ordered_json numbers(const std::vector<double>& xs) {
  auto a = nlohmann::ordered_json::array();
  for (double x : xs) a.push_back(number(x));
  return a;
}

}  // namespace

c10::Device parse_device(const std::string& name) {
  if (name == "cpu") return c10::Device(c10::kCPU);
  if (name == "cuda" || name.rfind("cuda:", 0) == 0) {
    if (!at::hasCUDA()) {
      throw UsageError("--device " + name +
                       ": this LibTorch has no usable CUDA device (build against a CUDA LibTorch, "
                       "or use --device cpu)");
    }
    if (name == "cuda") return c10::Device(c10::kCUDA, 0);
    const std::string idx = name.substr(5);
    if (idx.empty() || idx.find_first_not_of("0123456789") != std::string::npos || idx.size() > 3)
      throw UsageError("--device '" + name + "': expected cuda:N");
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(std::stoi(idx)));
  }
  throw UsageError("--device must be cpu, cuda or cuda:N, not '" + name + "'");
}

std::optional<c10::ScalarType> parse_autocast_dtype(const std::string& name) {
  if (name == "float32" || name == "fp32" || name == "float") return std::nullopt;
  if (name == "bfloat16" || name == "bf16") return at::kBFloat16;
  throw UsageError("--dtype must be float32 or bfloat16, not '" + name + "'");
}

TttBatch to_ttt_batch(const Batch& batch) {
  TttBatch t;
  t.input_ids = batch.input_ids;
  t.attention_mask = batch.attention_mask;
  t.loss_mask = batch.loss_mask;
  t.hidden_states = batch.hidden_states;
  t.aux_hidden_states = batch.aux_hidden_states;
  t.document_ids = batch.document_ids;
  t.position_ids = batch.position_ids;
  return t;
}

at::Tensor loss_mask_sums(const Batch& batch, std::int64_t steps) {
  at::Tensor out = at::zeros({steps}, at::kDouble);
  if (batch.rows() == 0 || batch.input_ids.size(1) == 0) return out;
  const std::int64_t n = batch.input_ids.size(1);
  // The unroll weighs position t by loss_mask[t + 1] when t >= s (and t + 1 is in t's
  // document). Summed over the whole row that is: loss_mask[u] at every u whose position
  // is >= s + 1 (a document's first token has position 0, so the document condition is
  // implied). Counting at u rather than t keeps each context-parallel chunk's share local.
  const at::Tensor positions =
      batch.position_ids.defined()
          ? batch.position_ids.to(at::kCPU, at::kLong)
          : at::arange(batch.first_token, batch.first_token + n, at::kLong).unsqueeze(0);
  const at::Tensor mask = batch.loss_mask.to(at::kCPU, at::kDouble);
  auto acc = out.accessor<double, 1>();
  for (std::int64_t s = 0; s < steps; ++s)
    acc[s] = (mask * (positions >= s + 1).to(at::kDouble)).sum().item<double>();
  return out;
}

std::unique_ptr<SequenceContext> make_sequence_context(const dist::Mesh& mesh) {
  if (mesh.cp_size() == 1) return nullptr;
  return std::make_unique<RingContext>(mesh.cp(), mesh.cp());
}

void prepare_context(SequenceContext* context, const Batch& batch) {
  if (auto* ring = dynamic_cast<RingContext*>(context)) ring->set_global_length(batch.length);
}

TttStats evaluate_loader(TttUnroll& unroll, Loader& loader, const dist::Mesh* mesh, std::int64_t max_batches,
                         const std::function<void(const TttStats&)>& on_batch) {
  const dist::Mesh single = dist::Mesh::single();
  const dist::Mesh& m = mesh ? *mesh : single;
  const std::unique_ptr<SequenceContext> context = make_sequence_context(m);
  TttStats total(unroll.options().steps);
  c10::NoGradGuard no_grad;
  unroll.draft().train(false);
  std::int64_t done = 0;
  while (max_batches < 0 || done < max_batches) {
    std::optional<Batch> batch = loader.next();
    if (!batch) break;
    ++done;
    if (batch->rows() > 0) {
      prepare_context(context.get(), *batch);
      total += unroll.forward(to_ttt_batch(*batch), context.get()).stats;
    }
    if (on_batch) on_batch(total);
  }
  unroll.draft().train(true);
  if (m.world_size() > 1) total = all_reduce_stats(m.world(), total);
  return total;
}

std::string stats_json(const TttStats& stats, double loss_decay) {
  nlohmann::ordered_json j;
  j["loss"] = number(stats.loss(loss_decay));
  j["loss_per_step"] = numbers(stats.loss_per_step());
  j["acc"] = numbers(stats.acc());
  j["cond_acc"] = numbers(stats.cond_acc());
  j["est_ar"] = number(stats.est_ar());
  j["est_ar_cond"] = number(stats.est_ar_conditional());
  j["tokens"] = number(stats.tokens());
  return j.dump();
}

std::string EvaluateReport::to_json() const {
  auto j = nlohmann::ordered_json::parse(stats_json(stats, loss_decay));
  j["steps"] = stats.steps();
  j["loss_decay"] = loss_decay;
  j["samples"] = samples;
  j["seconds"] = seconds;
  return j.dump();
}

std::string EvaluateReport::to_text() const {
  std::ostringstream os;
  os << std::fixed;
  os << "evaluated " << samples << " samples, " << static_cast<std::int64_t>(stats.tokens())
     << " scored positions, " << stats.steps() << " TTT steps in " << std::setprecision(1) << seconds
     << " s\n";
  os << std::setprecision(4);
  os << "loss      " << stats.loss(loss_decay) << "  (sum of " << loss_decay << "^s * loss_s)\n";
  os << "step  loss      acc     cond_acc\n";
  const auto l = stats.loss_per_step(), a = stats.acc(), c = stats.cond_acc();
  for (std::int64_t s = 0; s < stats.steps(); ++s) {
    os << std::left << std::setw(6) << s << std::setw(10) << l[static_cast<std::size_t>(s)] << std::setw(8)
       << a[static_cast<std::size_t>(s)] << c[static_cast<std::size_t>(s)] << "\n";
  }
  os << std::setprecision(3) << "est_ar    " << stats.est_ar() << "  (conditional " << stats.est_ar_conditional()
     << ")\n";
  return os.str();
}

EvaluateReport run_evaluate(const EvaluateOptions& o, const dist::Mesh* mesh) {
  const auto t0 = Clock::now();
  const dist::Mesh single = dist::Mesh::single();
  const dist::Mesh& m = mesh ? *mesh : single;
  if (o.base.empty()) throw UsageError("--base is required (the base model folder)");
  if (o.draft.empty()) throw UsageError("--draft is required (an exported draft or a checkpoint)");
  if (o.data.empty()) throw UsageError("--data is required");
  if (o.index.empty()) throw UsageError("--index is required (build one with eaglekit index)");
  if (o.ttt_steps < 1) throw UsageError("--ttt-steps must be at least 1");
  if (o.batch_size < 1) throw UsageError("--batch-size must be at least 1");
  if (o.cp_size != m.cp_size())
    throw UsageError("--cp " + std::to_string(o.cp_size) + " does not match the mesh (cp " +
                     std::to_string(m.cp_size()) + ")");
  c10::Device device = parse_device(o.device);
  if (device.is_cuda() && m.world_size() > 1) device = c10::Device(c10::kCUDA, m.local_rank());
  const std::optional<c10::ScalarType> autocast = parse_autocast_dtype(o.dtype);
  const auto mode = parse_collate_mode(o.mode);
  if (!mode) throw UsageError("--mode must be pad, longest or pack, not '" + o.mode + "'");
  if (o.threads > 0) at::set_num_threads(o.threads);

  // A folder with checkpoints but no config.json: its newest checkpoint.
  std::string draft_dir = o.draft;
  if (!std::filesystem::exists(std::filesystem::path(draft_dir) / "config.json")) {
    if (auto latest = find_latest_checkpoint(draft_dir)) draft_dir = *latest;
  }

  DataSelection sel;
  sel.data = o.data;
  sel.index = o.index;
  sel.quarantine = o.quarantine;
  sel.split = o.split;
  sel.eval_fraction = o.eval_fraction;
  SelectedData data = select_data(sel);
  if (data.samples.empty())
    throw UsageError("the " + o.split + " split is empty (" + data.summary + "); try --split all");

  BaseLoadOptions bo;
  bo.device = device;
  const BaseModel base = load_base_model(o.base, bo);
  DraftModel draft = load_draft(draft_dir);
  const DraftConfig& dc = draft.config();
  if (dc.hidden_size != base.config.hidden_size || dc.vocab_size != base.config.vocab_size) {
    throw UsageError("the draft in " + draft_dir + " (hidden " + std::to_string(dc.hidden_size) + ", vocab " +
                     std::to_string(dc.vocab_size) + ") does not fit the base in " + o.base + " (hidden " +
                     std::to_string(base.config.hidden_size) + ", vocab " +
                     std::to_string(base.config.vocab_size) + ")");
  }

  LoaderOptions lo;
  lo.collate.mode = *mode;
  lo.collate.max_length = o.max_length;
  lo.collate.cp_rank = m.cp_rank();
  lo.collate.cp_size = m.cp_size();
  lo.sampler.batch_size = o.batch_size;
  lo.sampler.rank = m.dp_rank();
  lo.sampler.world_size = m.dp_size();
  lo.sampler.epochs = 1;
  lo.jobs = o.jobs;
  Loader loader(data.dataset, data.samples, lo);
  const RecordShape shape = loader.shape();
  if (shape.aux_width != dc.aux_width() || shape.hidden != dc.target_hidden_size) {
    throw UsageError("the data has hidden size " + std::to_string(shape.hidden) + " and aux width " +
                     std::to_string(shape.aux_width) + ", the draft expects " +
                     std::to_string(dc.target_hidden_size) + " and " + std::to_string(dc.aux_width()));
  }

  draft.to(device, at::kFloat);
  TttOptions to;
  to.steps = o.ttt_steps;
  to.loss_decay = o.loss_decay;
  to.autocast = autocast;
  TttUnroll unroll(base, draft, to);

  Progress progress("evaluate", loader.steps_in_epoch(), o.progress && m.is_main() ? -1 : 0);
  EvaluateReport report;
  report.loss_decay = o.loss_decay;
  report.summary = data.summary;
  report.samples = static_cast<std::int64_t>(data.samples.size());
  report.stats = evaluate_loader(unroll, loader, &m, o.max_batches, [&](const TttStats&) { progress.add(1); });
  progress.finish();
  report.seconds = seconds_since(t0);
  return report;
}

}  // namespace eaglekit::trainer
