#include "trainer/run/run_setup.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>

#include <stdexcept>

#include "formats/error.h"
#include "formats/registry.h"
#include "trainer/parallel/distributed.h"
#include "trainer/parallel/ring_attention.h"

namespace eaglekit::trainer {

c10::Device parse_device(const std::string& name, bool check_available) {
  if (check_available && (name == "cuda" || name.rfind("cuda:", 0) == 0) && !at::hasCUDA()) {
    throw UsageError("--device " + name +
                     ": this LibTorch has no usable CUDA device (build against a CUDA LibTorch, "
                     "or use --device cpu)");
  }
  const DeviceName d = parse_device_name(name);
  if (!d.cuda) return c10::Device(c10::kCPU);
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(d.index));
}

std::optional<c10::ScalarType> autocast_type(ComputeDType dtype) {
  if (dtype == ComputeDType::kBFloat16) return at::kBFloat16;
  return std::nullopt;
}

namespace {

// The norm facts of the format rows that state one, for a plan's words.
std::string norm_facts() {
  std::string out;
  for (const FormatRow& row : format_rows())
    if (!row.norm_fact.empty()) out += (out.empty() ? "" : "; ") + std::string(row.norm_fact);
  return out;
}

}  // namespace

NormPlan plan_hidden_states_norm(HiddenStatesNorm option, const std::vector<SampleRef>& samples,
                                 const NormMeasure& measure) {
  NormPlan p;
  const SampleRef* first_pre = nullptr;
  const SampleRef* first_post = nullptr;
  const SampleRef* first_layout_pre = nullptr;
  const SampleRef* first_layout_post = nullptr;
  const SampleRef* first_unstated = nullptr;
  for (const auto& s : samples) {
    if (s.hidden_states_prenorm) {
      ++(*s.hidden_states_prenorm ? p.stated_pre : p.stated_post);
      const SampleRef*& f = *s.hidden_states_prenorm ? first_pre : first_post;
      if (!f) f = &s;
    } else if (s.layout_prenorm) {
      ++(*s.layout_prenorm ? p.layout_pre : p.layout_post);
      const SampleRef*& f = *s.layout_prenorm ? first_layout_pre : first_layout_post;
      if (!f) f = &s;
    } else {
      ++p.unstated;
      if (!first_unstated) first_unstated = &s;
    }
  }
  const std::int64_t stated = p.stated_pre + p.stated_post;
  const std::int64_t by_layout = p.layout_pre + p.layout_post;
  std::string counts = std::to_string(p.stated_pre) + " pre-norm, " + std::to_string(p.stated_post) + " post-norm, " +
                       std::to_string(p.unstated + by_layout) + " not stated";
  if (by_layout > 0)
    counts += ", of which " + std::to_string(p.layout_pre) + " pre-norm and " + std::to_string(p.layout_post) +
              " post-norm by their layout";
  if (option == HiddenStatesNorm::kAuto) {
    p.layout_norm = true;
    if (stated > 0) p.source.push_back("stated");
    if (by_layout > 0) p.source.push_back("format");
    std::string said = "hidden states in the form each record states";
    if (by_layout > 0) said += " or its layout implies";
    said += " (" + counts + ")";
    if (by_layout > 0) said += " (the format's fact: " + norm_facts() + ")";
    if (p.unstated > 0) {
      if (!measure) throw std::logic_error("plan_hidden_states_norm: auto needs a measurement");
      const NormMeasurement m = measure();
      p.measured = m.said;
      if (m.form != "pre" && m.form != "post")
        throw UsageError("--hidden-states-norm auto: " + std::to_string(p.unstated) + " of " +
                         std::to_string(samples.size()) + " records state no norm form and their layout implies none "
                         "(e.g. '" + first_unstated->conversation_id + "'), and measuring them through the base's "
                         "head was unclear: " + m.said + ". Pass --hidden-states-norm post or pre for them (stated "
                         "forms still win; `eaglekit validate --base` measures every record)");
      p.default_pre = m.form == "pre";
      p.source.push_back("measured");
      const char* name = p.default_pre ? "pre" : "post";
      said = (stated + by_layout > 0 ? said + "; the " + std::to_string(p.unstated) + " that state none "
                                     : std::string("hidden states of the ") + std::to_string(p.unstated) +
                                           " records, which state no norm form, ") +
             "taken as " + name + "-norm, measured through the base's head: " + m.said;
    }
    if ((p.default_pre && p.unstated > 0) || p.stated_pre > 0 || p.layout_pre > 0)
      said += ": the base's final RMSNorm is applied before lm_head to the pre-norm ones";
    p.said = said;
  } else {
    p.layout_norm = false;
    p.default_pre = option == HiddenStatesNorm::kPre;
    p.source = {"option"};
    if (stated > 0) p.source.insert(p.source.begin(), "stated");
    const char* name = p.default_pre ? "pre" : "post";
    const std::int64_t against = p.default_pre ? p.stated_post : p.stated_pre;
    if (against > 0) {
      const SampleRef* e = p.default_pre ? first_post : first_pre;
      p.warnings.push_back(std::string("--hidden-states-norm ") + name + " contradicts " + std::to_string(against) +
                           " of " + std::to_string(samples.size()) + " records, which state " +
                           (p.default_pre ? "post" : "pre") + "-norm (e.g. '" + e->conversation_id +
                           "'): they are trained in their stated form, and the option applies only to the " +
                           std::to_string(p.unstated + by_layout) + " that state none");
    }
    const std::int64_t overridden = p.default_pre ? p.layout_post : p.layout_pre;
    if (overridden > 0) {
      const SampleRef* e = p.default_pre ? first_layout_post : first_layout_pre;
      p.warnings.push_back(std::string("--hidden-states-norm ") + name + " overrides the " +
                           (p.default_pre ? "post" : "pre") + "-norm form that the layout of " +
                           std::to_string(overridden) + " records implies (e.g. '" + e->conversation_id +
                           "'; " + norm_facts() + "): they are trained as " + name + "-norm");
    }
    p.said = std::string("hidden states taken as ") + name + "-norm (--hidden-states-norm " + name + ")" +
             (stated > 0 ? " where the record states no form (" + counts + ")" : std::string()) +
             (p.default_pre || p.stated_pre > 0 ? ": the base's final RMSNorm is applied before lm_head to the pre-norm ones"
                                                : "");
  }
  const std::int64_t defaulted = p.unstated + (p.layout_norm ? 0 : by_layout);
  p.any_pre = p.stated_pre > 0 || (p.layout_norm && p.layout_pre > 0) || (p.default_pre && defaulted > 0);
  // No record takes the default: the unroll must not ask for a final norm on its account.
  if (defaulted == 0) p.default_pre = false;
  return p;
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
  t.hidden_states_prenorm = batch.hidden_states_prenorm;
  t.target_probs = batch.target_probs;
  return t;
}

