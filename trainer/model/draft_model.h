// A draft: its config, its d2t map and the network of its architecture
// (trainer/model/architecture.h, trainer/model/draft_net.h; EAGLE-3 is the built-in one). The
// TTT unroll (trainer/unroll/ttt.h) drives net(); export, checkpoints and the plan read the
// parameters by their export names (docs/export.md) and ask the architecture the rest. d2t/t2d
// are not parameters: a cast to the float dtype would change them.
//
// Ownership: copies of a DraftModel share the same weights (like torch module holders).
// Thread safety: none; one training loop drives a model. Shape errors throw c10::Error.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "trainer/model/config.h"
#include "trainer/model/draft_net.h"

namespace eaglekit::trainer {

class DraftModel {
 public:
  // A fresh draft of config.architecture (UsageError when no row has that name). Linear
  // weights ~ N(0, 0.02) drawn on the CPU from `seed` (so equal on every device), norms 1.
  // A TTT draft's lm_head starts as the rows i + d2t[i] of `base_lm_head` [V, H] when that
  // is defined, else random (a block draft has no lm_head: it uses the base's). d2t: [Vd] int64 (docs/draft.md). The
  // model lives on the CPU in float32 until to().
  DraftModel(const DraftConfig& config, const at::Tensor& d2t, const at::Tensor& base_lm_head,
             std::uint64_t seed = 0);
  ~DraftModel();
  DraftModel(const DraftModel&);
  DraftModel& operator=(const DraftModel&);

  const DraftConfig& config() const;
  const at::Tensor& d2t() const;          // [Vd] int64, on the model's device
  at::Tensor draft_to_target() const;     // [Vd] int64: target id of draft id i = i + d2t[i]
  at::Tensor t2d() const;                 // [V] bool: target token present in the draft vocab

  // Trainable parameters in a fixed order (the export order); tensors share storage with
  // the module.
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;
  std::vector<at::Tensor> parameters() const;

  // Copies values into the parameter `name` (shape must match; dtype/device converted).
  // Throws UsageError for an unknown name or a shape mismatch.
  void load_parameter(const std::string& name, const at::Tensor& value);
  // Replaces d2t ([Vd] int64, each i + d2t[i] in [0, V)); throws UsageError otherwise.
  void set_d2t(const at::Tensor& d2t);

  void to(c10::Device device, c10::ScalarType dtype);
  c10::Device device() const;
  c10::ScalarType dtype() const;
  void train(bool on = true);

  // The architecture's network, which the unroll drives (trainer/model/draft_net.h).
  const DraftNet& net() const;
  // The same network as the TTT unroll or the block unroll talks to it; UsageError naming
  // the architecture when it is driven by the other unroll.
  const TttNet& ttt_net() const;
  const BlockNet& block_net() const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace eaglekit::trainer
