// .eks: eaglekit's compressed shard of hidden-state records. Each tensor is cut into
// blocks of rows (tokens), each block byte-plane shuffled (or fp8-quantized) and stored as
// its own zstd frame with an xxh3-64 checksum of its decoded bytes, so one record, or the
// first N tokens of one, decodes without touching the rest of the shard. A footer index
// found through a fixed-size trailer describes every record; opening a shard reads only
// the trailer and the index. A shard may also state file facts (formats/format.h FileFacts:
// the aux layer ids, and the draft vocabulary of records that store the target's
// distribution instead of a last hidden state, as NeMo AutoModel's EAGLE-3 cache does).
// Layout also in docs/formats.md.
//
// Byte layout (all integers little-endian):
//
//   offset        size  field
//   ------------  ----  --------------------------------------------------------------
//   0             8     magic "EKSHARD1"
//   8             2     u16 version (1)
//   10            2     u16 flags: bit 0 (1) = index entries hold hidden_norm; bit 1 (2) =
//                       the index starts with a facts block. A reader refuses other bits,
//                       so a build that predates a bit refuses a shard that sets it instead
//                       of misreading it. Each bit is set only when needed (some record
//                       states its norm form; the writer was given file facts), so shards
//                       without that are byte for byte what older builds wrote and read.
//   12            4     u32 reserved (0)
//   16            ...   data: the zstd frames of every block, record after record, no
//                       padding. A frame records its content size in its header.
//   index_offset  ...   index (below), index_size bytes
//   size - 32     8     u64 index_offset (>= 16)
//   size - 24     8     u64 index_size (index_offset + index_size == size - 32)
//   size - 16     8     u64 XXH3_64bits(index bytes), seed 0
//   size - 8      8     trailer magic "EKSINDEX"
//
// Index:
//   facts block, only when header flag 2 is set (offsets from the block's start; A aux
//   layer ids, Vd draft tokens):
//     0        u32 facts_size    bytes of the block after this field: 5 + 8A, or with a
//                                target vocabulary 33 + 8A + 4Vd
//     4        u32 aux_layer_count  A (0: not stated)
//     8        i64 aux_layer_ids[A]  HF hidden_states indices (>= 0) of the layers that
//                                aux_hidden_states holds side by side (FileFacts)
//     8+8A     u8  vocabulary    0 none, 1 a target vocabulary follows:
//     9+8A     i64 target_vocab_size  V (1 .. 2^32)
//     17+8A    i64 topk          the producer kept the top k per position (0: all; < Vd)
//     25+8A    i64 target_hidden_size  H of the records carrying target_probs (0: none yet)
//     33+8A    u32 draft_vocab_size  Vd (>= 1)
//     37+8A    u32 selected[Vd]  draft id i is target id selected[i] (< V)
//   u32 record_count
//   record_count times:
//     u16 id_len, then id_len bytes: conversation id (UTF-8, no terminator)
//     u64 data_offset    first byte of the record's frames (>= 16)
//     u64 data_size      bytes of its frames (data_offset + data_size <= index_offset)
//     i64 tokens         T
//     u8  codec          0 "zstd" (lossless), 1 "fp8" (hidden/aux lossy, rest lossless)
//     u8  hidden_norm    only when header flag 1 is set: 0 not stated, 1 post-norm,
//                        2 pre-norm (Record::hidden_states_prenorm)
//     u8  tensor_count   3 or 4
//     tensor_count times, in role order:
//       u8  role         0 input_ids, 1 hidden_states, 2 aux_hidden_states, 3 loss_mask,
//                        4 target_probs (0 and 2 required, then 1 or 4: a record of hidden
//                        states or one of stored target distributions, [T, Vd] in aux's
//                        dtype, only in a shard whose facts state a target vocabulary, and
//                        then in every record of it; 3 optional; each at most once)
//       u8  dtype        0 bool, 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float16,
//                        7 bfloat16, 8 float32, 9 float64 (dtype of the decoded tensor)
//       u8  transform    0 none, 1 byte planes, 2 fp8 e4m3 with per-row fp32 scales
//       u8  ndim         1 or 2; shape[0] == T
//       i64 shape[ndim]
//       u32 rows_per_block (>= 1)
//       u32 block_count  == ceil(shape[0] / rows_per_block)
//       block_count times (20 bytes):
//         u64 offset     of the block's zstd frame, relative to data_offset
//         u32 stored_size  bytes of the frame (offset + stored_size <= data_size)
//         u64 xxh3       XXH3_64bits of the block's decoded tensor bytes: its rows, row-major,
//                        little-endian, in `dtype`, exactly what a reader returns
//
// Block payload (what the zstd frame decodes to), for a block of R rows of row width C
// elements of E bytes:
//   transform 0: the R*C*E tensor bytes as they are (E == 1: bool, uint8, int8).
//   transform 1: E planes of R*C bytes, most significant byte first: for bf16 the first
//                plane is sign + 7 exponent bits (compressible), the second the mantissa.
//   transform 2: R f32 scales, then R*C e4m3fn codes (formats/codec.h); value = code *
//                scale[row], rounded to `dtype`. Only hidden/aux of codec fp8 use it;
//                target_probs is always lossless (transform 1), whatever the codec.
//
// Readers check every count and offset against the file before allocating; a block's
// decoded size is also checked against the frame header and against what zstd can expand
// stored_size bytes to. Damage inside one record (a bad offset, a frame that does not
// decode, a checksum mismatch) makes only that record fail, with an error naming the shard,
// the record number and its conversation id; the other records stay readable. Damage to the
// facts block fails the open, naming the shard, the byte offset and the field.
//
// Thread safety: EksReader is immutable after open; read()/read_prefix()/verify_record()
// may run concurrently. encode_eks_record() is thread-safe. EksWriter is single-threaded.
// Errors: FormatError / ChecksumError / UnsupportedError / IoError (formats/error.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "formats/format.h"
#include "formats/names.h"

