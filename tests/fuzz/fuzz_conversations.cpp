// libFuzzer harness: the conversations parser (lib/dataset.h load_conversations). It
// reads only from a path, so the input goes to a file in /dev/shm (or $TMPDIR) first; the
// first byte picks the form: odd = JSONL (one object a line, "*.jsonl"), even = one JSON
// array (any other name).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "formats/error.h"
#include "lib/dataset.h"
#include "tests/fuzz/fuzz_common.h"

namespace {

std::string temp_base() {
  const char* dir = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : std::getenv("TMPDIR");
  return std::string(dir ? dir : "/tmp") + "/eaglekit-fuzz-conv-" + std::to_string(getpid());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  static const std::string base = temp_base();
  const std::string path = base + ((data[0] & 1) ? ".jsonl" : ".json");
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) __builtin_trap();  // the harness cannot run: not a finding about the parser
  if (size > 1 && std::fwrite(data + 1, 1, size - 1, f) != size - 1) __builtin_trap();
  std::fclose(f);
  std::uint64_t acc = 0;
  try {
    for (const auto& c : eaglekit::load_conversations(path)) acc += c.id.size() + c.source.size();
  } catch (const eaglekit::Error&) {
  }
  std::remove(path.c_str());
  eaglekit::fuzz::g_sink = acc;
  return 0;
}
