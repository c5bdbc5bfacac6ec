// Our exports as vLLM and SGLang load them: tests/tools/engine_loaders.py applies each
// engine's config reading and weight-name mapping (written from their code, docs/export.md)
// to a draft trained here, in our layout and in the speculators layout, for k = 3 and 4 aux
// layers. Which engine versions serve which draft is the table in docs/export.md; this test
// is what keeps that table true. A misnamed tensor must be caught (vLLM refuses it; SGLang
// skips it silently and leaves the parameter random, which the check reports).
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/support.h"

using namespace eaglekit;

namespace {

struct Case {
  int k;       // aux layers
  int layers;  // draft decoder layers
  const char* aux_ids;
};

// Trains a one-step draft on a synthetic bf16 dump with k aux layers and exports it in
// both layouts. Returns the folder holding base/, ours/ and spec/.
std::string make_exports(const test::TempDir& dir, const Case& c) {
  const std::string d = dir.path();
  auto r = test::eaglekit("synth --out " + test::quote(d + "/data") + " --conversations 12 --hidden 32 --vocab 48" +
                          " --min-tokens 8 --max-tokens 16 --dtype bf16 --seed 3 --aux-layers " + std::to_string(c.k) +
                          " --base-out " + test::quote(d + "/base"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  r = test::eaglekit("index " + test::quote(d + "/data") + " --out " + test::quote(d + "/i.eki"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  std::string train = "train --data " + test::quote(d + "/data/conversations.jsonl") + " --index " +
                      test::quote(d + "/i.eki") + " --base " + test::quote(d + "/base") +
                      " --max-length 16 --max-steps 1 --ttt-steps 2 --draft-vocab-size 40 --threads 2 --eval-every -1" +
                      " --aux-layer-ids " + c.aux_ids + " --out " + test::quote(d + "/run");
  if (c.layers != 1) train += " --draft-layers " + std::to_string(c.layers);
  r = test::eaglekit(train);
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  r = test::eaglekit("export " + test::quote(d + "/run") + " --out " + test::quote(d + "/ours"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  r = test::eaglekit("export " + test::quote(d + "/run") + " --out " + test::quote(d + "/spec") + " --format speculators");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  return d;
}

struct Outcome {
  int exit_code;
  nlohmann::json report;
  std::string err;
};

Outcome check(const std::string& d, const std::string& draft, const std::string& engine) {
  const auto r = test::run(test::quote(test::python_bin()) + " " +
                           test::quote(test::source_dir() + "/tests/tools/engine_loaders.py") + " check " +
                           test::quote(d + "/" + draft) + " --engine " + engine + " --ours " + test::quote(d + "/ours") +
                           " --base " + test::quote(d + "/base") + " --speculative-tokens 2");
  INFO(engine, " on ", draft, ": ", r.err);
  REQUIRE(!r.out.empty());
  return {r.exit_code, nlohmann::json::parse(r.out), r.err};
}

}  // namespace

TEST_CASE("engine loaders: vLLM and SGLang load our exports (k = 3, 4; one draft layer)") {
  test::require_python("torch");
  for (const Case& c : {Case{3, 1, "2,16,29"}, Case{4, 1, "2,11,20,29"}}) {
    CAPTURE(c.k);
    test::TempDir dir("engine-loaders");
    const std::string d = make_exports(dir, c);

    // vLLM with num_aux_hidden_states reads both layouts, every parameter from the file.
    for (const char* draft : {"ours", "spec"}) {
      const Outcome o = check(d, draft, "vllm");
      CHECK_MESSAGE(o.exit_code == 0, o.err);
      CHECK(o.report["left_random"].empty());
      CHECK(o.report["shared_with_target"] == nlohmann::json::array({"model.embed_tokens.weight"}));
      CHECK(o.report["config_read"]["fc_input"] == c.k * 32);
    }
    const Outcome spec = check(d, "spec", "vllm");
    CHECK(spec.report["speculative_config"]["num_speculative_tokens"] == 2);  // the run's --ttt-steps
    CHECK(spec.report["speculative_config"]["method"] == "eagle3");
    CHECK(spec.report["speculative_config"]["target"] == d + "/base");

    // SGLang reads our layout, refuses the speculators one (no such architecture).
    const Outcome sg_spec = check(d, "spec", "sglang-aux");
    CHECK(sg_spec.exit_code == 1);
    CHECK(sg_spec.report["refused"].get<std::string>().find("no speculators-format loader") != std::string::npos);
    for (const char* engine : {"sglang-aux", "sglang-1layer"}) {
      const Outcome o = check(d, "ours", engine);
      if (c.k == 3 || std::string(engine) == "sglang-aux") {
        CHECK_MESSAGE(o.exit_code == 0, o.err);
        CHECK(o.report["dropped"].empty());
        CHECK(o.report["d2t_rows"] == nlohmann::json::array({40}));
      } else {  // older SGLang: fc is 3 * Ht wide, loudly refused
        CHECK(o.exit_code == 1);
        CHECK(o.report["refused"].get<std::string>().find("fc.weight -> model.fc.weight: shape [32, 128]") !=
              std::string::npos);
      }
    }
    // Engines that hard-code three aux layers refuse a k = 4 draft loudly (fc shape).
    for (const char* engine : {"vllm-fc3", "sglang"}) {
      const Outcome o = check(d, "ours", engine);
      CHECK(o.exit_code == (c.k == 3 ? 0 : 1));
    }
  }
}

TEST_CASE("engine loaders: a misnamed tensor is caught (vLLM refuses it, SGLang would leave it random)") {
  test::require_python("torch");
  test::TempDir dir("engine-loaders-bad");
  const std::string d = make_exports(dir, Case{3, 1, "2,16,29"});
  const auto r = test::run(test::quote(test::python_bin()) + " " +
                           test::quote(test::source_dir() + "/tests/tools/engine_loaders.py") + " rename " +
                           test::quote(d + "/ours") + " " + test::quote(d + "/bad") +
                           " midlayer.hidden_norm.weight midlayer.hiden_norm.weight");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const Outcome v = check(d, "bad", "vllm");
  CHECK(v.exit_code == 1);
  CHECK(v.report["refused"].get<std::string>().find("midlayer.hiden_norm.weight: no parameter") != std::string::npos);
  const Outcome s = check(d, "bad", "sglang");
  CHECK(s.exit_code == 1);
  CHECK(s.report["left_random"] == nlohmann::json::array({"model.midlayer.hidden_norm.weight"}));
  CHECK(s.report["dropped"] == nlohmann::json::array({"midlayer.hiden_norm.weight"}));
}

// Two draft layers: vLLM loads layers.{0,1}.* (its layer 1's hidden_norm is built but never
// read); SGLang names its layers midlayer + additional_layers.{j}, so it skips our
// layers.* names without an error and leaves its decoder layers random (and would compute
// another function with them anyway, docs/export.md).
TEST_CASE("engine loaders: a two-layer draft serves in vLLM only") {
  test::require_python("torch");
  for (const Case& c : {Case{3, 2, "2,16,29"}, Case{4, 2, "2,11,20,29"}}) {
    CAPTURE(c.k);
    test::TempDir dir("engine-loaders-n2");
    const std::string d = make_exports(dir, c);
    for (const char* draft : {"ours", "spec"}) {
      const Outcome o = check(d, draft, "vllm");
      CHECK_MESSAGE(o.exit_code == 0, o.err);
      CHECK(o.report["config_read"]["num_hidden_layers"] == 2);
      CHECK(o.report["unused_by_forward"] == nlohmann::json::array({"model.layers.1.hidden_norm.weight"}));
      CHECK(o.report["left_random"].empty());
    }
    const Outcome s = check(d, "ours", "sglang-aux");
    CHECK(s.exit_code == 1);
    CHECK(!s.report["dropped"].empty());
    for (const auto& name : s.report["dropped"]) CHECK(name.get<std::string>().rfind("layers.", 0) == 0);
    for (const auto& p : s.report["left_random"]) {
      const std::string n = p.get<std::string>();
      CHECK((n.rfind("model.midlayer.", 0) == 0 || n.rfind("model.additional_layers.0.", 0) == 0));
    }
    const Outcome old = check(d, "ours", "sglang-1layer");
    CHECK(old.exit_code == 1);
    CHECK(old.report["refused"].get<std::string>().find("only supports 1 layer") != std::string::npos);
  }
}
