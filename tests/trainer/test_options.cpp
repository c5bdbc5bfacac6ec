// The option tables of train and evaluate (trainer/run/options.h): the bounds their rows
// carry, at each edge, through the path a command line takes (the row's set_text, then
// check()), against what check() accepted and refused when it spelled every range by hand.
#include <doctest/doctest.h>

#include <set>
#include <string>
#include <utility>
#include <vector>

#include "formats/error.h"
#include "trainer/run/options.h"

using namespace eaglekit;
using namespace eaglekit::trainer;

namespace {

// A value just inside a bound and one just outside, and what the refusal says.
struct Edge {
  const char* flag;
  const char* inside;
  const char* outside;
  const char* refusal;
};

// train's bounds as TrainOptions::check wrote them before they moved onto the rows. Three
// messages changed then: "--jobs and --threads must not be negative" (now each flag alone),
// "Adam betas must be in [0, 1)" and "Adam eps must be positive" (now naming the flag).
const std::vector<Edge> kTrainEdges = {
    {"eval-fraction", "0", "-0.001", "--eval-fraction must be in [0, 1)"},
    {"eval-fraction", "0.999", "1", "--eval-fraction must be in [0, 1)"},
    {"batch-size", "1", "0", "--batch-size must be at least 1"},
    {"max-length", "2", "1", "--max-length must be at least 2"},
    {"pad-multiple", "1", "0", "--pad-multiple must be at least 1"},
    {"jobs", "0", "-1", "--jobs must not be negative"},
    {"prefetch", "1", "0", "--prefetch must be at least 1"},
    {"draft-vocab-size", "0", "-1", "--draft-vocab-size must not be negative"},
    {"ttt-steps", "1", "0", "--ttt-steps must be at least 1"},
    {"block-size", "0", "-1", "--block-size must not be negative"},
    {"dflash-anchors", "1", "0", "--dflash-anchors must be at least 1"},
    {"dpace-alpha", "1e-9", "0", "--dpace-alpha must be in (0, 1]"},
    {"dpace-alpha", "1", "1.001", "--dpace-alpha must be in (0, 1]"},
    {"dflash-decay", "0", "-1e-9", "--dflash-decay must not be negative"},
    {"muon-lr", "0", "-1e-9", "--muon-lr must not be negative"},
    {"muon-momentum", "0", "-1e-9", "--muon-momentum must be in [0, 1)"},
    {"muon-momentum", "0.999", "1", "--muon-momentum must be in [0, 1)"},
    {"muon-weight-decay", "0", "-1e-9", "--muon-weight-decay must not be negative"},
    {"muon-ns-steps", "1", "0", "--muon-ns-steps must be in [1, 99]"},
    {"muon-ns-steps", "99", "100", "--muon-ns-steps must be in [1, 99]"},
    {"loss-decay", "1e-9", "0", "--loss-decay must be positive"},
    {"grad-accum", "1", "0", "--grad-accum must be at least 1"},
    {"lr", "1e-12", "0", "--lr must be a positive number"},
    {"warmup-steps", "0", "-1", "--warmup-steps must not be negative"},
    {"weight-decay", "0", "-1e-9", "--weight-decay must not be negative"},
    {"adam-beta1", "0", "-1e-9", "--adam-beta1 must be in [0, 1)"},
    {"adam-beta1", "0.999999", "1", "--adam-beta1 must be in [0, 1)"},
    {"adam-beta2", "0", "-1e-9", "--adam-beta2 must be in [0, 1)"},
    {"adam-beta2", "0.999999", "1", "--adam-beta2 must be in [0, 1)"},
    {"adam-eps", "1e-30", "0", "--adam-eps must be positive"},
    {"epochs", "0", "-1", "--epochs must not be negative"},
    {"max-steps", "0", "-1", "--max-steps must not be negative"},
    {"threads", "0", "-1", "--threads must not be negative"},
    {"cp", "1", "0", "--cp must be at least 1"},
    {"timeout", "0.001", "0", "--timeout takes a positive number of seconds (at most a week), not 0.000000"},
    {"timeout", "604800", "604800.001",
     "--timeout takes a positive number of seconds (at most a week), not 604800.001000"},
    {"keep-checkpoints", "0", "-1",
     "--keep-checkpoints must not be negative (N > 0 keeps the newest N; 0 keeps all), not -1"},
    {"log-every", "1", "0", "--log-every must be at least 1"},
    {"progress-every", "0", "-0.001", "--progress-every takes seconds, 0 or more (0: no plain progress lines)"},
};

// The flags evaluate bounds with train's edges and words (EvaluateOptions::check); its
// --eval-fraction may be 1 as well (every sample eval).
const std::set<std::string> kEvaluateBounded = {"batch-size", "max-length", "pad-multiple", "jobs",    "prefetch",
                                                "ttt-steps",  "loss-decay", "threads",      "cp",      "timeout"};

std::vector<Edge> evaluate_edges() {
  std::vector<Edge> edges;
  for (const Edge& e : kTrainEdges)
    if (kEvaluateBounded.count(e.flag)) edges.push_back(e);
  edges.push_back({"eval-fraction", "0", "-0.001", "--eval-fraction must be in [0, 1]"});
  edges.push_back({"eval-fraction", "1", "1.001", "--eval-fraction must be in [0, 1]"});
  return edges;
}

// The refusal check() gives after the flag is set from `value` as a command line would;
// "" when it accepts.
template <class Options>
std::string outcome(Options o, const std::string& flag, const std::string& value) {
  const opt::Groups groups = o.groups();
  const opt::Option* row = nullptr;
  for (const auto& g : groups)
    if (!row) row = g.find(flag);
  REQUIRE_MESSAGE(row, flag);
  row->set_text(value);
  try {
    o.check();
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

// Every flag whose row carries a bound.
template <class Options>
std::set<std::string> bounded_flags(Options o) {
  std::set<std::string> flags;
  for (const auto& g : o.groups())
    for (const auto& row : g.options)
      if (row.bound) flags.insert(row.flag);
  return flags;
}

template <class Options>
void check_edges(const Options& o, const std::vector<Edge>& edges) {
  std::set<std::string> tested;
  for (const Edge& e : edges) {
    CAPTURE(e.flag);
    CHECK(outcome(o, e.flag, e.inside) == "");
    CHECK(outcome(o, e.flag, e.outside) == e.refusal);
    tested.insert(e.flag);
  }
  CHECK(bounded_flags(o) == tested);  // no bound without its edges here, none dropped
}

}  // namespace

TEST_CASE("options: every bound of train and evaluate takes the value just inside and refuses the one outside") {
  TrainOptions train;
  train.index = "i";
  train.base = "b";
  train.out = "o";
  check_edges(train, kTrainEdges);

  EvaluateOptions evaluate;
  evaluate.index = "i";
  evaluate.base = "b";
  evaluate.draft = "d";
  check_edges(evaluate, evaluate_edges());
  // evaluate refuses up front what train refuses: a --loss-decay of 0 or below (it used to
  // weigh its loss with it), an --eval-fraction outside [0, 1] (the split used to refuse it
  // once the data was read, in other words).
  CHECK(outcome(evaluate, "loss-decay", "-1") == "--loss-decay must be positive");
  CHECK(outcome(evaluate, "eval-fraction", "-0.5") == "--eval-fraction must be in [0, 1]");

  // A --config value is judged by the same bound, once every option is set.
  TrainOptions from_json = train;
  from_json.apply_json(R"({"adam_beta2": 1.5})", "cfg.json");
  CHECK_THROWS_WITH_AS(from_json.check(), "--adam-beta2 must be in [0, 1)", UsageError);
  // What involves two options stays in check().
  CHECK(outcome(train, "keep-best", "est_ar") == "");
  TrainOptions no_eval = train;
  no_eval.eval_every = -1;
  CHECK(outcome(no_eval, "keep-best", "est_ar").rfind("--keep-best est_ar needs evaluation", 0) == 0);
}
