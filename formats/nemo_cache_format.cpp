#include "formats/nemo_cache_format.h"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <regex>
#include <system_error>

#include "formats/byte_source.h"
#include "formats/bytes.h"
#include "formats/error.h"
#include "formats/json_manifest.h"
#include "formats/record.h"
#include "formats/safetensors_format.h"

namespace eaglekit {

namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// selected_token_ids is the largest field: a 150k-token vocabulary is about 1.5 MB indented.
constexpr std::uint64_t kMaxManifestBytes = 16u << 20;
constexpr std::int64_t kMaxHiddenWidth = 1 << 24;
constexpr std::int64_t kMaxVocab = 1 << 24;
constexpr std::int64_t kMaxSeqLength = 1 << 24;
constexpr const char* kManifestName = "manifest.json";
constexpr const char* kEmbeddingsName = "target_embeddings.safetensors";

bool looks_like_manifest(const json& j) {
  return j.is_object() && j.contains("format_version") && j.contains("shard_size") && j.contains("aux_hidden_dim") &&
         j.contains("selected_token_ids");
}

std::string shard_name(std::size_t s) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "shard-%06zu.safetensors", s);
  return buf;
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// One tensor of a shard, checked against the manifest.
struct Field {
  DType dtype = DType::kInt64;
  std::uint64_t start = 0;     // file offset of row 0
  std::uint64_t row_bytes = 0;  // bytes of one sample
  std::vector<std::int64_t> row_shape;
};

struct Shard {
  std::shared_ptr<const SafetensorsFile> file;
  std::int64_t samples = 0;
  Field ids, attention, loss, aux, position, probs, values, indices;
};

}  // namespace

bool is_nemo_cache_manifest(const std::string& path) {
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  if (ec || size < 2 || size > kMaxManifestBytes) return false;
  try {
    const auto bytes = read_file_head(path, static_cast<std::size_t>(size));
    if (bytes.empty() || bytes[0] != '{') return false;
    return looks_like_manifest(json::parse(bytes.begin(), bytes.end(), nullptr, /*allow_exceptions=*/false));
  } catch (const std::exception&) {
    return false;
  }
}

bool is_nemo_cache_member(const std::string& path) {
  static const std::regex kShard("^shard-[0-9]{6}\\.safetensors$");
  const fs::path p(path);
  const std::string name = p.filename().string();
  if (name != kEmbeddingsName && !std::regex_match(name, kShard)) return false;
  return is_nemo_cache_manifest((p.parent_path() / kManifestName).string());
}

struct NemoCacheReader::Impl {
  std::string path;  // the manifest
  std::size_t samples = 0;
  std::int64_t shard_size = 1, seq = 0, hidden = 0, aux_width = 0, draft_vocab = 0, target_vocab = 0, topk = 0;
  DType dtype = DType::kBFloat16;
  std::vector<std::int64_t> layers, selected;
  std::vector<Shard> shards;

  [[noreturn]] void bad(const Shard& sh, const Field& f, std::int64_t row, std::int64_t element, std::size_t i,
                        const char* field, const std::string& detail) const {
    throw FormatError(sh.file->path(),
                      f.start + static_cast<std::uint64_t>(row) * f.row_bytes +
                          static_cast<std::uint64_t>(element) * dtype_size(f.dtype),
                      "sample " + std::to_string(i) + " " + field, detail);
  }

  HostTensor view(const Shard& sh, const Field& f, std::int64_t row) const {
    const ByteSource& src = *sh.file->source();
    const std::uint8_t* p = src.at(f.start + static_cast<std::uint64_t>(row) * f.row_bytes, f.row_bytes, "tensor row");
    return HostTensor::view(f.dtype, f.row_shape, p, sh.file->source());
  }

