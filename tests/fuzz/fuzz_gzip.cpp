// libFuzzer harness: the gzip stream of .ckpt.gz (formats/gzip_source.h) from memory,
// decompressed under a 4 MiB cap (small, so that the cap is reached often and each run
// stays fast), then handed to the .pt record reader as a real .ckpt.gz is.
#include <cstddef>
#include <cstdint>

#include "formats/error.h"
#include "formats/gzip_source.h"
#include "formats/pt_format.h"
#include "tests/fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace eaglekit;
  std::uint64_t acc = 0;
  try {
    const auto compressed = fuzz::source_of(data, size, "fuzz.ckpt.gz");
    const auto plain = gunzip(*compressed, std::uint64_t{4} << 20);
    acc += fuzz::touch(plain->data(), plain->size());
    const PtReader reader(plain, "fuzz/7.ckpt.gz");
    const Record r = reader.read(0);
    acc += fuzz::touch(r.input_ids) + fuzz::touch(r.hidden_states);
  } catch (const Error&) {
  }
  fuzz::g_sink = acc;
  return 0;
}
