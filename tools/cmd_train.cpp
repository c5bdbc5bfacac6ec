// eaglekit train: options from a JSON config file and/or flags (flags win) -> run_training.
// Under torchrun / `eaglekit launch` the process joins the job's dp x cp mesh.
#include <cxxopts.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "formats/error.h"
#include "tools/cli.h"
#include "tools/commands.h"
#include "trainer/distributed.h"
#include "trainer/evaluate.h"
#include "trainer/train.h"

namespace eaglekit::tools {

namespace {

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw UsageError("--config: cannot read '" + path + "'");
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// "2,16,29" -> {2, 16, 29}
std::vector<std::int64_t> parse_ids(const std::string& text, const char* flag) {
  std::vector<std::int64_t> ids;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty() || item.find_first_not_of("0123456789") != std::string::npos)
      throw UsageError(std::string(flag) + " takes comma-separated layer ids such as 2,16,29, not '" + text + "'");
    ids.push_back(std::stoll(item));
  }
  return ids;
}

// `--resume` takes an optional folder: "--resume DIR" becomes "--resume=DIR" (cxxopts only
// binds an implicit-value option's value with '=').
std::vector<std::string> join_resume(int argc, char** argv) {
  std::vector<std::string> out;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--resume" && i + 1 < argc && argv[i + 1][0] != '-') {
      out.push_back("--resume=" + std::string(argv[i + 1]));
      ++i;
    } else {
      out.push_back(a);
    }
  }
  return out;
}

}  // namespace

// Shared with cmd_evaluate / cmd_export.
std::vector<std::int64_t> parse_layer_ids(const std::string& text, const char* flag) { return parse_ids(text, flag); }

// --timeout SECONDS -> the bound on the rendezvous and on every collective (cmd_evaluate too).
std::chrono::milliseconds collective_timeout(double seconds) {
  if (!(seconds > 0) || seconds > 7 * 24 * 3600.0)
    throw UsageError("--timeout takes a positive number of seconds (at most a week), not " + std::to_string(seconds));
  return std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(seconds * 1000)));
}

