// replace_folder_atomic (a folder appears whole, an existing one is exchanged in one step)
// and process_gone (how stale temp files of killed writers are recognized).
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "formats/atomic_file.h"
#include "formats/error.h"
#include "tests/support.h"

namespace fs = std::filesystem;
using namespace eaglekit;

namespace {
std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}
std::vector<std::string> names_in(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}
}  // namespace

TEST_CASE("atomic_file: replace_folder_atomic renames a new folder and exchanges a full one") {
  test::TempDir d("replace");
  fs::create_directories(d / ".new.tmp-1");
  test::write_text(d / ".new.tmp-1/a.txt", "first");
  replace_folder_atomic(d / ".new.tmp-1", d / "final");
  CHECK(slurp(d / "final/a.txt") == "first");
  CHECK(names_in(d.path()) == std::vector<std::string>{"final"});

  // A full folder of that name (which rename(2) refuses) is replaced as a whole: files only
  // the old one had are gone, nothing is left beside it.
  fs::create_directories(d / ".new.tmp-2");
  test::write_text(d / ".new.tmp-2/b.txt", "second");
  replace_folder_atomic(d / ".new.tmp-2", d / "final");
  CHECK(names_in(d / "final") == std::vector<std::string>{"b.txt"});
  CHECK(slurp(d / "final/b.txt") == "second");
  CHECK(names_in(d.path()) == std::vector<std::string>{"final"});

  CHECK_THROWS_AS(replace_folder_atomic(d / "missing", d / "other"), IoError);
}

TEST_CASE("atomic_file: process_gone tells a dead writer's pid from a live one") {
  CHECK_FALSE(process_gone(::getpid()));
  CHECK_FALSE(process_gone(0));
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) ::_exit(0);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);  // reaped: the pid names nothing now
  CHECK(process_gone(child));
}
