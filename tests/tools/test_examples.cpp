// Every file in examples/ parses and dry-runs (train --dry-run), as a user copies it: the
// 8B config against the real Llama-3.1-8B config.json and a dump of its width, the
// torchrun and Slurm scripts for their whole job, the SpecForge script on a SpecForge-
// layout dump, and the evaluation script on a draft trained here.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/support.h"

using namespace eaglekit;
namespace fs = std::filesystem;

namespace {

std::string example(const std::string& name) { return test::source_dir() + "/examples/" + name; }

// A dump as wide as Llama-3.1-8B (H 4096, k 3), a few short conversations, and a base
// folder holding the real config.json only (a dry run reads no weights).
struct Llama8bJob {
  test::TempDir dir{"examples"};
  std::string data = dir / "data/conversations.jsonl";
  std::string index = dir / "index.eki";
  std::string base = dir / "base";
  std::string env() const {
    return "EAGLEKIT=" + test::quote(test::eaglekit_path()) + " DATA=" + test::quote(data) + " INDEX=" +
           test::quote(index) + " BASE=" + test::quote(base) + " OUT=" + test::quote(dir / "run") + " ";
  }
};

std::unique_ptr<Llama8bJob> make_llama8b_job() {
  auto job = std::make_unique<Llama8bJob>();
  auto r = test::eaglekit("synth --out " + test::quote(job->dir / "data") +
                          " --conversations 8 --hidden 4096 --vocab 128256 --min-tokens 4 --max-tokens 8 --seed 3");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  r = test::eaglekit("index " + test::quote(job->dir / "data") + " --out " + test::quote(job->index));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  fs::create_directories(job->base);
  fs::copy_file(test::source_dir() + "/tests/data/base-configs/llama-3.1-8b.json", job->base + "/config.json");
  return job;
}

}  // namespace

TEST_CASE("examples: every shell example parses") {
  for (const auto& e : fs::directory_iterator(test::source_dir() + "/examples")) {
    const std::string p = e.path().string();
    if (e.path().extension() != ".sh" && e.path().extension() != ".sbatch") continue;
    const auto r = test::run("bash -n " + test::quote(p));
    CHECK_MESSAGE(r.exit_code == 0, std::string(p + ": " + r.err));
  }
}

TEST_CASE("examples: the Llama-3.1-8B config, torchrun and Slurm scripts dry-run for their jobs") {
  auto job = make_llama8b_job();
  SUBCASE("train --config examples/llama-3.1-8b/train.json") {
    const auto r = test::eaglekit("train --config " + test::quote(example("llama-3.1-8b/train.json")) + " --data " +
                                  test::quote(job->data) + " --index " + test::quote(job->index) + " --base " +
                                  test::quote(job->base) + " --out " + test::quote(job->dir / "run") +
                                  " --device cpu --dry-run --json");
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    const auto plan = nlohmann::json::parse(r.out);
    CHECK(plan["aux_layer_ids"] == nlohmann::json::array({2, 16, 29}));
    CHECK(plan["draft_vocab_size"] == 32000);
    CHECK(plan["vocab_size"] == 128256);
    CHECK(plan["draft_config"]["rope_scaling"]["rope_type"] == "llama3");
    CHECK(plan["draft_config"]["rope_theta"] == 500000.0);
    CHECK(plan["rope"].get<std::string>().find("llama3") != std::string::npos);
    // One 8B-wide decoder layer, fc and a 32k lm_head: the README's count, exactly.
    CHECK(plan["parameters"].get<std::int64_t>() == 424'689'664);
    CHECK(plan["memory_estimate_bytes"]["total"].get<double>() > 8e9);
    CHECK(!fs::exists(job->dir / "run"));
  }
  SUBCASE("torchrun-multinode.sh: 2 nodes x 8 GPUs, then with CP 2") {
    auto r = test::run(job->env() + "DRY_RUN=1 NNODES=2 NPROC=8 bash " + test::quote(example("torchrun-multinode.sh")) +
                       " --device cpu --json");
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    auto plan = nlohmann::json::parse(r.out);
    CHECK(plan["world_size"] == 16);
    CHECK(plan["dp_size"] == 16);
    r = test::run(job->env() + "DRY_RUN=1 NNODES=2 NPROC=8 CP=2 bash " + test::quote(example("torchrun-multinode.sh")) +
                  " --device cpu --json");
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    plan = nlohmann::json::parse(r.out);
    CHECK(plan["cp_size"] == 2);
    CHECK(plan["dp_size"] == 8);
  }
  SUBCASE("slurm.sbatch: 4 nodes") {
    const auto r = test::run(job->env() + "DRY_RUN=1 NNODES=4 bash " + test::quote(example("slurm.sbatch")) +
                             " --device cpu --json");
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    CHECK(nlohmann::json::parse(r.out)["world_size"] == 32);
  }
}

