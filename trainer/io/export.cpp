#include "trainer/io/export.h"

#include <ATen/ATen.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <variant>

#include "formats/atomic_file.h"
#include "formats/error.h"
#include "formats/pt_format.h"
#include "formats/safetensors_format.h"
#include "lib/collate.h"
#include "trainer/io/speculators_format.h"
#include "trainer/model/architecture_rows.h"
#include "trainer/model/base_model.h"
#include "trainer/model/config.h"

namespace eaglekit::trainer {

void check_servable(const DraftConfig& config, bool allow_unservable, const std::string& what) {
  if (allow_unservable) return;
  if (const auto why = draft_architecture(config.architecture).unservable(config)) throw UsageError(what + ": " + *why);
}

std::vector<std::string> serving_warnings(const DraftConfig& c) {
  return draft_architecture(c.architecture).serving_warnings(c);
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
  const bool speculators = options.format == ExportFormat::kSpeculators;
  const bool block = draft_architecture(config.architecture).unroll() == DraftUnrollKind::kBlock;
  // Both throw before anything is written.
  const std::string config_text = speculators ? speculators_config_json(config, options.speculators, weights_dtype)
                                              : draft_config_json(config, weights_dtype);

  std::vector<NamedTensor> tensors;
  for (const auto& [name, param] : draft.named_parameters()) {
    tensors.push_back({speculators ? speculators_tensor_name(name) : name,
                       to_host_tensor(param.detach().to(at::kCPU, dtype).contiguous())});
  }
  // The speculators layout carries the mapping only for a reduced vocabulary (its model
  // has no d2t/t2d buffers otherwise); vLLM reads the absent d2t as the identity.
  // A block drafter predicts with the base's lm_head over the whole vocabulary: no mapping.
  if (!block && (!speculators || config.draft_vocab_size < config.vocab_size)) {
    tensors.push_back({"d2t", to_host_tensor(draft.d2t().to(at::kCPU).contiguous())});
    tensors.push_back({"t2d", to_host_tensor(draft.t2d().to(at::kCPU).contiguous())});
  }

  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw IoError(dir + ": cannot create folder: " + ec.message());
  write_safetensors(dir + "/model.safetensors", tensors);
  if (!options.run_options_json.empty())
    write_file_atomic(dir + "/train_options.json", options.run_options_json.data(), options.run_options_json.size());
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
      if (file && (name == "config.json" || name == "model.safetensors" || name == "train_options.json" ||
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

namespace {

// A draft folder's tensors under eaglekit's names, whatever layout wrote them.
struct DraftWeights {
  std::string path;    // the weights file (or the folder of shards)
  std::string layout;  // what was recognised, for the user
  std::map<std::string, HostTensor> tensors;  // canonical name -> tensor
  std::map<std::string, std::string> origin;  // canonical name -> the name in the file
  std::map<std::string, std::string> file;    // canonical name -> the file holding it
  bool ours = true;                           // eaglekit's own names and files
  std::string file_name;                      // model.safetensors, its index, pytorch_model.bin
  std::vector<std::string> skipped;           // names in the file that are not the draft's
};

// Decoder layers are named layers.{i} (ModelOpt, vLLM; optionally under model.), midlayer
// (the EAGLE authors, SpecForge and eaglekit for one layer) or midlayer.{i} (some deep
// ModelOpt exports). All come to layers.{i}.* here; embed_tokens is the target's, never the
// draft's. `style` gets the form the name used ("" when no layer).
std::string neutral_name(std::string name, std::string* style) {
  if (name.rfind("model.", 0) == 0) name = name.substr(6);
  auto indexed = [](const std::string& rest) {
    const std::size_t dot = rest.find('.');
    return dot != std::string::npos && dot > 0 &&
           rest.find_first_not_of("0123456789") == dot;
  };
  if (name.rfind("midlayer.", 0) == 0) {
    const std::string rest = name.substr(9);
    if (indexed(rest)) {
      *style = "midlayer.{i}";
      return "layers." + rest;
    }
    *style = "midlayer";
    return "layers.0." + rest;
  }
  if (name.rfind("layers.", 0) == 0 && indexed(name.substr(7))) *style = "layers.{i}";
  return name;
}

// The layer index of a neutral name ("layers.3.mlp..." -> 3), -1 for others.
std::int64_t layer_of(const std::string& neutral) {
  if (neutral.rfind("layers.", 0) != 0) return -1;
  return std::strtoll(neutral.c_str() + 7, nullptr, 10);
}

// Neutral names as DraftModel names them: midlayer.* for a one-layer draft.
std::string draft_name(const std::string& neutral, std::int64_t layers) {
  if (layers == 1 && neutral.rfind("layers.0.", 0) == 0) return "midlayer." + neutral.substr(9);
  return neutral;
}

DraftWeights read_draft_weights(const std::string& dir, std::int64_t layers) {
  namespace fs = std::filesystem;
  DraftWeights w;
  std::vector<std::pair<std::string, HostTensor>> named;
  std::map<std::string, std::string> file_of;
  const bool safetensors =
      fs::exists(fs::path(dir) / "model.safetensors") || fs::exists(fs::path(dir) / "model.safetensors.index.json");
  if (safetensors) {
    const SafetensorsWeights st = SafetensorsWeights::open_folder(dir);
    w.path = st.path();
    for (const auto& n : st.names()) {
      named.emplace_back(n, *st.get(n));
      file_of[n] = st.file_of(n);
    }
  } else if (fs::exists(fs::path(dir) / "pytorch_model.bin")) {
    // torch.save of a state dict (the EAGLE authors' published drafts), read by our own
    // unpickler: no Python objects beyond tensors and the dict are accepted.
    w.path = (fs::path(dir) / "pytorch_model.bin").string();
    const PtContents pt = read_pt(w.path);
    for (const auto& e : pt.entries)
      if (const auto* t = std::get_if<HostTensor>(&e.value)) {
        named.emplace_back(e.name, *t);
        file_of[e.name] = w.path;
      }
  } else {
    throw IoError(dir + ": no draft weights (looked for model.safetensors, model.safetensors.index.json and "
                  "pytorch_model.bin)");
  }
  std::set<std::string> styles;
  std::int64_t top_layer = -1;
  std::string top_name;
  for (auto& [name, t] : named) {
    std::string style;
    const std::string neutral = neutral_name(name, &style);
    if (!style.empty()) styles.insert(style);
    if (neutral == "embed_tokens.weight") {
      w.skipped.push_back(name);
      continue;
    }
    if (layer_of(neutral) > top_layer) {
      top_layer = layer_of(neutral);
      top_name = name;
    }
    const std::string c = draft_name(neutral, layers);
    if (w.tensors.count(c))
      throw FormatError(w.path, std::nullopt, name, "names the same weight as " + w.origin[c]);
    w.tensors.emplace(c, std::move(t));
    w.origin.emplace(c, name);
    w.file.emplace(c, file_of[name]);
  }
  if (styles.size() > 1) {
    std::string list;
    for (const auto& st : styles) list += (list.empty() ? "" : ", ") + st + ".*";
    throw FormatError(file_of[top_name], std::nullopt, top_name, "mixes decoder layer names (" + list + ")");
  }
  if (top_layer >= layers) {
    throw FormatError(file_of[top_name], std::nullopt, top_name,
                      "is decoder layer " + std::to_string(top_layer) + ", but config.json says num_hidden_layers " +
                          std::to_string(layers) + " (or names none: 1)");
  }
  const std::string file = !safetensors ? "pytorch_model.bin"
                           : fs::exists(fs::path(dir) / "model.safetensors.index.json") ? "model.safetensors.index.json"
                                                                                       : "model.safetensors";
  const std::string style = styles.empty() ? "midlayer" : *styles.begin();
  // eaglekit writes midlayer.* for one layer and layers.{i}.* for more (docs/export.md).
  w.ours = safetensors && style == (layers == 1 ? "midlayer" : "layers.{i}");
  if (!safetensors) w.layout = "EAGLE-3 state dict (" + file + ", " + style + ".*)";
  else if (w.ours && layers == 1) w.layout = "eaglekit / EAGLE-3 layout (" + file + ", midlayer.*)";
  else if (w.ours) w.layout = "eaglekit / vLLM layout (" + file + ", layers.{i}.*)";
  else if (style == "layers.{i}") w.layout = "ModelOpt / vLLM names (" + file + ", layers.0.*)";
  else w.layout = "deep EAGLE-3 names (" + file + ", " + style + ".*)";
  w.file_name = file;
  return w;
}

// config.json of a draft folder in any layout, read as the engines read it.
struct FolderConfig {
  DraftConfig config;
  bool speculators = false;  // speculators_model_type: vLLM's speculators layout
  bool ours = false;         // written by eaglekit (its own keys)
  SpeculatorsInfo info;
};

FolderConfig read_folder_config(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  std::ifstream f(path, std::ios::binary);
  if (!f) throw IoError::from_errno(path, "open", errno);
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  FolderConfig out;
  out.speculators = is_speculators_config(text);
  if (out.speculators) {
    out.config = parse_draft_config(speculators_to_draft_config(text, path, &out.info), path);
  } else {
    out.config = parse_draft_config(text, path);
  }
  out.ours = text.find("\"eaglekit_num_aux_layers\"") != std::string::npos;
  return out;
}

// SpecForge keeps the vocabulary mapping apart from the weights, as vocab_mapping.pt
// ({"d2t": [Vd] int64, "t2d": [V] bool}); copied beside a draft it supplies a d2t/t2d the
// weights lack and must agree with the ones they hold (the lm_head rows follow one mapping).
bool apply_vocab_mapping(const std::string& dir, DraftWeights& w) {
  const std::string path = (std::filesystem::path(dir) / "vocab_mapping.pt").string();
  if (!std::filesystem::exists(path)) return false;
  const PtContents pt = read_pt(path);
  bool used = false;
  for (const char* key : {"d2t", "t2d"}) {
    const HostTensor* t = pt.tensor(key);
    if (t == nullptr) throw FormatError(path, std::nullopt, key, "missing (expected SpecForge's {\"d2t\", \"t2d\"})");
    const auto it = w.tensors.find(key);
    if (it == w.tensors.end()) {
      w.tensors.emplace(key, *t);
      w.origin.emplace(key, key);
      w.file.emplace(key, path);
      used = true;
      continue;
    }
    const at::Tensor mine = tensor_from_host(it->second).to(at::kLong);
    const at::Tensor theirs = tensor_from_host(*t).to(at::kLong);
    if (mine.sizes() != theirs.sizes() || !at::equal(mine, theirs)) {
      throw FormatError(path, std::nullopt, key,
                        std::string("differs from the ") + key + " in " + w.file[key] +
                            ": the draft's lm_head rows follow one mapping; remove the file that does not belong");
    }
  }
  return used;
}

// What the user is told the folder was: from the config and the files beside the weights.
void name_layout(const std::string& dir, const FolderConfig& fc, DraftWeights& w) {
  namespace fs = std::filesystem;
  const std::string& file = w.file_name;
  const bool mapping = apply_vocab_mapping(dir, w);
  if (fc.speculators) {
    w.layout = "speculators (config.json speculators_config, " + file + ", layers.*)";
    w.ours = false;
  } else if (w.layout.rfind("eaglekit", 0) == 0) {  // our names in safetensors
    const bool deep = fc.config.num_hidden_layers > 1;
    const std::string names = deep ? "layers.{i}.*" : "midlayer.*";
    if (fc.ours && !mapping) {
      w.layout = "eaglekit (" + file + ", " + names + ")";
    } else if (mapping || fs::exists(fs::path(dir) / "training_state.pt")) {
      // A SpecForge checkpoint folder holds its optimizer state in training_state.pt.
      w.layout = "SpecForge (" + file + ", " + names + (mapping ? ", d2t/t2d from vocab_mapping.pt" : "") + ")";
      w.ours = false;
    } else {
      w.layout = (deep ? "vLLM / ModelOpt names (" : "EAGLE-3 layout (") + file + ", " + names + ")";
      w.ours = false;
    }
  }
}

}  // namespace

DraftModel load_draft(const std::string& dir, DraftSource* source) {
  if (!std::filesystem::is_directory(dir)) throw IoError(dir + ": not a folder (expected an exported draft)");
  const FolderConfig fc = read_folder_config(dir);
  const DraftConfig& config = fc.config;
  DraftWeights weights = read_draft_weights(dir, config.num_hidden_layers);
  name_layout(dir, fc, weights);
  auto read = [&](const std::string& name) -> std::optional<at::Tensor> {
    const auto it = weights.tensors.find(name);
    if (it == weights.tensors.end()) return std::nullopt;
    return tensor_from_host(it->second);
  };
  auto name_in_file = [&](const std::string& name) {
    const auto it = weights.origin.find(name);
    return it == weights.origin.end() ? name : it->second;
  };
  auto file_of = [&](const std::string& name) {
    const auto it = weights.file.find(name);
    return it == weights.file.end() ? weights.path : it->second;
  };

  at::Tensor d2t;
  if (auto t = read("d2t")) {
    if (t->dim() != 1 || t->size(0) != config.draft_vocab_size || !at::isIntegralType(t->scalar_type(), false)) {
      throw FormatError(file_of("d2t"), std::nullopt, "d2t",
                        "expected an integer tensor [" + std::to_string(config.draft_vocab_size) +
                            "] (draft_vocab_size), got " + c10::str(t->sizes()));
    }
    d2t = t->to(at::kLong);
  } else if (config.draft_vocab_size == config.vocab_size) {
    d2t = at::zeros({config.vocab_size}, at::kLong);
  } else {
    throw FormatError(weights.path, std::nullopt, "d2t",
                      "missing, and draft_vocab_size != vocab_size so it cannot be implied");
  }

  DraftModel draft(config, d2t, at::Tensor());
  std::set<std::string> expected;
  for (const auto& [name, param] : draft.named_parameters()) {
    expected.insert(name);
    const std::optional<at::Tensor> value = read(name);
    if (!value)
      throw FormatError(weights.path, std::nullopt, name, weights.ours ? "missing" : "missing (" + weights.layout + ")");
    if (value->sizes() != param.sizes()) {
      throw FormatError(file_of(name), std::nullopt, name_in_file(name),
                        "shape " + c10::str(value->sizes()) + " does not match config.json (expected " +
                            c10::str(param.sizes()) + ")");
    }
    if (!at::isFloatingType(value->scalar_type()))
      throw FormatError(file_of(name), std::nullopt, name_in_file(name), "expected a floating-point tensor");
    draft.load_parameter(name, *value);
  }
  if (auto t2d = read("t2d")) {
    const at::Tensor mine = draft.t2d();
    if (t2d->sizes() != mine.sizes() || !at::equal(t2d->to(at::kBool), mine)) {
      throw FormatError(file_of("t2d"), std::nullopt, "t2d", "does not mark exactly the target tokens d2t maps to");
    }
  }
  for (const auto& [name, t] : weights.tensors) {
    if (expected.count(name) || name == "d2t" || name == "t2d") continue;
    throw FormatError(file_of(name), std::nullopt, name_in_file(name),
                      "not part of a " + std::to_string(config.num_hidden_layers) +
                          "-layer " + std::string(draft_architecture(config.architecture).title()) +
                          " draft (unexpected tensor)");
  }
  if (source) {
    source->layout = weights.layout;
    source->path = weights.path;
    source->speculators = fc.info;
  }
  return draft;
}

}  // namespace eaglekit::trainer
