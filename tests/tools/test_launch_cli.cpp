// `eaglekit launch` and the torchrun environment driving `train` and `evaluate` across local
// processes, as a user runs them: every mesh shape gives the single-process weights on the
// same global batch, resume through the CLI, rank-0-only outputs, a killed rank failing the
// job with a clear error, signal forwarding and usage errors. The library-level equivalence
// (gradients, ring attention) is in tests/trainer; this file checks the wiring of the CLI.
//
// Data is tiny and every rank runs one LibTorch thread and one loader thread: the cost of a
// case is mostly process start-up (LibTorch loading), so independent jobs run concurrently.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "formats/safetensors_format.h"
#include "tests/adamw_bound.h"
#include "tests/compare.h"
#include "tests/support.h"
#include "tests/tools/weights_diff.h"

using namespace eaglekit;
namespace fs = std::filesystem;
using test::max_rel_diff;

namespace {

std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::istringstream in(test::read_text(path));
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  return out;
}


using test::rel_diff;
double rel(const nlohmann::json& a, const nlohmann::json& b) { return rel_diff(a.get<double>(), b.get<double>()); }

std::vector<int> run_concurrently(const std::vector<std::string>& commands);

// Synthetic data and a base, made once for every case, and the single-process reference
// run (4 steps of 4 rows, a checkpoint at every step), made by the first case that needs it.
struct Fixture {
  test::TempDir dir{"launch-cli"};
  std::string data = dir / "data/conversations.jsonl";
  std::string index = dir / "index.eki";
  std::string base = dir / "base";
  std::string single = dir / "single";  // the reference run's --out

  // Options every run shares; --batch-size and --max-steps come per run.
  std::string common() const {
    return " --data " + test::quote(data) + " --index " + test::quote(index) + " --base " + test::quote(base) +
           " --max-length 24 --schedule constant --lr 0.005 --jobs 1 --threads 1 --log-every 1"
           " --eval-every -1 --aux-layer-ids 2,16,29 --timeout 60";
  }
  std::string evaluate_args() const {
    return " --data " + test::quote(data) + " --index " + test::quote(index) + " --base " + test::quote(base) +
           " --draft " + test::quote(single + "/final") +
           " --split all --max-length 24 --batch-size 3 --jobs 1 --threads 1 --timeout 60 --json";
  }
  bool has_reference() const { return fs::exists(single + "/final/model.safetensors"); }
  std::string reference_command() const {
    return test::quote(test::eaglekit_path()) + " train" + common() + " --batch-size 4 --max-steps 4 --save-every 1 --out " +
           test::quote(single) + " > /dev/null 2> " + test::quote(single + ".err");
  }
  void check_reference(int exit_code) const {
    REQUIRE_MESSAGE(exit_code == 0, test::read_text(single + ".err"));
    REQUIRE(fs::exists(single + "/checkpoint-2/model.safetensors"));
  }
  // How far another mesh's weights may be from the reference's after `steps` steps: the
  // gradients agree to rounding, rho as in tests/trainer/test_data_parallel.cpp.
  test::AdamWBound bound(std::int64_t steps) const { return test::AdamWBound::from_run(single, steps, 1e-4); }
  // `run`'s checkpoint (or final/) against the reference's of the same step.
  void check_weights(const std::string& run, const std::string& which, std::int64_t steps) const {
    const auto w = test::agreement(run + "/" + which + "/model.safetensors", single + "/" + which + "/model.safetensors",
                                   bound(steps));
    CHECK_MESSAGE(w.holds(), run << "/" << which << ": " << w.text());
  }
  void need_reference() const {
    if (!has_reference()) check_reference(run_concurrently({reference_command()})[0]);
  }
};

const Fixture& fixture() {
  static std::unique_ptr<Fixture> f;
  if (f) return *f;
  f = std::make_unique<Fixture>();
  auto r = test::eaglekit("synth --out " + test::quote(f->dir / "data") +
                          " --conversations 24 --hidden 32 --vocab 48 --min-tokens 10 --max-tokens 28"
                          " --dtype fp32 --jobs 1 --seed 4 --base-out " + test::quote(f->base));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  r = test::eaglekit("index " + test::quote(f->dir / "data") + " --out " + test::quote(f->index) + " --jobs 1");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  return *f;
}

// Runs shell commands concurrently (independent jobs; process start-up dominates, so this
// roughly halves the wall time on two cores). Returns each command's exit code; stdout and
// stderr go where each command redirects them.
std::vector<int> run_concurrently(const std::vector<std::string>& commands) {
  std::string script;
  for (std::size_t i = 0; i < commands.size(); ++i) script += "( " + commands[i] + " ) & p" + std::to_string(i) + "=$!; ";
  for (std::size_t i = 0; i < commands.size(); ++i)
    script += "wait $p" + std::to_string(i) + "; echo rc" + std::to_string(i) + "=$?; ";
  const auto r = test::run("bash -c " + test::quote(script));
  std::vector<int> codes;
  for (std::size_t i = 0; i < commands.size(); ++i) {
    const std::string key = "rc" + std::to_string(i) + "=";
    const auto at = r.out.find(key);
    codes.push_back(at == std::string::npos ? -1 : std::atoi(r.out.c_str() + at + key.size()));
  }
  return codes;
}

