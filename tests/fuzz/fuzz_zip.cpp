// libFuzzer harness: the ZIP directory reader (formats/zip.h) over the raw input.
#include <cstddef>
#include <cstdint>

#include "formats/error.h"
#include "formats/zip.h"
#include "tests/fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace eaglekit;
  try {
    const ZipArchive zip(fuzz::source_of(data, size, "fuzz.zip"));
    std::uint64_t acc = zip.zip64() ? 1 : 0;
    for (const ZipEntry& e : zip.entries()) {
      if (zip.find(e.name) == nullptr) __builtin_trap();  // every listed name is found
      try {
        acc += fuzz::touch(zip.data(e), e.size);
        acc += zip.text(e).size();
      } catch (const UnsupportedError&) {
        // a compressed entry: refused when read, by design
      }
    }
    fuzz::g_sink = acc;
  } catch (const Error&) {
  }
  return 0;
}
