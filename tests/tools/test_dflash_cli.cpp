// `eaglekit train --draft-arch dflash` as a user runs it: the plan says the block, the anchors,
// the weights, the teacher and where the target layers come from; the run learns (held-out
// accuracy at block position 1 up), trains on packed rows, exports what vLLM's DFlashDraftModel
// loads, evaluates per block position, resumes exactly; what DFlash does not take is refused
// with what to pass.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "tests/support.h"
#include "tests/tools/plan_decision.h"

using namespace eaglekit;

using test::plan_decision;

namespace {

nlohmann::json evaluate_json(const std::string& draft, const std::string& data) {
  // The held-out quarter only: train takes the same --eval-fraction, so these 6 conversations
  // were never trained on.
  auto r = test::eaglekit("evaluate --draft " + test::quote(draft) + data +
                          " --split eval --eval-fraction 0.25 --max-length 24 --json --threads 1");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  return nlohmann::json::parse(r.out);
}

}  // namespace

TEST_CASE("dflash cli: planned, trained, exported, evaluated and resumed as DFlash") {
  test::TempDir dir("dflash-cli");
  auto r = test::eaglekit("synth --out " + test::quote(dir / "data") +
                          " --conversations 24 --hidden 32 --vocab 48 --min-tokens 12 --max-tokens 24 --dtype fp32"
                          " --seed 5 --base-out " + test::quote(dir / "base"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  r = test::eaglekit("index " + test::quote(dir / "data") + " --out " + test::quote(dir / "index.eki"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const std::string data = " --data " + test::quote(dir / "data/conversations.jsonl") + " --index " +
                           test::quote(dir / "index.eki") + " --base " + test::quote(dir / "base");
  const std::string flags = " --max-length 24 --batch-size 4 --eval-every -1 --eval-fraction 0.25 --threads 1 --lr 3e-3";
  const std::string dflash = " --draft-arch dflash --block-size 4 --mask-token-id 47 --dflash-anchors 6";

  r = test::eaglekit("train" + data + flags + dflash + " --max-steps 2 --out " + test::quote(dir / "p") +
                     " --dry-run --json");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const auto plan = nlohmann::json::parse(r.out);
  CHECK(plan["draft_architecture"] == "dflash");
  CHECK(plan["draft_config"]["architectures"][0] == "DFlashDraftModel");
  CHECK(plan["draft_config"]["block_size"] == 4);
  CHECK(plan["draft_config"]["dflash_config"]["mask_token_id"] == 47);
  const std::string decided = plan_decision(plan, "dflash")["value"];
  CHECK(decided.find("block 4, mask token 47; up to 6 blocks per sequence; D-PACE weights (alpha 0.5); teacher: the "
                     "base's distribution") == 0);
  CHECK(plan_decision(plan, "architecture")["value"].get<std::string>().rfind("DFlash; 3 decoder layers", 0) == 0);
  CHECK(plan["notes"].dump().find("DFlash target layers: base layers 1,15,28 (the dump's aux layers") != std::string::npos);
  // The memory and FLOP models are DFlash's (trainer/run/plan.cpp, dflash_*): they grow with the
  // blocks per row, which the TTT unroll's models know nothing of; 6 and 12 blocks fit a row of 24.
  r = test::eaglekit("train" + data + flags + " --draft-arch dflash --block-size 4 --mask-token-id 47 --dflash-anchors 12"
                     " --max-steps 2 --out " + test::quote(dir / "p") + " --dry-run --json");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const auto plan12 = nlohmann::json::parse(r.out);
  const double act6 = plan["memory_estimate_bytes"]["activations"], act12 = plan12["memory_estimate_bytes"]["activations"];
  const double flops6 = plan["flops"], flops12 = plan12["flops"];
  CHECK(act12 > 1.5 * act6);
  CHECK(flops12 > 1.5 * flops6);

  // Refused, with what to pass.
  r = test::eaglekit("train" + data + flags + " --draft-arch dflash --out " + test::quote(dir / "x") + " --dry-run");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("needs --mask-token-id") != std::string::npos);
  r = test::eaglekit("train" + data + flags + dflash + " --cp 2 --out " + test::quote(dir / "x") + " --dry-run");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("does not run under context parallelism") != std::string::npos);
  r = test::eaglekit("train" + data + flags + " --block-size 4 --out " + test::quote(dir / "x") + " --dry-run");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("are DFlash's: pass --draft-arch dflash") != std::string::npos);
  r = test::eaglekit("train" + data + flags + dflash + " --draft-vocab-size 16 --out " + test::quote(dir / "x") +
                     " --dry-run");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("whole vocabulary") != std::string::npos);

  // --dpace-alpha reaches the unroll: the D-PACE weights move the gradients, so the loss after
  // three steps moves with alpha (the first step's loss is the same for any alpha: at the start
  // every position's loss is about log V, and a weighted mean of equal losses does not move);
  // 0.5 given is the default. (speculators' own D-PACE at 0.3 is test_dflash.cpp's fixture case.)
  auto last_loss = [&](const std::string& extra, const std::string& out) {
    auto t = test::eaglekit("train" + data + flags + dflash + " --max-steps 3 --seed 3 --log-every 1" + extra +
                            " --out " + test::quote(dir / out));
    REQUIRE_MESSAGE(t.exit_code == 0, t.err);
    std::ifstream f(dir / (out + "/metrics.jsonl"));
    double loss = -1;
    for (std::string line; std::getline(f, line);) {
      const auto m = nlohmann::json::parse(line);
      if (m.contains("loss") && m.value("split", "") != "eval") loss = m["loss"].get<double>();
    }
    REQUIRE_MESSAGE(loss >= 0, "no training loss in " << out << "/metrics.jsonl");
    return loss;
  };
  const double loss_default = last_loss("", "a-default"), loss_half = last_loss(" --dpace-alpha 0.5", "a-half");
  const double loss_03 = last_loss(" --dpace-alpha 0.3", "a-03");
  CHECK(loss_half == loss_default);
  CHECK(std::abs(loss_03 - loss_default) > 1e-4 * std::abs(loss_default));

  // Packed rows train too (each document as a row of its own, docs/dflash.md), and say so.
  r = test::eaglekit("train" + data + flags + dflash + " --mode pack --max-steps 2 --out " + test::quote(dir / "pack") +
                     " --json");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(nlohmann::json::parse(r.out)["steps"] == 2);
  r = test::eaglekit("train" + data + flags + dflash + " --mode pack --max-steps 2 --out " + test::quote(dir / "p") +
                     " --dry-run --json");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(plan_decision(nlohmann::json::parse(r.out), "dflash")["why"].get<std::string>().find(
            "in packed rows each document draws as a row of its own") != std::string::npos);

  // Trains; held-out figures per block position, before and after.
  r = test::eaglekit("train" + data + flags + dflash + " --max-steps 1 --lr 1e-9 --out " + test::quote(dir / "r0"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const auto before = evaluate_json(dir / "r0/final", data);
  r = test::eaglekit("train" + data + flags + dflash + " --max-steps 40 --save-every 20 --out " + test::quote(dir / "run"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const auto after = evaluate_json(dir / "run/final", data);
  CHECK(after["steps"] == 3);  // block positions 1..3
  CHECK(after["loss_fn"] == "dflash-kd");
  CHECK(after["acc"][0].get<double>() > before["acc"][0].get<double>() + 0.1);
  CHECK(after["loss"].get<double>() < before["loss"].get<double>());

  // The export: vLLM's names and config, no d2t; it reads back for evaluate.
  const auto cfg = nlohmann::json::parse(std::ifstream(dir / "run/final/config.json"));
  CHECK(cfg["architectures"][0] == "DFlashDraftModel");
  CHECK(cfg["dflash_config"]["target_layer_ids"].size() == 3);
  {  // the weights' names, from the safetensors header
    const std::vector<std::uint8_t> bytes = test::read_bytes(dir / "run/final/model.safetensors");
    REQUIRE(bytes.size() > 8);
    std::uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[static_cast<std::size_t>(i)];
    const auto header = nlohmann::json::parse(std::string(bytes.begin() + 8, bytes.begin() + 8 + static_cast<std::ptrdiff_t>(n)));
    CHECK(header.contains("layers.0.self_attn.q_norm.weight"));
    CHECK(header.contains("hidden_norm.weight"));
    CHECK_FALSE(header.contains("d2t"));
    CHECK_FALSE(header.contains("lm_head.weight"));
  }
  // speculators' DFlash layout: block_size - 1 speculative tokens, read back as the same draft.
  r = test::eaglekit("export " + test::quote(dir / "run/final") + " --format speculators --verifier " +
                     test::quote(dir / "base") + " --out " + test::quote(dir / "spec"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(r.err.find("speculative tokens: 3, block_size - 1 of the DFlash draft") != std::string::npos);
  {
    std::ifstream f(dir / "spec/config.json");
    const auto j = nlohmann::json::parse(f);
    CHECK(j["speculators_model_type"] == "dflash");
    CHECK(j["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3);
    CHECK(j["aux_hidden_state_layer_ids"] == nlohmann::json({2, 16, 29}));  // base layers 1, 15, 28
  }
  CHECK(evaluate_json(dir / "spec", data)["loss"].get<double>() == after["loss"].get<double>());
  r = test::eaglekit("export " + test::quote(dir / "run/final") + " --format speculators --verifier " +
                     test::quote(dir / "base") + " --speculative-tokens 5 --out " + test::quote(dir / "spec5"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(r.err.find("computes another function than trained") != std::string::npos);

  // Resumed from step 20, the run ends where the uninterrupted one did (anchors follow the
  // seed, the epoch and the conversation, nothing a checkpoint must carry).
  std::filesystem::create_directories(dir / "resumed");
  std::filesystem::copy(dir / "run/checkpoint-20", dir / "resumed/checkpoint-20", std::filesystem::copy_options::recursive);
  r = test::eaglekit("train" + data + flags + dflash + " --max-steps 40 --resume --out " + test::quote(dir / "resumed"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const auto resumed = evaluate_json(dir / "resumed/final", data);
  CHECK(resumed["loss"].get<double>() == after["loss"].get<double>());
  CHECK(resumed["acc"] == after["acc"]);
}
