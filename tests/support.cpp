#include "tests/support.h"

#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <stdexcept>

namespace eaglekit::test {

namespace fs = std::filesystem;

namespace {
std::atomic<int> g_counter{0};

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}
}  // namespace

TempDir::TempDir(const std::string& tag) {
  const std::string base = std::string(EAGLEKIT_BINARY_DIR) + "/test-tmp";
  fs::create_directories(base);
  path_ = base + "/" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(g_counter++);
  fs::remove_all(path_);
  fs::create_directories(path_);
}

TempDir::~TempDir() {
  std::error_code ec;
  if (std::getenv("EAGLEKIT_KEEP_TEST_TMP") == nullptr) fs::remove_all(path_, ec);
}

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) {
    if (c == '\'') q += "'\\''";
    else q += c;
  }
  return q + "'";
}

RunResult run(const std::string& command_line) {
  TempDir d("run");
  const std::string out = d / "out", err = d / "err";
  const std::string full = "(" + command_line + ") >" + quote(out) + " 2>" + quote(err) + " </dev/null";
  const int status = std::system(full.c_str());
  RunResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

std::string python_bin() {
  const char* p = std::getenv("EAGLEKIT_PYTHON");
  return p ? p : "/usr/bin/python3";
}

RunResult python(const std::string& script, const std::vector<std::string>& args) {
  TempDir d("py");
  const std::string file = d / "script.py";
  write_text(file, script);
  std::string cmd = python_bin() + " " + quote(file);
  for (const auto& a : args) cmd += " " + quote(a);
  return run(cmd);
}

bool python_has(const std::string& module) {
  return run(python_bin() + " -c 'import " + module + "'").exit_code == 0;
}

void require_python(const std::string& module) {
  static std::map<std::string, bool> known;
  const auto it = known.find(module);
  const bool has = it != known.end() ? it->second : (known[module] = python_has(module));
  const bool stdlib = module != "torch" && module != "h5py" && module != "numpy";
  REQUIRE_MESSAGE(has, python_bin() << " cannot import " << module << ": install Debian's "
                                    << (stdlib ? "python3" : "python3-" + module) << " (scripts/setup does)");
}

bool require_program(const std::string& path, const std::string& provider) {
  if (::access(path.c_str(), X_OK) == 0) return true;
  const char* allow = std::getenv("EAGLEKIT_ALLOW_SKIP");
  if (allow && std::string(allow) == "1") {
    MESSAGE("skipped (EAGLEKIT_ALLOW_SKIP=1): " << path << " is missing; " << provider);
    return false;
  }
  FAIL(path << " is missing: " << provider << " (or set EAGLEKIT_ALLOW_SKIP=1 to skip this test)");
  return false;
}

std::string eaglekit_path() {
  const char* bin = std::getenv("EAGLEKIT_BIN");
  return bin ? bin : std::string(EAGLEKIT_BINARY_DIR) + "/bin/eaglekit";
}

RunResult eaglekit(const std::string& args) { return run(quote(eaglekit_path()) + " " + args); }

std::string source_dir() { return EAGLEKIT_SOURCE_DIR; }

std::string binary_dir() { return EAGLEKIT_BINARY_DIR; }

bool fused_build() {
#ifdef EAGLEKIT_FUSED_BUILD
  return true;
#else
  return false;
#endif
}

std::string dead_pid() {
  const pid_t child = ::fork();
  if (child < 0) throw std::runtime_error("dead_pid: fork failed");
  if (child == 0) ::_exit(0);
  int status = 0;
  if (::waitpid(child, &status, 0) != child) throw std::runtime_error("dead_pid: waitpid failed");
  return std::to_string(child);
}

std::string shared_testdata(const std::string& rel) {
  const std::string shared = source_dir() + "/../shared/testdata/" + rel;
  if (fs::exists(shared)) return shared;
  return source_dir() + "/tests/data/" + rel;
}

std::vector<std::uint8_t> read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path);
  return std::vector<std::uint8_t>(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::vector<std::uint8_t>& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!f) throw std::runtime_error("cannot write " + path);
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
  if (!f) throw std::runtime_error("cannot write " + path);
}

}  // namespace eaglekit::test