int run_train(int argc, char** argv) {
  const trainer::TrainOptions d;  // defaults, for the help text
  cxxopts::Options options(argv[0],
                           "Train an EAGLE-3 draft with training-time test on offline hidden states.\n"
                           "Options come from --config FILE (JSON, keys as the flags with '_' or '-') and the "
                           "flags; flags win. Writes OUT/metrics.jsonl, OUT/checkpoint-STEP/ and OUT/final/.");
  options.add_options("Data")
      ("data", "Conversations: a .jsonl file, a folder of them, or a JSON array file", cxxopts::value<std::string>())
      ("index", "Dataset index (eaglekit index)", cxxopts::value<std::string>())
      ("quarantine", "File of conversation ids to leave out", cxxopts::value<std::string>())
      ("eval-fraction", "Share of matched samples (at the end) that evaluate (default 0.05)", cxxopts::value<double>())
      ("mode", "Collation: pad (the reference), longest, pack (default pad)", cxxopts::value<std::string>())
      ("no-shuffle", "Reference order instead of a seeded per-epoch permutation")
      ("max-length", "Tokens per sample (default 2048)", cxxopts::value<std::int64_t>())
      ("jobs", "Loader threads (default 0: all cores)", cxxopts::value<int>())
      ("prefetch", "Batches read ahead (default 4)", cxxopts::value<int>());
  options.add_options("Model")
      ("base", "Base model folder (config.json + model.safetensors)", cxxopts::value<std::string>())
      ("init-draft", "Start from an exported draft folder (its config wins)", cxxopts::value<std::string>())
      ("draft-vocab-size", "Draft vocabulary size (default: the base's)", cxxopts::value<std::int64_t>())
      ("d2t", "d2t.pt from eaglekit vocab (default: counted over the train split)", cxxopts::value<std::string>())
      ("aux-layer-ids", "Aux layers of the dump, HF hidden_states ids (e.g. 2,16,29)", cxxopts::value<std::string>())
      ("modelopt-norm", "ModelOpt's form: input_layernorm also applied to the hidden input (no serving engine computes it)")
      ("allow-unservable", "Train and write final/ for a draft vLLM and SGLang do not compute (--modelopt-norm)")
      ("ttt-steps", "TTT steps S (default 3)", cxxopts::value<std::int64_t>())
      ("loss-decay", "Loss weight decay per step (default 0.9)", cxxopts::value<double>());
  options.add_options("Optimization")
      ("batch-size", "Rows per micro-batch per data-parallel rank (default 8)", cxxopts::value<std::int64_t>())
      ("grad-accum", "Micro-batches per optimizer step (default 1)", cxxopts::value<std::int64_t>())
      ("lr", "Peak learning rate (default 1e-4)", cxxopts::value<double>())
      ("warmup-steps", "Linear warmup steps (default 0)", cxxopts::value<std::int64_t>())
      ("schedule", "cosine, linear or constant (default cosine)", cxxopts::value<std::string>())
      ("weight-decay", "AdamW weight decay on matrices (default 0)", cxxopts::value<double>())
      ("grad-clip", "Clip the global gradient norm (default 1; 0 off)", cxxopts::value<double>())
      ("adam-beta1", "default 0.9", cxxopts::value<double>())
      ("adam-beta2", "default 0.999", cxxopts::value<double>())
      ("adam-eps", "default 1e-8", cxxopts::value<double>())
      ("epochs", "Epochs (default 1, unbounded when only --max-steps is given)", cxxopts::value<std::int64_t>())
      ("max-steps", "Stop after this many optimizer steps", cxxopts::value<std::int64_t>())
      ("seed", "Draft init and shuffle seed (default 0)", cxxopts::value<std::uint64_t>());
  options.add_options("Run")
      ("config", "JSON file of options", cxxopts::value<std::string>())
      ("out", "Output folder", cxxopts::value<std::string>())
      ("device", "cpu, cuda or cuda:N (default cpu)", cxxopts::value<std::string>())
      ("dtype", "float32, or bfloat16 (autocast; weights stay float32) (default float32)", cxxopts::value<std::string>())
      ("threads", "LibTorch threads (default: its own)", cxxopts::value<int>())
      ("cp", "Context-parallel size (world / cp = data-parallel size) (default 1)", cxxopts::value<int>())
      ("timeout", "Seconds a rendezvous or collective may wait for the other ranks before the job fails "
       "with an error (default 300)", cxxopts::value<double>())
      ("eval-every", "Evaluate every N steps (0: at the end only; -1: never) (default 0)", cxxopts::value<std::int64_t>())
      ("save-every", "Checkpoint every N steps (one is always saved at the end)", cxxopts::value<std::int64_t>())
      ("log-every", "Metrics line every N steps (default 10)", cxxopts::value<std::int64_t>())
      ("resume", "Continue from the newest complete checkpoint in DIR (default: --out)",
       cxxopts::value<std::string>()->implicit_value(""))
      ("export-dtype", "dtype of OUT/final (default: the base's torch_dtype)", cxxopts::value<std::string>())
      ("tensorboard", "Folder of the TensorBoard event files (default: OUT/tensorboard)", cxxopts::value<std::string>())
      ("no-tensorboard", "Write no TensorBoard event files")
      ("no-progress", "No progress line even on a terminal")
      ("json", "Print the result as JSON");
  std::vector<std::string> joined = join_resume(argc, argv);
  std::vector<char*> args_v;
  for (auto& s : joined) args_v.push_back(s.data());
  auto args = parse_args(options, static_cast<int>(args_v.size()), args_v.data());
  if (!args) return 0;
  const auto& a = *args;

  trainer::TrainOptions o;
  if (a.count("config")) {
    const std::string path = a["config"].as<std::string>();
    o.apply_json(read_file(path), path);
  }
  auto set = [&](const char* flag, auto& field) {
    using T = std::decay_t<decltype(field)>;
    if (a.count(flag)) field = a[flag].as<T>();
  };
  set("data", o.data);
  set("index", o.index);
  set("quarantine", o.quarantine);
  set("eval-fraction", o.eval_fraction);
  set("mode", o.mode);
  if (a.count("no-shuffle")) o.shuffle = false;
  set("max-length", o.max_length);
  set("jobs", o.jobs);
  set("prefetch", o.prefetch);
  set("base", o.base);
  set("init-draft", o.init_draft);
  set("draft-vocab-size", o.draft_vocab_size);
  set("d2t", o.d2t);
  if (a.count("aux-layer-ids")) o.aux_layer_ids = parse_ids(a["aux-layer-ids"].as<std::string>(), "--aux-layer-ids");
  if (a.count("modelopt-norm")) o.modelopt_norm = true;
  if (a.count("allow-unservable")) o.allow_unservable = true;
  set("ttt-steps", o.ttt_steps);
  set("loss-decay", o.loss_decay);
  set("batch-size", o.batch_size);
  set("grad-accum", o.grad_accum);
  set("lr", o.lr);
  set("warmup-steps", o.warmup_steps);
  set("schedule", o.schedule);
  set("weight-decay", o.weight_decay);
  set("grad-clip", o.grad_clip);
  set("adam-beta1", o.adam_beta1);
  set("adam-beta2", o.adam_beta2);
  set("adam-eps", o.adam_eps);
  set("epochs", o.epochs);
  set("max-steps", o.max_steps);
  set("seed", o.seed);
  set("out", o.out);
  set("device", o.device);
  set("dtype", o.dtype);
  set("threads", o.threads);
  set("cp", o.cp_size);
  set("eval-every", o.eval_every);
  set("save-every", o.save_every);
  set("log-every", o.log_every);
  set("export-dtype", o.export_dtype);
  set("tensorboard", o.tensorboard);
  if (a.count("no-tensorboard")) o.no_tensorboard = true;
  if (a.count("resume")) {
    o.resume = true;
    o.resume_from = a["resume"].as<std::string>();
  }
  if (a.count("no-progress")) o.progress = false;
  o.progress = o.progress && stderr_is_tty();
  o.check();

  dist::GroupOptions go;
  go.cuda = trainer::parse_device(o.device).is_cuda();
  if (a.count("timeout")) go.timeout = collective_timeout(a["timeout"].as<double>());
  const dist::Mesh mesh = dist::Mesh::from_environment(o.cp_size, go);
  const trainer::TrainResult r = trainer::run_training(o, &mesh);
  if (!mesh.is_main()) return 0;
  if (a.count("json")) {
    nlohmann::ordered_json j;
    j["steps"] = r.steps;
    j["start_step"] = r.start_step;
    j["epoch"] = r.epoch;
    j["interrupted"] = r.interrupted;
    j["last_checkpoint"] = r.last_checkpoint;
    j["final_dir"] = r.final_dir;
    j["train"] = nlohmann::ordered_json::parse(trainer::stats_json(r.train_stats, o.loss_decay));
    j["eval"] = r.eval_stats ? nlohmann::ordered_json::parse(trainer::stats_json(*r.eval_stats, o.loss_decay))
                             : nlohmann::ordered_json(nullptr);
    j["seconds"] = r.seconds;
    j["tokens_per_s"] = r.tokens_per_s;
    j["data_wait_share"] = r.data_wait_share;
    std::cout << j.dump() << "\n";
  } else {
    std::cout << (r.interrupted ? "interrupted" : "trained") << " at step " << r.steps << " (" << r.seconds
              << " s, " << static_cast<std::int64_t>(r.tokens_per_s) << " tokens/s, "
              << static_cast<int>(100 * r.data_wait_share + 0.5) << "% waiting for data)\n";
    if (r.eval_stats) {
      const auto acc = r.eval_stats->acc();
      std::cout << "eval: loss " << r.eval_stats->loss(o.loss_decay) << ", acc";
      for (double x : acc) std::cout << " " << x;
      std::cout << ", est_ar " << r.eval_stats->est_ar() << "\n";
    }
    std::cout << "checkpoint: " << r.last_checkpoint << "\n";
    if (!r.final_dir.empty()) std::cout << "final draft: " << r.final_dir << "\n";
  }
  return 0;
}

}  // namespace eaglekit::tools