  NemoCacheSample sample(std::size_t i) const {
    if (i >= samples) throw FormatError(path, std::nullopt, "record", "no sample " + std::to_string(i));
    const Shard& sh = shards[i / static_cast<std::size_t>(shard_size)];
    const auto row = static_cast<std::int64_t>(i % static_cast<std::size_t>(shard_size));
    NemoCacheSample s;
    s.input_ids = view(sh, sh.ids, row);
    s.attention_mask = view(sh, sh.attention, row);
    s.loss_mask = view(sh, sh.loss, row);
    s.aux_hidden_states = view(sh, sh.aux, row);
    s.position_mask = view(sh, sh.position, row);
    // NeMo's collator right-pads: the real tokens are a prefix of ones.
    std::int64_t t = 0;
    for (std::int64_t j = 0; j < seq; ++j) {
      const double a = s.attention_mask.get(j);
      if (a != 0 && a != 1)
        bad(sh, sh.attention, row, j, i, "attention_mask",
            "holds " + std::to_string(static_cast<std::int64_t>(a)) + " (0 or 1)");
      if (a == 1 && t != j)
        bad(sh, sh.attention, row, j, i, "attention_mask",
            "has a 1 after a 0 at position " + std::to_string(t) + " (NeMo right-pads: ones, then zeros)");
      if (a == 1) t = j + 1;
    }
    if (t == 0) bad(sh, sh.attention, row, 0, i, "attention_mask", "has no real token");
    s.tokens = t;
    for (std::int64_t j = 0; j < seq; ++j) {
      const double l = s.loss_mask.get(j);
      if (l != 0 && l != 1)
        bad(sh, sh.loss, row, j, i, "loss_mask", "holds " + std::to_string(static_cast<std::int64_t>(l)) + " (0 or 1)");
      const double id = s.input_ids.get(j);
      if (id < 0 || id >= static_cast<double>(target_vocab))
        bad(sh, sh.ids, row, j, i, "input_ids",
            "holds " + std::to_string(static_cast<std::int64_t>(id)) + " outside the target vocabulary of " +
                std::to_string(target_vocab));
    }
    // position_mask[t] = loss_mask[t] and the target's argmax in the draft vocabulary; the
    // target of the last real position is read at the first padding one and never counts.
    for (std::int64_t j = 0; j < seq; ++j) {
      const double pm = s.position_mask.get(j);
      if (pm == 0) continue;
      if (s.loss_mask.get(j) == 0)
        bad(sh, sh.position, row, j, i, "position_mask",
            "is set at position " + std::to_string(j) + " where loss_mask is 0 (NeMo sets it only inside the loss mask)");
      if (j >= t - 1)
        bad(sh, sh.position, row, j, i, "position_mask",
            "is set at position " + std::to_string(j) + ", past the last target inside the sample's " +
                std::to_string(t) + " tokens (that target is read at a padding position)");
    }
    if (topk == 0) {
      s.target_probs = view(sh, sh.probs, row);
    } else {
      s.target_probs_values = view(sh, sh.values, row);
      s.target_probs_indices = view(sh, sh.indices, row);
      for (std::int64_t j = 0; j < seq * topk; ++j) {
        const double v = s.target_probs_indices->get(j);
        if (v < 0 || v >= static_cast<double>(draft_vocab))
          bad(sh, sh.indices, row, j, i, "target_probs_indices",
              "holds " + std::to_string(static_cast<std::int64_t>(v)) + " outside the draft vocabulary of " +
                  std::to_string(draft_vocab));
      }
    }
    return s;
  }
};

NemoCacheReader::NemoCacheReader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
NemoCacheReader::~NemoCacheReader() = default;

std::unique_ptr<NemoCacheReader> NemoCacheReader::open(const std::string& manifest_path) {
  const auto src = ByteSource::open_file(manifest_path);
  if (src->size() > kMaxManifestBytes)
    throw FormatError(manifest_path, 0, "manifest",
                      "is " + std::to_string(src->size()) + " bytes; a NeMo cache manifest is under 16 MiB");
  const fs::path dir = fs::path(manifest_path).parent_path();
  const std::string_view text(reinterpret_cast<const char*>(src->data()), src->size());
  auto reader = open(manifest_path, text, [&](const std::string& name) {
    return ByteSource::open_file((dir / name).string());
  });
  // NeMo's reader wants exactly shards 0 .. N-1 in the folder; one more is another run's.
  const std::string extra = (dir / shard_name(reader->impl_->shards.size())).string();
  std::error_code ec;
  if (fs::exists(extra, ec))
    throw FormatError(extra, std::nullopt, "shard",
                      "is beyond the " + std::to_string(reader->impl_->shards.size()) + " shards that num_samples " +
                          std::to_string(reader->impl_->samples) + " and shard_size " +
                          std::to_string(reader->impl_->shard_size) + " make (" + manifest_path + ")");
  return reader;
}

