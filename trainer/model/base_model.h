// The frozen parts of the base model the draft needs (docs/draft.md): its config,
// `embed_tokens` [V, H] and `lm_head` [V, H], read from a Hugging Face folder
// (config.json + model.safetensors or a sharded model.safetensors.index.json). Only those
// two tensors are read, never the rest of the model.
//
// Ownership: plain values; the tensors own their memory (copied out of the mapping).
// Errors: IoError (no folder/file), FormatError (missing tensor, wrong shape, bad config),
// UnsupportedError (a dtype we cannot hold).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <optional>
#include <string>

#include "formats/host_tensor.h"
#include "trainer/model/config.h"

namespace eaglekit::trainer {

struct BaseModel {
  BaseConfig config;
  at::Tensor embed_tokens;  // [V, H], requires_grad false
  at::Tensor lm_head;       // [V, H]; the same tensor as embed_tokens when tied
  bool tied = false;        // lm_head.weight was absent: tied to the embeddings
  // [H] the final RMSNorm's weight (model.norm.weight), applied to pre-norm hidden states
  // (--hidden-states-norm pre) before lm_head; undefined when the folder holds none.
  at::Tensor final_norm;
  std::string path;         // the folder it came from ("" when built in memory)
};

struct BaseLoadOptions {
  c10::Device device = c10::kCPU;
  std::optional<c10::ScalarType> dtype;  // nullopt: as stored
  // Also read the final norm's weight (model.norm.weight): pre-norm hidden states need it.
  // Off by default, so that a sharded folder is read only where embed_tokens and lm_head are.
  bool final_norm = false;
};

// Reads DIR/config.json and the two tensors (`model.embed_tokens.weight`, also accepted
// without the "model." prefix; `lm_head.weight`, else tied). Checks both are [V, H] with
// V and H from the config.
BaseModel load_base_model(const std::string& dir, const BaseLoadOptions& options = {});

// An owning LibTorch copy of a host tensor (any strides) on the CPU.
at::Tensor tensor_from_host(const HostTensor& t);

}  // namespace eaglekit::trainer
