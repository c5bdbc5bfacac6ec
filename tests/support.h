// Helpers shared by the test binaries: scratch folders, running Python (Debian's
// python3-torch / h5py at /usr/bin/python3) and the eaglekit binary.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace eaglekit::test {

// A fresh folder under the build tree, removed when the object dies.
class TempDir {
 public:
  explicit TempDir(const std::string& tag = "t");
  ~TempDir();
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

struct RunResult {
  int exit_code = -1;
  std::string out;  // stdout
  std::string err;  // stderr
};

// Runs a shell command line; captures stdout and stderr.
RunResult run(const std::string& command_line);
// The interpreter for interop tests: $EAGLEKIT_PYTHON, else Debian's /usr/bin/python3
// (the python3 on PATH may lack torch/h5py).
std::string python_bin();
// Runs `python3 -c SCRIPT` with that interpreter. Extra args follow the script.
RunResult python(const std::string& script, const std::vector<std::string>& args = {});
bool python_has(const std::string& module);  // e.g. "torch", "h5py"
// Fails the calling test unless python_bin() imports `module` (answers cached per module):
// the interop tests are part of the suite, and scripts/setup installs what they need.
void require_python(const std::string& module);

// The message of the E that f throws, or "(no exception)"; another exception type escapes.
template <typename E>
std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "(no exception)";
}
// A test that needs a program the suite cannot make itself calls this first. It fails the
// test, naming `path` and what provides it (`provider`: "install Debian's chromium
// (scripts/setup does)"), unless EAGLEKIT_ALLOW_SKIP=1 is set, which CI never sets: then it
// says the test is skipped and returns false, and the caller returns. True when present.
bool require_program(const std::string& path, const std::string& provider);
// Runs the built eaglekit binary with args (already shell-quoted as needed).
RunResult eaglekit(const std::string& args);
std::string eaglekit_path();  // that binary ($EAGLEKIT_BIN, else the build's bin/eaglekit)

std::string source_dir();  // repository root
// The build folder these tests were built in. Only support.cpp sees the build's own facts
// (its folder, whether its LibTorch has the fused kernels), so that every test file compiles
// to the same command in each build and ccache shares the torch-free binaries' objects
// between the LibTorch 1.13 and 2.x builds (docs/contributing.md, "CI's budget").
std::string binary_dir();
// Whether this build's binaries have the fused TTT attention kernels (LibTorch >= 2.5).
bool fused_build();
std::string shared_testdata(const std::string& rel);  // ../shared/testdata/REL (or tests/data)
std::string quote(const std::string& s);  // shell single-quote
// The pid of a process that has exited and been reaped: it names no process now, like the
// pid a SIGKILLed writer left in its temp file names. Throws when fork or waitpid fails.
std::string dead_pid();
std::vector<std::uint8_t> read_bytes(const std::string& path);
std::string read_text(const std::string& path);  // the file's bytes; "" when it cannot be read
void write_bytes(const std::string& path, const std::vector<std::uint8_t>& bytes);
void write_text(const std::string& path, const std::string& text);

}  // namespace eaglekit::test
