// The shared folder walk: which files it lists (temp files and symlinked folders not),
// its errors, and the record / not a record / unreadable classification that
// find_record_files and the index both apply to what it lists.
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>

#include "formats/error.h"
#include "formats/file_walk.h"
#include "formats/format.h"
#include "formats/hdf5_format.h"
#include "tests/support.h"

using namespace eaglekit;
namespace fs = std::filesystem;

namespace {

std::vector<std::string> sorted(std::vector<std::string> v) {
  std::sort(v.begin(), v.end());
  return v;
}

}  // namespace

TEST_CASE("file walk: regular files below the root, no temp files, no symlinked folders") {
  test::TempDir d("walk");
  const std::string root = d / "root";
  fs::create_directories(root + "/a/b");
  for (const char* name : {"a/one.h5", "a/b/two.h5"}) {
    auto w = create_hdf5_shard_writer(root + "/" + name, {});
    w->finish();
  }
  test::write_text(root + "/notes.txt", "not a record");
  test::write_text(root + "/a/.three.h5.tmp.123.0", "a writer's temp file");
  fs::create_directory_symlink(root + "/a", root + "/link");  // would list a/ twice
  fs::create_directories(root + "/empty");

  const std::vector<std::string> all = {root + "/a/b/two.h5", root + "/a/one.h5", root + "/notes.txt"};
  CHECK(sorted(list_files_below(root)) == all);
  CHECK(list_files_below(root + "/notes.txt") == std::vector<std::string>{root + "/notes.txt"});
  CHECK(list_files_below(root + "/empty").empty());
  CHECK_THROWS_WITH_AS(list_files_below(d / "missing"), (d / "missing" + ": no such file or directory").c_str(),
                       IoError);

  CHECK(record_file_format(root + "/a/one.h5") == Format::kHdf5);
  CHECK(record_file_format(root + "/notes.txt") == std::nullopt);
  // A head that cannot be read (here: a folder) is kept as kUnknown for the caller to report.
  CHECK(record_file_format(root + "/empty") == Format::kUnknown);

  // find_record_files is the walk, sorted, keeping what the classification keeps.
  CHECK(find_record_files(root) == std::vector<std::string>{root + "/a/b/two.h5", root + "/a/one.h5"});
  CHECK_THROWS_WITH_AS(find_record_files(d / "missing"), (d / "missing" + ": no such file or directory").c_str(),
                       IoError);
}
