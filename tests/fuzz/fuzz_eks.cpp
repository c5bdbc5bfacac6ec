// libFuzzer harness: .eks shards (formats/eks_format.h) from memory: trailer, index, and
// every record's frames (a prefix, the whole record, verify). The index checksum is
// recomputed over the mutated index first, so that mutations reach the index parser
// instead of stopping at the checksum; block checksums are left as they are (decoding
// happens before they are checked).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "formats/byte_source.h"
#include "formats/bytes.h"
#include "formats/codec.h"
#include "formats/eks_format.h"
#include "formats/error.h"
#include "formats/record.h"
#include "tests/fuzz/fuzz_common.h"

namespace {

void fix_index_checksum(std::vector<std::uint8_t>& b) {
  using eaglekit::kEksHeaderSize;
  using eaglekit::kEksTrailerSize;
  if (b.size() < kEksHeaderSize + kEksTrailerSize) return;
  std::uint8_t* t = b.data() + b.size() - kEksTrailerSize;
  const std::uint64_t off = eaglekit::load_le64(t), len = eaglekit::load_le64(t + 8);
  const std::uint64_t end = b.size() - kEksTrailerSize;
  if (off > end || len != end - off) return;
  const std::uint64_t h = eaglekit::codec::xxh3_64(b.data() + off, static_cast<std::size_t>(len));
  for (int i = 0; i < 8; ++i) t[16 + i] = static_cast<std::uint8_t>(h >> (8 * i));
}

std::uint64_t touch_record(const eaglekit::Record& r) {
  using eaglekit::fuzz::touch;
  std::uint64_t acc = r.conversation_id.size();
  acc += touch(r.input_ids) + touch(r.aux_hidden_states);
  // A record of stored target distributions has no hidden states (an empty tensor, no data).
  if (r.hidden_states.dim() > 0) acc += touch(r.hidden_states);
  if (r.loss_mask) acc += touch(*r.loss_mask);
  if (r.target_probs) acc += touch(*r.target_probs) + static_cast<std::uint64_t>(r.target_hidden_size);
  return acc;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace eaglekit;
  std::vector<std::uint8_t> bytes(data, data + size);
  fix_index_checksum(bytes);
  std::uint64_t acc = 0;
  try {
    const auto reader = EksReader::open(ByteSource::from_bytes(std::move(bytes), "fuzz.eks"));
    acc += reader->file_size();
    const FileFacts facts = reader->facts();
    acc += facts.aux_layer_ids.size() + (facts.target_vocabulary ? facts.target_vocabulary->selected.size() : 0);
    for (std::size_t i = 0; i < reader->size() && i < 64; ++i) {
      const EksRecordEntry& e = reader->entry(i);
      acc += e.tensors.size();
      if (!reader->find(e.conversation_id)) __builtin_trap();
      try {
        acc += reader->info(i).tokens;
        acc += touch_record(reader->read_prefix(i, 1));
        acc += touch_record(reader->read(i));
      } catch (const Error&) {
      }
      try {
        reader->verify_record(i);
      } catch (const Error&) {
      }
    }
  } catch (const Error&) {
  }
  fuzz::g_sink = acc;
  return 0;
}
