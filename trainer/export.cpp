#include "trainer/export.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <set>

#include "formats/atomic_file.h"
#include "formats/error.h"
#include "formats/safetensors_format.h"
#include "lib/collate.h"
#include "trainer/base_model.h"
#include "trainer/config.h"

namespace eaglekit::trainer {

void export_draft(const DraftModel& draft, const std::string& dir, const ExportOptions& options) {
  const c10::ScalarType dtype = options.dtype.value_or(draft.dtype());
  if (!at::isFloatingType(dtype)) throw UsageError("export dtype must be a floating-point type");
  DraftConfig config = draft.config();
  config.torch_dtype = std::string(dtype_name(to_dtype(dtype)));
  const std::string config_text = draft_config_json(config);  // throws before anything is written

  std::vector<NamedTensor> tensors;
  for (const auto& [name, param] : draft.named_parameters())
    tensors.push_back({name, to_host_tensor(param.detach().to(at::kCPU, dtype).contiguous())});
  tensors.push_back({"d2t", to_host_tensor(draft.d2t().to(at::kCPU).contiguous())});
  tensors.push_back({"t2d", to_host_tensor(draft.t2d().to(at::kCPU).contiguous())});

  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw IoError(dir + ": cannot create folder: " + ec.message());
  write_safetensors(dir + "/model.safetensors", tensors);
  write_file_atomic(dir + "/config.json", config_text.data(), config_text.size());
}

DraftModel load_draft(const std::string& dir) {
  if (!std::filesystem::is_directory(dir)) throw IoError(dir + ": not a folder (expected an exported draft)");
  const DraftConfig config = load_draft_config(dir);
  const SafetensorsWeights weights = SafetensorsWeights::open_folder(dir);

  auto read = [&](const std::string& name) -> std::optional<at::Tensor> {
    const std::optional<HostTensor> host = weights.get(name);
    if (!host) return std::nullopt;
    return tensor_from_host(*host);
  };

  at::Tensor d2t;
  if (auto t = read("d2t")) {
    if (t->dim() != 1 || t->size(0) != config.draft_vocab_size || !at::isIntegralType(t->scalar_type(), false)) {
      throw FormatError(weights.file_of("d2t"), std::nullopt, "d2t",
                        "expected an integer tensor [" + std::to_string(config.draft_vocab_size) +
                            "] (draft_vocab_size), got " + c10::str(t->sizes()));
    }
    d2t = t->to(at::kLong);
  } else if (config.draft_vocab_size == config.vocab_size) {
    d2t = at::zeros({config.vocab_size}, at::kLong);
  } else {
    throw FormatError(weights.path(), std::nullopt, "d2t",
                      "missing, and draft_vocab_size != vocab_size so it cannot be implied");
  }

  DraftModel draft(config, d2t, at::Tensor());
  std::set<std::string> expected;
  for (const auto& [name, param] : draft.named_parameters()) {
    expected.insert(name);
    const std::optional<at::Tensor> value = read(name);
    if (!value) throw FormatError(weights.path(), std::nullopt, name, "missing");
    if (value->sizes() != param.sizes()) {
      throw FormatError(weights.file_of(name), std::nullopt, name,
                        "shape " + c10::str(value->sizes()) + " does not match config.json (expected " +
                            c10::str(param.sizes()) + ")");
    }
    if (!at::isFloatingType(value->scalar_type()))
      throw FormatError(weights.file_of(name), std::nullopt, name, "expected a floating-point tensor");
    draft.load_parameter(name, *value);
  }
  if (auto t2d = read("t2d")) {
    const at::Tensor mine = draft.t2d();
    if (t2d->sizes() != mine.sizes() || !at::equal(t2d->to(at::kBool), mine)) {
      throw FormatError(weights.file_of("t2d"), std::nullopt, "t2d",
                        "does not mark exactly the target tokens d2t maps to");
    }
  }
  for (const std::string& name : weights.names()) {
    if (expected.count(name) || name == "d2t" || name == "t2d" || name == "embed_tokens.weight") continue;
    throw FormatError(weights.file_of(name), std::nullopt, name,
                      "not part of a one-layer EAGLE-3 draft (unexpected tensor)");
  }
  return draft;
}

}  // namespace eaglekit::trainer
