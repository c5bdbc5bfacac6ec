// OpenMP waiting (lib/wait_policy.h): a run of eaglekit's LibTorch commands starts with its
// OpenMP threads waiting passively unless the user chose otherwise, whether it is started as
// `eaglekit` or as `eaglekit-torch`, and the plan says which policy applies and where it came
// from. The plan reads the environment the process was started with (/proc/self/environ), which
// is what libgomp read when it loaded: a variable set after the start could not pass here.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "tests/support.h"
#include "tests/tools/plan_decision.h"

using namespace eaglekit;

namespace {

// Every variable through which a user chooses, and eaglekit's marker, removed.
const std::string kClean = "env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT -u KMP_BLOCKTIME -u EAGLEKIT_OMP_WAIT_POLICY ";

nlohmann::json decision(const std::string& plan_json, const std::string& name) {
  return test::plan_decision(nlohmann::json::parse(plan_json), name);
}

// A tiny synthetic data set and base in `dir`, indexed: the arguments of a `train --dry-run
// --json` on it (after the binary), and the two binaries that run it (eaglekit, eaglekit-torch).
struct DryRun {
  std::string args;
  std::vector<std::string> binaries;
};
DryRun dry_run(const test::TempDir& dir) {
  auto r = test::eaglekit("synth --out " + test::quote(dir / "data") +
                          " --conversations 12 --hidden 16 --vocab 32 --min-tokens 8 --max-tokens 16 --dtype fp32"
                          " --base-out " + test::quote(dir / "base"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  r = test::eaglekit("index " + test::quote(dir / "data") + " --out " + test::quote(dir / "index.eki"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  DryRun d;
  d.args = " train --data " + test::quote(dir / "data/conversations.jsonl") + " --index " +
           test::quote(dir / "index.eki") + " --base " + test::quote(dir / "base") + " --out " +
           test::quote(dir / "out") + " --max-length 16 --batch-size 2 --dry-run --json";
  const std::string front = test::eaglekit_path();
  d.binaries = {test::quote(front), test::quote(front.substr(0, front.rfind('/')) + "/eaglekit-torch")};
  return d;
}

}  // namespace

TEST_CASE("wait policy: train starts passive by default, as eaglekit or eaglekit-torch, and says why") {
  test::TempDir dir("wait-policy");
  const DryRun d = dry_run(dir);
  const std::string& args = d.args;
  test::RunResult r;
  for (const std::string& bin : d.binaries) {
    CAPTURE(bin);
    r = test::run(kClean + bin + args);
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    CHECK(nlohmann::json::parse(r.out)["omp_wait_policy"] == "passive");
    const auto d = decision(r.out, "openmp waiting");
    REQUIRE(d.is_object());
    CHECK(d["value"] == "passive");
    CHECK(d["why"].get<std::string>().rfind("eaglekit's default", 0) == 0);

    // The user's choice is kept and named, whichever variable it is in.
    r = test::run(kClean + "OMP_WAIT_POLICY=ACTIVE " + bin + args);
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    CHECK(decision(r.out, "openmp waiting")["value"] == "active");
    CHECK(decision(r.out, "openmp waiting")["why"] == "OMP_WAIT_POLICY in the environment");
    r = test::run(kClean + "GOMP_SPINCOUNT=1000 " + bin + args);
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    CHECK(decision(r.out, "openmp waiting")["value"] == "GOMP_SPINCOUNT=1000");
    // A marker inherited from an eaglekit parent does not speak for a policy the user changed.
    r = test::run(kClean + "EAGLEKIT_OMP_WAIT_POLICY=default OMP_WAIT_POLICY=active " + bin + args);
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    CHECK(decision(r.out, "openmp waiting")["value"] == "active");
  }
}

// Freed memory (lib/malloc_policy.h): kept for reuse by default, in eaglekit and eaglekit-torch
// alike; a user's allocator setting is kept and named.
TEST_CASE("malloc policy: train keeps freed memory by default and names a user's allocator setting") {
  test::TempDir dir("malloc-policy");
  const DryRun d = dry_run(dir);
  const std::string& args = d.args;
  test::RunResult r;
  const std::string clean = "env -u MALLOC_TRIM_THRESHOLD_ -u MALLOC_MMAP_THRESHOLD_ -u MALLOC_TOP_PAD_ "
                            "-u MALLOC_MMAP_MAX_ -u MALLOC_ARENA_MAX -u GLIBC_TUNABLES -u EAGLEKIT_MALLOC ";
  for (const std::string& bin : d.binaries) {
    CAPTURE(bin);
    r = test::run(clean + bin + args);
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    const auto plan = nlohmann::json::parse(r.out);
    CHECK(plan["malloc_policy"].get<std::string>().rfind("freed blocks kept for reuse", 0) == 0);
    CHECK(decision(r.out, "freed memory")["why"].get<std::string>().rfind("eaglekit's default", 0) == 0);
    r = test::run(clean + "MALLOC_TRIM_THRESHOLD_=131072 " + bin + args);
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    CHECK(decision(r.out, "freed memory")["value"] == "MALLOC_TRIM_THRESHOLD_=131072");
    r = test::run(clean + "GLIBC_TUNABLES=glibc.malloc.arena_max=2 " + bin + args);
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    CHECK(decision(r.out, "freed memory")["value"] == "GLIBC_TUNABLES=glibc.malloc.arena_max=2");
    r = test::run(clean + "EAGLEKIT_MALLOC=libc " + bin + args);
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    CHECK(decision(r.out, "freed memory")["value"] == "the C library's defaults");
    CHECK(decision(r.out, "freed memory")["why"].get<std::string>().rfind("EAGLEKIT_MALLOC=libc", 0) == 0);
    // A GLIBC_TUNABLES without a malloc tunable is not a choice of the allocator's.
    r = test::run(clean + "GLIBC_TUNABLES=glibc.cpu.hwcaps=-AVX512F " + bin + args);
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    CHECK(decision(r.out, "freed memory")["value"].get<std::string>().rfind("freed blocks kept", 0) == 0);
  }
}
