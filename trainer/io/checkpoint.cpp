#include "trainer/io/checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <fcntl.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <system_error>

#include "formats/atomic_file.h"
#include "formats/error.h"
#include "formats/safetensors_format.h"
#include "lib/collate.h"
#include "trainer/io/export.h"
#include "trainer/model/base_model.h"
#include "trainer/model/config.h"

namespace eaglekit::trainer {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace {

constexpr const char* kFormat = "eaglekit-checkpoint";
constexpr int kVersion = 1;
const char* const kFiles[] = {"config.json", "model.safetensors", "optimizer.safetensors", "rng.safetensors",
                              "trainer_state.json", "train_options.json"};

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw IoError(path + ": cannot read");
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

void write_tensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  std::vector<NamedTensor> named;
  named.reserve(tensors.size());
  for (const auto& [name, t] : tensors) named.push_back({name, to_host_tensor(t.detach().to(at::kCPU).contiguous())});
  write_safetensors(path, named);
}

std::vector<std::pair<std::string, at::Tensor>> read_tensors(const std::string& path) {
  const auto file = SafetensorsFile::open(path);
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& e : file->entries()) out.emplace_back(e.name, tensor_from_host(file->tensor(e)));
  return out;
}

// Step of a folder named "checkpoint-STEP", else nullopt.
std::optional<std::int64_t> step_of(const std::string& name) {
  static const std::string kPrefix = "checkpoint-";
  if (name.rfind(kPrefix, 0) != 0) return std::nullopt;
  const std::string digits = name.substr(kPrefix.size());
  if (digits.empty() || digits.size() > 15 || digits.find_first_not_of("0123456789") != std::string::npos)
    return std::nullopt;
  return std::stoll(digits);
}

template <typename T>
T get(const json& j, const char* key, const std::string& where) {
  const auto it = j.find(key);
  if (it == j.end()) throw FormatError(where, std::nullopt, key, "missing");
  try {
    return it->get<T>();
  } catch (const nlohmann::json::exception&) {
    throw FormatError(where, std::nullopt, key, "wrong type: " + it->dump());
  }
}

}  // namespace

std::string TrainerState::to_json() const {
  json j;
  j["format"] = kFormat;
  j["version"] = kVersion;
  j["step"] = step;
  j["epoch"] = epoch;
  j["sampler"] = json::parse(sampler.to_json());
  j["optimizer_steps"] = optimizer_steps;
  j["schedule_total_steps"] = schedule_total_steps;
  j["tokens"] = tokens;
  j["world_size"] = world_size;
  j["cp_size"] = cp_size;
  return j.dump(2) + "\n";
}

TrainerState TrainerState::from_json(const std::string& text, const std::string& where) {
  json j;
  try {
    j = json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(where, std::nullopt, "json", e.what());
  }
  if (!j.is_object()) throw FormatError(where, std::nullopt, "json", "not an object");
  if (get<std::string>(j, "format", where) != kFormat)
    throw FormatError(where, std::nullopt, "format", "not an eaglekit checkpoint state");
  const int version = get<int>(j, "version", where);
  if (version != kVersion)
    throw UnsupportedError(where, std::nullopt, "version",
                           "checkpoint version " + std::to_string(version) + " (this build reads " +
                               std::to_string(kVersion) + ")");
  TrainerState s;
  s.step = get<std::int64_t>(j, "step", where);
  s.epoch = get<std::uint64_t>(j, "epoch", where);
  const auto sampler = j.find("sampler");
  if (sampler == j.end()) throw FormatError(where, std::nullopt, "sampler", "missing");
  s.sampler = SamplerState::from_json(sampler->dump());
  s.optimizer_steps = get<std::int64_t>(j, "optimizer_steps", where);
  s.schedule_total_steps = get<std::int64_t>(j, "schedule_total_steps", where);
  s.tokens = get<double>(j, "tokens", where);
  s.world_size = get<int>(j, "world_size", where);
  s.cp_size = get<int>(j, "cp_size", where);
  if (s.step < 0) throw FormatError(where, std::nullopt, "step", "negative");
  return s;
}

