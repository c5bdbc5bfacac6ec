#include "trainer/model/base_model.h"

#include <ATen/ATen.h>

#include <filesystem>

#include "formats/error.h"
#include "formats/safetensors_format.h"
#include "lib/collate.h"

namespace eaglekit::trainer {

at::Tensor tensor_from_host(const HostTensor& t) {
  const at::Tensor view = at::from_blob(const_cast<std::uint8_t*>(t.data), t.shape, t.strides,
                                        at::TensorOptions().dtype(to_scalar_type(t.dtype)));
  // The mapping is read-only and may go away: always own the bytes.
  return view.is_contiguous() ? view.clone() : view.contiguous();
}

namespace {

at::Tensor read_matrix(const SafetensorsWeights& w, const std::string& name, const BaseConfig& c,
                       const BaseLoadOptions& options) {
  const std::optional<HostTensor> host = w.get(name);
  if (!host) throw FormatError(w.path(), std::nullopt, name, "missing");  // callers check first
  if (host->dim() != 2 || host->shape[0] != c.vocab_size || host->shape[1] != c.hidden_size) {
    throw FormatError(w.file_of(name), std::nullopt, name,
                      "shape " + host->shape_string() + " does not match config.json [vocab_size " +
                          std::to_string(c.vocab_size) + ", hidden_size " + std::to_string(c.hidden_size) + "]");
  }
  if (!is_floating(host->dtype)) {
    throw FormatError(w.file_of(name), std::nullopt, name,
                      "expected a floating-point tensor, got " + std::string(dtype_name(host->dtype)));
  }
  at::Tensor t = tensor_from_host(*host);
  return t.to(options.device, options.dtype.value_or(t.scalar_type()));
}

}  // namespace

BaseModel load_base_model(const std::string& dir, const BaseLoadOptions& options) {
  if (!std::filesystem::is_directory(dir))
    throw IoError(dir + ": not a folder (expected a Hugging Face model folder)");
  BaseModel base;
  base.path = dir;
  base.config = load_base_config(dir);
  const SafetensorsWeights weights = SafetensorsWeights::open_folder(dir);
  std::string embed_name;
  for (const char* name : {"model.embed_tokens.weight", "embed_tokens.weight",
                           "model.language_model.embed_tokens.weight"}) {
    if (weights.contains(name)) {
      embed_name = name;
      break;
    }
  }
  if (embed_name.empty()) {
    throw FormatError(weights.path(), std::nullopt, "model.embed_tokens.weight",
                      "missing: the base folder must hold the input embeddings");
  }
  base.embed_tokens = read_matrix(weights, embed_name, base.config, options);
  if (weights.contains("lm_head.weight")) {
    base.lm_head = read_matrix(weights, "lm_head.weight", base.config, options);
  } else {
    base.lm_head = base.embed_tokens;
    base.tied = true;
  }
  for (const char* name : {"model.norm.weight", "norm.weight", "model.language_model.norm.weight"}) {
    if (!options.final_norm) break;
    const std::optional<HostTensor> host = weights.get(name);
    if (!host) continue;
    if (host->dim() != 1 || host->shape[0] != base.config.hidden_size || !is_floating(host->dtype))
      throw FormatError(weights.file_of(name), std::nullopt, name,
                        "expected a floating-point [hidden_size " + std::to_string(base.config.hidden_size) +
                            "] vector, got " + std::string(dtype_name(host->dtype)) + " " + host->shape_string());
    base.final_norm = tensor_from_host(*host).to(options.device, at::kFloat);
    break;
  }
  return base;
}

}  // namespace eaglekit::trainer
