#include "trainer/parallel/data_parallel.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <mutex>
#include <string>
#include <utility>

#include "formats/error.h"
#include "trainer/parallel/autograd_node.h"

namespace eaglekit::trainer {

struct GradientSync::State {
  dist::Group group;
  GradSyncOptions options;
  std::vector<at::Tensor> params;
  struct Bucket {
    std::vector<std::size_t> members;  // indices into params
    std::int64_t numel = 0;
    at::Tensor flat;
    dist::Group::Pending pending;
    std::size_t ready = 0;
    bool launched = false;
  };
  std::vector<Bucket> buckets;
  std::vector<std::size_t> bucket_of;  // param -> bucket
  std::vector<bool> seen;              // param's gradient accumulated since prepare()
  // Hooks live on the parameters' gradient accumulators; holding these keeps the
  // accumulators (and so the hooks) alive across backward passes.
  std::vector<NodePtr> accumulators;
  std::vector<std::uintptr_t> hook_keys;
  std::size_t next_launch = 0;
  bool armed = false;
  std::mutex mu;  // hooks run on the autograd thread

  void launch(std::size_t b) {
    Bucket& bk = buckets[b];
    std::vector<at::Tensor> parts;
    parts.reserve(bk.members.size());
    for (std::size_t i : bk.members) {
      const at::Tensor& p = params[i];
      const at::Tensor g = p.grad();
      parts.push_back(g.defined() ? g.detach().reshape({-1}) : at::zeros({p.numel()}, p.options()));
    }
    bk.flat = at::cat(parts);
    bk.pending = group.start_all_reduce_sum(bk.flat);
    bk.launched = true;
  }

  // Launches ready buckets strictly in bucket order, so every rank issues the collectives
  // in the same order whatever order its hooks fired in.
  void launch_ready() {
    while (next_launch < buckets.size() && buckets[next_launch].ready == buckets[next_launch].members.size()) {
      launch(next_launch);
      ++next_launch;
    }
  }

  void on_accumulated(std::size_t i) {
    std::lock_guard<std::mutex> lock(mu);
    if (!armed || seen[i]) return;
    seen[i] = true;
    ++buckets[bucket_of[i]].ready;
    launch_ready();
  }
};

GradientSync::GradientSync(dist::Group group, std::vector<at::Tensor> parameters, GradSyncOptions options)
    : state_(std::make_shared<State>()) {
  State& st = *state_;
  st.group = std::move(group);
  st.options = options;
  st.params = std::move(parameters);
  for (std::size_t i = 0; i < st.params.size(); ++i) {
    const at::Tensor& p = st.params[i];
    if (!p.defined() || !p.requires_grad() || !p.is_leaf())
      throw UsageError("GradientSync: parameter " + std::to_string(i) +
                       " is not a leaf tensor that requires grad");
  }
  st.bucket_of.assign(st.params.size(), 0);
  st.seen.assign(st.params.size(), false);
  // Reverse order; a new bucket when full or when dtype/device change (one flat tensor).
  for (std::size_t k = st.params.size(); k-- > 0;) {
    const at::Tensor& p = st.params[k];
    const std::size_t bytes = static_cast<std::size_t>(p.numel()) * p.element_size();
    bool fresh = st.buckets.empty();
    if (!fresh) {
      const auto& last = st.buckets.back();
      const at::Tensor& q = st.params[last.members.front()];
      const std::size_t last_bytes = static_cast<std::size_t>(last.numel) * q.element_size();
      fresh = q.scalar_type() != p.scalar_type() || q.device() != p.device() ||
              last_bytes + bytes > st.options.bucket_bytes;
    }
    if (fresh) st.buckets.emplace_back();
    st.buckets.back().members.push_back(k);
    st.buckets.back().numel += p.numel();
    st.bucket_of[k] = st.buckets.size() - 1;
  }
  if (st.options.overlap) {
    std::weak_ptr<State> weak = state_;
    for (std::size_t i = 0; i < st.params.size(); ++i) {
      auto acc = torch::autograd::impl::grad_accumulator(st.params[i]);
      const auto key = acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [weak, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
            if (auto s = weak.lock()) s->on_accumulated(i);
            return outputs;
          }));
      st.accumulators.push_back(std::move(acc));
      st.hook_keys.push_back(key);
    }
  }
}

GradientSync::~GradientSync() {
  State& st = *state_;
  for (std::size_t i = 0; i < st.accumulators.size(); ++i) st.accumulators[i]->del_post_hook(st.hook_keys[i]);
  // Unwaited buckets are waited (errors dropped) by their Pending destructors.
}

void GradientSync::prepare() {
  State& st = *state_;
  std::lock_guard<std::mutex> lock(st.mu);
  for (auto& b : st.buckets) {
    if (b.launched) b.pending.wait();
    b.ready = 0;
    b.launched = false;
    b.flat.reset();
  }
  st.seen.assign(st.params.size(), false);
  st.next_launch = 0;
  st.armed = st.options.overlap;
}

void GradientSync::finish() {
  State& st = *state_;
  std::lock_guard<std::mutex> lock(st.mu);
  st.armed = false;
  for (std::size_t b = 0; b < st.buckets.size(); ++b)
    if (!st.buckets[b].launched) st.launch(b);
  c10::NoGradGuard no_grad;
  for (auto& bk : st.buckets) {
    bk.pending.wait();
    std::int64_t offset = 0;
    for (std::size_t i : bk.members) {
      at::Tensor& p = st.params[i];
      const std::int64_t n = p.numel();
      const at::Tensor summed = bk.flat.narrow(0, offset, n).view(p.sizes());
      if (p.grad().defined()) {
        p.mutable_grad().copy_(summed);
      } else {
        p.mutable_grad() = summed.clone();
      }
      offset += n;
    }
    bk.launched = false;
    bk.ready = 0;
    bk.flat.reset();
  }
  st.next_launch = 0;
  st.seen.assign(st.params.size(), false);
}

std::size_t GradientSync::bucket_count() const { return state_->buckets.size(); }
const dist::Group& GradientSync::group() const { return state_->group; }

void broadcast_parameters(const dist::Group& group, const std::vector<at::Tensor>& parameters, int root) {
  c10::NoGradGuard no_grad;
  for (const at::Tensor& p : parameters) {
    at::Tensor t = p.detach();
    if (t.is_contiguous()) {
      group.broadcast(t, root);
    } else {
      at::Tensor c = t.contiguous();
      group.broadcast(c, root);
      t.copy_(c);
    }
  }
}

TttStats all_reduce_stats(const dist::Group& group, const TttStats& local) {
  at::Tensor t = local.to_tensor().contiguous();
  group.all_reduce_sum(t);
  return TttStats::from_tensor(t);
}

}  // namespace eaglekit::trainer