std::string checkpoint_name(std::int64_t step) { return "checkpoint-" + std::to_string(step); }

namespace {

// Temp folders of saves whose process is gone (a run killed in save_checkpoint, in the
// export of final/, in the copy into best/ or while pruning): ".checkpoint-STEP.tmp-PID",
// ".final.tmp-PID", ".best.tmp-PID", and what replace_folder_atomic moves aside (".old"
// added) or prune_checkpoints renames before deleting (".pruned" added). Those of a live
// process are left alone.
void remove_stale_temp_folders(const std::string& out_dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(out_dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(".checkpoint-", 0) != 0 && name.rfind(".final", 0) != 0 && name.rfind(".best", 0) != 0) continue;
    const auto tmp = name.find(".tmp-");
    if (tmp == std::string::npos) continue;
    if (process_gone(std::strtol(name.c_str() + tmp + 5, nullptr, 10))) fs::remove_all(e.path(), ec);
  }
}

// Writes the folder OUT/NAME atomically: its files in OUT/.NAME.tmp-PID, then one exchange.
// `fill` writes the files into the temp folder.
std::string write_folder_atomic(const std::string& out_dir, const std::string& name,
                                const std::function<void(const fs::path& tmp)>& fill) {
  const fs::path out(out_dir);
  const fs::path final_dir = out / name;
  const fs::path tmp = out / ("." + name + ".tmp-" + std::to_string(::getpid()));
  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec) throw IoError(out_dir + ": cannot create folder: " + ec.message());
  remove_stale_temp_folders(out_dir);
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  if (ec) throw IoError(tmp.string() + ": cannot create folder: " + ec.message());
  try {
    fill(tmp);
    fsync_dir(tmp.string());
    // An older folder of the same name (a run resumed from an earlier step, an older best/)
    // is exchanged for the new one, so the folder never goes missing.
    replace_folder_atomic(tmp.string(), final_dir.string());
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  return final_dir.string();
}

void write_checkpoint_files(const fs::path& tmp, const DraftModel& draft, const Checkpoint& ckpt) {
  export_draft(draft, tmp.string());
  write_tensors((tmp / "optimizer.safetensors").string(), ckpt.optimizer);
  write_tensors((tmp / "rng.safetensors").string(), ckpt.rng);
  write_file_atomic((tmp / "train_options.json").string(), ckpt.options_json.data(), ckpt.options_json.size());
  const std::string state = ckpt.state.to_json();
  write_file_atomic((tmp / "trainer_state.json").string(), state.data(), state.size());
}

}  // namespace

std::string save_checkpoint(const std::string& out_dir, const DraftModel& draft, const Checkpoint& ckpt) {
  return write_folder_atomic(out_dir, checkpoint_name(ckpt.state.step), [&](const fs::path& tmp) {
    write_checkpoint_files(tmp, draft, ckpt);
  });
}