TEST_CASE("examples: specforge-convert-pack.sh indexes, packs, verifies and plans a SpecForge dump") {
  test::require_python("torch");
  test::TempDir dir("examples-sf");
  auto r = test::run(test::quote(test::python_bin()) + " " +
                     test::quote(test::source_dir() + "/tests/tools/make_producer_dumps.py") + " " +
                     test::quote(dir.path()));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  r = test::eaglekit("synth --out " + test::quote(dir / "unused") + " --conversations 2 --hidden 32 --vocab 48 "
                     "--base-out " + test::quote(dir / "base"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  r = test::run("EAGLEKIT=" + test::quote(test::eaglekit_path()) + " DUMP=" + test::quote(dir / "specforge") +
                " CONVERSATIONS=" + test::quote(dir / "conversations.jsonl") + " BASE=" + test::quote(dir / "base") +
                " OUT=" + test::quote(dir / "out") + " JOBS=2 MAX_LENGTH=32 bash " +
                test::quote(example("specforge-convert-pack.sh")) +
                " --aux-layer-ids 1,2,3 --hidden-states-norm post");  // random states: not measurable
  REQUIRE_MESSAGE(r.exit_code == 0, std::string(r.out + r.err));
  CHECK(r.out.find("12 of 12 conversations matched a record by row") != std::string::npos);
  CHECK(fs::exists(dir / "out/shards/pack-manifest.json"));
}

TEST_CASE("examples: evaluate-downloaded-draft.sh evaluates a draft folder on your data") {
  test::TempDir dir("examples-eval");
  auto r = test::eaglekit("synth --out " + test::quote(dir / "data") + " --conversations 24 --hidden 32 --vocab 48"
                          " --min-tokens 10 --max-tokens 20 --seed 2 --base-out " + test::quote(dir / "base"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  r = test::eaglekit("index " + test::quote(dir / "data") + " --out " + test::quote(dir / "index.eki"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  r = test::eaglekit("train --data " + test::quote(dir / "data/conversations.jsonl") + " --index " +
                     test::quote(dir / "index.eki") + " --base " + test::quote(dir / "base") + " --out " +
                     test::quote(dir / "run") + " --max-steps 2 --max-length 24 --threads 2 --eval-every -1");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  r = test::run("EAGLEKIT=" + test::quote(test::eaglekit_path()) + " DRAFT=" + test::quote(dir / "run/final") +
                " BASE=" + test::quote(dir / "base") + " DATA=" + test::quote(dir / "data/conversations.jsonl") +
                " INDEX=" + test::quote(dir / "index.eki") + " TTT_STEPS=3 MAX_LENGTH=24 bash " +
                test::quote(example("evaluate-downloaded-draft.sh")) + " --json");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const auto j = nlohmann::json::parse(r.out);
  CHECK(j["acc"].size() == 3);
  CHECK(j["est_ar"].get<double>() >= 1.0);
}
