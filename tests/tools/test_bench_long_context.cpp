// bench/bench_long_context.sh as a smoke test (a few seconds): the tiny preset at one short
// length, eaglekit's tiled and local paths and the PyTorch eager side, side by side. The
// benchmark itself is not part of the suite; this checks that the script runs, that both
// sides build the same model and rows (their first-step losses agree), and its usage errors.
#include <doctest/doctest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/support.h"

using namespace eaglekit;

TEST_CASE("bench_long_context.sh: tiled, local and PyTorch eager train the same tiny draft, side by side") {
  test::require_python("torch");
  test::TempDir dir("bench-long");
  const std::string script = test::quote(test::source_dir() + "/bench/bench_long_context.sh");
  const std::string env = "EAGLEKIT_BUILD_DIR=" + test::quote(test::binary_dir()) + " ";
  const auto r = test::run(env + script + " --no-build --preset tiny --lengths 48 --ttt-steps 2 --threads 1"
                           " --impls tiled,local,eager-matmul --steps 1 --warmup 0 --python " +
                           test::quote(test::python_bin()) + " --out " + test::quote(dir.path()));
  REQUIRE_MESSAGE(r.exit_code == 0, std::string(r.out + r.err));
  std::ifstream f(dir.path() + "/summary.json");
  const auto summary = nlohmann::json::parse(f);
  REQUIRE(summary["rows"].size() == 3);
  double loss = 0;
  for (const auto& row : summary["rows"]) {
    CAPTURE(row.dump());
    REQUIRE(row["status"] == "ok");
    CHECK(row["tokens_per_s"].get<double>() > 0);
    CHECK(row["flops_per_step"].get<double>() > 0);
    if (row["impl"] == "tiled") {
      loss = row["first_loss"].get<double>();
      CHECK(row["peak_mib"].get<double>() > 0);  // the CPU allocator's peak
    } else {
      CHECK(row["first_loss_rel_diff_vs_tiled"].get<double>() < 1e-5);
    }
  }
  CHECK(loss > 0);
  CHECK(r.out.find("first loss check (relative 1e-05 against tiled): ok") != std::string::npos);

  CHECK(test::run(script + " --help").exit_code == 0);
  const auto bad = test::run(script + " --no-build --preset huge");
  CHECK(bad.exit_code == 2);
  CHECK(bad.err.find("--preset takes small, 8b or tiny, not 'huge'") != std::string::npos);
  CHECK(test::run(script + " --no-build --impls tiled,flash").exit_code == 2);
}