std::vector<std::string> prune_checkpoints(const std::string& out_dir, std::int64_t keep, const std::string& newest) {
  std::vector<std::string> removed;
  if (keep <= 0) return removed;
  std::error_code ec;
  const fs::path newest_path = fs::weakly_canonical(newest, ec);
  std::vector<std::pair<std::int64_t, fs::path>> others;
  for (const auto& e : fs::directory_iterator(out_dir, ec)) {
    const auto step = step_of(e.path().filename().string());
    if (!step || !e.is_directory(ec)) continue;
    if (!newest.empty() && fs::weakly_canonical(e.path(), ec) == newest_path) continue;
    others.emplace_back(*step, e.path());
  }
  std::sort(others.begin(), others.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  const std::size_t kept_others = static_cast<std::size_t>(newest.empty() ? keep : keep - 1);
  for (std::size_t i = kept_others; i < others.size(); ++i) {
    const fs::path& dir = others[i].second;
    // One rename takes the folder out of sight (resume never sees half of it); the rest of
    // the deletion may then be interrupted: the next save removes what is left.
    const fs::path doomed = dir.parent_path() / ("." + dir.filename().string() + ".tmp-" +
                                                 std::to_string(::getpid()) + ".pruned");
    fs::rename(dir, doomed, ec);
    if (ec) throw IoError(dir.string() + ": cannot remove (--keep-checkpoints): " + ec.message());
    fs::remove_all(doomed, ec);
    if (ec) throw IoError(doomed.string() + ": cannot remove (--keep-checkpoints): " + ec.message());
    removed.push_back(dir.string());
  }
  if (!removed.empty()) fsync_dir(out_dir);
  return removed;
}

std::string BestCheckpoint::to_json() const {
  json j;
  j["format"] = "eaglekit-best";
  j["metric"] = metric;
  j["step"] = step;
  j["est_ar"] = est_ar;
  j["checkpoint"] = checkpoint_name(step);
  return j.dump(2) + "\n";
}

std::string save_best_checkpoint(const std::string& out_dir, const DraftModel& draft, const Checkpoint& ckpt,
                                 const BestCheckpoint& best, const std::string& same_step) {
  if (best.step != ckpt.state.step) throw std::logic_error("save_best_checkpoint: best.step is not the checkpoint's");
  return write_folder_atomic(out_dir, kBestFolder, [&](const fs::path& tmp) {
    bool linked = false;
    if (!same_step.empty() && is_complete_checkpoint(same_step)) {
      const std::string state_path = (fs::path(same_step) / "trainer_state.json").string();
      if (TrainerState::from_json(read_text(state_path), state_path).step == best.step) {
        // The checkpoint of this step is on disk: its files again, as hard links (no second copy
        // on disk; a checkpoint's files are never rewritten in place, so the two stay equal
        // after --keep-checkpoints deletes the step's folder). A file system without hard links
        // gets copies.
        linked = true;
        for (const auto& e : fs::directory_iterator(same_step)) {
          if (!e.is_regular_file()) continue;
          const fs::path to = tmp / e.path().filename();
          std::error_code ec;
          fs::create_hard_link(e.path(), to, ec);
          if (ec) fs::copy_file(e.path(), to, fs::copy_options::overwrite_existing, ec);
          if (ec) throw IoError(to.string() + ": cannot link or copy from " + e.path().string() + ": " + ec.message());
        }
      }
    }
    if (!linked) write_checkpoint_files(tmp, draft, ckpt);
    const std::string text = best.to_json();
    write_file_atomic((tmp / kBestFile).string(), text.data(), text.size());
  });
}

std::optional<BestCheckpoint> read_best(const std::string& out_dir) {
  const fs::path path = fs::path(out_dir) / kBestFolder / kBestFile;
  std::error_code ec;
  if (!fs::exists(path, ec)) return std::nullopt;
  const std::string where = path.string();
  json j;
  try {
    j = json::parse(read_text(where));
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(where, std::nullopt, "json", e.what());
  }
  if (!j.is_object()) throw FormatError(where, std::nullopt, "json", "not an object");
  BestCheckpoint b;
  b.metric = get<std::string>(j, "metric", where);
  b.step = get<std::int64_t>(j, "step", where);
  b.est_ar = get<double>(j, "est_ar", where);
  return b;
}

namespace {

void check_complete(const std::string& dir) {
  for (const char* f : kFiles) {
    if (!fs::exists(fs::path(dir) / f))
      throw IoError(dir + ": not a complete checkpoint (" + f + " is missing)");
  }
}

}  // namespace

LoadedCheckpoint load_checkpoint(const std::string& dir) {
  check_complete(dir);
  const std::string state_path = (fs::path(dir) / "trainer_state.json").string();
  LoadedCheckpoint out{dir, load_draft(dir), {}};
  out.checkpoint.state = TrainerState::from_json(read_text(state_path), state_path);
  out.checkpoint.optimizer = read_tensors((fs::path(dir) / "optimizer.safetensors").string());
  out.checkpoint.rng = read_tensors((fs::path(dir) / "rng.safetensors").string());
  out.checkpoint.options_json = read_text((fs::path(dir) / "train_options.json").string());
  return out;
}

CheckpointInfo read_checkpoint_info(const std::string& dir) {
  check_complete(dir);
  const std::string state_path = (fs::path(dir) / "trainer_state.json").string();
  CheckpointInfo out;
  out.dir = dir;
  out.config = load_draft_config(dir);
  out.state = TrainerState::from_json(read_text(state_path), state_path);
  out.options_json = read_text((fs::path(dir) / "train_options.json").string());
  return out;
}

bool is_complete_checkpoint(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return false;
  for (const char* f : kFiles)
    if (!fs::is_regular_file(fs::path(dir) / f, ec)) return false;
  try {
    const std::string path = (fs::path(dir) / "trainer_state.json").string();
    TrainerState::from_json(read_text(path), path);
  } catch (const Error&) {
    return false;
  }
  return true;
}

std::optional<std::string> find_latest_checkpoint(const std::string& out_dir) {
  std::error_code ec;
  if (!fs::is_directory(out_dir, ec)) return std::nullopt;
  std::vector<std::pair<std::int64_t, std::string>> found;
  for (const auto& e : fs::directory_iterator(out_dir, ec)) {
    const auto step = step_of(e.path().filename().string());
    if (step) found.emplace_back(*step, e.path().string());
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (const auto& [step, path] : found)
    if (is_complete_checkpoint(path)) return path;
  return std::nullopt;
}

std::string resolve_resume(const std::string& dir) {
  if (is_complete_checkpoint(dir)) return dir;
  if (auto latest = find_latest_checkpoint(dir)) return *latest;
  throw UsageError("--resume: no complete checkpoint in " + dir +
                   " (looked for the folder itself and checkpoint-STEP folders below it)");
}

namespace {

// Name of CUDA device i's generator in rng.safetensors: "cuda" for device 0 (what
// checkpoints held before every device was saved, so old and new read each other), then
// "cuda:1", "cuda:2", ...
std::string cuda_rng_name(std::size_t i) { return i == 0 ? "cuda" : "cuda:" + std::to_string(i); }

// The device index of a "cuda" / "cuda:N" name, else nullopt.
std::optional<std::size_t> cuda_rng_index(const std::string& name) {
  if (name == "cuda") return 0;
  if (name.rfind("cuda:", 0) != 0 || name.size() == 5 || name.size() > 9 ||
      name.find_first_not_of("0123456789", 5) != std::string::npos)
    return std::nullopt;
  return std::stoul(name.substr(5));
}

// torch::cuda::device_count() is in the C++ API of LibTorch 1.13 and 2.x alike, and 0 in a
// CPU build or with no visible device (at::hasCUDA() is true for a CUDA build without GPUs).
std::size_t visible_cuda_devices() { return at::hasCUDA() ? torch::cuda::device_count() : 0; }

at::Generator cuda_generator(std::size_t i) {
  return at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i)));
}

}  // namespace

