// eaglekit evaluate: the TTT unroll without gradients over a split, metrics pooled over
// every masked position (independent of the batch size): an offline acceptance estimate.
#include <cxxopts.hpp>

#include <chrono>
#include <iostream>
#include <memory>
#include <string>

#include "formats/error.h"
#include "tools/cli.h"
#include "tools/commands.h"
#include "trainer/distributed.h"
#include "trainer/evaluate.h"

namespace eaglekit::tools {

std::chrono::milliseconds collective_timeout(double seconds);  // cmd_train.cpp

int run_evaluate(int argc, char** argv) {
  const trainer::EvaluateOptions d;
  cxxopts::Options options(argv[0],
                           "Evaluate a draft (exported folder or checkpoint) on a split: loss, loss_per_step, "
                           "acc, cond_acc, est_ar pooled over every scored position");
  options.add_options()
      ("base", "Base model folder", cxxopts::value<std::string>())
      ("draft", "Draft folder: an export, a checkpoint, or an output folder (its newest checkpoint)",
       cxxopts::value<std::string>())
      ("data", "Conversations", cxxopts::value<std::string>())
      ("index", "Dataset index", cxxopts::value<std::string>())
      ("quarantine", "File of conversation ids to leave out", cxxopts::value<std::string>()->default_value(""))
      ("split", "eval, train or all", cxxopts::value<std::string>()->default_value(d.split))
      ("eval-fraction", "Share of matched samples that evaluate", cxxopts::value<double>()->default_value("0.05"))
      ("ttt-steps", "TTT steps S", cxxopts::value<std::int64_t>()->default_value("3"))
      ("loss-decay", "Weight of step s is decay^s", cxxopts::value<double>()->default_value("0.9"))
      ("max-length", "Tokens per sample", cxxopts::value<std::int64_t>()->default_value("2048"))
      ("batch-size", "Rows per batch (the metrics do not depend on it)", cxxopts::value<std::int64_t>()->default_value("8"))
      ("mode", "pad, longest or pack", cxxopts::value<std::string>()->default_value("pad"))
      ("max-batches", "Stop after N batches (default: the whole split)", cxxopts::value<std::int64_t>()->default_value("-1"))
      ("device", "cpu, cuda or cuda:N", cxxopts::value<std::string>()->default_value("cpu"))
      ("dtype", "float32 or bfloat16 (autocast)", cxxopts::value<std::string>()->default_value("float32"))
      ("jobs", "Loader threads (0: all cores)", cxxopts::value<int>()->default_value("0"))
      ("threads", "LibTorch threads (0: its default)", cxxopts::value<int>()->default_value("0"))
      ("cp", "Context-parallel size", cxxopts::value<int>()->default_value("1"))
      ("timeout", "Seconds a rendezvous or collective may wait for the other ranks before the job fails",
       cxxopts::value<double>()->default_value("300"))
      ("json", "Print {\"loss\", \"loss_per_step\", \"acc\", \"cond_acc\", \"est_ar\", \"tokens\", ...}");
  auto args = parse_args(options, argc, argv);
  if (!args) return 0;
  const auto& a = *args;
  trainer::EvaluateOptions o;
  if (a.count("base")) o.base = a["base"].as<std::string>();
  if (a.count("draft")) o.draft = a["draft"].as<std::string>();
  if (a.count("data")) o.data = a["data"].as<std::string>();
  if (a.count("index")) o.index = a["index"].as<std::string>();
  o.quarantine = a["quarantine"].as<std::string>();
  o.split = a["split"].as<std::string>();
  o.eval_fraction = a["eval-fraction"].as<double>();
  o.ttt_steps = a["ttt-steps"].as<std::int64_t>();
  o.loss_decay = a["loss-decay"].as<double>();
  o.max_length = a["max-length"].as<std::int64_t>();
  o.batch_size = a["batch-size"].as<std::int64_t>();
  o.mode = a["mode"].as<std::string>();
  o.max_batches = a["max-batches"].as<std::int64_t>();
  o.device = a["device"].as<std::string>();
  o.dtype = a["dtype"].as<std::string>();
  o.jobs = a["jobs"].as<int>();
  o.threads = a["threads"].as<int>();
  o.cp_size = a["cp"].as<int>();
  o.progress = stderr_is_tty();
  if (o.cp_size < 1) throw UsageError("--cp must be at least 1");
  const bool json = a.count("json") > 0;

  dist::GroupOptions go;
  go.cuda = trainer::parse_device(o.device).is_cuda();
  go.timeout = collective_timeout(a["timeout"].as<double>());
  const dist::Mesh mesh = dist::Mesh::from_environment(o.cp_size, go);
  const trainer::EvaluateReport r = trainer::run_evaluate(o, &mesh);
  if (!mesh.is_main()) return 0;
  if (!json) std::cerr << r.summary << "\n";
  std::cout << (json ? r.to_json() + "\n" : r.to_text());
  return 0;
}

}  // namespace eaglekit::tools