std::unique_ptr<NemoCacheReader> NemoCacheReader::open(const std::string& manifest_name, std::string_view text,
                                                       const FileSource& file) {
  auto impl = std::make_unique<Impl>();
  impl->path = manifest_name;
  const JsonManifest f(manifest_name, text, "NeMo's EAGLE-3 cache manifest has it");
  const std::int64_t version = f.integer("format_version", 0, std::numeric_limits<std::int64_t>::max());
  if (version != 2)
    throw UnsupportedError(manifest_name, f.where("format_version"), "format_version",
                           "is " + std::to_string(version) + "; eaglekit reads NeMo's EAGLE-3 cache format_version 2");
  const json& dt = f.need("dtype");
  if (dt == "bf16") impl->dtype = DType::kBFloat16;
  else if (dt == "fp16") impl->dtype = DType::kFloat16;
  else if (dt == "fp32") impl->dtype = DType::kFloat32;
  else
    throw UnsupportedError(manifest_name, f.where("dtype"), "dtype",
                           "is " + dt.dump() + "; NeMo writes \"bf16\", \"fp16\" or \"fp32\"");
  const std::int64_t num_samples = f.integer("num_samples", 0, std::numeric_limits<std::int32_t>::max());
  impl->shard_size = f.integer("shard_size", 1, std::numeric_limits<std::int32_t>::max());
  impl->seq = f.integer("seq_length", 1, kMaxSeqLength);
  impl->aux_width = f.integer("aux_hidden_dim", 1, kMaxHiddenWidth);
  impl->target_vocab = f.integer("target_vocab_size", 1, kMaxVocab);
  impl->draft_vocab = f.integer("draft_vocab_size", 1, impl->target_vocab);
  impl->layers = f.int_list("aux_layer_ids", 0, 1000000);
  if (impl->layers.empty() || impl->aux_width % static_cast<std::int64_t>(impl->layers.size()) != 0)
    throw FormatError(manifest_name, f.where("aux_layer_ids"), "aux_layer_ids",
                      "lists " + std::to_string(impl->layers.size()) + " layers, which do not divide aux_hidden_dim " +
                          std::to_string(impl->aux_width));
  impl->hidden = impl->aux_width / static_cast<std::int64_t>(impl->layers.size());
  impl->selected = f.int_list("selected_token_ids", 0, impl->target_vocab - 1);
  if (static_cast<std::int64_t>(impl->selected.size()) != impl->draft_vocab)
    throw FormatError(manifest_name, f.where("selected_token_ids"), "selected_token_ids",
                      "lists " + std::to_string(impl->selected.size()) + " ids but draft_vocab_size is " +
                          std::to_string(impl->draft_vocab));
  // NeMo stores the top k only when 0 < k < draft_vocab_size (eagle3_cache.is_compressed); a
  // null or larger k means the full distribution.
  const json& k = f.need("target_probs_topk");
  if (!k.is_null()) {
    if (!k.is_number_integer())
      throw FormatError(manifest_name, f.where("target_probs_topk"), "target_probs_topk",
                        "is " + k.dump() + "; expected an integer or null");
    const std::int64_t kv = k.get<std::int64_t>();
    impl->topk = kv > 0 && kv < impl->draft_vocab ? kv : 0;
  }
  impl->samples = static_cast<std::size_t>(num_samples);
  const std::int64_t n_shards = (num_samples + impl->shard_size - 1) / impl->shard_size;
  const std::int64_t s_len = impl->seq;
  for (std::int64_t s = 0; s < n_shards; ++s) {
    Shard sh;
    sh.samples = std::min(impl->shard_size, num_samples - s * impl->shard_size);
    sh.file = SafetensorsFile::parse(file(shard_name(static_cast<std::size_t>(s))));
    const SafetensorsFile& f = *sh.file;
    const std::string_view header(reinterpret_cast<const char*>(f.source()->data()) + 8, f.data_start() - 8);
    const auto get = [&](const char* name, DType want, std::vector<std::int64_t> row_shape, Field& out) {
      const SafetensorsEntry* e = f.find(name);
      if (!e)
        throw FormatError(f.path(), std::nullopt, name,
                          std::string("missing (NeMo's shard holds it") +
                              (impl->topk ? " when target_probs_topk is set)" : " when target_probs_topk is 0)"));
      const auto at = json_key_offset(header, name);
      const std::optional<std::uint64_t> off = at ? std::optional<std::uint64_t>(8 + *at) : std::nullopt;
      if (!e->dtype || *e->dtype != want)
        throw FormatError(f.path(), off, std::string(name) + " dtype",
                          "is " + e->dtype_code + "; expected " + std::string(dtype_name(want)) +
                              " (the manifest's dtype \"" + dt.get<std::string>() + "\")");
      std::vector<std::int64_t> shape{sh.samples};
      shape.insert(shape.end(), row_shape.begin(), row_shape.end());
      if (e->shape != shape)
        throw FormatError(f.path(), off, std::string(name) + " shape",
                          "is " + shape_text(e->shape) + "; the manifest makes it " + shape_text(shape));
      out.dtype = want;
      out.row_shape = std::move(row_shape);
      out.start = f.data_start() + e->begin;
      out.row_bytes = (e->end - e->begin) / static_cast<std::uint64_t>(sh.samples);
    };
    get("input_ids", DType::kInt64, {s_len}, sh.ids);
    get("attention_mask", DType::kInt64, {s_len}, sh.attention);
    get("loss_mask", DType::kInt64, {s_len}, sh.loss);
    get("aux_hidden_states", impl->dtype, {s_len, impl->aux_width}, sh.aux);
    get("position_mask", DType::kBool, {s_len, 1}, sh.position);
    if (impl->topk == 0) {
      get("target_probs", impl->dtype, {s_len, impl->draft_vocab}, sh.probs);
    } else {
      get("target_probs_values", impl->dtype, {s_len, impl->topk}, sh.values);
      get("target_probs_indices", DType::kInt32, {s_len, impl->topk}, sh.indices);
    }
    impl->shards.push_back(std::move(sh));
  }
  return std::unique_ptr<NemoCacheReader>(new NemoCacheReader(std::move(impl)));
}