std::int64_t dflash_batch_most_valid(const Batch& batch, const DraftConfig& config) {
  if (batch.rows() == 0) return 0;
  return dflash_most_valid(batch.loss_mask, batch.document_ids, batch.position_ids, config.block_size);
}

DFlashAnchors dflash_batch_anchors(const Batch& batch, const DraftConfig& config, std::int64_t num_anchors,
                                   std::uint64_t seed, std::int64_t most_valid) {
  // Each document's own seed, pad or pack: the collator lists each sample's row and its
  // document in that row.
  if (batch.sample_rows.size() != batch.conversation_ids.size() || batch.sample_documents.size() != batch.conversation_ids.size())
    throw UsageError("DFlash anchors: the batch lists " + std::to_string(batch.conversation_ids.size()) +
                     " conversations but " + std::to_string(batch.sample_rows.size()) + " rows and " +
                     std::to_string(batch.sample_documents.size()) + " documents of them");
  std::vector<std::vector<std::uint64_t>> seeds(static_cast<std::size_t>(batch.rows()));
  for (std::size_t i = 0; i < batch.conversation_ids.size(); ++i) {
    const std::int64_t r = batch.sample_rows[i], d = batch.sample_documents[i];
    if (r < 0 || r >= batch.rows() || d < 0)
      throw UsageError("DFlash anchors: sample " + std::to_string(i) + " lies in row " + std::to_string(r) +
                       ", document " + std::to_string(d) + " of a batch of " + std::to_string(batch.rows()) + " rows");
    std::vector<std::uint64_t>& row = seeds[static_cast<std::size_t>(r)];
    if (row.size() <= static_cast<std::size_t>(d)) row.resize(static_cast<std::size_t>(d) + 1, 0);
    row[static_cast<std::size_t>(d)] = dflash_row_seed(seed, batch.epoch, batch.conversation_ids[i]);
  }
  return dflash_anchors(batch.loss_mask, batch.document_ids, batch.position_ids, config.block_size, num_anchors, seeds,
                        most_valid);
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

std::unique_ptr<SequenceContext> make_sequence_context(const dist::Mesh& mesh, TttAttention attention) {
  if (mesh.cp_size() == 1) return nullptr;
  RingOptions ro;
  ro.pair_kernel = ring_pair_kernel(attention);
  return std::make_unique<RingContext>(mesh.cp(), mesh.cp(), ro);
}

void prepare_context(SequenceContext* context, const Batch& batch) {
  if (auto* ring = dynamic_cast<RingContext*>(context)) ring->set_global_length(batch.length);
}

at::Tensor reduce_sum(const dist::Group& group, const at::Tensor& cpu, c10::Device device) {
  if (group.size() == 1) return cpu;
  at::Tensor t = cpu.contiguous();
  if (group.backend() == dist::Backend::kNccl) t = t.to(device);
  group.all_reduce_sum(t);
  return t.to(at::kCPU);
}

}  // namespace eaglekit::trainer
