#include "formats/deepspec_format.h"

#include <charconv>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <system_error>

#include "formats/byte_source.h"
#include "formats/bytes.h"
#include "formats/error.h"
#include "formats/json_manifest.h"
#include "formats/record.h"

namespace eaglekit {

namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// A manifest holds a few hundred bytes per shard; 16 MiB is tens of thousands of shards, and
// keeps the content test from reading large JSON files that are something else.
constexpr std::uint64_t kMaxManifestBytes = 16u << 20;
constexpr std::int64_t kMaxHiddenSize = 1 << 20;
constexpr std::int64_t kMaxLayers = 4096;

bool looks_like_manifest(const json& j) {
  return j.is_object() && j.contains("index_record_size") && j.contains("target_layer_ids") &&
         j.contains("shards");
}

struct Slot {  // one sample's place, from its samples.idx record, checked
  std::uint64_t sample_id = 0;
  std::uint32_t shard = 0;
  std::int64_t tokens = 0;
  std::uint64_t ids = 0, mask = 0, loss = 0, states = 0, last = 0;
};

}  // namespace

bool is_deepspec_manifest(const std::string& path) {
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  if (ec || size < 2 || size > kMaxManifestBytes) return false;
  try {
    const auto bytes = read_file_head(path, static_cast<std::size_t>(size));
    if (bytes.empty() || bytes[0] != '{') return false;
    const json j = json::parse(bytes.begin(), bytes.end(), nullptr, /*allow_exceptions=*/false);
    return looks_like_manifest(j);
  } catch (const std::exception&) {
    return false;
  }
}

struct DeepSpecReader::Impl {
  std::string path;  // the manifest
  std::shared_ptr<const ByteSource> index;
  std::vector<std::shared_ptr<const ByteSource>> shards;
  std::vector<std::int64_t> layers;
  std::int64_t hidden = 0;
  std::size_t samples = 0;

  [[noreturn]] void bad_index(std::size_t i, std::uint64_t field_at, const char* field,
                              const std::string& detail) const {
    throw FormatError(index->name(), i * kDeepSpecIndexRecordSize + field_at,
                      "sample " + std::to_string(i) + " " + field, detail);
  }

  Slot slot(std::size_t i) const {
    if (i >= samples) throw FormatError(path, std::nullopt, "record", "no sample " + std::to_string(i));
    const std::uint8_t* p = index->at(i * kDeepSpecIndexRecordSize, kDeepSpecIndexRecordSize, "index record");
    Slot s;
    s.sample_id = load_le64(p);
    s.shard = load_le32(p + 8);
    const std::uint32_t seq_len = load_le32(p + 12);
    s.ids = load_le64(p + 16);
    s.mask = load_le64(p + 24);
    s.loss = load_le64(p + 32);
    s.states = load_le64(p + 40);
    s.last = load_le64(p + 48);
    // DeepSpec's reader asserts the same: sample ids are dense, record i is sample i.
    if (s.sample_id != i)
      bad_index(i, 0, "sample_id", "is " + std::to_string(s.sample_id) + ", expected " + std::to_string(i) +
                                       " (samples.idx is sorted by dense sample_id)");
    if (s.shard >= shards.size())
      bad_index(i, 8, "shard_id", "is " + std::to_string(s.shard) + " but the manifest lists " +
                                      std::to_string(shards.size()) + " shards");
    if (seq_len == 0) bad_index(i, 12, "seq_len", "is 0 (must be positive)");
    s.tokens = seq_len;
    const ByteSource& shard = *shards[s.shard];
    const std::uint64_t t = seq_len;
    const std::uint64_t k = layers.size(), h = static_cast<std::uint64_t>(hidden);
    // t < 2^32, k <= 2^12, h <= 2^20: t*k*h*2 < 2^65 can overflow; checked below.
    std::uint64_t states_bytes = 0;
    if (__builtin_mul_overflow(t * h * 2, k, &states_bytes))
      bad_index(i, 12, "seq_len", "is " + std::to_string(t) + ": its target_hidden_states would exceed 2^64 bytes");
    const struct {
      std::uint64_t offset, bytes;
      std::uint64_t field_at;
      const char* name;
    } arrays[] = {{s.ids, t * 4, 16, "input_ids"},
                  {s.mask, t, 24, "attention_mask"},
                  {s.loss, t, 32, "loss_mask"},
                  {s.states, states_bytes, 40, "target_hidden_states"},
                  {s.last, t * h * 2, 48, "target_last_hidden_states"}};
    for (const auto& a : arrays)
      if (!shard.contains(a.offset, a.bytes))
        throw FormatError(shard.name(), a.offset, "sample " + std::to_string(i) + " " + a.name,
                          "needs " + std::to_string(a.bytes) + " bytes but the shard has " +
                              std::to_string(shard.size()) + " (samples.idx byte " +
                              std::to_string(i * kDeepSpecIndexRecordSize + a.field_at) + ")");
    return s;
  }
};

