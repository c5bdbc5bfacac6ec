// libFuzzer harness: safetensors headers (formats/safetensors_format.h) from memory, every
// tensor view, and the record view of the file.
#include <cstddef>
#include <cstdint>

#include "formats/error.h"
#include "formats/safetensors_format.h"
#include "tests/fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace eaglekit;
  std::uint64_t acc = 0;
  try {
    const auto file = SafetensorsFile::parse(fuzz::source_of(data, size, "fuzz.safetensors"));
    acc += file->data_start() + file->metadata().size();
    for (const SafetensorsEntry& e : file->entries()) {
      if (file->find(e.name) == nullptr) __builtin_trap();
      try {
        acc += fuzz::touch(file->tensor(e));
      } catch (const UnsupportedError&) {
        // a dtype eaglekit cannot hold (F8, U32...): refused when read, by design
      }
    }
    for (std::int64_t rows : {2, -1}) {
      try {
        const Record r = safetensors_record(*file, rows);
        acc += fuzz::touch(r.input_ids) + fuzz::touch(r.hidden_states) +
               fuzz::touch(r.aux_hidden_states) + r.conversation_id.size();
        if (r.loss_mask) acc += fuzz::touch(*r.loss_mask);
      } catch (const Error&) {
      }
    }
  } catch (const Error&) {
  }
  fuzz::g_sink = acc;
  return 0;
}