// `eaglekit launch --nproc N --log-dir LOGS -- ARGS`, as a shell command.
std::string launch(int nproc, const std::string& logs, const std::string& args) {
  fs::create_directories(logs);
  return test::quote(test::eaglekit_path()) + " launch --nproc " + std::to_string(nproc) + " --log-dir " + test::quote(logs) +
         " -- " + args + " > " + test::quote(logs + "/launch.out") + " 2> " + test::quote(logs + "/launch.err");
}

std::string logs_of(const std::string& logs, int nproc) {
  std::string all = test::read_text(logs + "/launch.err");
  for (int r = 0; r < nproc; ++r) all += "\n--- rank " + std::to_string(r) + ":\n" + test::read_text(logs + "/rank_" + std::to_string(r) + ".log");
  return all;
}

// The JSON line `train --json` / `evaluate --json` printed (rank 0 only, so exactly one).
nlohmann::json printed_json(const std::string& log) {
  std::vector<nlohmann::json> found;
  std::istringstream in(log);
  std::string line;
  while (std::getline(in, line))
    if (!line.empty() && line[0] == '{') found.push_back(nlohmann::json::parse(line));
  REQUIRE_MESSAGE(found.size() == 1, log);
  return found[0];
}

// The train-loss of every metrics line of a run.
std::vector<double> losses(const std::string& out) {
  std::vector<double> l;
  for (const auto& j : read_jsonl(out + "/metrics.jsonl")) l.push_back(j.at("loss").get<double>());
  return l;
}

}  // namespace

TEST_CASE("launch cli: train with CP=2, DP=2 and DP=2 x CP=2 equals one process on the global batch; resume") {
  const Fixture& f = fixture();
  const std::string d = f.dir.path();
  // --batch-size is per data-parallel rank: DP=2 with 2 rows is one process with 4; the
  // ranks of a context-parallel group share their rows.
  struct Job {
    const char* name;
    int nproc;
    std::string args;
  };
  const std::vector<Job> jobs = {
      {"cp2", 2, " --batch-size 4 --cp 2 --max-steps 2"},  // resumed below to 4 steps
      {"dp2", 2, " --batch-size 2 --max-steps 4"},
      {"dp2cp2", 4, " --batch-size 2 --cp 2 --max-steps 4"},
  };
  std::vector<std::string> cmds;
  for (const auto& j : jobs)
    cmds.push_back(launch(j.nproc, d + "/logs-" + j.name,
                          "train" + f.common() + j.args + " --json --out " + test::quote(d + "/" + j.name)));
  const bool reference = !f.has_reference();
  if (reference) cmds.push_back(f.reference_command());
  const auto codes = run_concurrently(cmds);
  if (reference) f.check_reference(codes.back());
  for (std::size_t i = 0; i < jobs.size(); ++i)
    REQUIRE_MESSAGE(codes[i] == 0, logs_of(d + "/logs-" + jobs[i].name, jobs[i].nproc));

  // CP=2 after 2 steps, then resumed with the same world size to 4 steps.
  f.check_weights(d + "/cp2", "checkpoint-2", 2);
  REQUIRE_MESSAGE(run_concurrently({launch(2, d + "/logs-cp2-resume",
                                           "train" + f.common() + " --batch-size 4 --cp 2 --max-steps 4 --resume --json --out " +
                                               test::quote(d + "/cp2"))})[0] == 0,
                  logs_of(d + "/logs-cp2-resume", 2));
  CHECK(test::read_text(d + "/logs-cp2-resume/rank_0.log").find("resuming from " + d + "/cp2/checkpoint-2") != std::string::npos);
  // Another world size or cp cannot resume it (the sampler's deal and the shards differ):
  // refused before anything is written, naming both.
  {
    const auto r = test::eaglekit("train" + f.common() + " --batch-size 4 --max-steps 6 --resume --out " +
                                  test::quote(d + "/cp2"));
    CHECK(r.exit_code == 2);
    CHECK(r.err.find("--resume: " + d + "/cp2/checkpoint-4 was saved by 2 ranks with cp 2; resume with the same "
                     "world size and cp (now 1 ranks, cp 1)") != std::string::npos);
    CHECK_FALSE(fs::exists(d + "/cp2/checkpoint-5"));
  }

  const std::vector<double> want = losses(f.single);
  REQUIRE(want.size() == 4);
  for (const auto& j : jobs) {
    CAPTURE(j.name);
    const std::string out = d + "/" + j.name;
    f.check_weights(out, "final", 4);
    f.check_weights(out, "checkpoint-4", 4);
    // Metrics are reduced over the ranks before rank 0 alone logs them: one line per step,
    // the single-process losses.
    const std::vector<double> got = losses(out);
    REQUIRE(got.size() == want.size());
    for (std::size_t s = 0; s < want.size(); ++s) CHECK(rel_diff(got[s], want[s]) < 1e-5);
    // The gradient norm before clipping, per step: AdamW and the clip hide a uniform
    // gradient-scale error from the weights, not from it (docs/testing.md).
    CHECK(test::metric_rel_diff(out + "/metrics.jsonl", f.single + "/metrics.jsonl", "grad_norm") < 1e-4);
    // Only rank 0 prints: its log has the result, the others' have nothing at all.
    const std::string logs = d + "/logs-" + j.name;
    const std::string resumed = j.name == std::string("cp2") ? "-resume" : "";
    const auto result = printed_json(test::read_text(logs + resumed + "/rank_0.log"));
    CHECK(result["steps"] == 4);
    CHECK(result["final_dir"] == out + "/final");
    for (int r = 1; r < j.nproc; ++r)
      CHECK_MESSAGE(test::read_text(logs + resumed + "/rank_" + std::to_string(r) + ".log").empty(), r);
    CHECK(test::read_text(logs + resumed + "/launch.err").empty());
  }
  // The DP=2 run's final weights are not the 4-row-per-rank ones: the check can fail.
  CHECK(max_rel_diff(d + "/dp2/checkpoint-4/model.safetensors", d + "/cp2/checkpoint-2/model.safetensors") > 1e-3);
  // ... and the bound is tighter than one step of training.
  CHECK_FALSE(test::agreement(f.single + "/checkpoint-3/model.safetensors", f.single + "/checkpoint-4/model.safetensors",
                              f.bound(4)).holds());
}