namespace eaglekit {

class ByteSource;
class AtomicFile;

enum class EksCodec : std::uint8_t { kZstd = 0, kFp8 = 1 };
enum class EksRole : std::uint8_t {
  kInputIds = 0,
  kHiddenStates = 1,
  kAuxHiddenStates = 2,
  kLossMask = 3,
  kTargetProbs = 4
};
enum class EksTransform : std::uint8_t { kNone = 0, kBytePlanes = 1, kFp8RowScaled = 2 };

inline constexpr NameTable<EksCodec, 2> kEksCodecNames{{{EksCodec::kZstd, "zstd"}, {EksCodec::kFp8, "fp8"}}};
std::string_view eks_codec_name(EksCodec c);  // kEksCodecNames
std::optional<EksCodec> parse_eks_codec(std::string_view name);
std::string_view eks_role_name(EksRole r);    // "input_ids", ...

constexpr std::uint64_t kEksHeaderSize = 16;
// Header flags (bytes [10, 12)).
constexpr std::uint16_t kEksFlagHiddenNorm = 1;
constexpr std::uint16_t kEksFlagFacts = 2;
constexpr std::uint64_t kEksTrailerSize = 32;
constexpr std::size_t kEksDefaultBlockBytes = 256 * 1024;

struct EksBlock {
  std::uint64_t offset = 0;  // relative to the record's data_offset
  std::uint32_t stored_size = 0;
  std::uint64_t xxh3 = 0;
};

struct EksTensorEntry {
  EksRole role = EksRole::kInputIds;
  DType dtype = DType::kInt64;
  EksTransform transform = EksTransform::kNone;
  std::vector<std::int64_t> shape;
  std::uint32_t rows_per_block = 1;
  std::vector<EksBlock> blocks;

  std::uint64_t row_elements() const;  // product of shape[1:]
  std::uint64_t row_bytes() const { return row_elements() * dtype_size(dtype); }
  // Rows in block b (the last one may be short).
  std::uint64_t block_rows(std::size_t b) const;
  // Bytes the block's zstd frame decodes to (depends on the transform).
  std::uint64_t payload_bytes(std::size_t b) const;
};

struct EksRecordEntry {
  std::string conversation_id;
  std::uint64_t data_offset = 0;
  std::uint64_t data_size = 0;
  std::int64_t tokens = 0;
  EksCodec codec = EksCodec::kZstd;
  std::optional<bool> hidden_states_prenorm;  // hidden_norm: nullopt 0, false 1, true 2
  std::vector<EksTensorEntry> tensors;  // in role order

