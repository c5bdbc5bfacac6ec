// eaglekit train: options from a JSON config file and/or flags (flags win), both read
// through the option tables (lib/options.h) -> run_training, or with --dry-run the plan
// (trainer/run/plan.h). Under torchrun / `eaglekit launch` the process joins the job's dp x cp
// mesh.
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <sstream>
#include <optional>
#include <string>
#include <vector>

#include "formats/error.h"
#include "tools/cli.h"
#include "tools/commands.h"
#include "trainer/io/metrics_log.h"
#include "trainer/parallel/distributed.h"
#include "trainer/run/evaluate.h"
#include "trainer/run/plan.h"
#include "trainer/run/train.h"

namespace eaglekit::tools {

namespace {

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw UsageError("--config: cannot read '" + path + "'");
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

}  // namespace

int run_train(int argc, char** argv) {
  trainer::TrainOptions o;
  std::string config;
  bool json = false, dry_run = false;
  opt::Groups groups = o.groups();
  groups.insert(groups.begin(),
                opt::Group{"Job",
                           {opt::cli_only(opt::field("config", "FILE", config,
                                                     "JSON file of options (keys as the flags, with '_' or '-'); "
                                                     "flags win")),
                            opt::cli_only(opt::field("dry_run", "", dry_run,
                                                     "Resolve every option, read the base config and the index, "
                                                     "print the plan (draft config, aux ids, RoPE, steps, tokens, "
                                                     "memory per rank, estimated time, and why each was decided) "
                                                     "and exit without training")),
                            opt::cli_only(opt::field("json", "", json, "Print the result as JSON"))}});
  const std::optional<CommandLine> cl = parse_or_help(
      argc, argv, groups, std::string(argv[0]) + " [OPTIONS]",
      "Train an EAGLE-3 draft with training-time test on offline hidden states, or on the target "
      "distributions a NeMo AutoModel EAGLE-3 cache stores (its draft vocabulary and position_mask; "
      "--loss kl only). Writes "
      "OUT/metrics.jsonl, OUT/tensorboard/, OUT/checkpoint-STEP/, OUT/final/ and with --keep-best "
      "OUT/best/. SIGINT or "
      "SIGTERM saves a checkpoint and exits 3 (--resume continues).");
  if (!cl) return 0;
  cl->apply([&](const std::string& path) { o.apply_json(read_file(path), path); });
  o.check();
  if (dry_run) {
    // Under a launcher the plan is for its world size; a dry run never joins the mesh.
    const auto env = dist::launch_env_from_environment();
    trainer::RunPlan plan = trainer::resolve(o, env ? env->world_size : 1);
    trainer::estimate_time(plan);
    if (env && env->rank != 0) return 0;
    std::cout << (json ? plan.to_json() + "\n" : plan.to_text());
    return 0;
  }

  dist::GroupOptions go;
  go.cuda = trainer::parse_device(o.device).is_cuda();
  go.timeout = collective_timeout(o.timeout);
  const dist::Mesh mesh = dist::Mesh::from_environment(o.cp_size, go);
  const trainer::TrainResult r = trainer::run_training(o, &mesh);
  const int rc = r.interrupted ? trainer::kExitInterrupted : 0;
  if (!mesh.is_main()) return rc;
  if (json) {
    nlohmann::ordered_json j;
    j["steps"] = r.steps;
    j["start_step"] = r.start_step;
    j["epoch"] = r.epoch;
    j["interrupted"] = r.interrupted;
    j["last_checkpoint"] = r.last_checkpoint;
    if (r.best_dir.empty()) {
      j["best"] = nullptr;
    } else {
      j["best"] = {{"dir", r.best_dir}, {"step", r.best_step}, {"est_ar", r.best_est_ar}};
    }
    j["final_dir"] = r.final_dir;
    j["train"] = trainer::stats_json(r.train_stats, o.loss_decay);
    j["eval"] = r.eval_stats ? trainer::stats_json(*r.eval_stats, o.loss_decay) : nlohmann::ordered_json(nullptr);
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
    if (!r.best_dir.empty())
      std::cout << "best: " << r.best_dir << " (step " << r.best_step << ", est_ar " << r.best_est_ar << ")\n";
    std::cout << "checkpoint: " << r.last_checkpoint << "\n";
    if (!r.final_dir.empty()) std::cout << "final draft: " << r.final_dir << "\n";
  }
  return rc;
}

}  // namespace eaglekit::tools
