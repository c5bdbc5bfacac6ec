// trainer/run/semantic_check.h: what validate --base says before it starts (the check itself is
// exercised end to end by tests/tools/test_validate_base_cli.cpp).
#include <doctest/doctest.h>

#include <string>

#include "trainer/run/semantic_check.h"

using namespace eaglekit::trainer;

TEST_CASE("semantic check: the notice names the work, bounds the CPU time, and says when it will take long") {
  // Llama-3.1-8B's head (128256 x 4096) over a million records: hours on any CPU.
  const std::string big = semantic_check_notice(1'000'000, 32, 128256, 4096, "cpu");
  CHECK(big.rfind("the semantic check runs 1000000 records x 32 positions through the base's head (128256 x 4096 = "
                  "525336576 parameters, read first) on cpu: 67.2 PFLOP, at least ", 0) == 0);
  CHECK(big.find("GFLOP/s a float32 matmul reached here. This will take long: a lower --positions or --device cuda "
                 "is faster") != std::string::npos);
  // A tiny one is said too, without the warning.
  const std::string small = semantic_check_notice(40, 8, 48, 32, "cpu");
  CHECK(small.find("40 records x 8 positions") != std::string::npos);
  CHECK(small.find("take long") == std::string::npos);
  // A GPU is not timed here: the work only, no made-up time.
  const std::string gpu = semantic_check_notice(1'000'000, 32, 128256, 4096, "cuda");
  CHECK(gpu.find("on cuda: 67.2 PFLOP") != std::string::npos);
  CHECK(gpu.find("at least") == std::string::npos);
}
