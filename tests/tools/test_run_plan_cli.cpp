// `train --dry-run` against a one-step `train` over a table of edge cases and the examples'
// config, on a tiny synthetic dataset: the plan (trainer/run/plan.h resolve) and the run it
// describes must make the same decisions. Both accept or both refuse, with the same
// message; when they accept, the run's final/config.json is the plan's draft config, the run
// says every note the plan makes (defaults applied, the norm form, the aux ids' default),
// and its "draft:" line has the plan's parameters, steps and rows. Issue 28: a dry run
// refused an --init-draft naming no aux ids that train accepted; it decided the draft with
// code of its own. Set EAGLEKIT_BIN to run the table against another build.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/support.h"

using namespace eaglekit;
namespace fs = std::filesystem;

namespace {

// The last non-empty line: a command's error message.
std::string last_line(const std::string& text) {
  std::size_t end = text.find_last_not_of('\n');
  if (end == std::string::npos) return "";
  const std::size_t start = text.rfind('\n', end);
  return text.substr(start == std::string::npos ? 0 : start + 1, end - (start == std::string::npos ? 0 : start + 1) + 1);
}

// A synthetic dump of `conversations` (hidden 32, vocabulary 48) with its base and index.
void make_dump(const std::string& d, int conversations) {
  auto r = test::eaglekit("synth --out " + test::quote(d + "/data") + " --conversations " +
                          std::to_string(conversations) +
                          " --hidden 32 --vocab 48 --min-tokens 10 --max-tokens 28 --dtype fp32 --jobs 2 --seed 4"
                          " --base-out " + test::quote(d + "/base"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  r = test::eaglekit("index " + test::quote(d + "/data") + " --out " + test::quote(d + "/index.eki") + " --jobs 2");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
}

struct Case {
  const char* name;
  std::string args;  // after the data options; each case names its own --max-steps
  bool accepted;     // what both must do
};

}  // namespace

TEST_CASE("run plan cli: --dry-run and a one-step train decide alike over the edge cases and examples/") {
  test::TempDir dir("run-plan");
  const std::string d = dir.path();
  make_dump(d, 40);
  const std::string data = " --data " + test::quote(d + "/data/conversations.jsonl") + " --index " +
                           test::quote(d + "/index.eki") + " --base " + test::quote(d + "/base");
  const std::string common = data + " --max-length 32 --batch-size 4 --jobs 2 --threads 1";
  auto r = test::eaglekit("vocab" + data + " --draft-vocab-size 32 --out " + test::quote(d + "/d2t.pt"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  // Drafts to start from: one as exported, one whose config names no aux layer ids (as
  // published configs often do), and a run with two checkpoints to resume.
  r = test::eaglekit("train" + common + " --out " + test::quote(d + "/first") + " --max-steps 2 --save-every 1 --eval-every -1");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  for (const char* name : {"init", "init-noaux"}) {
    fs::create_directories(d + "/" + name);
    for (const char* f : {"config.json", "model.safetensors"})
      fs::copy_file(d + "/first/final/" + f, d + "/" + name + "/" + f);
  }
  auto cfg = nlohmann::json::parse(test::read_text(d + "/init-noaux/config.json"));
  cfg.erase("eagle_aux_hidden_state_layer_ids");
  if (cfg.contains("eagle_config")) cfg["eagle_config"].erase("eagle_aux_hidden_state_layer_ids");
  test::write_text(d + "/init-noaux/config.json", cfg.dump(2));
  const std::string init = " --init-draft " + test::quote(d + "/init");
  const std::string noaux = " --init-draft " + test::quote(d + "/init-noaux");
  const std::string d2t = " --d2t " + test::quote(d + "/d2t.pt");
  const std::string one = " --max-steps 1";

  const std::vector<Case> cases = {
      {"fresh, every default", one, true},
      {"explicit --aux-layer-ids", one + " --aux-layer-ids 1,5,9", true},
      {"--aux-layer-ids of another count than the data's", one + " --aux-layer-ids 1,5", false},
      {"--draft-vocab-size (counted over the train split)", one + " --draft-vocab-size 32", true},
      {"--draft-vocab-size above the base vocabulary", one + " --draft-vocab-size 99", false},
      {"--d2t", one + d2t, true},
      {"--d2t and another --draft-vocab-size", one + d2t + " --draft-vocab-size 20", false},
      {"--modelopt-norm (no engine computes it)", one + " --modelopt-norm", false},
      {"--modelopt-norm --allow-unservable", one + " --modelopt-norm --allow-unservable", true},
      {"--draft-layers 2", one + " --draft-layers 2", true},
      {"--init-draft naming no aux ids (issue 28)", one + noaux, true},
      {"--init-draft naming no aux ids, explicit --aux-layer-ids", one + noaux + " --aux-layer-ids 3,7,11", true},
      {"--init-draft with aux ids", one + init, true},
      {"--init-draft with aux ids, other --aux-layer-ids", one + init + " --aux-layer-ids 4,8,12", true},
      {"--init-draft and another --draft-vocab-size", one + init + " --draft-vocab-size 7", false},
      {"--init-draft and a --d2t it was not trained with", one + init + d2t, false},
      {"--init-draft --modelopt-norm --allow-unservable", one + init + " --modelopt-norm --allow-unservable", true},
      {"--init-draft --modelopt-norm", one + init + " --modelopt-norm", false},
      {"--init-draft and another --draft-layers", one + init + " --draft-layers 2", false},
      {"--resume of a run, one step further", " --max-steps 3 --resume " + test::quote(d + "/first"), true},
      {"--resume with another --batch-size (the schedule re-planned)",
       " --max-steps 3 --batch-size 2 --resume " + test::quote(d + "/first"), true},
      {"--eval-fraction 0 --eval-every -1 (no eval split read)", one + " --eval-fraction 0 --eval-every -1", true},
      {"--eval-every 1 --keep-best est_ar", one + " --eval-every 1 --keep-best est_ar", true},
      {"--keep-best est_ar --eval-every -1", one + " --keep-best est_ar --eval-every -1", false},
      {"--mode pack --grad-accum 2 --epochs 1", " --mode pack --grad-accum 2 --epochs 1", true},
      {"--hidden-states-norm pre", one + " --hidden-states-norm pre", true},
      {"--ttt-steps 2 --compute-dtype bf16", one + " --ttt-steps 2 --compute-dtype bf16", true},
      {"--threads 2 --adapt-threads", one + " --threads 2 --adapt-threads", true},
      {"--adapt-threads --device cuda (the CPU's threads only)", one + " --adapt-threads --device cuda", false},
      // The examples' config as a user copies it, on this dump: what cannot fit a 48-token
      // vocabulary and a machine without a GPU is overridden (flags win over --config).
      {"examples/llama-3.1-8b/train.json",
       " --config " + test::quote(test::source_dir() + "/examples/llama-3.1-8b/train.json") + data +
           " --draft-vocab-size 32 --device cpu --max-length 64 --jobs 2 --threads 1 --max-steps 1",
       true},
  };
  int n = 0;
  for (const Case& c : cases) {
    const std::string name = c.name;
    INFO("case: " << name);
    const std::string out = " --out " + test::quote(d + "/case-" + std::to_string(n++));
    // --resume continues in the run's own folder: a copy per case.
    std::string args = c.args;
    const std::string resume_from = " --resume " + test::quote(d + "/first");
    if (args.find(resume_from) != std::string::npos) {
      const std::string copy = d + "/case-" + std::to_string(n - 1);
      fs::copy(d + "/first", copy, fs::copy_options::recursive);
      fs::remove_all(copy + "/final");
      args.replace(args.find(resume_from), resume_from.size(), " --resume");
    }
    const std::string base_args = c.args.rfind(" --config ", 0) == 0 ? args : common + args;
    const auto plan_run = test::eaglekit("train" + base_args + out + " --dry-run --json");
    const auto train_run = test::eaglekit("train" + base_args + out + " --json");
    CHECK_MESSAGE(plan_run.exit_code == train_run.exit_code,
                  "dry run: " << plan_run.exit_code << " " << last_line(plan_run.err) << "\ntrain: "
                              << train_run.exit_code << " " << last_line(train_run.err));
    CHECK_MESSAGE((train_run.exit_code == 0) == c.accepted, train_run.err);
    if (plan_run.exit_code != 0 || train_run.exit_code != 0) {
      CHECK(last_line(plan_run.err) == last_line(train_run.err));
      continue;
    }
    const auto plan = nlohmann::json::parse(plan_run.out);
    const auto trained = nlohmann::json::parse(train_run.out);
    // The draft: the config.json of final/ is the one planned, whole.
    const auto final_config = nlohmann::json::parse(test::read_text(d + "/case-" + std::to_string(n - 1) + "/final/config.json"));
    CHECK_MESSAGE(final_config == plan["draft_config"], "final: " << final_config.dump() << "\nplan:  "
                                                                   << plan["draft_config"].dump());
    // What the plan notes (defaults, the norm form, the aux ids' default), the run says.
    for (const auto& note : plan["notes"])
      CHECK_MESSAGE(train_run.err.find("train: " + note.get<std::string>()) != std::string::npos,
                    "not said by train: " << note.get<std::string>());
    // Parameters, steps and rows as planned.
    const std::string draft_line = "train: draft: " + std::to_string(plan["parameters"].get<std::int64_t>()) +
                                   " parameters, hidden " + std::to_string(plan["hidden"].get<std::int64_t>()) +
                                   ", draft vocab " + std::to_string(plan["draft_vocab_size"].get<std::int64_t>()) +
                                   "; " + std::to_string(plan["total_steps"].get<std::int64_t>()) +
                                   " optimizer steps of " + std::to_string(plan["rows_per_step"].get<std::int64_t>()) +
                                   " rows on 1 rank(s), " + std::to_string(plan["threads"].get<int>()) + " threads";
    CHECK_MESSAGE(train_run.err.find(draft_line) != std::string::npos, "expected: " << draft_line << "\n" << train_run.err);
    CHECK(trained["steps"].get<std::int64_t>() <= plan["total_steps"].get<std::int64_t>());
    // An adapting run logs the count each metrics line ran at; a fixed one does not.
    const std::string metrics = test::read_text(d + "/case-" + std::to_string(n - 1) + "/metrics.jsonl");
    const auto first = nlohmann::json::parse(metrics.substr(0, metrics.find('\n')));
    CHECK(first.contains("threads") == plan["adapt_threads"].get<bool>());
    if (first.contains("threads")) CHECK(first["threads"].get<int>() == plan["threads"].get<int>());
  }
}

TEST_CASE("run plan cli: --dry-run says why it decided each thing, as text and as JSON") {
  test::TempDir dir("run-plan-why");
  const std::string d = dir.path();
  make_dump(d, 12);
  const std::string args = "train --data " + test::quote(d + "/data/conversations.jsonl") + " --index " +
                           test::quote(d + "/index.eki") + " --base " + test::quote(d + "/base") + " --out " +
                           test::quote(d + "/out") + " --max-length 32 --draft-vocab-size 32 --max-steps 5 --dry-run";
  auto r = test::eaglekit(args + " --json");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const auto plan = nlohmann::json::parse(r.out);
  std::vector<std::string> names;
  for (const auto& decision : plan["decisions"]) {
    names.push_back(decision["name"]);
    CHECK_MESSAGE(!decision["why"].get<std::string>().empty(), decision.dump());
  }
  CHECK(names == std::vector<std::string>{"mesh", "threads", "openmp waiting", "freed memory", "split", "evaluation", "norm form",
                                          "base", "draft", "architecture", "aux ids", "draft vocab", "rope", "loss",
                                          "optimizer", "steps"});
  // The thread count says where it came from; --adapt-threads says what it does, and is for
  // the CPU only.
  r = test::eaglekit(args + " --threads 1 --adapt-threads");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK_MESSAGE(r.out.find("  threads: 1, fewer while the cores are busy\n    why: --threads; --adapt-threads: a count "
                           "is kept only where it measured faster, and the float rounding follows it (not "
                           "bit-reproducible)\n") != std::string::npos,
                r.out);
  r = test::eaglekit(args + " --adapt-threads --device cuda");
  CHECK(r.exit_code == 2);
  CHECK_MESSAGE(r.err.find("--adapt-threads adapts the CPU's LibTorch threads") != std::string::npos, r.err);
  r = test::eaglekit(args);
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK_MESSAGE(r.out.find("  aux ids: 2,16,29\n    why: EAGLE-3's default for a 32-layer base (2, N/2, N-3); no "
                           "--aux-layer-ids given\n") != std::string::npos,
                r.out);
  CHECK(r.out.find("  draft vocab: 32 of 48\n    why: --draft-vocab-size 32: the most frequent tokens of the train "
                   "split, counted when the run opens (no --d2t)\n") != std::string::npos);
  CHECK(r.out.find("  steps: 5 optimizer steps of 8 rows\n    why: --max-steps 5\n") != std::string::npos);
}
