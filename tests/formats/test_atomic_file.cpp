// replace_folder_atomic (a folder appears whole, an existing one is exchanged in one step)
// and process_gone (how stale temp files of killed writers are recognized).
#include <doctest/doctest.h>
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
  CHECK(test::read_text(d / "final/a.txt") == "first");
  CHECK(names_in(d.path()) == std::vector<std::string>{"final"});

  // A full folder of that name (which rename(2) refuses) is replaced as a whole: files only
  // the old one had are gone, nothing is left beside it.
  fs::create_directories(d / ".new.tmp-2");
  test::write_text(d / ".new.tmp-2/b.txt", "second");
  replace_folder_atomic(d / ".new.tmp-2", d / "final");
  CHECK(names_in(d / "final") == std::vector<std::string>{"b.txt"});
  CHECK(test::read_text(d / "final/b.txt") == "second");
  CHECK(names_in(d.path()) == std::vector<std::string>{"final"});

  CHECK_THROWS_AS(replace_folder_atomic(d / "missing", d / "other"), IoError);
}

TEST_CASE("atomic_file: process_gone tells a dead writer's pid from a live one") {
  CHECK_FALSE(process_gone(::getpid()));
  CHECK_FALSE(process_gone(0));
  CHECK(process_gone(std::stol(test::dead_pid())));
}

TEST_CASE("atomic_file: remove_stale_temp_files removes only dead writers' temps of our outputs") {
  test::TempDir d("stale");
  const std::string dead = test::dead_pid(), live = std::to_string(::getpid());
  const std::vector<std::string> files = {
      "." + std::string("a.pt.tmp.") + dead + ".0",    // stale, ours: removed
      ".b.pt.tmp." + dead + ".17",                      // stale, ours: removed
      ".a.pt.tmp." + live + ".1",                       // this process is writing it
      ".c.h5.tmp." + dead + ".0",                       // stale, not ours (ours: *.pt)
      "a.pt",                                           // a finished output
      ".a.pt.tmp.x.0",                                  // not a temp name: no pid
      ".a.pt.tmp." + dead,                              // not a temp name: no counter
      "a.pt.tmp." + dead + ".0",                        // not hidden: not ours to touch
  };
  for (const auto& f : files) test::write_text(d / f, "x");
  fs::create_directories(d / "sub");
  test::write_text(d / ("sub/.d.pt.tmp." + dead + ".0"), "x");  // below dir: left alone
  const auto ends_pt = [](const std::string& name) {
    return name.size() > 3 && name.compare(name.size() - 3, 3, ".pt") == 0;
  };
  CHECK(remove_stale_temp_files(d.path(), ends_pt) == 2);
  std::vector<std::string> want = {files[2], files[3], files[4], files[5], files[6], files[7], "sub"};
  std::sort(want.begin(), want.end());
  CHECK(names_in(d.path()) == want);
  CHECK(fs::exists(d / ("sub/.d.pt.tmp." + dead + ".0")));
  CHECK(remove_stale_temp_files(d / "missing", ends_pt) == 0);  // no folder: nothing, no throw
}