TEST_CASE("launch cli: evaluate --cp 2 gives the single-process figures") {
  const Fixture& f = fixture();
  f.need_reference();
  const std::string d = f.dir.path();
  const auto codes = run_concurrently(
      {test::quote(test::eaglekit_path()) + " evaluate" + f.evaluate_args() + " > " + test::quote(d + "/ev1.out") + " 2> " +
           test::quote(d + "/ev1.err"),
       launch(2, d + "/logs-ev-cp2", "evaluate" + f.evaluate_args() + " --cp 2")});
  REQUIRE_MESSAGE(codes[0] == 0, test::read_text(d + "/ev1.err"));
  REQUIRE_MESSAGE(codes[1] == 0, logs_of(d + "/logs-ev-cp2", 2));
  const auto one = printed_json(test::read_text(d + "/ev1.out"));
  const auto two = printed_json(test::read_text(d + "/logs-ev-cp2/rank_0.log"));
  CHECK(test::read_text(d + "/logs-ev-cp2/rank_1.log").empty());
  CHECK(two["samples"] == one["samples"]);
  CHECK(two["tokens"] == one["tokens"]);
  CHECK(one["tokens"].get<double>() > 100);
  CHECK(rel(two["loss"], one["loss"]) < 1e-5);
  CHECK(rel(two["est_ar"], one["est_ar"]) < 1e-5);
  for (const char* k : {"loss_per_step", "acc", "cond_acc"}) {
    CAPTURE(k);
    REQUIRE(two[k].size() == 3);
    for (std::size_t s = 0; s < 3; ++s) CHECK(rel(two[k][s], one[k][s]) < 1e-5);
  }
}

TEST_CASE("launch cli: torchrun variables set by hand work without launch; only rank 0 writes") {
  const Fixture& f = fixture();
  f.need_reference();
  const std::string d = f.dir.path();
  // MASTER_PORT is a port the OS handed out and released, which another process may take
  // before rank 0 binds it: a rendezvous that finds it in use is retried on a fresh port
  // (bounded), any other failure is reported at once.
  std::vector<int> codes;
  std::string logs;
  for (int attempt = 0; attempt < 3; ++attempt) {
    const auto port = test::python("import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])");
    REQUIRE_MESSAGE(port.exit_code == 0, port.err);
    const int master_port = std::stoi(port.out);
    // Each rank runs in its own folder with a relative --out: whatever a rank writes lands in
    // its own folder, so rank 1's must stay empty.
    std::vector<std::string> cmds;
    for (int r = 0; r < 2; ++r) {
      const std::string cwd = d + "/hand" + std::to_string(r);
      fs::remove_all(cwd);
      fs::create_directories(cwd);
      cmds.push_back("cd " + test::quote(cwd) + " && RANK=" + std::to_string(r) + " LOCAL_RANK=" + std::to_string(r) +
                     " WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(master_port) + " " +
                     test::quote(test::eaglekit_path()) + " train" + f.common() + " --batch-size 2 --max-steps 2 --out out --json > ../hand" +
                     std::to_string(r) + ".out 2> ../hand" + std::to_string(r) + ".err");
    }
    codes = run_concurrently(cmds);
    logs = test::read_text(d + "/hand0.err") + "\n--- rank 1:\n" + test::read_text(d + "/hand1.err");
    if (codes[0] == 0 || logs.find("ddress already in use") == std::string::npos) break;
    MESSAGE("MASTER_PORT " << master_port << " was taken before rank 0 bound it; retrying on another port");
  }
  REQUIRE_MESSAGE(codes[0] == 0, logs);
  REQUIRE_MESSAGE(codes[1] == 0, logs);
  f.check_weights(d + "/hand0/out", "checkpoint-2", 2);
  CHECK(fs::exists(d + "/hand0/out/final/model.safetensors"));
  CHECK(read_jsonl(d + "/hand0/out/metrics.jsonl").size() == 2);
  CHECK(fs::exists(d + "/hand0/out/checkpoint-2/optimizer.safetensors"));
  CHECK(printed_json(test::read_text(d + "/hand0.out"))["steps"] == 2);
  CHECK(fs::is_empty(d + "/hand1"));  // no metrics, checkpoints or export from rank 1
  CHECK(test::read_text(d + "/hand1.out").empty());
  CHECK(test::read_text(d + "/hand1.err").empty());
}

