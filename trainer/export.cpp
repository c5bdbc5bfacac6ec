#include "trainer/export.h"

#include <ATen/ATen.h>

#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <set>

#include "formats/atomic_file.h"
#include "formats/error.h"
#include "formats/safetensors_format.h"
#include "lib/collate.h"
#include "trainer/base_model.h"
#include "trainer/config.h"

namespace eaglekit::trainer {

void check_servable(const DraftConfig& config, bool allow_unservable, const std::string& what) {
  if (!config.modelopt_norm || allow_unservable) return;
  throw UsageError(what + ": the draft uses ModelOpt's norm form (input_layernorm applied to the hidden input "
                   "before hidden_norm), which neither vLLM nor SGLang computes: served there it would run "
                   "another function than the one trained, with low acceptance and no error. Pass "
                   "--allow-unservable to write it anyway (for ModelOpt's own stack)");
}

void export_draft(const DraftModel& draft, const std::string& dir, const ExportOptions& options) {
  const c10::ScalarType dtype = options.dtype.value_or(draft.dtype());
  if (!at::isFloatingType(dtype)) throw UsageError("export dtype must be a floating-point type");
  if (options.serving) check_servable(draft.config(), options.allow_unservable, "export");
  const std::string weights_dtype(dtype_name(to_dtype(dtype)));
  // A checkpoint keeps the serving dtype beside its float32 weights; a served folder is
  // served in the dtype it holds.
  DraftConfig config = draft.config();
  if (options.serving) config.torch_dtype = weights_dtype;
  const std::string config_text = draft_config_json(config, weights_dtype);  // throws before anything is written

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

void export_draft_folder(const DraftModel& draft, const std::string& dir, const ExportOptions& options_in) {
  ExportOptions options = options_in;
  options.serving = true;
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path target = fs::absolute(dir, ec).lexically_normal();
  if (ec) throw IoError(dir + ": cannot resolve the folder: " + ec.message());
  if (!target.has_filename()) target = target.parent_path();  // "served/"
  if (!target.has_filename() || target == target.root_path())
    throw UsageError(dir + ": not a folder an export can replace");
  const fs::file_status st = fs::symlink_status(target, ec);
  if (fs::exists(st)) {
    if (!fs::is_directory(st))
      throw UsageError(dir + ": exists and is not a folder (export writes a folder)");
    // The old folder goes as a whole: refuse to take anything with it but an old export.
    for (const auto& e : fs::directory_iterator(target, ec)) {
      const std::string name = e.path().filename().string();
      const bool file = e.is_regular_file(ec);
      if (file && (name == "config.json" || name == "model.safetensors" ||
                   name.find(".tmp.") != std::string::npos))
        continue;
      throw UsageError(dir + ": holds " + name + (file ? "" : " (not a file)") +
                       ", which is not part of an exported draft; export replaces the folder as a "
                       "whole, so give a new or empty folder");
    }
    if (ec) throw IoError(dir + ": cannot list folder: " + ec.message());
  }
  const fs::path parent = target.parent_path();
  const std::string name = target.filename().string();
  fs::create_directories(parent, ec);
  if (ec) throw IoError(parent.string() + ": cannot create folder: " + ec.message());
  // Temp folders of exports to the same DIR whose process is gone (killed mid-export), and
  // what replace_folder_atomic may have set aside (".old" added).
  const std::string prefix = "." + name + ".tmp-";
  for (const auto& e : fs::directory_iterator(parent, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(prefix, 0) != 0) continue;
    if (process_gone(std::strtol(n.c_str() + prefix.size(), nullptr, 10)))
      fs::remove_all(e.path(), ec);
  }
  const fs::path tmp = parent / (prefix + std::to_string(::getpid()));
  fs::remove_all(tmp, ec);
  try {
    export_draft(draft, tmp.string(), options);
    // The files are fsynced by their writers; their names in the folder must be too
    // before the folder becomes visible as DIR.
    const int fd = ::open(tmp.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
      ::fsync(fd);
      ::close(fd);
    }
    replace_folder_atomic(tmp.string(), target.string());
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
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