std::vector<std::pair<std::string, at::Tensor>> capture_rng_state() {
  std::vector<std::pair<std::string, at::Tensor>> out;
  {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());  // as torch.get_rng_state does
    out.emplace_back("cpu", gen.get_state());
  }
  // Every visible device, as torch.cuda.get_rng_state_all: a process may draw on devices
  // other than its current one.
  for (std::size_t i = 0, n = visible_cuda_devices(); i < n; ++i) {
    at::Generator gen = cuda_generator(i);
    std::lock_guard<std::mutex> lock(gen.mutex());
    out.emplace_back(cuda_rng_name(i), gen.get_state());
  }
  return out;
}

void restore_rng_state(const std::vector<std::pair<std::string, at::Tensor>>& states) {
  const std::size_t devices = visible_cuda_devices();
  for (const auto& [name, state] : states) {
    if (name == "cpu") {
      at::Generator gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    } else if (const auto i = cuda_rng_index(name); i && *i < devices) {
      // A state of a device not visible now (a resume on fewer GPUs, or on the CPU) has no
      // generator to go to; the draws it would govern do not happen here either.
      at::Generator gen = cuda_generator(*i);
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    }
  }
}

c10::ScalarType parse_float_dtype(const std::string& name) {
  if (name == "bfloat16" || name == "bf16") return at::kBFloat16;
  if (name == "float16" || name == "fp16" || name == "half") return at::kHalf;
  if (name == "float32" || name == "fp32" || name == "float") return at::kFloat;
  throw UsageError("dtype must be bfloat16, float16 or float32, not '" + name + "'");
}

