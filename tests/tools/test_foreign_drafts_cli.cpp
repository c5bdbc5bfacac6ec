// Drafts trained elsewhere, as users download them: the EAGLE authors' pytorch_model.bin
// (midlayer.*, a config naming no aux layers), ModelOpt's HF export (layers.0.*, aux ids
// only under eagle_config), the speculators layout and a SpecForge checkpoint folder (its
// mapping in vocab_mapping.pt), written by tests/tools/foreign_drafts.py from a draft
// trained here. Each evaluates exactly as the original, starts a fine-tuning run, and
// exports; `export --format speculators` loads back as the same draft.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/support.h"

using namespace eaglekit;
namespace fs = std::filesystem;

TEST_CASE("foreign drafts: EAGLE-3 pytorch_model.bin, ModelOpt, speculators and SpecForge layouts evaluate as the original, train, export") {
  test::require_python("torch");
  test::TempDir dir("foreign-drafts");
  const std::string d = dir.path();
  auto r = test::eaglekit("synth --out " + test::quote(d + "/data") +
                          " --conversations 30 --hidden 32 --vocab 48 --min-tokens 10 --max-tokens 24 --dtype fp32"
                          " --seed 6 --base-out " + test::quote(d + "/base"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  r = test::eaglekit("index " + test::quote(d + "/data") + " --out " + test::quote(d + "/i.eki"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const std::string data = " --data " + test::quote(d + "/data/conversations.jsonl") + " --index " +
                           test::quote(d + "/i.eki") + " --base " + test::quote(d + "/base") + " --max-length 24";
  r = test::eaglekit("train" + data + " --out " + test::quote(d + "/run") +
                     " --max-steps 3 --draft-vocab-size 40 --export-dtype fp32 --threads 2 --eval-every -1");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  r = test::run(test::quote(test::python_bin()) + " " + test::quote(test::source_dir() + "/tests/tools/foreign_drafts.py") +
                " " + test::quote(d + "/run/final") + " " + test::quote(d + "/foreign"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);

  auto evaluate = [&](const std::string& draft, std::string* err = nullptr) {
    const auto e = test::eaglekit("evaluate" + data + " --draft " + test::quote(draft) + " --split all --json");
    REQUIRE_MESSAGE(e.exit_code == 0, e.err);
    if (err) *err = e.err;
    auto j = nlohmann::json::parse(e.out);
    j.erase("seconds");
    return j;
  };
  const auto ours = evaluate(d + "/run/final");
  std::string said;
  CHECK(evaluate(d + "/foreign/eagle3", &said) == ours);
  CHECK(said.find("EAGLE-3 state dict (pytorch_model.bin, midlayer.*)") != std::string::npos);
  CHECK(evaluate(d + "/foreign/modelopt", &said) == ours);
  CHECK(said.find("ModelOpt / vLLM names (model.safetensors, layers.0.*)") != std::string::npos);
  CHECK(evaluate(d + "/foreign/speculators", &said) == ours);
  CHECK(said.find("speculators (config.json speculators_config, model.safetensors, layers.*)") != std::string::npos);
  CHECK(evaluate(d + "/foreign/specforge", &said) == ours);
  CHECK(said.find("SpecForge (model.safetensors, midlayer.*, d2t/t2d from vocab_mapping.pt)") != std::string::npos);
  // Must fail: a vocab_mapping.pt that is another mapping than the weights' own d2t.
  {
    const auto e = test::eaglekit("evaluate" + data + " --draft " + test::quote(d + "/foreign/specforge-bad") +
                                  " --split all --json");
    CHECK(e.exit_code == 1);
    CHECK_MESSAGE(e.err.find("vocab_mapping.pt: d2t") != std::string::npos, e.err);
    CHECK(e.err.find("differs from the d2t in") != std::string::npos);
  }
  // Fine-tuning from a SpecForge folder with SpecForge's mapping file as --d2t: the same
  // mapping is accepted, another one refused (its lm_head rows belong to its own).
  r = test::eaglekit("train" + data + " --init-draft " + test::quote(d + "/foreign/specforge") + " --d2t " +
                     test::quote(d + "/foreign/specforge/vocab_mapping.pt") + " --out " + test::quote(d + "/tuned-sf") +
                     " --max-steps 1 --threads 2 --eval-every -1");
  CHECK_MESSAGE(r.exit_code == 0, r.err);
  r = test::eaglekit("train" + data + " --init-draft " + test::quote(d + "/foreign/specforge") + " --d2t " +
                     test::quote(d + "/foreign/specforge-bad/vocab_mapping.pt") + " --out " +
                     test::quote(d + "/refused-sf") + " --max-steps 1");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("differs from the d2t of --init-draft") != std::string::npos);

  // Our speculators export: what vLLM reads, back to the same draft; and back to our layout.
  r = test::eaglekit("export " + test::quote(d + "/run/final") + " --out " + test::quote(d + "/spec") +
                     " --format speculators --dtype fp32 --json");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(r.err.find("speculative tokens: 3, the --ttt-steps the draft was trained with") != std::string::npos);
  {
    const auto report = nlohmann::json::parse(r.out);
    CHECK(report["format"] == "speculators");
    CHECK(report["speculative_tokens"] == 3);
    CHECK(report["verifier"] == d + "/base");
    const auto sc = nlohmann::json::parse(std::ifstream(d + "/spec/config.json"));
    CHECK(sc["speculators_model_type"] == "eagle3");
    CHECK(sc["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3);
    CHECK(sc["speculators_config"]["verifier"]["name_or_path"] == d + "/base");
    CHECK(sc["norm_before_residual"] == false);
    CHECK(sc["transformer_layer_config"]["num_aux_hidden_states"] == 3);
  }
  CHECK(evaluate(d + "/spec", &said) == ours);
  CHECK(said.find("speculators (config.json") != std::string::npos);
  r = test::eaglekit("export " + test::quote(d + "/spec") + " --out " + test::quote(d + "/spec-back") + " --dtype fp32");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(evaluate(d + "/spec-back") == ours);
  // A folder with no run beside it and no speculators config: the token count is asked for.
  r = test::eaglekit("export " + test::quote(d + "/foreign/modelopt") + " --out " + test::quote(d + "/spec2") +
                     " --format speculators");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("pass --speculative-tokens N") != std::string::npos);
  // ... and a speculators source keeps its own (5), said.
  r = test::eaglekit("export " + test::quote(d + "/foreign/speculators") + " --out " + test::quote(d + "/spec3") +
                     " --format speculators --json");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(nlohmann::json::parse(r.out)["speculative_tokens"] == 5);
  CHECK(r.err.find("speculative tokens: 5, the source draft's speculators_config") != std::string::npos);

  // Fine-tuning from the published form: its d2t is kept, its missing aux ids defaulted and said.
  r = test::eaglekit("train" + data + " --init-draft " + test::quote(d + "/foreign/eagle3") + " --out " +
                     test::quote(d + "/tuned") + " --max-steps 1 --threads 2 --eval-every -1");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(r.err.find("--init-draft names no aux layer ids: 2,16,29") != std::string::npos);
  const auto tuned = nlohmann::json::parse(std::ifstream(d + "/tuned/final/config.json"));
  CHECK(tuned["draft_vocab_size"] == 40);
  CHECK(tuned["eagle_aux_hidden_state_layer_ids"] == nlohmann::json::array({2, 16, 29}));
  // A --d2t that disagrees with the draft's mapping is refused (its lm_head rows belong to its own).
  r = test::eaglekit("vocab --data " + test::quote(d + "/data/conversations.jsonl") + " --index " +
                     test::quote(d + "/i.eki") + " --base " + test::quote(d + "/base") + " --draft-vocab-size 40 --split eval --out " + test::quote(d + "/other-d2t.pt"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  r = test::eaglekit("train" + data + " --init-draft " + test::quote(d + "/foreign/modelopt") + " --d2t " +
                     test::quote(d + "/other-d2t.pt") + " --out " + test::quote(d + "/refused") + " --max-steps 1");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("differs from the d2t of --init-draft") != std::string::npos);

  // Export rewrites a foreign draft in the engines' layout.
  r = test::eaglekit("export " + test::quote(d + "/foreign/modelopt") + " --out " + test::quote(d + "/served") +
                     " --dtype fp32 --json");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(evaluate(d + "/served") == ours);
}
