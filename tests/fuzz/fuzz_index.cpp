// libFuzzer harness: the dataset index file (formats/index_format.h,
// DatasetIndex::from_source) from memory, and every accessor over it (entries, files, roots,
// lookups, and lib/index.h's text and JSON dumps).
// The trailing XXH3 checksum is recomputed over the mutated bytes first, so that mutations
// reach the section and entry checks instead of stopping at the checksum.
#include <xxhash.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "formats/byte_source.h"
#include "formats/error.h"
#include "lib/index.h"
#include "tests/fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace eaglekit;
  std::vector<std::uint8_t> bytes(data, data + size);
  if (bytes.size() >= 16) {
    const std::uint64_t h = XXH3_64bits(bytes.data(), bytes.size() - 8);
    for (int i = 0; i < 8; ++i) bytes[bytes.size() - 8 + i] = static_cast<std::uint8_t>(h >> (8 * i));
  }
  std::uint64_t acc = 0;
  try {
    const DatasetIndex index = DatasetIndex::from_source(
        ByteSource::from_bytes(std::move(bytes), "fuzz.ekindex"));
    acc += index.bad_count() + index.roots().size();
    for (std::size_t i = 0; i < index.file_count(); ++i) {
      try {
        acc += index.file(i).path.size();
      } catch (const Error&) {
      }
    }
    for (std::size_t i = 0; i < index.size(); ++i) {
      try {
        const IndexEntry e = index.entry(i);
        acc += e.tokens + e.conversation_id.size() + index.conversation_id(i).size();
        acc += index.find(e.conversation_id).size();
        acc += index.sorted_entry(i);
      } catch (const Error&) {
      }
    }
    acc += index.duplicate_ids().size();
    acc += index_to_text(index).size();
    acc += index_to_json(index).size();
  } catch (const Error&) {
  }
  fuzz::g_sink = acc;
  return 0;
}