Format NemoCacheReader::format() const { return Format::kNemoCache; }
const std::string& NemoCacheReader::path() const { return impl_->path; }
std::size_t NemoCacheReader::size() const { return impl_->samples; }
std::int64_t NemoCacheReader::seq_length() const { return impl_->seq; }
std::int64_t NemoCacheReader::hidden_size() const { return impl_->hidden; }
const std::vector<std::int64_t>& NemoCacheReader::aux_layer_ids() const { return impl_->layers; }
FileFacts NemoCacheReader::facts() const {
  FileFacts f;
  for (const std::int64_t id : impl_->layers) f.aux_layer_ids.push_back(id + 1);
  f.target_vocabulary = TargetVocabulary{impl_->selected, target_vocab_size(), target_probs_topk()};
  return f;
}
const std::vector<std::int64_t>& NemoCacheReader::selected_token_ids() const { return impl_->selected; }
std::int64_t NemoCacheReader::target_probs_topk() const { return impl_->topk; }
std::int64_t NemoCacheReader::target_vocab_size() const { return impl_->target_vocab; }
std::int64_t NemoCacheReader::draft_vocab_size() const { return impl_->draft_vocab; }
DType NemoCacheReader::dtype() const { return impl_->dtype; }
NemoCacheSample NemoCacheReader::sample(std::size_t i) const { return impl_->sample(i); }