std::string ExportReport::to_json() const {
  json j;
  j["source"] = source;
  j["out"] = out;
  j["parameters"] = parameters;
  j["dtype"] = dtype;
  j["aux_layer_ids"] = aux_layer_ids;
  j["layout"] = layout;
  j["format"] = format;
  if (format == "speculators") {
    j["speculative_tokens"] = speculative_tokens;
    j["verifier"] = verifier;
  }
  j["notes"] = notes;
  j["warnings"] = warnings;
  return j.dump();
}

c10::ScalarType serving_export_dtype(const std::string& requested, const DraftConfig& config,
                                     std::vector<std::string>& warnings) {
  c10::ScalarType dtype = at::kBFloat16;
  if (!requested.empty()) {
    dtype = parse_float_dtype(requested);
  } else {
    try {
      dtype = parse_float_dtype(config.torch_dtype);
    } catch (const UsageError&) {
      warnings.push_back("the draft's serving dtype '" + config.torch_dtype + "' is no float dtype: exporting bfloat16");
    }
  }
  if (dtype == at::kFloat)
    warnings.push_back("float32 export: SGLang's --dtype auto serves a float32 config as float16; pass --dtype bf16 "
                       "(or the target's dtype) for a draft served as trained");
  return dtype;
}

namespace {

// The TrainOptions JSON of the run that trained the draft in `source`: its own
// train_options.json (a checkpoint), else the newest checkpoint's beside it (OUT/final).
std::optional<std::pair<std::string, json>> run_options_of(const std::string& source) {
  std::error_code ec;
  fs::path file = fs::path(source) / "train_options.json";
  if (!fs::exists(file, ec)) {
    const fs::path parent = fs::absolute(source, ec).lexically_normal().parent_path();
    const auto latest = find_latest_checkpoint(parent.string());
    if (!latest) return std::nullopt;
    file = fs::path(*latest) / "train_options.json";
  }
  std::ifstream f(file);
  if (!f) return std::nullopt;
  try {
    json j = json::parse(std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()));
    if (!j.is_object()) return std::nullopt;
    return std::make_pair(file.string(), std::move(j));
  } catch (const json::exception& e) {
    throw FormatError(file.string(), std::nullopt, "train_options", std::string("not valid JSON: ") + e.what());
  }
}

// An integer option of a run read by run_options_of, with the file that said it.
std::optional<std::pair<std::int64_t, std::string>> integer_option(
    const std::optional<std::pair<std::string, json>>& run, const std::string& key) {
  if (!run || !run->second.contains(key) || !run->second[key].is_number_integer()) return std::nullopt;
  return std::make_pair(run->second[key].get<std::int64_t>(), run->first);
}

}  // namespace

std::optional<std::pair<std::int64_t, std::string>> trained_with(const std::string& source, const std::string& key) {
  return integer_option(run_options_of(source), key);
}

