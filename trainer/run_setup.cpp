#include "trainer/run_setup.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>

#include "formats/error.h"
#include "trainer/distributed.h"
#include "trainer/ring_attention.h"

namespace eaglekit::trainer {

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

std::optional<c10::ScalarType> autocast_type(ComputeDType dtype) {
  if (dtype == ComputeDType::kBFloat16) return at::kBFloat16;
  return std::nullopt;
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

at::Tensor reduce_sum(const dist::Group& group, const at::Tensor& cpu, c10::Device device) {
  if (group.size() == 1) return cpu;
  at::Tensor t = cpu.contiguous();
  if (group.backend() == dist::Backend::kNccl) t = t.to(device);
  group.all_reduce_sum(t);
  return t.to(at::kCPU);
}

}  // namespace eaglekit::trainer
