#include "formats/eks_format.h"

#include <tbb/parallel_for.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <unordered_map>

#include "formats/atomic_file.h"
#include "formats/byte_source.h"
#include "formats/bytes.h"
#include "formats/codec.h"
#include "formats/error.h"

namespace eaglekit {

namespace {

constexpr char kMagic[8] = {'E', 'K', 'S', 'H', 'A', 'R', 'D', '1'};
constexpr char kTrailerMagic[8] = {'E', 'K', 'S', 'I', 'N', 'D', 'E', 'X'};
constexpr std::uint16_t kVersion = 1;
// Header flag 1: every index entry holds a hidden_norm byte after its codec byte. Set only
// when some record states its norm form, so other shards stay readable by older builds.
constexpr std::uint16_t kFlagHiddenNorm = kEksFlagHiddenNorm;
// Header flag 2: the index starts with the facts block. Set only when the writer was given
// file facts; a build that predates it refuses the shard (unknown flag) rather than read
// records of stored distributions as records of hidden states.
constexpr std::uint16_t kFlagFacts = kEksFlagFacts;
constexpr std::uint16_t kKnownFlags = kFlagHiddenNorm | kFlagFacts;
// Bounds of the facts block's numbers: ids are stored as u32.
constexpr std::int64_t kMaxTargetVocab = std::int64_t{1} << 32;
constexpr std::int64_t kMaxFactsHiddenSize = std::int64_t{1} << 31;
constexpr std::uint64_t kBlockEntryBytes = 20;
// id_len + data_offset + data_size + tokens + codec + tensor_count.
constexpr std::uint64_t kMinRecordEntryBytes = 2 + 8 + 8 + 8 + 1 + 1;
// role, dtype, transform, ndim, rows_per_block, block_count.
constexpr std::uint64_t kMinTensorEntryBytes = 4 + 4 + 4;
// A zstd block decodes to at most 128 KiB and takes at least 4 bytes (an RLE block), so a
// frame of n bytes never decodes to more than (n / 4 + 1) * 128 KiB.
constexpr std::uint64_t kZstdMaxBlock = 128 * 1024;
// No single tensor of a record is allowed past 2^48 bytes: far above any real record,
// far below where size arithmetic could overflow.
constexpr std::uint64_t kMaxTensorBytes = 1ull << 48;

// The file's dtype codes, fixed here so that reordering enum DType never changes files.
constexpr DType kDTypeCodes[] = {DType::kBool,    DType::kUInt8,   DType::kInt8,
                                 DType::kInt16,   DType::kInt32,   DType::kInt64,
                                 DType::kFloat16, DType::kBFloat16, DType::kFloat32,
                                 DType::kFloat64};

std::uint8_t dtype_code(DType t) {
  for (std::uint8_t i = 0; i < std::size(kDTypeCodes); ++i)
    if (kDTypeCodes[i] == t) return i;
  throw Error("eks: dtype without a file code");
}

std::optional<DType> dtype_from_code(std::uint8_t c) {
  if (c >= std::size(kDTypeCodes)) return std::nullopt;
  return kDTypeCodes[c];
}

std::string hex64(std::uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%016" PRIx64, v);
  return buf;
}

std::string record_field(std::size_t i, const std::string& id) {
  return "record " + std::to_string(i) + " ('" + id + "')";
}

std::string tensor_field(std::size_t i, const std::string& id, const EksTensorEntry& t) {
  return record_field(i, id) + " " + std::string(eks_role_name(t.role));
}

std::string block_field(std::size_t i, const std::string& id, const EksTensorEntry& t,
                        std::size_t b) {
  return tensor_field(i, id, t) + " block " + std::to_string(b);
}

// a * b, or nullopt on overflow.
std::optional<std::uint64_t> mul_checked(std::uint64_t a, std::uint64_t b) {
  std::uint64_t r;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

struct Scratch {
  std::vector<std::uint8_t> a;
  std::vector<std::uint8_t> b;
  std::vector<float> scales;
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

std::uint8_t* grow(std::vector<std::uint8_t>& v, std::uint64_t n) {
  if (v.size() < n) v.resize(static_cast<std::size_t>(n));
  return v.data();
}

// Why a record cannot be read (its index entry is inconsistent with the file).
struct Problem {
  std::uint64_t offset = 0;
  std::string field;
  std::string detail;
};

}  // namespace

// ---------------------------------------------------------------------------------------
// Names and entries

std::string_view eks_codec_name(EksCodec c) { return name_in(kEksCodecNames, c); }

std::optional<EksCodec> parse_eks_codec(std::string_view name) { return value_in(kEksCodecNames, name); }

std::string_view eks_role_name(EksRole r) {
  switch (r) {
    case EksRole::kInputIds: return "input_ids";
    case EksRole::kHiddenStates: return "hidden_states";
    case EksRole::kAuxHiddenStates: return "aux_hidden_states";
    case EksRole::kLossMask: return "loss_mask";
    case EksRole::kTargetProbs: return "target_probs";
  }
  return "?";
}

std::uint64_t EksTensorEntry::row_elements() const {
  std::uint64_t n = 1;
  for (std::size_t d = 1; d < shape.size(); ++d) n *= static_cast<std::uint64_t>(shape[d]);
  return n;
}

std::uint64_t EksTensorEntry::block_rows(std::size_t b) const {
  const auto rows = static_cast<std::uint64_t>(shape.empty() ? 0 : shape[0]);
  const std::uint64_t begin = static_cast<std::uint64_t>(b) * rows_per_block;
  return begin >= rows ? 0 : std::min<std::uint64_t>(rows_per_block, rows - begin);
}

std::uint64_t EksTensorEntry::payload_bytes(std::size_t b) const {
  const std::uint64_t r = block_rows(b);
  if (transform == EksTransform::kFp8RowScaled) return r * (4 + row_elements());
  return r * row_bytes();
}

const EksTensorEntry* EksRecordEntry::tensor(EksRole r) const {
  for (const auto& t : tensors)
    if (t.role == r) return &t;
  return nullptr;
}

// ---------------------------------------------------------------------------------------
// Encoding

void check_eks_options(const EksEncodeOptions& opts) {
  if (opts.level < codec::zstd_min_level() || opts.level > codec::zstd_max_level() ||
      opts.level == 0)
    throw UsageError("zstd level " + std::to_string(opts.level) + " is out of range (1.." +
                     std::to_string(codec::zstd_max_level()) + ")");
  if (opts.block_bytes == 0) throw UsageError("eks block size must be positive");
}

namespace {

struct EncodedBlock {
  std::vector<std::uint8_t> frame;
  std::uint64_t xxh3 = 0;
};

EncodedBlock encode_block(const EksTensorEntry& te, const std::uint8_t* src, std::uint64_t rows,
                          int level) {
  EncodedBlock out;
  const std::uint64_t elems = rows * te.row_elements();
  const std::uint64_t bytes = rows * te.row_bytes();
  Scratch& s = scratch();
  switch (te.transform) {
    case EksTransform::kNone:
      codec::zstd_compress_append(src, bytes, codec::ZstdSettings{level, {}, false}, out.frame);
      out.xxh3 = codec::xxh3_64(src, bytes);
      break;
    case EksTransform::kBytePlanes: {
      std::uint8_t* planes = grow(s.a, bytes);
      const std::size_t es = dtype_size(te.dtype);
      codec::split_byte_planes(src, elems, es, planes);
      codec::ZstdSettings zs{level, std::vector<std::size_t>(es, elems), is_floating(te.dtype)};
      codec::zstd_compress_append(planes, bytes, zs, out.frame);
      out.xxh3 = codec::xxh3_64(src, bytes);
      break;
    }
    case EksTransform::kFp8RowScaled: {
      const std::uint64_t cols = te.row_elements();
      std::uint8_t* payload = grow(s.a, rows * (4 + cols));
      s.scales.resize(rows);
      codec::fp8_quantize_rows(src, te.dtype, rows, cols, s.scales.data(), payload + 4 * rows);
      std::memcpy(payload, s.scales.data(), 4 * rows);
      codec::ZstdSettings zs{level, {4 * rows, rows * cols}, true};
      codec::zstd_compress_append(payload, rows * (4 + cols), zs, out.frame);
      // The checksum covers what a reader will return: the dequantized values.
      std::uint8_t* decoded = grow(s.b, bytes);
      codec::fp8_dequantize_rows(s.scales.data(), payload + 4 * rows, rows, cols, te.dtype,
                                 decoded);
      out.xxh3 = codec::xxh3_64(decoded, bytes);
      break;
    }
  }
  if (out.frame.size() > std::numeric_limits<std::uint32_t>::max())
    throw Error("eks: a compressed block exceeds 4 GiB; rows are too wide");
  return out;
}

void encode_tensor(EksRole role, const HostTensor& tensor, const EksEncodeOptions& opts,
                   EksEncodedRecord& rec) {
  const HostTensor t = tensor.contiguous();
  EksTensorEntry te;
  te.role = role;
  te.dtype = t.dtype;
  te.shape = t.shape;
  const bool lossy = opts.codec == EksCodec::kFp8 &&
                     (role == EksRole::kHiddenStates || role == EksRole::kAuxHiddenStates);
  if (lossy) {
    if (!codec::fp8_supported(t.dtype))
      throw UsageError("fp8 codec: " + std::string(eks_role_name(role)) + " is " +
                       std::string(dtype_name(t.dtype)) +
                       "; only bfloat16, float16 and float32 can be quantized");
    te.transform = EksTransform::kFp8RowScaled;
  } else {
    te.transform = t.itemsize() > 1 ? EksTransform::kBytePlanes : EksTransform::kNone;
  }
  const std::uint64_t rows = static_cast<std::uint64_t>(t.shape[0]);
  const std::uint64_t row_bytes = std::max<std::uint64_t>(te.row_bytes(), 1);
  std::uint64_t rpb = std::max<std::uint64_t>(opts.block_bytes / row_bytes, 1);
  rpb = std::min<std::uint64_t>(rpb, std::max<std::uint64_t>(rows, 1));
  rpb = std::min<std::uint64_t>(rpb, std::numeric_limits<std::uint32_t>::max());
  te.rows_per_block = static_cast<std::uint32_t>(rpb);
  const std::size_t nblocks = static_cast<std::size_t>((rows + rpb - 1) / rpb);

  std::vector<EncodedBlock> blocks(nblocks);
  tbb::parallel_for(std::size_t{0}, nblocks, [&](std::size_t b) {
    blocks[b] = encode_block(te, t.data + b * rpb * te.row_bytes(), te.block_rows(b), opts.level);
  });
  for (auto& b : blocks) {
    EksBlock eb;
    eb.offset = rec.data.size();
    eb.stored_size = static_cast<std::uint32_t>(b.frame.size());
    eb.xxh3 = b.xxh3;
    rec.data.insert(rec.data.end(), b.frame.begin(), b.frame.end());
    te.blocks.push_back(eb);
  }
  rec.raw_bytes += t.nbytes();
  rec.entry.tensors.push_back(std::move(te));
}

}  // namespace

EksEncodedRecord encode_eks_record(const Record& r, const EksEncodeOptions& opts) {
  check_eks_options(opts);
  r.check("conversation '" + r.conversation_id + "'");
  if (r.conversation_id.size() > std::numeric_limits<std::uint16_t>::max())
    throw FormatError("conversation '" + r.conversation_id.substr(0, 40) + "...'", std::nullopt,
                      "conversation_id",
                      std::to_string(r.conversation_id.size()) +
                          " bytes; .eks allows at most 65535");
  EksEncodedRecord rec;
  rec.entry.conversation_id = r.conversation_id;
  rec.entry.tokens = r.tokens();
  rec.entry.codec = opts.codec;
  rec.entry.hidden_states_prenorm = r.hidden_states_prenorm;
  // In role order; a record of stored target distributions has target_probs (always
  // lossless: encode_tensor quantizes hidden and aux only) instead of hidden_states.
  encode_tensor(EksRole::kInputIds, r.input_ids, opts, rec);
  if (!r.target_probs) encode_tensor(EksRole::kHiddenStates, r.hidden_states, opts, rec);
  encode_tensor(EksRole::kAuxHiddenStates, r.aux_hidden_states, opts, rec);
  if (r.loss_mask) encode_tensor(EksRole::kLossMask, *r.loss_mask, opts, rec);
  if (r.target_probs) {
    encode_tensor(EksRole::kTargetProbs, *r.target_probs, opts, rec);
    rec.target_hidden_size = r.target_hidden_size;
  }
  return rec;
}

// ---------------------------------------------------------------------------------------
// Writer

struct EksWriter::Impl {
  std::string path;
  EksEncodeOptions opts;
  std::unique_ptr<AtomicFile> file;
  std::vector<EksRecordEntry> entries;
  FileFacts facts;
  std::int64_t target_hidden = 0;  // of the records with target_probs added so far
  bool finished = false;

  void check(const EksEncodedRecord& rec) const;
};

namespace {

std::string eks_ids_text(const std::vector<std::int64_t>& ids) {
  std::string s = "[";
  for (std::size_t i = 0; i < ids.size(); ++i) s += (i ? ", " : "") + std::to_string(ids[i]);
  return s + "]";
}

}  // namespace

std::vector<std::string> EksWriter::set_facts(const FileFacts& facts) {
  const std::string& p = impl_->path;
  if (impl_->finished || !impl_->entries.empty()) throw Error(p + ": set_facts() after add() or finish()");
  if (facts.aux_layer_ids.size() > std::numeric_limits<std::uint32_t>::max())
    throw UsageError(p + ": " + std::to_string(facts.aux_layer_ids.size()) + " aux layer ids; .eks holds at most 2^32 - 1");
  for (const std::int64_t id : facts.aux_layer_ids)
    if (id < 0)
      throw UsageError(p + ": aux layer ids " + eks_ids_text(facts.aux_layer_ids) +
                       " hold a negative id; they are HF hidden_states indices (>= 0)");
  if (const auto& v = facts.target_vocabulary) {
    const auto vd = static_cast<std::int64_t>(v->selected.size());
    if (v->target_vocab_size < 1 || v->target_vocab_size > kMaxTargetVocab)
      throw UsageError(p + ": target_vocab_size " + std::to_string(v->target_vocab_size) + " is not in 1 .. 2^32");
    if (vd < 1 || vd >= kMaxTargetVocab)
      throw UsageError(p + ": a target vocabulary of " + std::to_string(vd) + " draft tokens (1 .. 2^32 - 1)");
    if (v->topk < 0 || v->topk >= vd)
      throw UsageError(p + ": topk " + std::to_string(v->topk) + " is not in 0 .. " + std::to_string(vd - 1) +
                       " (0: the full distribution)");
    for (std::size_t i = 0; i < v->selected.size(); ++i)
      if (v->selected[i] < 0 || v->selected[i] >= v->target_vocab_size)
        throw UsageError(p + ": draft id " + std::to_string(i) + " selects target id " + std::to_string(v->selected[i]) +
                         ", outside the target vocabulary of " + std::to_string(v->target_vocab_size));
  }
  impl_->facts = facts;
  return {};
}

void EksWriter::Impl::check(const EksEncodedRecord& rec) const {
  const EksRecordEntry& e = rec.entry;
  const auto* probs = e.tensor(EksRole::kTargetProbs);
  const std::string who = path + ": conversation '" + e.conversation_id + "'";
  if (!probs) {
    if (facts.target_vocabulary)
      throw UsageError(who + " holds hidden states, but the shard's facts state a target vocabulary: its records "
                       "store the target's distribution instead, every one of them (write the two kinds to two shards)");
    return;
  }
  if (!facts.target_vocabulary)
    throw UsageError(who + " stores the target's distribution over a draft vocabulary (target_probs), but no target "
                     "vocabulary was set (EksWriter::set_facts, before the first record): without it the "
                     "distribution's columns name no token. convert passes the source's facts");
  const auto vd = static_cast<std::int64_t>(facts.target_vocabulary->selected.size());
  if (probs->shape.size() != 2 || probs->shape[1] != vd)
    throw UsageError(who + ": target_probs is " + std::to_string(probs->shape.size() == 2 ? probs->shape[1] : 0) +
                     " wide, but the shard's target vocabulary has " + std::to_string(vd) + " draft tokens");
  if (rec.target_hidden_size <= 0 || rec.target_hidden_size > kMaxFactsHiddenSize)
    throw UsageError(who + ": target_hidden_size " + std::to_string(rec.target_hidden_size) + " is not in 1 .. 2^31");
  if (target_hidden != 0 && rec.target_hidden_size != target_hidden)
    throw UsageError(who + ": hidden size " + std::to_string(rec.target_hidden_size) + " differs from " +
                     std::to_string(target_hidden) + ", that of the shard's earlier records (one H a shard)");
}

EksWriter::EksWriter(std::string path, EksEncodeOptions opts) : impl_(std::make_unique<Impl>()) {
  check_eks_options(opts);
  impl_->path = std::move(path);
  impl_->opts = opts;
  impl_->file = std::make_unique<AtomicFile>(impl_->path);
  ByteWriter h;
  h.bytes(kMagic, 8);
  h.u16(kVersion);
  h.u16(0);
  h.u32(0);
  impl_->file->write(h.data(), h.size());
}

EksWriter::~EksWriter() = default;

void EksWriter::add(const Record& r) {
  // One dtype for hidden and aux in a record's blocks.
  add_encoded(encode_eks_record(r.with_common_hidden_dtype(), impl_->opts));
}

void EksWriter::add_encoded(EksEncodedRecord rec) {
  if (impl_->finished) throw Error(impl_->path + ": add() after finish()");
  if (impl_->entries.size() >= std::numeric_limits<std::uint32_t>::max())
    throw Error(impl_->path + ": too many records for one shard");
  impl_->check(rec);
  if (rec.entry.tensor(EksRole::kTargetProbs)) impl_->target_hidden = rec.target_hidden_size;
  rec.entry.data_offset = impl_->file->tell();
  rec.entry.data_size = rec.data.size();
  impl_->file->write(rec.data.data(), rec.data.size());
  impl_->entries.push_back(std::move(rec.entry));
}

void EksWriter::finish() {
  if (impl_->finished) throw Error(impl_->path + ": finish() called twice");
  const bool norm_bytes =
      std::any_of(impl_->entries.begin(), impl_->entries.end(),
                  [](const EksRecordEntry& e) { return e.hidden_states_prenorm.has_value(); });
  const FileFacts& facts = impl_->facts;
  ByteWriter w;
  if (!facts.empty()) {
    ByteWriter f;
    f.u32(static_cast<std::uint32_t>(facts.aux_layer_ids.size()));
    for (const std::int64_t id : facts.aux_layer_ids) f.i64(id);
    f.u8(facts.target_vocabulary ? 1 : 0);
    if (const auto& v = facts.target_vocabulary) {
      f.i64(v->target_vocab_size);
      f.i64(v->topk);
      f.i64(impl_->target_hidden);
      f.u32(static_cast<std::uint32_t>(v->selected.size()));
      for (const std::int64_t id : v->selected) f.u32(static_cast<std::uint32_t>(id));
    }
    if (f.size() > std::numeric_limits<std::uint32_t>::max())
      throw Error(impl_->path + ": the facts block exceeds 4 GiB");
    w.u32(static_cast<std::uint32_t>(f.size()));
    w.bytes(f);
  }
  w.u32(static_cast<std::uint32_t>(impl_->entries.size()));
  for (const auto& e : impl_->entries) {
    w.u16(static_cast<std::uint16_t>(e.conversation_id.size()));
    w.bytes(e.conversation_id.data(), e.conversation_id.size());
    w.u64(e.data_offset);
    w.u64(e.data_size);
    w.i64(e.tokens);
    w.u8(static_cast<std::uint8_t>(e.codec));
    if (norm_bytes) w.u8(!e.hidden_states_prenorm ? 0 : *e.hidden_states_prenorm ? 2 : 1);
    w.u8(static_cast<std::uint8_t>(e.tensors.size()));
    for (const auto& t : e.tensors) {
      w.u8(static_cast<std::uint8_t>(t.role));
      w.u8(dtype_code(t.dtype));
      w.u8(static_cast<std::uint8_t>(t.transform));
      w.u8(static_cast<std::uint8_t>(t.shape.size()));
      for (auto s : t.shape) w.i64(s);
      w.u32(t.rows_per_block);
      w.u32(static_cast<std::uint32_t>(t.blocks.size()));
      for (const auto& b : t.blocks) {
        w.u64(b.offset);
        w.u32(b.stored_size);
        w.u64(b.xxh3);
      }
    }
  }
  const std::uint64_t index_offset = impl_->file->tell();
  impl_->file->write(w.data(), w.size());
  ByteWriter t;
  t.u64(index_offset);
  t.u64(w.size());
  t.u64(codec::xxh3_64(w.data(), w.size()));
  t.bytes(kTrailerMagic, 8);
  impl_->file->write(t.data(), t.size());
  const std::uint16_t flags = (norm_bytes ? kFlagHiddenNorm : 0) | (facts.empty() ? 0 : kFlagFacts);
  if (flags != 0) {
    ByteWriter f;
    f.u16(flags);
    impl_->file->pwrite(f.data(), f.size(), 10);
  }
  impl_->file->commit();
  impl_->finished = true;
}

std::size_t EksWriter::size() const { return impl_->entries.size(); }
std::uint64_t EksWriter::bytes_written() const { return impl_->file->tell(); }
const std::string& EksWriter::path() const { return impl_->path; }

// ---------------------------------------------------------------------------------------
// Reader

struct EksReader::Impl {
  std::shared_ptr<const ByteSource> src;
  EksReadOptions opts;
  std::uint64_t index_offset = 0;
  std::vector<EksRecordEntry> records;
  std::vector<std::optional<Problem>> problems;
  std::unordered_map<std::string, std::size_t> by_id;  // first record of each id
  FileFacts facts;                 // the facts block (header flag 2)
  std::int64_t target_hidden = 0;  // its target_hidden_size

  void parse();
  void parse_facts(ByteCursor& c);
  std::optional<Problem> validate(std::size_t i, const EksRecordEntry& e) const;
  HostTensor decode(std::size_t i, const EksRecordEntry& e, const EksTensorEntry& t,
                    std::uint64_t rows, bool verify) const;
  Record read(std::size_t i, std::int64_t max_rows, bool verify) const;
};

EksReader::EksReader() : impl_(std::make_unique<Impl>()) {}
EksReader::~EksReader() = default;

std::unique_ptr<EksReader> EksReader::open(const std::string& path, EksReadOptions opts) {
  return open(ByteSource::open_file(path), opts);
}

std::unique_ptr<EksReader> EksReader::open(std::shared_ptr<const ByteSource> src,
                                           EksReadOptions opts) {
  std::unique_ptr<EksReader> r(new EksReader());
  r->impl_->src = std::move(src);
  r->impl_->opts = opts;
  r->impl_->parse();
  return r;
}

void EksReader::Impl::parse() {
  const ByteSource& s = *src;
  const std::string& name = s.name();
  const std::uint64_t size = s.size();
  if (size >= 8 && std::memcmp(s.data(), kMagic, 8) != 0)
    throw FormatError(name, 0, "magic", "not an .eks shard (the file does not start with 'EKSHARD1')");
  if (size < kEksHeaderSize + kEksTrailerSize)
    throw FormatError(name, 0, "header",
                      "file is " + std::to_string(size) +
                          " bytes, too short for an .eks shard (16-byte header + 32-byte "
                          "trailer): truncated");
  const std::uint8_t* h = s.data();
  const std::uint16_t version = load_le16(h + 8);
  if (version != kVersion)
    throw UnsupportedError(name, 8, "version",
                           ".eks version " + std::to_string(version) +
                               " (this build reads version 1)");
  const std::uint16_t flags = load_le16(h + 10);
  if ((flags & ~kKnownFlags) != 0)
    throw UnsupportedError(name, 10, "flags", "unknown header flags " + std::to_string(flags));
  const bool norm_bytes = (flags & kFlagHiddenNorm) != 0;

  const std::uint64_t trailer_at = size - kEksTrailerSize;
  const std::uint8_t* t = s.at(trailer_at, kEksTrailerSize, "trailer");
  if (std::memcmp(t + 24, kTrailerMagic, 8) != 0)
    throw FormatError(name, trailer_at, "trailer",
                      "no 'EKSINDEX' trailer at the end of the file: the shard is truncated, "
                      "was never finished, or its trailer is damaged");
  index_offset = load_le64(t);
  const std::uint64_t index_size = load_le64(t + 8);
  const std::uint64_t index_hash = load_le64(t + 16);
  if (index_offset < kEksHeaderSize || index_offset > trailer_at ||
      index_size != trailer_at - index_offset)
    throw FormatError(name, trailer_at, "trailer",
                      "index at byte " + std::to_string(index_offset) + " with " +
                          std::to_string(index_size) + " bytes does not end where the trailer "
                          "starts (byte " + std::to_string(trailer_at) + "): trailer damaged");
  const std::uint64_t actual = codec::xxh3_64(s.data() + index_offset, index_size);
  if (actual != index_hash)
    throw ChecksumError(name, index_offset, "index",
                        "xxh3 " + hex64(actual) + " does not match " + hex64(index_hash) +
                            " in the trailer: index or trailer damaged");

  ByteCursor c(s, index_offset, trailer_at, "index");
  if (flags & kFlagFacts) parse_facts(c);
  const std::uint32_t count = c.u32("index record_count");
  if (count > c.left() / kMinRecordEntryBytes)
    throw FormatError(name, c.pos() - 4, "index record_count",
                      std::to_string(count) + " records cannot fit in " +
                          std::to_string(index_size) + " index bytes");
  records.reserve(count);
  problems.reserve(count);
  for (std::uint32_t i = 0; i < count; ++i) {
    const std::string rf = "index entry " + std::to_string(i);
    EksRecordEntry e;
    std::optional<Problem> bad;
    auto note = [&](const std::string& field, const std::string& detail) {
      if (!bad) bad = Problem{c.pos(), field, detail};
    };
    const std::uint16_t id_len = c.u16(rf + " id length");
    const std::uint8_t* id = c.take(id_len, rf + " id");
    e.conversation_id.assign(reinterpret_cast<const char*>(id), id_len);
    const std::string where = record_field(i, e.conversation_id);
    e.data_offset = c.u64(where + " data_offset");
    e.data_size = c.u64(where + " data_size");
    e.tokens = c.i64(where + " tokens");
    const std::uint8_t codec_code = c.u8(where + " codec");
    if (codec_code > 1) note(where + " codec", "unknown codec " + std::to_string(codec_code));
    else e.codec = static_cast<EksCodec>(codec_code);
    if (norm_bytes) {
      const std::uint8_t norm = c.u8(where + " hidden_norm");
      if (norm > 2) note(where + " hidden_norm", "unknown value " + std::to_string(norm) + " (0, 1 or 2)");
      else if (norm > 0) e.hidden_states_prenorm = norm == 2;
    }
    const std::uint8_t ntensors = c.u8(where + " tensor_count");
    if (ntensors > c.left() / kMinTensorEntryBytes)
      throw FormatError(name, c.pos(), where + " tensor_count",
                        std::to_string(ntensors) + " tensors cannot fit in the index");
    for (std::uint8_t k = 0; k < ntensors; ++k) {
      const std::string tf = where + " tensor " + std::to_string(k);
      EksTensorEntry te;
      const std::uint8_t role = c.u8(tf + " role");
      const std::uint8_t dt = c.u8(tf + " dtype");
      const std::uint8_t tr = c.u8(tf + " transform");
      const std::uint8_t ndim = c.u8(tf + " ndim");
      if (role > 4) note(tf + " role", "unknown role " + std::to_string(role));
      else te.role = static_cast<EksRole>(role);
      if (auto d = dtype_from_code(dt)) te.dtype = *d;
      else note(tf + " dtype", "unknown dtype code " + std::to_string(dt));
      if (tr > 2) note(tf + " transform", "unknown transform " + std::to_string(tr));
      else te.transform = static_cast<EksTransform>(tr);
      const std::uint8_t* shape = c.take(8ull * ndim, tf + " shape");
      for (std::uint8_t d = 0; d < ndim; ++d)
        te.shape.push_back(static_cast<std::int64_t>(load_le64(shape + 8 * d)));
      te.rows_per_block = c.u32(tf + " rows_per_block");
      const std::uint32_t nblocks = c.u32(tf + " block_count");
      if (nblocks > c.left() / kBlockEntryBytes)
        throw FormatError(name, c.pos() - 4, tf + " block_count",
                          std::to_string(nblocks) + " blocks cannot fit in the index");
      te.blocks.resize(nblocks);
      for (auto& b : te.blocks) {
        const std::uint8_t* p = c.take(kBlockEntryBytes, tf + " block");
        b.offset = load_le64(p);
        b.stored_size = load_le32(p + 8);
        b.xxh3 = load_le64(p + 12);
      }
      e.tensors.push_back(std::move(te));
    }
    if (!bad) bad = validate(i, e);
    records.push_back(std::move(e));
    problems.push_back(std::move(bad));
  }
  if (c.left() != 0)
    throw FormatError(name, c.pos(), "index",
                      std::to_string(c.left()) + " bytes left after the last entry (index corrupt)");
  for (std::size_t i = 0; i < records.size(); ++i)
    by_id.emplace(records[i].conversation_id, i);
}

// The facts block at the start of the index (header flag 2): every count is checked against
// the block's bytes before anything is allocated, and every value against its range; damage
// fails the open, naming the field and its byte.
void EksReader::Impl::parse_facts(ByteCursor& c) {
  const std::string& name = src->name();
  const std::uint32_t size = c.u32("facts block facts_size");
  if (size > c.left())
    throw FormatError(name, c.pos() - 4, "facts block facts_size",
                      std::to_string(size) + " bytes, but the index has " + std::to_string(c.left()) +
                          " left (index corrupt)");
  ByteCursor f(*src, c.pos(), c.pos() + size, "facts block");
  c.skip(size, "facts block");
  const std::uint32_t layers = f.u32("facts block aux_layer_count");
  if (layers > f.left() / 8)
    throw FormatError(name, f.pos() - 4, "facts block aux_layer_count",
                      std::to_string(layers) + " ids cannot fit in the " + std::to_string(f.left()) +
                          " bytes left of the facts block");
  facts.aux_layer_ids.reserve(layers);
  for (std::uint32_t k = 0; k < layers; ++k) {
    const std::string field = "facts block aux_layer_ids[" + std::to_string(k) + "]";
    const std::int64_t id = f.i64(field);
    if (id < 0)
      throw FormatError(name, f.pos() - 8, field, "is " + std::to_string(id) + "; HF hidden_states indices are >= 0");
    facts.aux_layer_ids.push_back(id);
  }
  const std::uint8_t has_vocab = f.u8("facts block vocabulary");
  if (has_vocab > 1)
    throw FormatError(name, f.pos() - 1, "facts block vocabulary",
                      "is " + std::to_string(has_vocab) + " (0 none, 1 a target vocabulary follows)");
  if (has_vocab == 1) {
    TargetVocabulary v;
    v.target_vocab_size = f.i64("facts block target_vocab_size");
    if (v.target_vocab_size < 1 || v.target_vocab_size > kMaxTargetVocab)
      throw FormatError(name, f.pos() - 8, "facts block target_vocab_size",
                        "is " + std::to_string(v.target_vocab_size) + " (1 .. 2^32)");
    v.topk = f.i64("facts block topk");
    const std::uint64_t topk_at = f.pos() - 8;
    target_hidden = f.i64("facts block target_hidden_size");
    if (target_hidden < 0 || target_hidden > kMaxFactsHiddenSize)
      throw FormatError(name, f.pos() - 8, "facts block target_hidden_size",
                        "is " + std::to_string(target_hidden) + " (0 .. 2^31)");
    const std::uint32_t vd = f.u32("facts block draft_vocab_size");
    if (vd == 0) throw FormatError(name, f.pos() - 4, "facts block draft_vocab_size", "is 0");
    if (vd > f.left() / 4)
      throw FormatError(name, f.pos() - 4, "facts block draft_vocab_size",
                        std::to_string(vd) + " ids cannot fit in the " + std::to_string(f.left()) +
                            " bytes left of the facts block");
    if (v.topk < 0 || v.topk >= static_cast<std::int64_t>(vd))
      throw FormatError(name, topk_at, "facts block topk",
                        "is " + std::to_string(v.topk) + "; 0 (the full distribution) or below draft_vocab_size " +
                            std::to_string(vd));
    v.selected.reserve(vd);
    for (std::uint32_t k = 0; k < vd; ++k) {
      const std::int64_t id = f.u32("facts block selected");
      if (id >= v.target_vocab_size)
        throw FormatError(name, f.pos() - 4, "facts block selected[" + std::to_string(k) + "]",
                          "target id " + std::to_string(id) + " is not below target_vocab_size " +
                              std::to_string(v.target_vocab_size));
      v.selected.push_back(id);
    }
    facts.target_vocabulary = std::move(v);
  }
  if (f.left() != 0)
    throw FormatError(name, f.pos(), "facts block",
                      std::to_string(f.left()) + " bytes left after its last field (facts_size says " +
                          std::to_string(size) + "; facts block corrupt)");
}

std::optional<Problem> EksReader::Impl::validate(std::size_t i, const EksRecordEntry& e) const {
  const std::string rf = record_field(i, e.conversation_id);
  if (e.data_offset < kEksHeaderSize || e.data_offset > index_offset ||
      e.data_size > index_offset - e.data_offset)
    return Problem{e.data_offset, rf,
                   "data of " + std::to_string(e.data_size) + " bytes at byte " +
                       std::to_string(e.data_offset) + " lies outside the data area [16, " +
                       std::to_string(index_offset) + ")"};
  if (e.tokens < 0) return Problem{e.data_offset, rf, "negative token count"};
  const std::uint64_t tokens = static_cast<std::uint64_t>(e.tokens);
  int last_role = -1;
  for (const auto& t : e.tensors) {
    const std::string tf = tensor_field(i, e.conversation_id, t);
    if (static_cast<int>(t.role) <= last_role)
      return Problem{e.data_offset, tf, "tensors out of order or repeated"};
    last_role = static_cast<int>(t.role);
    const bool per_row_1d = t.role == EksRole::kInputIds || t.role == EksRole::kLossMask;
    if (t.role == EksRole::kTargetProbs && t.transform == EksTransform::kFp8RowScaled)
      return Problem{e.data_offset, tf, "fp8 transform: target_probs is stored lossless"};
    if (t.shape.size() != (per_row_1d ? 1u : 2u))
      return Problem{e.data_offset, tf, "has " + std::to_string(t.shape.size()) + " dimensions"};
    for (auto d : t.shape)
      if (d < 0) return Problem{e.data_offset, tf, "negative dimension"};
    if (static_cast<std::uint64_t>(t.shape[0]) != tokens)
      return Problem{e.data_offset, tf,
                     std::to_string(t.shape[0]) + " rows but the record has " +
                         std::to_string(tokens) + " tokens"};
    const auto row = mul_checked(t.shape.size() == 2 ? static_cast<std::uint64_t>(t.shape[1]) : 1,
                                 dtype_size(t.dtype));
    const auto total = row ? mul_checked(*row, tokens) : std::nullopt;
    if (!total || *total > kMaxTensorBytes)
      return Problem{e.data_offset, tf, "shape " + std::to_string(t.shape[0]) + " x ... is too large"};
    if (t.transform == EksTransform::kFp8RowScaled &&
        (per_row_1d || !codec::fp8_supported(t.dtype)))
      return Problem{e.data_offset, tf, "fp8 transform on a " + std::string(dtype_name(t.dtype)) +
                                            " tensor"};
    if (t.rows_per_block == 0) return Problem{e.data_offset, tf, "rows_per_block is 0"};
    const std::uint64_t want = (tokens + t.rows_per_block - 1) / t.rows_per_block;
    if (t.blocks.size() != want)
      return Problem{e.data_offset, tf,
                     std::to_string(t.blocks.size()) + " blocks, " + std::to_string(tokens) +
                         " rows in blocks of " + std::to_string(t.rows_per_block) + " need " +
                         std::to_string(want)};
    for (std::size_t b = 0; b < t.blocks.size(); ++b) {
      const EksBlock& blk = t.blocks[b];
      if (blk.offset > e.data_size || blk.stored_size > e.data_size - blk.offset)
        return Problem{e.data_offset + std::min(blk.offset, e.data_size),
                       block_field(i, e.conversation_id, t, b),
                       "frame of " + std::to_string(blk.stored_size) + " bytes at record offset " +
                           std::to_string(blk.offset) + " lies past the record's end (" +
                           std::to_string(e.data_size) + " bytes)"};
      if (t.payload_bytes(b) > (blk.stored_size / 4 + 1) * kZstdMaxBlock)
        return Problem{e.data_offset + blk.offset, block_field(i, e.conversation_id, t, b),
                       std::to_string(t.payload_bytes(b)) + " decoded bytes cannot come from a " +
                           std::to_string(blk.stored_size) + "-byte zstd frame"};
    }
  }
  const auto* ids = e.tensor(EksRole::kInputIds);
  const auto* hid = e.tensor(EksRole::kHiddenStates);
  const auto* aux = e.tensor(EksRole::kAuxHiddenStates);
  const auto* probs = e.tensor(EksRole::kTargetProbs);
  const auto& vocab = facts.target_vocabulary;
  if (!ids || !aux || (!hid && !probs))
    return Problem{e.data_offset, rf, "input_ids, hidden_states or aux_hidden_states missing"};
  if (hid && probs)
    return Problem{e.data_offset, rf, "holds both hidden_states and target_probs (a record holds one)"};
  if (hid && vocab)
    return Problem{e.data_offset, rf,
                   "holds hidden_states, but the facts block states a target vocabulary: every record of the shard "
                   "stores target_probs"};
  if (probs) {
    const std::string tf = tensor_field(i, e.conversation_id, *probs);
    if (!vocab)
      return Problem{e.data_offset, tf, "stored, but the shard states no target vocabulary (no facts block)"};
    if (probs->shape[1] != static_cast<std::int64_t>(vocab->selected.size()))
      return Problem{e.data_offset, tf,
                     std::to_string(probs->shape[1]) + " wide, but the target vocabulary has " +
                         std::to_string(vocab->selected.size()) + " draft tokens"};
    if (probs->dtype != aux->dtype)
      return Problem{e.data_offset, tf,
                     "dtype " + std::string(dtype_name(probs->dtype)) + " differs from aux_hidden_states' " +
                         std::string(dtype_name(aux->dtype))};
    if (target_hidden <= 0 || aux->shape[1] % target_hidden != 0)
      return Problem{e.data_offset, tf,
                     "aux width " + std::to_string(aux->shape[1]) + " is not a positive multiple of the facts "
                     "block's target_hidden_size " + std::to_string(target_hidden)};
  }
  return std::nullopt;
}

HostTensor EksReader::Impl::decode(std::size_t i, const EksRecordEntry& e,
                                   const EksTensorEntry& t, std::uint64_t rows,
                                   bool verify) const {
  const std::uint64_t row_bytes = t.row_bytes();
  const std::uint64_t out_bytes = rows * row_bytes;
  std::shared_ptr<std::uint8_t> buf(new std::uint8_t[std::max<std::uint64_t>(out_bytes, 1)],
                                    std::default_delete<std::uint8_t[]>());
  const std::size_t nblocks = static_cast<std::size_t>((rows + t.rows_per_block - 1) / t.rows_per_block);
  Scratch& s = scratch();
  const std::uint64_t cols = t.row_elements();
  for (std::size_t b = 0; b < nblocks; ++b) {
    const EksBlock& blk = t.blocks[b];
    const std::uint64_t brows = t.block_rows(b);
    const std::uint64_t first = static_cast<std::uint64_t>(b) * t.rows_per_block;
    const std::uint64_t take = std::min(brows, rows - first);
    const std::uint64_t block_bytes = brows * row_bytes;
    const std::uint64_t payload = t.payload_bytes(b);
    const std::uint64_t at = e.data_offset + blk.offset;
    const std::uint8_t* frame = src->at(at, blk.stored_size, "block");
    std::uint8_t* dst = buf.get() + first * row_bytes;
    // Full blocks decode straight into the output; a partial last block goes through
    // scratch so that its checksum (over the whole block) can still be checked.
    std::uint8_t* decoded = take == brows ? dst : grow(s.b, block_bytes);
    std::string err;
    std::uint8_t* zout = t.transform == EksTransform::kNone ? decoded : grow(s.a, payload);
    if (!codec::zstd_decompress_exact(frame, blk.stored_size, zout, payload, &err))
      throw FormatError(src->name(), at, block_field(i, e.conversation_id, t, b), err);
    if (t.transform == EksTransform::kBytePlanes) {
      codec::merge_byte_planes(zout, brows * cols, dtype_size(t.dtype), decoded);
    } else if (t.transform == EksTransform::kFp8RowScaled) {
      s.scales.resize(brows);
      std::memcpy(s.scales.data(), zout, 4 * brows);
      codec::fp8_dequantize_rows(s.scales.data(), zout + 4 * brows, brows, cols, t.dtype, decoded);
    }
    if (verify) {
      const std::uint64_t h = codec::xxh3_64(decoded, block_bytes);
      if (h != blk.xxh3)
        throw ChecksumError(src->name(), at, block_field(i, e.conversation_id, t, b),
                            "xxh3 of the decoded bytes is " + hex64(h) + " but the index says " +
                                hex64(blk.xxh3));
    }
    if (decoded != dst) std::memcpy(dst, decoded, take * row_bytes);
  }
  std::vector<std::int64_t> shape = t.shape;
  shape[0] = static_cast<std::int64_t>(rows);
  const std::uint8_t* data = buf.get();
  return HostTensor::view(t.dtype, std::move(shape), data, std::move(buf));
}

Record EksReader::Impl::read(std::size_t i, std::int64_t max_rows, bool verify) const {
  if (i >= records.size())
    throw Error(src->name() + ": record " + std::to_string(i) + " out of range (" +
                std::to_string(records.size()) + " records)");
  const EksRecordEntry& e = records[i];
  if (const auto& p = problems[i]) throw FormatError(src->name(), p->offset, p->field, p->detail);
  const std::uint64_t tokens = static_cast<std::uint64_t>(e.tokens);
  const std::uint64_t rows =
      max_rows < 0 ? tokens : std::min<std::uint64_t>(tokens, static_cast<std::uint64_t>(max_rows));
  Record r;
  r.conversation_id = e.conversation_id;
  r.hidden_states_prenorm = e.hidden_states_prenorm;
  for (const auto& t : e.tensors) {
    HostTensor h = decode(i, e, t, rows, verify);
    switch (t.role) {
      case EksRole::kInputIds: r.input_ids = std::move(h); break;
      case EksRole::kHiddenStates: r.hidden_states = std::move(h); break;
      case EksRole::kAuxHiddenStates: r.aux_hidden_states = std::move(h); break;
      case EksRole::kLossMask: r.loss_mask = std::move(h); break;
      case EksRole::kTargetProbs: r.target_probs = std::move(h); break;
    }
  }
  if (r.target_probs) r.target_hidden_size = target_hidden;
  r.check(src->name() + " " + record_field(i, e.conversation_id));
  return r;
}

const std::string& EksReader::path() const { return impl_->src->name(); }
std::size_t EksReader::size() const { return impl_->records.size(); }
std::uint64_t EksReader::file_size() const { return impl_->src->size(); }

const EksRecordEntry& EksReader::entry(std::size_t i) const { return impl_->records.at(i); }

RecordInfo EksReader::info(std::size_t i) const {
  const EksRecordEntry& e = impl_->records.at(i);
  RecordInfo info;
  info.conversation_id = e.conversation_id;
  info.key = e.conversation_id;
  info.tokens = e.tokens;
  if (const auto* t = e.tensor(EksRole::kInputIds)) info.ids_dtype = t->dtype;
  if (const auto* t = e.tensor(EksRole::kHiddenStates)) {
    info.hidden_dtype = t->dtype;
    info.hidden_size = t->shape.size() == 2 ? t->shape[1] : 0;
  }
  if (const auto* t = e.tensor(EksRole::kAuxHiddenStates))
    info.aux_width = t->shape.size() == 2 ? t->shape[1] : 0;
  if (const auto* t = e.tensor(EksRole::kTargetProbs)) {
    // A record of stored target distributions: H from the facts block, aux's dtype.
    info.hidden_size = impl_->target_hidden;
    info.target_probs_width = t->shape.size() == 2 ? t->shape[1] : 0;
    if (const auto* a = e.tensor(EksRole::kAuxHiddenStates)) info.hidden_dtype = a->dtype;
  }
  info.has_loss_mask = e.tensor(EksRole::kLossMask) != nullptr;
  info.hidden_states_prenorm = e.hidden_states_prenorm;
  info.codec = std::string(eks_codec_name(e.codec));
  info.byte_offset = e.data_offset;
  info.byte_size = e.data_size;
  return info;
}

Record EksReader::read_prefix(std::size_t i, std::int64_t max_rows) const {
  return impl_->read(i, max_rows, impl_->opts.verify_checksums);
}

void EksReader::verify_record(std::size_t i) const { impl_->read(i, -1, true); }

FileFacts EksReader::facts() const { return impl_->facts; }
std::int64_t EksReader::target_hidden_size() const { return impl_->target_hidden; }

std::optional<std::size_t> EksReader::find(std::string_view conversation_id) const {
  const auto it = impl_->by_id.find(std::string(conversation_id));
  if (it == impl_->by_id.end()) return std::nullopt;
  return it->second;
}

std::unique_ptr<RecordReader> open_eks_reader(const std::string& path) {
  return EksReader::open(path);
}

std::unique_ptr<RecordWriter> create_eks_writer(const std::string& path, const WriterOptions& opts) {
  EksEncodeOptions eo;
  const auto c = parse_eks_codec(opts.codec);
  if (!c) throw UsageError("unknown .eks codec '" + opts.codec + "' (use zstd or fp8)");
  eo.codec = *c;
  eo.level = opts.level;
  std::error_code ec;
  if (!opts.overwrite && std::filesystem::exists(path, ec))
    throw UsageError(path + ": already exists (not overwriting)");
  return std::make_unique<EksWriter>(path, eo);
}

}  // namespace eaglekit
