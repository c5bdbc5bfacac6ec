// libFuzzer harness: DeepSpec's target cache v2 (formats/deepspec_format.h) from memory. The
// input is u32 manifest length, u32 samples.idx length (little-endian), the manifest's text,
// samples.idx's bytes, and the rest: the bytes of every shard the manifest names (one buffer
// for all, so that any shard list reaches the per-sample checks). Every sample: info, a
// one-row prefix, the whole record, and find() of its id.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "formats/byte_source.h"
#include "formats/bytes.h"
#include "formats/deepspec_format.h"
#include "formats/error.h"
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
  if (size < 8) return 0;
  const std::uint64_t manifest_len = load_le32(data), idx_len = load_le32(data + 4);
  if (manifest_len > size - 8 || idx_len > size - 8 - manifest_len) return 0;
  const std::string_view manifest(reinterpret_cast<const char*>(data + 8), manifest_len);
  const std::uint8_t* idx = data + 8 + manifest_len;
  const auto index = ByteSource::from_bytes(std::vector<std::uint8_t>(idx, idx + idx_len), "samples.idx");
  const std::uint8_t* rest = idx + idx_len;
  const auto shard = ByteSource::from_bytes(std::vector<std::uint8_t>(rest, data + size), "shard.bin");
  std::uint64_t acc = 0;
  try {
    const auto reader = DeepSpecReader::open("manifest.json", manifest, [&](const std::string& name) {
      return name == "samples.idx" ? index : shard;
    });
    acc += reader->size() + reader->target_layer_ids().size();
    for (std::size_t i = 0; i < reader->size() && i < 64; ++i) {
      try {
        const RecordInfo info = reader->info(i);
        acc += static_cast<std::uint64_t>(info.tokens);
        if (reader->find(info.conversation_id) != i) __builtin_trap();
        acc += touch_record(reader->read_prefix(i, 1));
        const Record r = reader->read(i);
        r.check("fuzz");
        acc += touch_record(r);
      } catch (const Error&) {
      }
    }
  } catch (const Error&) {
  }
  fuzz::g_sink = acc;
  return 0;
}