TEST_CASE("launch cli: a killed rank fails the job with a clear error within the timeout, never a hang") {
  const Fixture& f = fixture();
  const std::string d = f.dir.path();
  const std::string out = d + "/killed", logs = d + "/logs-killed";
  fs::create_directories(logs);
  // The launcher would stop rank 0 at once; a long --stop-grace shows that rank 0 fails on
  // its own, within the collective timeout (train --timeout 30).
  const std::string cmd = test::quote(test::eaglekit_path()) + " launch --nproc 2 --stop-grace 100 --timeout 120 --json --log-dir " + test::quote(logs) +
                          " -- train" + f.common() + " --timeout 30 --batch-size 2 --max-steps 1000000 --out " +
                          test::quote(out);
  const std::string script =
      cmd + " > " + test::quote(logs + "/launch.out") + " 2> " + test::quote(logs + "/launch.err") +
      " & lp=$!; i=0; "
      "while [ ! -s " + test::quote(out + "/metrics.jsonl") + " ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; "
      // The launcher's children (from /proc: no procps needed), and of them rank 1.
      "for st in /proc/[0-9]*/stat; do read -r c comm state ppid rest 2>/dev/null < $st || continue; "
      "  [ \"$ppid\" = \"$lp\" ] && tr '\\0' '\\n' < /proc/$c/environ | grep -qx RANK=1 && victim=$c; done; "
      "t0=$(date +%s%N); kill -9 $victim; wait $lp; rc=$?; t1=$(date +%s%N); "
      "echo rc=$rc; echo elapsed_ms=$(( (t1 - t0) / 1000000 ))";
  const auto r = test::run("bash -c " + test::quote(script));
  const std::string all = r.out + r.err + "\n" + logs_of(logs, 2);
  REQUIRE_MESSAGE(r.out.find("rc=") != std::string::npos, all);
  CHECK_MESSAGE(r.out.find("rc=137") != std::string::npos, all);  // 128 + SIGKILL, rank 1's
  const auto at = r.out.find("elapsed_ms=");
  REQUIRE(at != std::string::npos);
  const long elapsed_ms = std::atol(r.out.c_str() + at + 11);
  CHECK_MESSAGE(elapsed_ms < 30000, all);
  CHECK_MESSAGE(test::read_text(logs + "/launch.err").find("rank 1 was killed by signal 9") != std::string::npos, all);
  const auto result = nlohmann::json::parse(test::read_text(logs + "/launch.out"));
  CHECK(result["exit_code"] == 137);
  CHECK(result["first_failed"] == 1);
  CHECK(result["ranks"][0]["exit_code"] == 1);
  CHECK(result["ranks"][0]["stopped"] == false);  // it failed by itself, before any SIGTERM
  const std::string rank0 = test::read_text(logs + "/rank_0.log");
  CHECK_MESSAGE(rank0.find("error: distributed: ") != std::string::npos, rank0);
  CHECK_MESSAGE(rank0.find("(rank 0 of 2") != std::string::npos, rank0);
  CHECK(!fs::exists(out + "/final"));
}

