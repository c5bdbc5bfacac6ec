// lib/progress.h: the redrawn line on a terminal, plain lines in a log, nothing when off.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "formats/error.h"
#include "lib/progress.h"
#include "tests/support.h"

using namespace eaglekit;

namespace {

// Runs `body` with stderr (fd 2) sent to a file, as a batch job's log; returns what it got.
template <class F>
std::string stderr_of(const std::string& path, F body) {
  std::fflush(stderr);
  const int saved = ::dup(2);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  REQUIRE(fd >= 0);
  ::dup2(fd, 2);
  ::close(fd);
  body();
  std::fflush(stderr);
  ::dup2(saved, 2);
  ::close(saved);
  const auto bytes = test::read_bytes(path);
  return std::string(bytes.begin(), bytes.end());
}

struct EnvGuard {
  explicit EnvGuard(const char* value) { ::setenv("EAGLEKIT_PROGRESS_EVERY", value, 1); }
  ~EnvGuard() { ::unsetenv("EAGLEKIT_PROGRESS_EVERY"); }
};

}  // namespace

TEST_CASE("progress: in a log, plain lines every EAGLEKIT_PROGRESS_EVERY seconds; none for short work or 0") {
  test::TempDir dir("progress");
  {
    // An interval shorter than any add: a line per add, each whole, and a last one.
    EnvGuard env("0.000000001");
    const std::string log = stderr_of(dir / "a.log", [] {
      Progress p("indexing files", 3);
      for (int i = 0; i < 3; ++i) p.add(1);
    });
    CHECK(log.find('\r') == std::string::npos);
    CHECK(log.find("\033[K") == std::string::npos);
    CHECK(log.find("indexing files: 1/3 (33%)") != std::string::npos);
    CHECK(log.find("indexing files: 3/3 (100%)") != std::string::npos);
    CHECK(log.find(" (done)\n") != std::string::npos);
  }
  // The default (60 s): quick work leaves the log as it was, so do 0 and enabled = 0.
  CHECK(progress_every_s() == 60);
  CHECK(stderr_of(dir / "b.log", [] {
          Progress p("quick", 3);
          p.add(3);
        }).empty());
  {
    EnvGuard env("0");
    CHECK(stderr_of(dir / "c.log", [] {
            Progress p("off", 3);
            p.add(3);
          }).empty());
  }
  {
    EnvGuard env("0.000000001");
    CHECK(stderr_of(dir / "d.log", [] {
            Progress p("disabled", 3, 0);
            p.add(3);
          }).empty());
  }
  {
    EnvGuard env("soon");
    CHECK_THROWS_WITH_AS(Progress("bad", 3), "EAGLEKIT_PROGRESS_EVERY must be a number of seconds, 0 or more (0: no "
                                             "progress lines in logs), not 'soon'", UsageError);
  }
}
