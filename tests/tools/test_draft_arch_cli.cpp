// `eaglekit train --draft-arch eagle3.1` as a user runs it: the plan names the architecture, its
// norms and its parameter count; the run trains, exports both layouts, evaluates and resumes it;
// combinations that are not the architecture asked for are refused with what to pass.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <string>

#include "tests/support.h"
#include "tests/tools/plan_decision.h"

using namespace eaglekit;

using test::plan_decision;

TEST_CASE("draft arch cli: eagle3.1 is planned, trained, exported, evaluated and resumed as itself") {
  test::TempDir dir("draft-arch");
  auto r = test::eaglekit("synth --out " + test::quote(dir / "data") +
                          " --conversations 24 --hidden 32 --vocab 48 --min-tokens 10 --max-tokens 24 --dtype fp32"
                          " --seed 5 --base-out " + test::quote(dir / "base"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  r = test::eaglekit("index " + test::quote(dir / "data") + " --out " + test::quote(dir / "index.eki"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const std::string data = " --data " + test::quote(dir / "data/conversations.jsonl") + " --index " +
                           test::quote(dir / "index.eki") + " --base " + test::quote(dir / "base");
  const std::string flags = " --max-length 24 --batch-size 4 --max-steps 3 --eval-every -1 --threads 1";

  // The plans: EAGLE-3 by default, EAGLE 3.1 when asked, 3 x 32 more parameters (fc_norm).
  r = test::eaglekit("train" + data + flags + " --out " + test::quote(dir / "p3") + " --dry-run --json");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const auto p3 = nlohmann::json::parse(r.out);
  CHECK(p3["draft_architecture"] == "eagle3");
  CHECK(plan_decision(p3, "architecture")["value"].get<std::string>().rfind("EAGLE-3; 1 decoder layer", 0) == 0);
  r = test::eaglekit("train" + data + flags + " --draft-arch eagle3.1 --out " + test::quote(dir / "p31") +
                     " --dry-run --json");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const auto p31 = nlohmann::json::parse(r.out);
  CHECK(p31["draft_architecture"] == "eagle3.1");
  CHECK(p31["parameters"].get<std::int64_t>() == p3["parameters"].get<std::int64_t>() + 3 * 32);
  CHECK(plan_decision(p31, "architecture")["value"].get<std::string>().rfind(
            "EAGLE 3.1: fc_norm per aux layer, norm_output; 1 decoder layer", 0) == 0);
  CHECK(plan_decision(p31, "architecture")["why"] == "--draft-arch eagle3.1 and its default norms");
  CHECK(p31["draft_config"]["fc_norm"] == true);
  CHECK(p31["draft_config"]["norm_output"] == true);
  // --fc-norm concat: speculators' one norm over the whole fc input (3 x 32 wide).
  r = test::eaglekit("train" + data + flags + " --draft-arch eagle3.1 --fc-norm concat --out " +
                     test::quote(dir / "pc") + " --dry-run --json");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(nlohmann::json::parse(r.out)["draft_config"]["norm_before_fc"] == true);
  CHECK(nlohmann::json::parse(r.out)["parameters"] == p31["parameters"]);

  // Refused, with what to pass.
  r = test::eaglekit("train" + data + flags + " --draft-arch eagle3 --fc-norm per-layer --out " +
                     test::quote(dir / "x") + " --dry-run");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("those norms are EAGLE 3.1's; pass --draft-arch eagle3.1") != std::string::npos);
  r = test::eaglekit("train" + data + flags + " --draft-arch eagle3.1 --fc-norm none --norm-output off --out " +
                     test::quote(dir / "x") + " --dry-run");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("is EAGLE-3: pass --draft-arch eagle3") != std::string::npos);
  r = test::eaglekit("train" + data + flags + " --draft-arch eagle4 --out " + test::quote(dir / "x") + " --dry-run");
  CHECK(r.exit_code == 2);

  // Trains, exports (both layouts), evaluates.
  r = test::eaglekit("train" + data + flags + " --draft-arch eagle3.1 --out " + test::quote(dir / "run"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(r.err.find("EAGLE 3.1 draft (fc_norm, norm_output) is served as trained by vLLM 0.32") != std::string::npos);
  const auto cfg = nlohmann::json::parse(std::ifstream(dir / "run/final/config.json"));
  CHECK(cfg["fc_norm"] == true);
  CHECK(cfg["norm_output"] == true);
  r = test::eaglekit("export " + test::quote(dir / "run/final") + " --format speculators --verifier " +
                     test::quote(dir / "base") + " --out " + test::quote(dir / "spec"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const auto spec = nlohmann::json::parse(std::ifstream(dir / "spec/config.json"));
  CHECK(spec["fc_norm"] == true);
  CHECK(spec["norm_output"] == true);
  CHECK(spec["norm_before_fc"] == false);
  std::string loss;
  for (const std::string folder : {"run/final", "spec"}) {
    CAPTURE(folder);
    r = test::eaglekit("evaluate" + data + " --draft " + test::quote(dir / folder) + " --split all --json");
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    const std::string l = nlohmann::json::parse(r.out)["loss"].dump();
    if (loss.empty()) loss = l;
    CHECK(l == loss);  // both layouts are the same draft
  }

  // A draft keeps its architecture: --init-draft with another one is refused, naming it.
  r = test::eaglekit("train" + data + flags + " --init-draft " + test::quote(dir / "run/final") +
                     " --draft-arch eagle3 --out " + test::quote(dir / "y") + " --dry-run");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--draft-arch eagle3 differs from the draft in") != std::string::npos);
  CHECK(r.err.find("which is eagle3.1 (fc_norm true") != std::string::npos);
  r = test::eaglekit("train" + data + flags + " --init-draft " + test::quote(dir / "spec") + " --out " +
                     test::quote(dir / "y") + " --dry-run --json");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(nlohmann::json::parse(r.out)["draft_architecture"] == "eagle3.1");

  // Resume continues it as itself.
  r = test::eaglekit("train" + data + " --max-length 24 --batch-size 4 --max-steps 5 --eval-every -1 --threads 1"
                     " --resume --out " + test::quote(dir / "run"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(nlohmann::json::parse(std::ifstream(dir / "run/final/config.json"))["fc_norm"] == true);
}