TEST_CASE("launch cli: SIGTERM and SIGINT to launch reach every rank") {
  const Fixture& f = fixture();
  const std::string d = f.dir.path();
  // SIGTERM to a training job: every rank stops at the same step boundary, rank 0 saves a
  // checkpoint, and everybody exits 3 (interrupted), which launch passes on. (launch --timeout: should forwarding fail, the job
  // ends with 124 instead of hanging the test. The scripts background the launcher itself,
  // not a subshell, so that $! is its pid.)
  const std::string out = d + "/term", logs = d + "/logs-term";
  fs::create_directories(logs);
  const std::string term_script =
      "set -m; " + test::quote(test::eaglekit_path()) + " launch --nproc 2 --timeout 120 --log-dir " + test::quote(logs) + " -- train" +
      f.common() + " --batch-size 2 --max-steps 1000000 --json --out " + test::quote(out) + " > " +
      test::quote(logs + "/launch.out") + " 2> " + test::quote(logs + "/launch.err") +
      " & lp=$!; i=0; "
      "while [ ! -s " + test::quote(out + "/metrics.jsonl") + " ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; "
      "kill -TERM $lp; wait $lp; echo rc=$?";
  const auto t = test::run("bash -c " + test::quote(term_script));
  const std::string all = t.out + t.err + "\n" + logs_of(logs, 2);
  CHECK_MESSAGE(t.out.find("rc=3") != std::string::npos, all);
  // An interrupted rank is no failure: launch does not stop the others for it.
  CHECK_MESSAGE(test::read_text(logs + "/launch.err").find("stopping the other ranks") == std::string::npos, all);
  CHECK_MESSAGE(test::read_text(logs + "/launch.err").find("forwarding SIGTERM to the ranks") != std::string::npos, all);
  const auto result = printed_json(test::read_text(logs + "/rank_0.log"));
  CHECK(result["interrupted"] == true);
  const std::int64_t step = result["steps"];
  CHECK(step >= 1);
  CHECK(fs::exists(out + "/checkpoint-" + std::to_string(step) + "/trainer_state.json"));
  CHECK(!fs::exists(out + "/final"));
  CHECK(read_jsonl(out + "/metrics.jsonl").size() == static_cast<std::size_t>(step));

  // SIGINT, with programs that say which signal they got.
  const std::string int_script =
      "set -m; cd " + test::quote(d) + " || exit 1; " + test::quote(test::eaglekit_path()) +
      " launch --nproc 2 --timeout 120 --json -- sh -c 'trap \"exit 7\" INT; trap \"exit 8\" TERM; : > ready_$RANK; "
      "while :; do sleep 0.05; done' > int.out 2> int.err & lp=$!; i=0; "
      "while { [ ! -e ready_0 ] || [ ! -e ready_1 ]; } && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; "
      "kill -INT $lp; wait $lp; echo rc=$?";
  const auto s = test::run("bash -c " + test::quote(int_script));
  const std::string int_log = s.out + s.err + test::read_text(d + "/int.err");
  CHECK_MESSAGE(s.out.find("rc=7") != std::string::npos, int_log);
  const auto ints = nlohmann::json::parse(test::read_text(d + "/int.out"));
  CHECK(ints["ranks"][0]["exit_code"] == 7);
  CHECK(ints["ranks"][1]["exit_code"] == 7);
  CHECK(test::read_text(d + "/int.err").find("forwarding SIGINT to the ranks") != std::string::npos);
}

TEST_CASE("launch cli: --help and usage errors exit 2") {
  const Fixture& f = fixture();
  const std::string d = f.dir.path();
  const auto help = test::eaglekit("launch --help");
  CHECK(help.exit_code == 0);
  CHECK(help.out.find("--nproc") != std::string::npos);
  CHECK(help.out.find("--stop-grace") != std::string::npos);

  struct Bad {
    std::string args;
    const char* message;
  };
  const std::string no_data = " --data x --index x --base x --out " + test::quote(d + "/never");
  const std::vector<Bad> bad = {
      {"launch -- train", "--nproc is required"},
      {"launch --nproc 2", "nothing to launch"},
      {"launch --nproc 0 -- train", "--nproc must be at least 1"},
      {"launch --nproc 2 -- no-such-program-eaglekit", "not found in PATH"},
      {"train --cp 2" + no_data, "needs a distributed launch"},
      {"train --timeout 0" + no_data, "--timeout takes a positive number"},
      // A usage error on every rank: the job exits with the ranks' code 2.
      {"launch --nproc 3 -- train" + f.common() + " --batch-size 2 --cp 2 --out " + test::quote(d + "/never"),
       "--cp 2 does not divide the world size 3"},
  };
  std::vector<std::string> cmds;
  for (std::size_t i = 0; i < bad.size(); ++i)
    cmds.push_back(test::quote(test::eaglekit_path()) + " " + bad[i].args + " > /dev/null 2> " + test::quote(d + "/bad" + std::to_string(i) + ".err"));
  const auto codes = run_concurrently(cmds);
  for (std::size_t i = 0; i < bad.size(); ++i) {
    CAPTURE(bad[i].args);
    const std::string err = test::read_text(d + "/bad" + std::to_string(i) + ".err");
    CHECK(codes[i] == 2);
    CHECK_MESSAGE(err.find(bad[i].message) != std::string::npos, err);
  }
  CHECK(!fs::exists(d + "/never"));
}