DeepSpecReader::DeepSpecReader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DeepSpecReader::~DeepSpecReader() = default;

std::unique_ptr<DeepSpecReader> DeepSpecReader::open(const std::string& manifest_path) {
  const auto src = ByteSource::open_file(manifest_path);
  if (src->size() > kMaxManifestBytes)
    throw FormatError(manifest_path, 0, "manifest", "is " + std::to_string(src->size()) +
                                                        " bytes; a DeepSpec manifest is under 16 MiB");
  const fs::path dir = fs::path(manifest_path).parent_path();
  const std::string_view text(reinterpret_cast<const char*>(src->data()), src->size());
  return open(manifest_path, text, [&](const std::string& name) {
    return ByteSource::open_file((dir / name).string());
  });
}

std::unique_ptr<DeepSpecReader> DeepSpecReader::open(const std::string& manifest_name, std::string_view text,
                                                     const FileSource& file) {
  auto impl = std::make_unique<Impl>();
  impl->path = manifest_name;
  const JsonManifest f(manifest_name, text, "DeepSpec's target cache manifest has it");
  const auto exactly = [&](const std::string& key, const json& want, const std::string& why) {
    const json& v = f.need(key);
    if (v != want)
      throw UnsupportedError(manifest_name, f.where(key), key, "is " + v.dump() + "; " + why);
  };
  const std::int64_t version = f.integer("version", 0, std::numeric_limits<std::int64_t>::max());
  if (version != 2)
    throw UnsupportedError(manifest_name, f.where("version"), "version",
                           "is " + std::to_string(version) + "; eaglekit reads DeepSpec's target cache version 2");
  exactly("hidden_dtype", "bfloat16", "DeepSpec's version 2 writes and reads \"bfloat16\" only");
  exactly("token_dtype", "int32", "DeepSpec's version 2 writes and reads \"int32\" only");
  exactly("mask_dtype", "uint8", "DeepSpec's version 2 writes and reads \"uint8\" only");
  exactly("index_record_size", kDeepSpecIndexRecordSize, "DeepSpec's version 2 records are 56 bytes (<QIIQQQQQ)");
  impl->hidden = f.integer("hidden_size", 1, kMaxHiddenSize);
  const json& layers = f.need("target_layer_ids");
  if (!layers.is_array() || layers.empty() || layers.size() > static_cast<std::size_t>(kMaxLayers))
    throw FormatError(manifest_name, f.where("target_layer_ids"), "target_layer_ids",
                      "is " + layers.dump() + "; expected a non-empty list of layer ids");
  for (const json& l : layers) {
    if (!l.is_number_integer() || l.get<std::int64_t>() < -1 || l.get<std::int64_t>() > 1000000)
      throw FormatError(manifest_name, f.where("target_layer_ids"), "target_layer_ids",
                        "holds " + l.dump() + "; expected layer ids (-1 the embeddings)");
    if (!impl->layers.empty() && l.get<std::int64_t>() < impl->layers.back())
      throw FormatError(manifest_name, f.where("target_layer_ids"), "target_layer_ids",
                        "is not sorted ascending (DeepSpec concatenates the layers in that order)");
    impl->layers.push_back(l.get<std::int64_t>());
  }
  const std::int64_t num_samples = f.integer("num_samples", 0, std::numeric_limits<std::int64_t>::max() / 64);
  const std::int64_t num_shards = f.integer("num_shards", 0, 1 << 24);
  const json& shards = f.need("shards");
  if (!shards.is_array() || shards.size() != static_cast<std::size_t>(num_shards))
    throw FormatError(manifest_name, f.where("shards"), "shards",
                      "lists " + std::to_string(shards.is_array() ? shards.size() : 0) + " shards but num_shards is " +
                          std::to_string(num_shards));
  for (std::size_t s = 0; s < shards.size(); ++s) {
    const json& e = shards[s];
    const std::string field = "shards[" + std::to_string(s) + "]";
    if (!e.is_object() || !e.contains("shard_id") || !e["shard_id"].is_number_integer() ||
        e["shard_id"].get<std::int64_t>() != static_cast<std::int64_t>(s))
      throw FormatError(manifest_name, f.where("shards"), field + ".shard_id",
                        "expected " + std::to_string(s) + " (shard ids are contiguous from 0)");
    if (!e.contains("file_name") || !e["file_name"].is_string())
      throw FormatError(manifest_name, f.where("shards"), field + ".file_name", "missing or not a string");
    const std::string name = e["file_name"].get<std::string>();
    // DeepSpec names them shard-NNNNN.bin beside the manifest; a path would reach elsewhere.
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..")
      throw FormatError(manifest_name, f.where(name), field + ".file_name",
                        "is \"" + name + "\"; expected a file name beside manifest.json");
    impl->shards.push_back(file(name));
  }
  impl->index = file("samples.idx");
  const std::uint64_t want = static_cast<std::uint64_t>(num_samples) * kDeepSpecIndexRecordSize;
  if (impl->index->size() != want)
    throw FormatError(impl->index->name(), std::min(impl->index->size(), want), "samples.idx size",
                      "is " + std::to_string(impl->index->size()) + " bytes but num_samples " +
                          std::to_string(num_samples) + " needs " + std::to_string(want) + " (56 per sample)");
  impl->samples = static_cast<std::size_t>(num_samples);
  return std::unique_ptr<DeepSpecReader>(new DeepSpecReader(std::move(impl)));
}

