// Data parallelism for the trainer: gradients summed over the ranks that share one loss
// normalizer, in flat buckets whose all-reduce starts during backward as soon as all of a
// bucket's gradients are accumulated; the initial broadcast of the weights; and the
// reduction of metrics before logging.
//
// Why a sum and not a mean: the TTT loss of every rank is divided by the mask sum of the
// whole global batch (TttUnroll::forward with RingContext::sum_across over the world), so
// the sum over ranks of the per-rank gradients is exactly the gradient of the single-process
// loss on the global batch, whatever the valid-token count of each rank's rows. Under
// context parallelism the cp ranks of a sequence are in the same group for the same reason.
//
// Thread safety: a GradientSync is driven by one training loop; its hooks run on the
// autograd engine's thread during backward. Every rank must register the same parameters
// in the same order. Communication failures throw dist::DistributedError.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <memory>
#include <vector>

#include "trainer/parallel/distributed.h"
#include "trainer/unroll/ttt.h"

namespace eaglekit::trainer {

struct GradSyncOptions {
  std::size_t bucket_bytes = 25u << 20;  // flat bucket size (parameters are never split)
  // Start a bucket's all-reduce from the autograd engine once its last gradient has been
  // accumulated (needs prepare() before the backward); otherwise finish() does it all.
  bool overlap = true;
};

class GradientSync {
 public:
  // `parameters`: leaf tensors that require grad, identical in shape and order on every
  // rank. Buckets are filled in reverse order (the order backward produces gradients).
  GradientSync(dist::Group group, std::vector<at::Tensor> parameters, GradSyncOptions options = {});
  ~GradientSync();
  GradientSync(const GradientSync&) = delete;
  GradientSync& operator=(const GradientSync&) = delete;

  // Arms the hooks for the next backward: call it before the backward of the last
  // micro-batch of a step (the gradients accumulated by then are what gets summed).
  void prepare();
  // Sums every parameter's gradient over the group and waits: afterwards p.grad() is the
  // same on every rank. A parameter with no gradient counts as zeros (and gets a zero
  // grad). Launches whatever backward did not (all of it without prepare()).
  void finish();

  std::size_t bucket_count() const;
  const dist::Group& group() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

// Copies root's parameter values to every rank (in place, without autograd).
void broadcast_parameters(const dist::Group& group, const std::vector<at::Tensor>& parameters,
                          int root = 0);

// The sums of every rank's statistics: what metrics of the global batch are computed from.
TttStats all_reduce_stats(const dist::Group& group, const TttStats& local);

}  // namespace eaglekit::trainer
