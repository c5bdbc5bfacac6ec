// eaglekit evaluate: the TTT unroll without gradients over a split, metrics pooled over
// every masked position (independent of the batch size): an offline acceptance estimate.
// Options: trainer::EvaluateOptions's tables.
#include <iostream>
#include <optional>
#include <string>

#include "formats/error.h"
#include "tools/cli.h"
#include "tools/commands.h"
#include "trainer/parallel/distributed.h"
#include "trainer/run/evaluate.h"
#include "trainer/run/run_setup.h"

namespace eaglekit::tools {

int run_evaluate(int argc, char** argv) {
  trainer::EvaluateOptions o;
  bool json = false;
  opt::Groups groups = o.groups();
  groups.push_back(opt::Group{
      "Output",
      {opt::cli_only(opt::field("json", "", json,
                                "Print {\"loss\", \"loss_per_step\", \"acc\", \"cond_acc\", \"est_ar\", "
                                "\"tokens\", ...}"))}});
  const std::optional<CommandLine> cl = parse_or_help(
      argc, argv, groups, std::string(argv[0]) + " --base DIR --draft DIR --data PATH --index FILE [OPTIONS]",
      "Evaluate a draft (exported folder or checkpoint) on a split: loss, loss_per_step, acc, "
      "cond_acc, est_ar pooled over every scored position. --ttt-steps and --max-length, when not given, "
      "are the ones the draft was trained with (its run's train_options.json), else their defaults; stderr says "
      "which applied.");
  if (!cl) return 0;
  cl->apply();
  // What the user left unset follows the draft's training run (EvaluateOptions::from_run).
  for (const char* key : {"ttt_steps", "max_length"})
    if (!cl->given(key)) o.from_run.push_back(key);
  o.check();

  dist::GroupOptions go;
  go.cuda = trainer::parse_device(o.device).is_cuda();
  go.timeout = collective_timeout(o.timeout);
  const dist::Mesh mesh = dist::Mesh::from_environment(o.cp_size, go);
  const trainer::EvaluateReport r = trainer::run_evaluate(o, &mesh);
  if (!mesh.is_main()) return 0;
  std::cerr << r.summary << "\n";  // what matched and which draft: stderr, also beside --json
  std::cout << (json ? r.to_json() + "\n" : r.to_text());
  return 0;
}

}  // namespace eaglekit::tools
