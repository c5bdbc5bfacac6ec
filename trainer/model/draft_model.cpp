#include "trainer/model/draft_model.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <cmath>
#include <map>

#include "formats/error.h"
#include "trainer/model/architecture_rows.h"

namespace eaglekit::trainer {

namespace {

void check_d2t(const at::Tensor& d2t, const DraftConfig& c) {
  if (!d2t.defined() || d2t.dim() != 1 || d2t.size(0) != c.draft_vocab_size ||
      d2t.scalar_type() != at::kLong) {
    throw UsageError("d2t must be an int64 tensor [" + std::to_string(c.draft_vocab_size) +
                     "] (the draft vocabulary size)");
  }
  const at::Tensor target = d2t.cpu() + torch::arange(c.draft_vocab_size, torch::kLong);
  if (c.draft_vocab_size > 0 &&
      (target.min().item<std::int64_t>() < 0 || target.max().item<std::int64_t>() >= c.vocab_size)) {
    throw UsageError("d2t maps a draft token outside the target vocabulary [0, " +
                     std::to_string(c.vocab_size) + ")");
  }
  if (std::get<0>(at::_unique(target)).numel() != c.draft_vocab_size)
    throw UsageError("d2t maps two draft tokens to the same target token");
}

}  // namespace

struct DraftModel::Impl {
  DraftConfig config;
  std::shared_ptr<DraftNet> net;
  at::Tensor d2t;
  // The net's first parameter, which device() and dtype() read: Module::to moves a parameter
  // in place (set_data), so the handle follows it; asking the net would build its whole
  // parameter list on every forward.
  at::Tensor first_parameter;
};

DraftModel::DraftModel(const DraftConfig& config, const at::Tensor& d2t, const at::Tensor& base_lm_head,
                       std::uint64_t seed)
    : impl_(std::make_shared<Impl>()) {
  config.check();
  check_d2t(d2t, config);
  impl_->config = config;
  impl_->net = draft_architecture(config.architecture).make_net(config);
  impl_->first_parameter = impl_->net->named_parameters().front().second;
  impl_->d2t = d2t.to(torch::kCPU).clone();
  torch::NoGradGuard no_grad;
  auto gen = at::detail::createCPUGenerator(seed);
  for (auto& [name, p] : impl_->net->named_parameters()) {
    if (name.size() > 7 && name.compare(name.size() - 7, 7, ".weight") == 0 && p.dim() == 2) p.normal_(0.0, 0.02, gen);
  }
  auto* ttt = dynamic_cast<TttNet*>(impl_->net.get());
  if (base_lm_head.defined() && ttt != nullptr) {
    if (base_lm_head.dim() != 2 || base_lm_head.size(0) != config.vocab_size ||
        base_lm_head.size(1) != config.hidden_size) {
      throw UsageError("base lm_head has shape " + std::string(c10::str(base_lm_head.sizes())) +
                       ", expected [" + std::to_string(config.vocab_size) + ", " +
                       std::to_string(config.hidden_size) + "]");
    }
    ttt->lm_head_weight().copy_(
        base_lm_head.to(torch::kCPU).index_select(0, draft_to_target()).to(torch::kFloat));
  }
}

DraftModel::~DraftModel() = default;
DraftModel::DraftModel(const DraftModel&) = default;
DraftModel& DraftModel::operator=(const DraftModel&) = default;

const DraftConfig& DraftModel::config() const { return impl_->config; }
const at::Tensor& DraftModel::d2t() const { return impl_->d2t; }

at::Tensor DraftModel::draft_to_target() const {
  return impl_->d2t + torch::arange(impl_->d2t.size(0), impl_->d2t.options());
}

at::Tensor DraftModel::t2d() const {
  at::Tensor t2d = torch::zeros({impl_->config.vocab_size}, impl_->d2t.options().dtype(torch::kBool));
  t2d.index_fill_(0, draft_to_target(), true);
  return t2d;
}

std::vector<std::pair<std::string, at::Tensor>> DraftModel::named_parameters() const {
  return impl_->net->named_parameters();
}

std::vector<at::Tensor> DraftModel::parameters() const {
  std::vector<at::Tensor> out;
  for (auto& [name, p] : impl_->net->named_parameters()) out.push_back(std::move(p));
  return out;
}

const DraftNet& DraftModel::net() const { return *impl_->net; }

const TttNet& DraftModel::ttt_net() const {
  if (const auto* n = dynamic_cast<const TttNet*>(impl_->net.get())) return *n;
  throw UsageError("the " + impl_->config.architecture + " draft is not driven by the TTT unroll");
}

const BlockNet& DraftModel::block_net() const {
  if (const auto* n = dynamic_cast<const BlockNet*>(impl_->net.get())) return *n;
  throw UsageError("the " + impl_->config.architecture + " draft is not a block-parallel drafter");
}

void DraftModel::load_parameter(const std::string& name, const at::Tensor& value) {
  for (auto& [n, p] : impl_->net->named_parameters()) {
    if (n != name) continue;
    if (p.sizes() != value.sizes()) {
      throw UsageError("parameter '" + name + "' has shape " + c10::str(p.sizes()) + ", got " +
                       c10::str(value.sizes()));
    }
    torch::NoGradGuard no_grad;
    p.copy_(value);
    return;
  }
  throw UsageError("the draft has no parameter '" + name + "'");
}

void DraftModel::set_d2t(const at::Tensor& d2t) {
  check_d2t(d2t, impl_->config);
  impl_->d2t = d2t.to(impl_->d2t.device()).clone();
}

void DraftModel::to(c10::Device device, c10::ScalarType dtype) {
  impl_->net->to(device, dtype);
  impl_->d2t = impl_->d2t.to(device);
}

// Every network has at least one parameter (DraftConfig::check asks for a layer).
c10::Device DraftModel::device() const { return impl_->first_parameter.device(); }
c10::ScalarType DraftModel::dtype() const { return impl_->first_parameter.scalar_type(); }
void DraftModel::train(bool on) { impl_->net->train(on); }

}  // namespace eaglekit::trainer