namespace {

// The proposal and the verifier of a speculators export (see ExportCheckpointOptions).
SpeculatorsInfo speculators_info_for(const std::string& source, const DraftSource& found, const DraftConfig& config,
                                     const ExportCheckpointOptions& o, std::vector<std::string>& notes,
                                     std::vector<std::string>& warnings) {
  // 0 is "not given": the count is derived below.
  if (o.speculative_tokens < 0)
    throw UsageError("--speculative-tokens must be at least 1 (0: the --ttt-steps the draft was trained with), not " +
                     std::to_string(o.speculative_tokens));
  SpeculatorsInfo info;
  const auto run = run_options_of(source);
  if (config.architecture == "dflash") {
    // vLLM drafts a block of speculative_tokens + 1 (the anchor, then the predictions): the
    // block the draft was trained on is block_size - 1 tokens (speculators writes the same).
    const std::int64_t trained = config.block_size - 1;
    info.speculative_tokens = o.speculative_tokens > 0 ? o.speculative_tokens : trained;
    if (o.speculative_tokens == 0)
      notes.push_back("speculative tokens: " + std::to_string(trained) + ", block_size - 1 of the DFlash draft (block " +
                      std::to_string(config.block_size) + "); --speculative-tokens sets it");
    else if (o.speculative_tokens != trained)
      warnings.push_back("--speculative-tokens " + std::to_string(o.speculative_tokens) + " makes vLLM draft blocks of " +
                         std::to_string(o.speculative_tokens + 1) + " tokens, and the DFlash draft was trained on blocks of " +
                         std::to_string(config.block_size) + " (every position attends to its whole block): it computes "
                         "another function than trained; " + std::to_string(trained) + " serves it as trained");
  } else if (o.speculative_tokens > 0) {
    info.speculative_tokens = o.speculative_tokens;
    const auto steps = integer_option(run, "ttt_steps");
    if (steps && o.speculative_tokens > steps->first)
      warnings.push_back("--speculative-tokens " + std::to_string(o.speculative_tokens) + " asks the draft for more " +
                         "tokens than the " + std::to_string(steps->first) + " TTT steps it was trained with (" +
                         steps->second + "): tokens " + std::to_string(steps->first + 1) + " to " +
                         std::to_string(o.speculative_tokens) +
                         " come from steps it never trained and are mostly rejected; speculate at most " +
                         std::to_string(steps->first) + ", or train with --ttt-steps " +
                         std::to_string(o.speculative_tokens));
  } else if (const auto steps = integer_option(run, "ttt_steps")) {
    info.speculative_tokens = steps->first;
    notes.push_back("speculative tokens: " + std::to_string(info.speculative_tokens) +
                    ", the --ttt-steps the draft was trained with (" + steps->second + "); --speculative-tokens sets it");
  } else if (found.speculators.speculative_tokens > 0) {
    info.speculative_tokens = found.speculators.speculative_tokens;
    notes.push_back("speculative tokens: " + std::to_string(info.speculative_tokens) +
                    ", the source draft's speculators_config; --speculative-tokens sets it");
  } else {
    throw UsageError(source + ": no training run or speculators config says how many tokens the draft was trained "
                     "to propose; pass --speculative-tokens N (the --ttt-steps it was trained with)");
  }
  if (!o.verifier.empty()) {
    info.verifier = o.verifier;
  } else if (run && run->second.contains("base") && run->second["base"].is_string() &&
             !run->second["base"].get<std::string>().empty()) {
    info.verifier = run->second["base"].get<std::string>();
    notes.push_back("verifier: " + info.verifier + ", the run's --base (" + run->first +
                    "); --verifier names the target as the server finds it");
    // A local folder name ("smallbase", "/models/x") resolves only where it was typed; the
    // base's config.json may name the model it came from.
    std::error_code ec;
    if (fs::is_directory(info.verifier, ec)) {
      std::string hub;
      std::ifstream f(fs::path(info.verifier) / "config.json");
      const json j = json::parse(std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()),
                                 nullptr, /*allow_exceptions=*/false);
      if (j.is_object() && j.contains("_name_or_path") && j["_name_or_path"].is_string())
        hub = j["_name_or_path"].get<std::string>();
      if (!hub.empty() && hub.front() != '/' && hub.front() != '.' && hub.find('/') != std::string::npos &&
          !fs::exists(hub, ec))
        warnings.push_back("verifier " + info.verifier + " is a local folder; its config.json names the model " + hub +
                           ": if that is what the server loads, pass --verifier " + hub);
      else
        warnings.push_back("verifier " + info.verifier + " is a local folder, which the server resolves only if it "
                           "finds the same path; pass --verifier with the name it serves the target under "
                           "(e.g. meta-llama/Llama-3.1-8B-Instruct)");
    }
  } else if (!found.speculators.verifier.empty()) {
    info.verifier = found.speculators.verifier;
    info.verifier_architectures = found.speculators.verifier_architectures;
    notes.push_back("verifier: " + info.verifier + ", the source draft's speculators_config; --verifier sets it");
    return info;
  } else {
    throw UsageError(source + ": no training run or speculators config names the target model; pass --verifier "
                     "NAME_OR_PATH (what vLLM loads as the target)");
  }
  // The verifier's architectures, when its config.json is here to read.
  std::error_code ec;
  const fs::path base_config = fs::path(info.verifier) / "config.json";
  if (fs::exists(base_config, ec)) {
    std::ifstream f(base_config);
    const json j = json::parse(std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()),
                               nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.contains("architectures") && j["architectures"].is_array())
      for (const auto& a : j["architectures"])
        if (a.is_string()) info.verifier_architectures.push_back(a.get<std::string>());
  } else {
    notes.push_back("verifier architectures: [] (" + base_config.string() + " is not here to read; vLLM does not use them)");
  }
  return info;
}

}  // namespace