TEST_CASE("launch cli: DP edge cases and CP=2 in pack mode equal one process; another --cp cannot resume") {
  // 24 conversations, the last 3 for evaluation: 21 train samples, one epoch.
  //   dp-last: DP=2 x 2 rows = one process x 4 rows: steps of 4 samples, the 6th holds 1,
  //            so rank 1 gets no row at all in it (a partial global batch, a zero-row rank).
  //   dp-accum: DP=2 x 2 rows x --grad-accum 2 = one process x 8 rows: steps of 8, 8 and 5
  //            samples; the last micro-batch holds 1 sample (rank 1: none).
  //   cp-pack: --mode pack with CP=2 = one process in pack mode: packed documents cut into
  //            chunks, document and position ids through the ring attention.
  // The references save every step, for the AdamW bound (tests/adamw_bound.h); the cosine
  // schedule with warmup also checks that each mesh plans the same number of steps.
  const Fixture& f = fixture();
  const std::string d = f.dir.path() + "/edge";
  fs::create_directories(d);
  const std::string base = " --data " + test::quote(f.data) + " --index " + test::quote(f.index) + " --base " +
                           test::quote(f.base) +
                           " --max-length 24 --lr 0.005 --warmup-steps 1 --jobs 1 --threads 1 --log-every 1"
                           " --eval-every -1 --eval-fraction 0.125 --aux-layer-ids 2,16,29 --timeout 60";
  const std::string pack = " --mode pack --max-length 40 --batch-size 2 --max-steps 3";
  struct Pair {
    const char* name;
    std::string single, mesh;  // the options of the reference and of the 2-rank job
    std::int64_t steps;
  };
  const std::vector<Pair> pairs = {
      {"dp-last", " --batch-size 4 --epochs 1", " --batch-size 2 --epochs 1", 6},
      {"dp-accum", " --batch-size 8 --epochs 1", " --batch-size 2 --grad-accum 2 --epochs 1", 3},
      {"cp-pack", pack, pack + " --cp 2", 3},
  };
  std::vector<std::string> cmds;
  for (const auto& p : pairs) {
    const std::string ref = d + "/" + p.name + "-single";
    cmds.push_back(test::quote(test::eaglekit_path()) + " train" + base + p.single + " --save-every 1 --json --out " + test::quote(ref) +
                   " > " + test::quote(ref + ".out") + " 2> " + test::quote(ref + ".err"));
    cmds.push_back(launch(2, d + "/logs-" + p.name, "train" + base + p.mesh + " --json --out " + test::quote(d + "/" + p.name)));
  }
  const auto codes = run_concurrently(cmds);
  for (std::size_t i = 0; i < pairs.size(); ++i) {
    const std::string ref = d + "/" + pairs[i].name + "-single";
    REQUIRE_MESSAGE(codes[2 * i] == 0, test::read_text(ref + ".err"));
    REQUIRE_MESSAGE(codes[2 * i + 1] == 0, logs_of(d + "/logs-" + pairs[i].name, 2));
  }

  for (const auto& p : pairs) {
    CAPTURE(p.name);
    const std::string ref = d + "/" + p.name + "-single", run = d + "/" + p.name;
    const auto one = printed_json(test::read_text(ref + ".out"));
    const auto two = printed_json(test::read_text(d + "/logs-" + p.name + "/rank_0.log"));
    CHECK(one["steps"] == p.steps);
    CHECK(two["steps"] == p.steps);
    REQUIRE(fs::exists(ref + "/checkpoint-" + std::to_string(p.steps)));
    const test::AdamWBound bound = test::AdamWBound::from_run(ref, p.steps, 1e-4);
    const auto w = test::agreement(run + "/final/model.safetensors", ref + "/final/model.safetensors", bound);
    CHECK_MESSAGE(w.holds(), p.name << ": " << w.text());
    // One step less is outside the bound: the last (partial) step counts, and the bound
    // can tell it.
    const std::string before = ref + "/checkpoint-" + std::to_string(p.steps - 1) + "/model.safetensors";
    CHECK_FALSE(test::agreement(before, ref + "/checkpoint-" + std::to_string(p.steps) + "/model.safetensors", bound).holds());
    // The logged losses and token counts of every step are the single process's.
    const auto want = read_jsonl(ref + "/metrics.jsonl"), got = read_jsonl(run + "/metrics.jsonl");
    REQUIRE(got.size() == want.size());
    REQUIRE(want.size() == static_cast<std::size_t>(p.steps));
    for (std::size_t s = 0; s < want.size(); ++s) {
      CAPTURE(s);
      CHECK(got[s]["step"] == want[s]["step"]);
      CHECK(got[s]["tokens"] == want[s]["tokens"]);
      CHECK(rel(got[s]["loss"], want[s]["loss"]) < 1e-5);
      CHECK(rel(got[s]["lr"], want[s]["lr"]) < 1e-12);
    }
    CHECK(test::metric_rel_diff(run + "/metrics.jsonl", ref + "/metrics.jsonl", "grad_norm") < 1e-4);
  }

  // A CP=2 checkpoint resumed on the same 2 ranks without --cp (DP=2): refused before
  // anything is written, naming both layouts.
  const std::string logs = d + "/logs-cp-resume";
  CHECK(run_concurrently({launch(2, logs, "train" + base + " --mode pack --max-length 40 --batch-size 2 --max-steps 5"
                                           " --resume --out " + test::quote(d + "/cp-pack"))})[0] == 2);
  const std::string rank0 = test::read_text(logs + "/rank_0.log");
  CHECK_MESSAGE(rank0.find("--resume: " + d + "/cp-pack/checkpoint-3 was saved by 2 ranks with cp 2; resume with the "
                           "same world size and cp (now 2 ranks, cp 1)") != std::string::npos, rank0);
  CHECK_FALSE(fs::exists(d + "/cp-pack/checkpoint-4"));
}