RecordInfo NemoCacheReader::info(std::size_t i) const {
  const NemoCacheSample s = impl_->sample(i);
  const Shard& sh = impl_->shards[i / static_cast<std::size_t>(impl_->shard_size)];
  RecordInfo info;
  info.conversation_id = std::to_string(i);
  info.key = info.conversation_id;
  info.tokens = s.tokens;
  info.hidden_size = impl_->hidden;
  info.aux_width = impl_->aux_width;
  info.ids_dtype = DType::kInt64;
  info.hidden_dtype = impl_->dtype;
  info.has_loss_mask = true;
  info.target_probs_width = impl_->draft_vocab;
  info.codec = impl_->topk ? "nemo-topk" : "nemo";
  // The sample's rows in its shard (FormatRow::records_beside), padding included.
  info.byte_offset = 0;
  info.byte_size = sh.ids.row_bytes + sh.attention.row_bytes + sh.loss.row_bytes + sh.aux.row_bytes +
                   sh.position.row_bytes + sh.probs.row_bytes + sh.values.row_bytes + sh.indices.row_bytes;
  return info;
}

// The sample as a normalized record (formats/nemo_cache_format.h, "As a record").
Record NemoCacheReader::read_prefix(std::size_t i, std::int64_t max_rows) const {
  const Impl& m = *impl_;
  const NemoCacheSample s = m.sample(i);
  const std::int64_t n = max_rows < 0 ? s.tokens : std::min(s.tokens, max_rows);
  Record r;
  r.conversation_id = std::to_string(i);
  // Unshifted: row j holds token j. The first token is not stored; row 0 reads 0, which
  // nothing trained reads (the draft embeds token t+1 at position t, docs/ttt.md).
  r.input_ids = HostTensor::zeros(DType::kInt64, {n});
  HostTensor mask = HostTensor::zeros(DType::kInt64, {n});
  auto* ids = reinterpret_cast<std::int64_t*>(r.input_ids.mutable_data());
  auto* w = reinterpret_cast<std::int64_t*>(mask.mutable_data());
  for (std::int64_t j = 1; j < n; ++j) {
    ids[j] = static_cast<std::int64_t>(s.input_ids.get(j - 1));
    // position_mask[t] weighs the target read at position t+1: eaglekit's loss_mask[t+1].
    w[j] = s.position_mask.get(j - 1) != 0 ? 1 : 0;
  }
  r.loss_mask = std::move(mask);
  r.aux_hidden_states = s.aux_hidden_states.rows(n);
  r.target_hidden_size = m.hidden;
  if (s.target_probs) {
    r.target_probs = s.target_probs->rows(n);
  } else {
    // NeMo's reader scatters the top k back to the draft vocabulary's width, zeros elsewhere.
    const Shard& sh = m.shards[i / static_cast<std::size_t>(m.shard_size)];
    const auto row = static_cast<std::int64_t>(i % static_cast<std::size_t>(m.shard_size));
    HostTensor full = HostTensor::zeros(m.dtype, {n, m.draft_vocab});
    const std::size_t item = dtype_size(m.dtype);
    std::uint8_t* out = full.mutable_data();
    std::vector<std::int64_t> seen(static_cast<std::size_t>(m.draft_vocab), -1);
    for (std::int64_t t = 0; t < n; ++t) {
      for (std::int64_t k = 0; k < m.topk; ++k) {
        const std::int64_t e = t * m.topk + k;
        const auto d = static_cast<std::int64_t>(s.target_probs_indices->get(e));
        if (seen[static_cast<std::size_t>(d)] == t)
          m.bad(sh, sh.indices, row, e, i, "target_probs_indices",
                "names draft id " + std::to_string(d) + " twice at position " + std::to_string(t) +
                    " (a top k lists distinct ids)");
        seen[static_cast<std::size_t>(d)] = t;
        std::memcpy(out + static_cast<std::size_t>(t * m.draft_vocab + d) * item,
                    s.target_probs_values->data + static_cast<std::size_t>(e) * item, item);
      }
    }
    r.target_probs = std::move(full);
  }
  return r;
}

std::optional<std::size_t> NemoCacheReader::find(std::string_view id) const {
  std::uint64_t v = 0;
  const auto [end, ec] = std::from_chars(id.data(), id.data() + id.size(), v);
  if (ec != std::errc() || end != id.data() + id.size() || v >= impl_->samples) return std::nullopt;
  if (std::to_string(v) != id) return std::nullopt;
  return static_cast<std::size_t>(v);
}

std::unique_ptr<RecordReader> open_nemo_cache_reader(const std::string& path) { return NemoCacheReader::open(path); }

}  // namespace eaglekit