Format DeepSpecReader::format() const { return Format::kDeepSpec; }
const std::string& DeepSpecReader::path() const { return impl_->path; }
std::size_t DeepSpecReader::size() const { return impl_->samples; }
const std::vector<std::int64_t>& DeepSpecReader::target_layer_ids() const { return impl_->layers; }
FileFacts DeepSpecReader::facts() const {
  FileFacts f;
  for (const std::int64_t id : impl_->layers) f.aux_layer_ids.push_back(id + 1);
  return f;
}
std::int64_t DeepSpecReader::hidden_size() const { return impl_->hidden; }

RecordInfo DeepSpecReader::info(std::size_t i) const {
  const Slot s = impl_->slot(i);
  RecordInfo info;
  info.conversation_id = std::to_string(s.sample_id);
  info.key = info.conversation_id;
  info.tokens = s.tokens;
  info.hidden_size = impl_->hidden;
  info.aux_width = impl_->hidden * static_cast<std::int64_t>(impl_->layers.size());
  info.ids_dtype = DType::kInt32;
  info.hidden_dtype = DType::kBFloat16;
  info.has_loss_mask = true;
  info.layout_prenorm = false;
  info.codec = "raw";
  // The record's bytes lie in its shard and samples.idx, not in the manifest this entry's
  // file names (FormatRow::records_beside): its five arrays and its 56-byte index record.
  info.byte_offset = 0;
  info.byte_size = static_cast<std::uint64_t>(s.tokens) *
                       (6 + 2 * static_cast<std::uint64_t>(info.aux_width + info.hidden_size)) +
                   kDeepSpecIndexRecordSize;
  return info;
}

Record DeepSpecReader::read_prefix(std::size_t i, std::int64_t max_rows) const {
  const Slot s = impl_->slot(i);
  const std::int64_t n = max_rows < 0 ? s.tokens : std::min(max_rows, s.tokens);
  const auto& shard = impl_->shards[s.shard];
  const std::int64_t h = impl_->hidden, kh = h * static_cast<std::int64_t>(impl_->layers.size());
  Record r;
  r.conversation_id = std::to_string(s.sample_id);
  // DeepSpec packs samples back to back, so int32 ids are often 2 bytes off alignment: copied.
  std::vector<std::uint8_t> ids(static_cast<std::size_t>(n) * 4);
  if (n > 0) std::memcpy(ids.data(), shard->data() + s.ids, ids.size());
  r.input_ids = HostTensor::from_bytes(DType::kInt32, {n}, std::move(ids));
  r.hidden_states = HostTensor::view(DType::kBFloat16, {n, h}, shard->data() + s.last, shard);
  r.aux_hidden_states = HostTensor::view(DType::kBFloat16, {n, kh}, shard->data() + s.states, shard);
  r.loss_mask = HostTensor::view(DType::kUInt8, {n}, shard->data() + s.loss, shard);
  r.layout_prenorm = false;  // AutoModel's last_hidden_state: after the final norm
  return r;
}

std::optional<std::size_t> DeepSpecReader::find(std::string_view id) const {
  std::uint64_t v = 0;
  const auto [end, ec] = std::from_chars(id.data(), id.data() + id.size(), v);
  if (ec != std::errc() || end != id.data() + id.size() || v >= impl_->samples) return std::nullopt;
  if (std::to_string(v) != id) return std::nullopt;  // "007" is not sample 7's id
  return static_cast<std::size_t>(v);
}

std::unique_ptr<RecordReader> open_deepspec_reader(const std::string& path) { return DeepSpecReader::open(path); }

}  // namespace eaglekit