TEST_CASE("launch cli: DFlash under DP=2 equals one process on the global batch (D-PACE; decay with --grad-accum 2)") {
  // The DFlash loss is sum(w * l) / sum(w) with the weight sum of the global batch (every
  // micro-batch of every rank, trainer/run/train.cpp's backward_block): two ranks must give
  // the single process's weights, loss, per-position figures and gradient norm.
  //   dpace: DP=2 x 2 rows = one process x 4 rows, D-PACE weights (they come from the forward),
  //          ModelOpt's 512 anchors: the blocks per row, min(anchors, max n - 1), then come
  //          from the global batch's longest row, which only one rank holds.
  //   decay: DP=2 x 2 rows x --grad-accum 2 = one process x 8 rows, exp(-(k-1)/2) weights,
  //          5 anchors per row.
  const Fixture& f = fixture();
  const std::string d = f.dir.path() + "/dflash-dp";
  fs::create_directories(d);
  const std::string base = f.common() + " --draft-arch dflash --block-size 4 --mask-token-id 47 --max-steps 3";
  struct Pair {
    const char* name;
    std::string single, mesh;
  };
  const std::vector<Pair> pairs = {
      {"dpace", " --batch-size 4", " --batch-size 2"},
      {"decay", " --batch-size 8 --dflash-anchors 5 --dflash-weights decay --dflash-decay 2",
       " --batch-size 2 --grad-accum 2 --dflash-anchors 5 --dflash-weights decay --dflash-decay 2"},
  };
  std::vector<std::string> cmds;
  for (const auto& p : pairs) {
    const std::string ref = d + "/" + p.name + "-single";
    cmds.push_back(test::quote(test::eaglekit_path()) + " train" + base + p.single + " --save-every 1 --json --out " + test::quote(ref) +
                   " > " + test::quote(ref + ".out") + " 2> " + test::quote(ref + ".err"));
    cmds.push_back(launch(2, d + "/logs-" + p.name, "train" + base + p.mesh + " --json --out " + test::quote(d + "/" + p.name)));
  }
  const auto codes = run_concurrently(cmds);
  for (std::size_t i = 0; i < pairs.size(); ++i) {
    const std::string ref = d + "/" + pairs[i].name + "-single";
    REQUIRE_MESSAGE(codes[2 * i] == 0, test::read_text(ref + ".err"));
    REQUIRE_MESSAGE(codes[2 * i + 1] == 0, logs_of(d + "/logs-" + pairs[i].name, 2));
  }

  for (const auto& p : pairs) {
    const std::string name = p.name;
    CAPTURE(name);
    const std::string ref = d + "/" + p.name + "-single", run = d + "/" + p.name;
    const test::AdamWBound bound = test::AdamWBound::from_run(ref, 3, 1e-4);
    const auto w = test::agreement(run + "/final/model.safetensors", ref + "/final/model.safetensors", bound);
    CHECK_MESSAGE(w.holds(), p.name << ": " << w.text());
    // The bound can tell one step of training.
    CHECK_FALSE(test::agreement(ref + "/checkpoint-2/model.safetensors", ref + "/checkpoint-3/model.safetensors", bound).holds());
    const auto want = read_jsonl(ref + "/metrics.jsonl"), got = read_jsonl(run + "/metrics.jsonl");
    REQUIRE(want.size() == 3);
    REQUIRE(got.size() == want.size());
    for (std::size_t s = 0; s < want.size(); ++s) {
      CAPTURE(s);
      CHECK(got[s]["step"] == want[s]["step"]);
      CHECK(got[s]["tokens"] == want[s]["tokens"]);
      CHECK(rel(got[s]["loss"], want[s]["loss"]) < 1e-5);
      // Per block position 1..3: the unweighted loss, the accuracy and the conditional
      // accuracy of the global batch (counts summed over the ranks).
      REQUIRE(want[s]["loss_per_step"].size() == 3);
      REQUIRE(got[s]["loss_per_step"].size() == 3);
      for (std::size_t k = 0; k < 3; ++k) {
        CAPTURE(k);
        CHECK(rel(got[s]["loss_per_step"][k], want[s]["loss_per_step"][k]) < 1e-5);
        CHECK(got[s]["acc"][k].get<double>() == doctest::Approx(want[s]["acc"][k].get<double>()).epsilon(1e-12));
        CHECK(got[s]["cond_acc"][k].get<double>() == doctest::Approx(want[s]["cond_acc"][k].get<double>()).epsilon(1e-12));
      }
    }
    // The gradients' scale: a normalizer other than the global weight sum shows here first.
    CHECK(test::metric_rel_diff(run + "/metrics.jsonl", ref + "/metrics.jsonl", "grad_norm") < 1e-4);
  }
}

