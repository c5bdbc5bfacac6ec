// libFuzzer harness: NeMo AutoModel's EAGLE-3 offline cache (formats/nemo_cache_format.h) from
// memory. The input is u32 manifest length (little-endian), the manifest's text, and the rest:
// the bytes every shard the manifest makes reads (one buffer for all, so that any shard count
// reaches the per-sample checks). Every sample: info, sample (and its tensors' bytes), find()
// of its id, and read(): a record of stored target distributions that passes Record::check,
// as many rows as the sample has tokens.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "formats/byte_source.h"
#include "formats/bytes.h"
#include "formats/error.h"
#include "formats/nemo_cache_format.h"
#include "formats/record.h"
#include "tests/fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace eaglekit;
  using fuzz::touch;
  if (size < 4) return 0;
  const std::uint64_t manifest_len = load_le32(data);
  if (manifest_len > size - 4) return 0;
  const std::string_view manifest(reinterpret_cast<const char*>(data + 4), manifest_len);
  const std::uint8_t* rest = data + 4 + manifest_len;
  const auto shard = ByteSource::from_bytes(std::vector<std::uint8_t>(rest, data + size), "shard.safetensors");
  std::uint64_t acc = 0;
  try {
    const auto reader = NemoCacheReader::open("manifest.json", manifest, [&](const std::string&) { return shard; });
    acc += reader->size() + reader->selected_token_ids().size();
    for (std::size_t i = 0; i < reader->size() && i < 64; ++i) {
      try {
        const RecordInfo info = reader->info(i);
        acc += static_cast<std::uint64_t>(info.tokens);
        if (reader->find(info.conversation_id) != i) __builtin_trap();
        const NemoCacheSample s = reader->sample(i);
        acc += touch(s.input_ids) + touch(s.attention_mask) + touch(s.loss_mask) + touch(s.aux_hidden_states) +
               touch(s.position_mask);
        if (s.target_probs) acc += touch(*s.target_probs);
        if (s.target_probs_values) acc += touch(*s.target_probs_values) + touch(*s.target_probs_indices);
        const Record r = reader->read(i);  // a top k naming one id twice throws FormatError
        r.check("fuzz");
        if (r.tokens() != info.tokens || !r.target_probs || r.hidden_states.dim() != 0) __builtin_trap();
        acc += touch(*r.target_probs) + touch(r.input_ids) + touch(*r.loss_mask);
      } catch (const Error&) {
      }
    }
  } catch (const Error&) {
  }
  fuzz::g_sink = acc;
  return 0;
}
