// libFuzzer harness: .pt files (formats/pt_format.h) from memory, both as one record
// (PtReader: info, a prefix, the whole record) and as a generic torch.save (read_pt).
#include <cstddef>
#include <cstdint>

#include "formats/error.h"
#include "formats/pt_format.h"
#include "formats/record.h"
#include "tests/fuzz/fuzz_common.h"

namespace {

std::uint64_t touch_record(const eaglekit::Record& r) {
  using eaglekit::fuzz::touch;
  std::uint64_t acc = r.conversation_id.size();
  acc += touch(r.input_ids) + touch(r.hidden_states) + touch(r.aux_hidden_states);
  if (r.loss_mask) acc += touch(*r.loss_mask);
  return acc;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace eaglekit;
  const auto src = fuzz::source_of(data, size, "fuzz.pt");
  std::uint64_t acc = 0;
  try {
    const PtReader reader(src, "fuzz/7.pt");
    const RecordInfo info = reader.info(0);
    acc += info.tokens + info.hidden_size + info.conversation_id.size();
    acc += touch_record(reader.read_prefix(0, 2));
    acc += touch_record(reader.read(0));
  } catch (const Error&) {
  }
  try {
    const PtContents c = read_pt(src);
    for (const PtEntry& e : c.entries) {
      acc += e.name.size();
      if (const auto* t = std::get_if<HostTensor>(&e.value)) acc += fuzz::touch(*t);
      if (const auto* s = std::get_if<std::string>(&e.value)) acc += s->size();
    }
  } catch (const Error&) {
  }
  fuzz::g_sink = acc;
  return 0;
}