TEST_CASE("launch cli: a NeMo cache's stored distributions train and evaluate under CP=2 as in one process") {
  // NeMo's cache holds p[t] itself, row t, instead of a last hidden state: each CP rank keeps
  // its own rows of it (trainer/parallel/ring_attention.cpp shard_batch), and the losses,
  // gradients, weights and evaluation must be one process's.
  test::TempDir dir("launch-cli-nemo");
  const std::string d = dir.path();
  const std::string fx = test::source_dir() + "/tests/data/nemo_cache";
  auto r = test::eaglekit("synth --out " + test::quote(d + "/unused") + " --conversations 2 --hidden 8 --vocab 32 "
                          "--min-tokens 4 --max-tokens 6 --dtype fp32 --seed 3 --base-out " + test::quote(d + "/base"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  r = test::eaglekit("index " + test::quote(fx + "/lossless") + " --out " + test::quote(d + "/nemo.eki"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const std::string data = " --data " + test::quote(fx + "/conversations.jsonl") + " --index " +
                           test::quote(d + "/nemo.eki") + " --base " + test::quote(d + "/base") +
                           " --max-length 8 --jobs 1 --threads 1 --timeout 60";
  const std::string train = "train" + data +
                            " --batch-size 2 --max-steps 3 --eval-fraction 0 --eval-every -1 --schedule constant"
                            " --lr 0.005 --log-every 1 --save-every 1 --json --out ";
  const std::string single = d + "/single", cp = d + "/cp2";
  const auto codes = run_concurrently(
      {test::quote(test::eaglekit_path()) + " " + train + test::quote(single) + " > /dev/null 2> " + test::quote(single + ".err"),
       launch(2, d + "/logs-cp2", train + test::quote(cp) + " --cp 2")});
  REQUIRE_MESSAGE(codes[0] == 0, test::read_text(single + ".err"));
  REQUIRE_MESSAGE(codes[1] == 0, logs_of(d + "/logs-cp2", 2));
  // The targets were the cache's: the plan said so.
  CHECK_MESSAGE(test::read_text(single + ".err").find("draft vocabulary: the 16 tokens of selected_token_ids") !=
                    std::string::npos,
                test::read_text(single + ".err"));
  const std::vector<double> want = losses(single), got = losses(cp);
  REQUIRE(want.size() == 3);
  REQUIRE(got.size() == want.size());
  for (std::size_t s = 0; s < want.size(); ++s) CHECK(rel_diff(got[s], want[s]) < 1e-5);
  CHECK(test::metric_rel_diff(cp + "/metrics.jsonl", single + "/metrics.jsonl", "grad_norm") < 1e-4);
  const auto w = test::agreement(cp + "/final/model.safetensors", single + "/final/model.safetensors",
                                 test::AdamWBound::from_run(single, 3, 1e-4));
  CHECK_MESSAGE(w.holds(), w.text());
  // The check can fail: one step of training moves the weights past the bound.
  CHECK_FALSE(test::agreement(single + "/checkpoint-2/model.safetensors", single + "/final/model.safetensors",
                              test::AdamWBound::from_run(single, 3, 1e-4))
                  .holds());

  // evaluate --cp 2 on the cache gives one process's figures.
  const std::string evaluate = "evaluate" + data + " --draft " + test::quote(single + "/final") +
                               " --split all --batch-size 2 --json";
  const auto ev = run_concurrently(
      {test::quote(test::eaglekit_path()) + " " + evaluate + " > " + test::quote(d + "/ev1.out") + " 2> " + test::quote(d + "/ev1.err"),
       launch(2, d + "/logs-ev-cp2", evaluate + " --cp 2")});
  REQUIRE_MESSAGE(ev[0] == 0, test::read_text(d + "/ev1.err"));
  REQUIRE_MESSAGE(ev[1] == 0, logs_of(d + "/logs-ev-cp2", 2));
  const auto one = printed_json(test::read_text(d + "/ev1.out"));
  const auto two = printed_json(test::read_text(d + "/logs-ev-cp2/rank_0.log"));
  CHECK(one["samples"] == 5);
  CHECK(two["samples"] == one["samples"]);
  CHECK(two["tokens"] == one["tokens"]);
  CHECK(rel(two["loss"], one["loss"]) < 1e-5);
  for (const char* k : {"loss_per_step", "acc"}) {
    CAPTURE(k);
    REQUIRE(two[k].size() == one[k].size());
    for (std::size_t s = 0; s < one[k].size(); ++s) CHECK(rel(two[k][s], one[k][s]) < 1e-5);
  }
}