  const EksTensorEntry* tensor(EksRole r) const;  // nullptr when absent
};

struct EksEncodeOptions {
  EksCodec codec = EksCodec::kZstd;
  int level = 3;
  // Decoded bytes per block, rounded to whole rows (at least one row per block). Smaller
  // blocks make prefix reads touch fewer bytes and compress slightly worse.
  std::size_t block_bytes = kEksDefaultBlockBytes;
};

// A record compressed and ready to append to a shard. entry.data_offset is 0 until a
// writer places it.
struct EksEncodedRecord {
  EksRecordEntry entry;
  std::vector<std::uint8_t> data;  // the frames, block offsets relative to its start
  std::uint64_t raw_bytes = 0;     // decoded size of all tensors
  std::int64_t target_hidden_size = 0;  // Record::target_hidden_size (with target_probs)
};

// Checks and compresses one record (blocks in parallel with TBB): input_ids, hidden_states or
// target_probs, aux_hidden_states, loss_mask. Throws FormatError for a record that fails
// Record::check, UsageError for options that cannot apply (fp8 of float64, a bad level).
EksEncodedRecord encode_eks_record(const Record& r, const EksEncodeOptions& opts);

// Validates encode options; throws UsageError naming the bad value.
void check_eks_options(const EksEncodeOptions& opts);

class EksWriter final : public RecordWriter {
 public:
  // Creates "DIR/.NAME.tmp.*" at once (IoError if it cannot).
  EksWriter(std::string path, EksEncodeOptions opts);
  ~EksWriter() override;  // removes the temp file unless finish() returned
  EksWriter(const EksWriter&) = delete;
  EksWriter& operator=(const EksWriter&) = delete;

  // Keeps both facts (written as the facts block by finish()); returns none. Call before the
  // first add (Error after it). UsageError for facts no shard can hold (a negative layer id,
  // a selected id outside the target vocabulary, more than 2^32 of anything).
  std::vector<std::string> set_facts(const FileFacts& facts) override;
  // add/add_encoded throw UsageError, adding nothing, for a record with target_probs when no
  // target vocabulary was set, one whose target_probs width is not the vocabulary's size or
  // whose target_hidden_size differs from an earlier one's, and a record of hidden states
  // when a target vocabulary was set (a shard holds one kind).
  void add(const Record& r) override;
  // Appends a record encoded elsewhere (e.g. on another thread).
  void add_encoded(EksEncodedRecord rec);
  // Writes index and trailer, then renames the temp file into place.
  void finish() override;

  std::size_t size() const;              // records added
  std::uint64_t bytes_written() const;   // header + data so far (index not yet counted)
  const std::string& path() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct EksReadOptions {
  // Check each decoded block against its xxh3 (about 3% of decode time). Off: trust the
  // bytes (zstd still rejects frames that do not decode).
  bool verify_checksums = true;
};

class EksReader final : public RecordReader {
 public:
  // Maps the file and reads trailer + index. Throws IoError, FormatError (not an .eks
  // shard, truncated, damaged trailer or index), ChecksumError (index checksum),
  // UnsupportedError (newer version).
  static std::unique_ptr<EksReader> open(const std::string& path, EksReadOptions opts = {});
  // Same over bytes already in memory (name is used in messages).
  static std::unique_ptr<EksReader> open(std::shared_ptr<const ByteSource> src,
                                         EksReadOptions opts = {});
  ~EksReader() override;

  Format format() const override { return Format::kEks; }
  const std::string& path() const override;
  std::size_t size() const override;
  RecordInfo info(std::size_t i) const override;
  // Decodes only the blocks that hold the first max_rows rows. Throws FormatError /
  // ChecksumError naming shard, record number and conversation id.
  Record read_prefix(std::size_t i, std::int64_t max_rows) const override;
  std::optional<std::size_t> find(std::string_view conversation_id) const override;
  // The facts block (empty without header flag 2).
  FileFacts facts() const override;
  // H of the records that carry target_probs, as the facts block states it (0 without one).
  std::int64_t target_hidden_size() const;

  // The index entry of record i, as stored.
  const EksRecordEntry& entry(std::size_t i) const;
  // Decodes every block of record i and checks every checksum (whatever the options say).
  // Throws like read().
  void verify_record(std::size_t i) const;
  std::uint64_t file_size() const;

 private:
  EksReader();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Registry entry points (formats/registry.cpp).
std::unique_ptr<RecordReader> open_eks_reader(const std::string& path);
// opts.codec "zstd" | "fp8", opts.level a zstd level. Throws UsageError otherwise.
std::unique_ptr<RecordWriter> create_eks_writer(const std::string& path, const WriterOptions& opts);

}  // namespace eaglekit
