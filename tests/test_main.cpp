// The test binaries' main: doctest's, after the process has made sure that LibTorch's OpenMP
// threads wait passively as eaglekit's own binaries do (lib/wait_policy.h): two test binaries
// run at once under `ctest -j2`, and spinning threads would slow each by the other.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "lib/wait_policy.h"

int main(int argc, char** argv) {
  eaglekit::reexec_with_passive_wait(argv);
  doctest::Context context(argc, argv);
  return context.run();
}