ExportReport export_checkpoint(const std::string& checkpoint, const std::string& out_dir,
                               const ExportCheckpointOptions& options) {
  std::string source = checkpoint;
  std::error_code ec;
  if (!fs::exists(fs::path(source) / "config.json", ec)) {
    const auto latest = find_latest_checkpoint(source);
    if (!latest)
      throw UsageError(checkpoint + ": neither a draft folder (config.json + model.safetensors) nor an output "
                       "folder with checkpoint-STEP folders");
    source = *latest;
  }
  if (out_dir.empty()) throw UsageError("--out is required");
  if (fs::weakly_canonical(source, ec) == fs::weakly_canonical(out_dir, ec))
    throw UsageError("--out must differ from the checkpoint folder");
  const std::optional<ExportFormat> format = options.format;
  if (*format != ExportFormat::kSpeculators && (options.speculative_tokens != 0 || !options.verifier.empty()))
    throw UsageError("--speculative-tokens and --verifier are part of the speculators layout: add --format speculators");
  DraftSource found;
  DraftModel draft = load_draft(source, &found);
  if (!options.aux_layer_ids.empty()) {
    DraftConfig config = draft.config();
    config.aux_layer_ids = options.aux_layer_ids;
    config.check();
    DraftModel renamed(config, draft.d2t(), at::Tensor());
    for (const auto& [name, value] : draft.named_parameters()) renamed.load_parameter(name, value);
    draft = renamed;
  }
  ExportReport r;
  ExportOptions eo;
  eo.dtype = serving_export_dtype(options.dtype, draft.config(), r.warnings);
  for (auto& w : serving_warnings(draft.config())) r.warnings.push_back(std::move(w));
  eo.allow_unservable = options.allow_unservable;
  eo.format = *format;
  if (*format == ExportFormat::kSpeculators) {
    eo.speculators = speculators_info_for(source, found, draft.config(), options, r.notes, r.warnings);
    r.speculative_tokens = eo.speculators.speculative_tokens;
    r.verifier = eo.speculators.verifier;
  }
  // The run's options go along as they are stored, so that the export says how the draft was
  // trained wherever it is copied (final/ of the same run holds the same bytes).
  if (const auto run = run_options_of(source)) {
    std::ifstream f(run->first, std::ios::binary);
    eo.run_options_json.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  export_draft_folder(draft, out_dir, eo);
  r.source = source;
  r.layout = found.layout;
  r.format = std::string(export_format_name(*format));
  r.out = out_dir;
  for (const auto& p : draft.parameters()) r.parameters += p.numel();
  r.dtype = std::string(dtype_name(to_dtype(*eo.dtype)));
  r.aux_layer_ids = draft.config().aux_layer_ids;
  return r;
}

}  // namespace eaglekit::trainer
