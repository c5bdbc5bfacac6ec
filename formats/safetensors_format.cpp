#include "formats/safetensors_format.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <system_error>
#include <unordered_map>

#include "formats/atomic_file.h"
#include "formats/byte_source.h"
#include "formats/bytes.h"
#include "formats/codec.h"
#include "formats/error.h"

namespace eaglekit {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// The reference library rejects larger headers; so do we (a corrupt length would
// otherwise make us parse megabytes of tensor data as JSON).
constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

struct DtypeCode {
  const char* code;
  unsigned bits;              // per element (sub-byte float formats exist)
  std::optional<DType> dtype;
  int rank;                   // the reference enum order = increasing alignment
};

// In the reference library's enum order (its sort key when writing).
const DtypeCode kDtypeCodes[] = {
    {"BOOL", 8, DType::kBool, 0},
    {"F4", 4, std::nullopt, 1},
    {"F6_E2M3", 6, std::nullopt, 2},
    {"F6_E3M2", 6, std::nullopt, 3},
    {"U8", 8, DType::kUInt8, 4},
    {"I8", 8, DType::kInt8, 5},
    {"F8_E5M2", 8, std::nullopt, 6},
    {"F8_E4M3", 8, std::nullopt, 7},
    {"F8_E8M0", 8, std::nullopt, 8},
    {"F8_E4M3FNUZ", 8, std::nullopt, 9},
    {"F8_E5M2FNUZ", 8, std::nullopt, 10},
    {"I16", 16, DType::kInt16, 11},
    {"U16", 16, std::nullopt, 12},
    {"F16", 16, DType::kFloat16, 13},
    {"BF16", 16, DType::kBFloat16, 14},
    {"I32", 32, DType::kInt32, 15},
    {"U32", 32, std::nullopt, 16},
    {"F32", 32, DType::kFloat32, 17},
    {"C64", 64, std::nullopt, 18},
    {"F64", 64, DType::kFloat64, 19},
    {"I64", 64, DType::kInt64, 20},
    {"U64", 64, std::nullopt, 21},
};

const DtypeCode* find_code(std::string_view code) {
  for (const auto& c : kDtypeCodes)
    if (code == c.code) return &c;
  return nullptr;
}

const DtypeCode& code_of(DType t) {
  for (const auto& c : kDtypeCodes)
    if (c.dtype == t) return c;
  throw Error("safetensors: no code for dtype " + std::string(dtype_name(t)));
}

std::string known_codes() {
  std::string s;
  for (const auto& c : kDtypeCodes) {
    if (!s.empty()) s += ", ";
    s += c.code;
  }
  return s;
}

std::string range_string(std::uint64_t b, std::uint64_t e) {
  return "[" + std::to_string(b) + ", " + std::to_string(e) + "]";
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// nlohmann messages start with "[json.exception.parse_error.101] "; keep the rest.
std::string json_detail(const std::exception& e) {
  std::string m = e.what();
  if (!m.empty() && m[0] == '[') {
    const auto close = m.find("] ");
    if (close != std::string::npos) m.erase(0, close + 2);
  }
  return m;
}

// A non-negative integer that fits int64 (JSON numbers parse as unsigned when >= 0).
std::optional<std::uint64_t> as_index(const json& v) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<std::uint64_t>();
    if (u <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) return u;
    return std::nullopt;
  }
  if (v.is_number_integer() && v.get<std::int64_t>() >= 0)
    return static_cast<std::uint64_t>(v.get<std::int64_t>());
  return std::nullopt;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Reader

std::shared_ptr<const SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  return parse(ByteSource::open_file(path));
}

std::shared_ptr<const SafetensorsFile> SafetensorsFile::parse(
    std::shared_ptr<const ByteSource> source) {
  const std::string& path = source->name();
  const std::uint64_t size = source->size();
  if (size < 8)
    throw FormatError(path, 0, "header length",
                      "the file has " + std::to_string(size) +
                          " bytes, fewer than the 8-byte header length (not a safetensors file)");
  const std::uint64_t n = load_le64(source->at(0, 8, "header length"));
  if (n > kMaxHeaderBytes)
    throw FormatError(path, 0, "header length",
                      std::to_string(n) + " bytes exceeds the limit of " +
                          std::to_string(kMaxHeaderBytes) + " (corrupt length)");
  if (n > size - 8)
    throw FormatError(path, 0, "header length",
                      std::to_string(n) + " bytes of header but only " +
                          std::to_string(size - 8) +
                          " bytes follow the length field (truncated or corrupt)");
  if (n == 0) throw FormatError(path, 8, "header", "empty header (expected a JSON object)");

  const auto* text = reinterpret_cast<const char*>(source->at(8, n, "header"));
  // Track the top-level keys: nlohmann keeps only the last of duplicates, which would hide
  // a second tensor claiming the same name.
  std::vector<std::string> duplicates;
  std::set<std::string> seen;
  json::parser_callback_t cb = [&](int depth, json::parse_event_t ev, json& parsed) {
    if (ev == json::parse_event_t::key && depth == 1) {
      const auto& k = parsed.get_ref<const std::string&>();
      if (!seen.insert(k).second) duplicates.push_back(k);
    }
    return true;
  };
  json header;
  try {
    header = json::parse(text, text + n, cb);
  } catch (const json::parse_error& e) {
    throw FormatError(path, 8 + (e.byte > 0 ? e.byte - 1 : 0), "header",
                      "not valid JSON: " + json_detail(e));
  } catch (const json::exception& e) {
    // A number too large for a double ("1E400") is out_of_range 406, not a parse_error.
    throw FormatError(path, 8, "header", "not valid JSON: " + json_detail(e));
  }
  if (!header.is_object())
    throw FormatError(path, 8, "header",
                      std::string("expected a JSON object, got ") + header.type_name());
  if (!duplicates.empty())
    throw FormatError(path, 8, duplicates.front(), "appears more than once in the header");

  std::shared_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->data_start_ = 8 + n;
  const std::uint64_t data_size = size - file->data_start_;

  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object())
        throw FormatError(path, 8, "__metadata__",
                          std::string("expected an object of strings, got ") + v.type_name());
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          throw FormatError(path, 8, "__metadata__." + m.key(),
                            std::string("expected a string value, got ") + m.value().type_name());
        file->metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!v.is_object())
      throw FormatError(path, 8, name,
                        std::string("expected an object with dtype, shape and data_offsets, got ") +
                            v.type_name());
    SafetensorsEntry e;
    e.name = name;
    const auto dt = v.find("dtype");
    if (dt == v.end() || !dt->is_string())
      throw FormatError(path, 8, name + ".dtype", "missing or not a string");
    e.dtype_code = dt->get<std::string>();
    const DtypeCode* code = find_code(e.dtype_code);
    if (code == nullptr)
      throw FormatError(path, 8, name + ".dtype",
                        "unknown dtype '" + e.dtype_code + "' (known: " + known_codes() + ")");
    e.dtype = code->dtype;

    const auto sh = v.find("shape");
    if (sh == v.end() || !sh->is_array())
      throw FormatError(path, 8, name + ".shape", "missing or not a list");
    std::uint64_t numel = 1;
    for (const auto& d : *sh) {
      const auto dim = as_index(d);
      if (!dim)
        throw FormatError(path, 8, name + ".shape",
                          "expected non-negative integers, got " + sh->dump());
      e.shape.push_back(static_cast<std::int64_t>(*dim));
      if (__builtin_mul_overflow(numel, *dim, &numel))
        throw FormatError(path, 8, name + ".shape", sh->dump() + " overflows the element count");
    }
    std::uint64_t bits = 0;
    if (__builtin_mul_overflow(numel, static_cast<std::uint64_t>(code->bits), &bits))
      throw FormatError(path, 8, name + ".shape", sh->dump() + " overflows the byte count");
    if (bits % 8 != 0)
      throw FormatError(path, 8, name + ".shape",
                        std::to_string(numel) + " elements of " + e.dtype_code +
                            " do not fill whole bytes");
    const std::uint64_t nbytes = bits / 8;

    const auto off = v.find("data_offsets");
    if (off == v.end() || !off->is_array() || off->size() != 2 || !as_index((*off)[0]) ||
        !as_index((*off)[1]))
      throw FormatError(path, 8, name + ".data_offsets",
                        "expected [begin, end] with non-negative integers, got " +
                            (off == v.end() ? std::string("nothing") : off->dump()));
    e.begin = *as_index((*off)[0]);
    e.end = *as_index((*off)[1]);
    if (e.begin > e.end)
      throw FormatError(path, 8, name + ".data_offsets",
                        range_string(e.begin, e.end) + ": begin is after end");
    if (e.end - e.begin != nbytes)
      throw FormatError(path, 8, name + ".data_offsets",
                        range_string(e.begin, e.end) + " holds " + std::to_string(e.end - e.begin) +
                            " bytes but " + e.dtype_code + " " + shape_text(e.shape) + " needs " +
                            std::to_string(nbytes));
    if (e.end > data_size)
      throw FormatError(path, file->data_start_ + e.begin, name + ".data_offsets",
                        range_string(e.begin, e.end) + " runs past the end of the data buffer (" +
                            std::to_string(data_size) + " bytes; truncated or corrupt)");
    file->entries_.push_back(std::move(e));
  }

  auto& entries = file->entries_;
  std::sort(entries.begin(), entries.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    if (a.begin != b.begin) return a.begin < b.begin;
    if (a.end != b.end) return a.end < b.end;
    return a.name < b.name;
  });
  // Sorted by begin: a tensor overlaps an earlier one iff it starts before the furthest end
  // seen so far. Empty tensors own no bytes.
  const SafetensorsEntry* furthest = nullptr;
  for (const auto& e : entries) {
    if (e.begin == e.end) continue;
    if (furthest != nullptr && e.begin < furthest->end)
      throw FormatError(path, file->data_start_ + e.begin, e.name + ".data_offsets",
                        range_string(e.begin, e.end) + " overlaps " + furthest->name + " " +
                            range_string(furthest->begin, furthest->end));
    if (furthest == nullptr || e.end > furthest->end) furthest = &e;
  }
  for (std::size_t i = 0; i < entries.size(); ++i) file->by_name_[entries[i].name] = i;
  file->source_ = std::move(source);
  return file;
}

const std::string& SafetensorsFile::path() const { return source_->name(); }

const SafetensorsEntry* SafetensorsFile::find(std::string_view name) const {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &entries_[it->second];
}

HostTensor SafetensorsFile::tensor(const SafetensorsEntry& e) const {
  if (!e.dtype)
    throw UnsupportedError(path(), data_start_ + e.begin, e.name + ".dtype",
                           "dtype " + e.dtype_code + " is not supported by eaglekit (supported: "
                           "BOOL, U8, I8, I16, I32, I64, F16, BF16, F32, F64)");
  const std::uint8_t* p =
      source_->at(data_start_ + e.begin, e.end - e.begin, "tensor data");  // checked at parse
  return HostTensor::view(*e.dtype, e.shape, p, source_);
}

std::optional<HostTensor> SafetensorsFile::get(std::string_view name) const {
  const SafetensorsEntry* e = find(name);
  if (e == nullptr) return std::nullopt;
  return tensor(*e);
}

// ---------------------------------------------------------------------------------------
// Writer

SafetensorsMetadata default_safetensors_metadata() { return {{"format", "pt"}}; }

namespace {

struct Planned {
  const NamedTensor* t;
  const DtypeCode* code;
  std::uint64_t begin, end;
};

// The reference order and the header text, padded to a multiple of 8.
std::vector<Planned> plan(const std::vector<NamedTensor>& tensors,
                          const SafetensorsMetadata& metadata, std::string& header) {
  std::vector<Planned> out;
  std::set<std::string_view> names;
  for (const auto& nt : tensors) {
    if (nt.name.empty()) throw UsageError("safetensors: a tensor has an empty name");
    if (nt.name == "__metadata__")
      throw UsageError("safetensors: '__metadata__' cannot name a tensor");
    if (!names.insert(nt.name).second)
      throw UsageError("safetensors: tensor name '" + nt.name + "' given twice");
    if (!nt.tensor.defined())
      throw UsageError("safetensors: tensor '" + nt.name + "' has no data");
    out.push_back({&nt, &code_of(nt.tensor.dtype), 0, 0});
  }
  std::sort(out.begin(), out.end(), [](const Planned& a, const Planned& b) {
    if (a.code->rank != b.code->rank) return a.code->rank > b.code->rank;
    return a.t->name < b.t->name;
  });
  std::uint64_t offset = 0;
  for (auto& p : out) {
    p.begin = offset;
    offset += p.t->tensor.nbytes();
    p.end = offset;
  }
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    h["__metadata__"] = std::move(m);
  }
  for (const auto& p : out) {
    nlohmann::ordered_json e = nlohmann::ordered_json::object();
    e["dtype"] = p.code->code;
    e["shape"] = p.t->tensor.shape;
    e["data_offsets"] = {p.begin, p.end};
    h[p.t->name] = std::move(e);
  }
  header = h.dump();
  header.append((8 - header.size() % 8) % 8, ' ');
  return out;
}

// Row-major bytes of t, in pieces of at most ~4 MiB, to sink(data, n).
template <class Sink>
void emit_tensor(const HostTensor& t, Sink&& sink) {
  if (t.nbytes() == 0) return;
  if (t.is_contiguous()) {
    sink(t.data, t.nbytes());
    return;
  }
  const std::int64_t rows = t.dim() == 0 ? 1 : t.shape[0];
  const std::size_t row_bytes = t.nbytes() / static_cast<std::size_t>(rows);
  const std::int64_t per_chunk =
      std::max<std::int64_t>(1, static_cast<std::int64_t>((4u << 20) / std::max<std::size_t>(row_bytes, 1)));
  std::vector<std::uint8_t> buf;
  for (std::int64_t r = 0; r < rows; r += per_chunk) {
    const HostTensor part = t.slice_rows(r, std::min(rows, r + per_chunk));
    buf.resize(part.nbytes());
    part.copy_to(buf.data());
    sink(buf.data(), buf.size());
  }
}

}  // namespace

std::vector<std::uint8_t> serialize_safetensors(const std::vector<NamedTensor>& tensors,
                                                const SafetensorsMetadata& metadata) {
  std::string header;
  const auto planned = plan(tensors, metadata, header);
  const std::uint64_t data = planned.empty() ? 0 : planned.back().end;
  ByteWriter out;
  out.reserve(8 + header.size() + data);
  out.u64(header.size()).bytes(header);
  for (const auto& p : planned)
    emit_tensor(p.t->tensor, [&](const std::uint8_t* d, std::size_t k) { out.bytes(d, k); });
  return out.release();
}

void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const SafetensorsMetadata& metadata) {
  std::string header;
  const auto planned = plan(tensors, metadata, header);
  AtomicFile f(path);
  std::uint8_t len[8];
  store_le64(len, header.size());
  f.write(len, 8);
  f.write(header.data(), header.size());
  for (const auto& p : planned)
    emit_tensor(p.t->tensor, [&](const std::uint8_t* d, std::size_t k) { f.write(d, k); });
  f.commit();
}

// ---------------------------------------------------------------------------------------
// Weights

struct SafetensorsWeights::State {
  std::string path;                                  // folder, or the single file
  std::vector<std::string> files;                    // shard paths
  std::unordered_map<std::string, std::size_t> where;  // tensor name -> shard
  std::string index_path;                            // empty when not sharded
  mutable std::mutex mu;
  mutable std::vector<std::shared_ptr<const SafetensorsFile>> opened;

  std::shared_ptr<const SafetensorsFile> shard(std::size_t i) const {
    std::lock_guard<std::mutex> lock(mu);
    if (!opened[i]) opened[i] = SafetensorsFile::open(files[i]);
    return opened[i];
  }
};

SafetensorsWeights SafetensorsWeights::open_folder(const std::string& dir) {
  auto st = std::make_shared<State>();
  st->path = dir;
  std::error_code ec;
  if (fs::is_regular_file(dir, ec)) {
    auto file = SafetensorsFile::open(dir);
    st->files.push_back(dir);
    for (const auto& e : file->entries()) st->where[e.name] = 0;
    st->opened.push_back(std::move(file));
    return SafetensorsWeights(std::move(st));
  }
  const std::string index = (fs::path(dir) / "model.safetensors.index.json").string();
  const std::string single = (fs::path(dir) / "model.safetensors").string();
  if (fs::exists(index, ec)) {
    st->index_path = index;
    const auto src = ByteSource::open_file(index);
    json j;
    try {
      j = json::parse(src->data(), src->data() + src->size());
    } catch (const json::parse_error& e) {
      throw FormatError(index, e.byte > 0 ? e.byte - 1 : 0, "index",
                        "not valid JSON: " + json_detail(e));
    } catch (const json::exception& e) {  // out_of_range 406: a number past a double's range
      throw FormatError(index, std::nullopt, "index", "not valid JSON: " + json_detail(e));
    }
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      throw FormatError(index, std::nullopt, "weight_map",
                        "missing or not an object of tensor name -> file name");
    std::map<std::string, std::size_t> file_ids;
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it.value().is_string())
        throw FormatError(index, std::nullopt, "weight_map." + it.key(),
                          std::string("expected a file name, got ") + it.value().type_name());
      const std::string f = it.value().get<std::string>();
      const fs::path fp(f);
      bool escapes = fp.is_absolute() || f.empty();
      for (const auto& part : fp) escapes = escapes || part == "..";
      if (escapes)
        throw FormatError(index, std::nullopt, "weight_map." + it.key(),
                          "file name '" + f + "' must be relative to the model folder");
      auto [pos, fresh] = file_ids.emplace(f, st->files.size());
      if (fresh) st->files.push_back((fs::path(dir) / fp).string());
      st->where[it.key()] = pos->second;
    }
    st->opened.resize(st->files.size());
    return SafetensorsWeights(std::move(st));
  }
  if (fs::exists(single, ec)) {
    auto file = SafetensorsFile::open(single);
    st->files.push_back(single);
    for (const auto& e : file->entries()) st->where[e.name] = 0;
    st->opened.push_back(std::move(file));
    return SafetensorsWeights(std::move(st));
  }
  if (!fs::is_directory(dir, ec)) throw IoError(dir + ": no such file or directory");
  throw IoError(dir + ": no model.safetensors or model.safetensors.index.json in this folder");
}

std::optional<HostTensor> SafetensorsWeights::get(std::string_view name) const {
  const auto it = state_->where.find(std::string(name));
  if (it == state_->where.end()) return std::nullopt;
  const auto file = state_->shard(it->second);
  auto t = file->get(name);
  if (!t)
    throw FormatError(file->path(), std::nullopt, std::string(name),
                      "not in this file, although " + state_->index_path + " names it");
  return t;
}

bool SafetensorsWeights::contains(std::string_view name) const {
  return state_->where.count(std::string(name)) != 0;
}

std::vector<std::string> SafetensorsWeights::names() const {
  std::vector<std::string> out;
  out.reserve(state_->where.size());
  for (const auto& [k, v] : state_->where) out.push_back(k);
  std::sort(out.begin(), out.end());
  return out;
}

std::string SafetensorsWeights::file_of(std::string_view name) const {
  const auto it = state_->where.find(std::string(name));
  return it == state_->where.end() ? std::string() : state_->files[it->second];
}

const std::string& SafetensorsWeights::path() const { return state_->path; }

// ---------------------------------------------------------------------------------------
// Records

namespace {

const SafetensorsEntry* find_any(const SafetensorsFile& f,
                                 std::initializer_list<const char*> names) {
  for (const char* n : names)
    if (const auto* e = f.find(n)) return e;
  return nullptr;
}

std::string record_keys_expected() {
  return "expected token_ids + hidden_states [T, k+1, H] (speculators) or input_ids + "
         "hidden_states [T, H] + aux_hidden_states [T, k*H]";
}

constexpr const char* kScalesKey = "hidden_states_scales";

// speculators' FP8 records (hs_connectors' FP8HiddenStatesConnector): hidden_states
// float8_e4m3fn [T, L, H] and hidden_states_scales float32 with one scale per token ([T, 1, 1]
// from hs_connectors 0.9, [T, 1] from speculators' first version, or [T]) or one for the
// whole tensor ([1] or []), read as fp8 * scale in float32, which is what the producer's
// dequantize_fp8_tensor(..., dtype=torch.float32) computes, bit for bit. Only the first
// `rows` token rows are decoded (the rest is checked against the file, not read).
HostTensor dequantized_fp8(const SafetensorsFile& file, const SafetensorsEntry& hidden, std::int64_t tokens,
                           std::int64_t rows) {
  const std::string& path = file.path();
  const SafetensorsEntry* scales = file.find(kScalesKey);
  if (scales == nullptr)
    throw FormatError(path, 8, hidden.name,
                      "is " + hidden.dtype_code + " but the file has no " + kScalesKey +
                          " (speculators' FP8 records store one float32 scale per token beside it)");
  if (hidden.dtype_code != "F8_E4M3")
    throw UnsupportedError(path, 8, hidden.name,
                           hidden.dtype_code + " hidden states cannot be read (speculators' FP8 records are F8_E4M3)");
  HostTensor shape_only;
  shape_only.shape = hidden.shape;
  if (hidden.shape.size() != 3 || hidden.shape[0] != tokens)
    throw FormatError(path, 8, hidden.name,
                      "F8_E4M3 of shape " + shape_only.shape_string() + ", expected [T, L, H] with T = " +
                          std::to_string(tokens) + " (the ids' length), as speculators' FP8 connector writes it");
  if (scales->dtype_code != "F32")
    throw FormatError(path, 8, kScalesKey, "dtype " + scales->dtype_code + ", expected F32");
  std::int64_t n_scales = 1;
  for (std::int64_t d : scales->shape) n_scales *= d;
  bool per_token = n_scales == tokens && !scales->shape.empty() && scales->shape[0] == tokens;
  for (std::size_t d = 1; per_token && d < scales->shape.size(); ++d) per_token = scales->shape[d] == 1;
  if (!per_token && n_scales != 1) {
    HostTensor ss;
    ss.shape = scales->shape;
    throw FormatError(path, 8, kScalesKey,
                      "shape " + ss.shape_string() + ", expected one scale per token ([" + std::to_string(tokens) +
                          ", 1, 1], [" + std::to_string(tokens) + ", 1] or [" + std::to_string(tokens) +
                          "]) or one for the tensor ([1])");
  }
  const std::uint8_t* base = file.source()->data() + file.data_start();
  const std::int64_t n = rows < 0 ? tokens : std::min(rows, tokens);
  const std::int64_t width = hidden.shape[1] * hidden.shape[2];
  std::vector<float> s(static_cast<std::size_t>(n));
  for (std::int64_t t = 0; t < n; ++t) {
    const std::uint64_t at = scales->begin + 4 * static_cast<std::uint64_t>(per_token ? t : 0);
    float v;
    std::memcpy(&v, base + at, 4);
    // The producer clamps every scale to at least 1e-12: anything else is not its output.
    if (!(v > 0) || !std::isfinite(v))
      throw FormatError(path, file.data_start() + at, std::string(kScalesKey) + "[" + std::to_string(per_token ? t : 0) + "]",
                        "scale " + std::to_string(v) + ", expected a finite value > 0 (amax / 448, at least 1e-12)");
    s[static_cast<std::size_t>(t)] = v;
  }
  HostTensor out = HostTensor::zeros(DType::kFloat32, {n, hidden.shape[1], hidden.shape[2]});
  codec::fp8_dequantize_rows(s.data(), base + hidden.begin, static_cast<std::size_t>(n), static_cast<std::size_t>(width),
                      DType::kFloat32, out.mutable_data());
  return out;
}

}  // namespace

Record safetensors_record(const SafetensorsFile& file, std::int64_t max_rows) {
  const std::string& path = file.path();
  Record r;
  const auto cid = file.metadata().find("conversation_id");
  r.conversation_id = cid != file.metadata().end() ? cid->second : fs::path(path).stem().string();

  const SafetensorsEntry* ids = find_any(file, {"input_ids", "token_ids"});
  const SafetensorsEntry* hidden = find_any(file, {"hidden_states", "hidden_state"});
  if (ids == nullptr)
    throw FormatError(path, std::nullopt, "input_ids",
                      "no input_ids or token_ids tensor (" + record_keys_expected() + ")");
  if (hidden == nullptr)
    throw FormatError(path, std::nullopt, "hidden_states",
                      "no hidden_states tensor (" + record_keys_expected() + ")");
  HostTensor ids_t = file.tensor(*ids);
  // A leading batch dimension of 1 (ids [1, T]) applies to every tensor.
  const bool batched = ids_t.dim() == 2 && ids_t.shape[0] == 1;
  auto unbatch = [&](HostTensor t) { return batched ? t.squeeze0() : t; };
  r.input_ids = unbatch(ids_t);
  const bool fp8 = hidden->dtype_code.rfind("F8_", 0) == 0 || file.find(kScalesKey) != nullptr;
  if (fp8 && hidden->dtype && hidden->dtype_code.rfind("F8_", 0) != 0)
    throw FormatError(path, 8, kScalesKey,
                      "present but " + hidden->name + " is " + hidden->dtype_code + ", not F8_E4M3");
  if (fp8 && r.input_ids.dim() != 1)
    throw FormatError(path, 8, ids->name, "shape " + r.input_ids.shape_string() + ", expected [T]");
  // FP8: only the rows asked for are decoded; ids (and mask) are cut to them below.
  HostTensor hidden_t = fp8 ? dequantized_fp8(file, *hidden, r.input_ids.shape[0], max_rows)
                            : unbatch(file.tensor(*hidden));
  const SafetensorsEntry* aux =
      find_any(file, {"aux_hidden_states", "aux_hidden_state", "hidden_state_features"});

  if (hidden_t.dim() == 3) {
    // speculators: [T, k+1, H], k aux layers then the last layer. Both parts are strided
    // views of the same bytes: row t of aux is the first k*H elements of token t's block.
    if (aux != nullptr)
      throw FormatError(path, std::nullopt, aux->name,
                        "present although " + hidden->name + " is stacked [T, k+1, H] " +
                            hidden_t.shape_string());
    const std::int64_t t = hidden_t.shape[0], layers = hidden_t.shape[1], h = hidden_t.shape[2];
    if (layers < 2)
      throw FormatError(path, std::nullopt, hidden->name,
                        "stacked layers " + hidden_t.shape_string() +
                            " need at least 2 (aux layers, then the last layer)");
    if (!hidden_t.is_contiguous())
      throw FormatError(path, std::nullopt, hidden->name, "not contiguous");
    const std::int64_t block = layers * h;
    HostTensor aux_v = hidden_t;
    aux_v.shape = {t, (layers - 1) * h};
    aux_v.strides = {block, 1};
    HostTensor last = hidden_t;
    last.shape = {t, h};
    last.strides = {block, 1};
    last.data = hidden_t.data + (layers - 1) * h * static_cast<std::int64_t>(hidden_t.itemsize());
    r.hidden_states = last;
    r.aux_hidden_states = aux_v;
    // The layout vLLM's hidden-state extraction writes (and speculators reads): every slice,
    // the last included, is a decoder layer's output before the final norm (formats/registry.h,
    // the row's norm_fact).
    r.layout_prenorm = true;
  } else {
    if (aux == nullptr)
      throw FormatError(path, std::nullopt, "aux_hidden_states",
                        "no aux_hidden_states tensor and " + hidden->name + " is " +
                            hidden_t.shape_string() + ", not stacked [T, k+1, H] (" +
                            record_keys_expected() + ")");
    r.hidden_states = hidden_t;
    r.aux_hidden_states = unbatch(file.tensor(*aux));
  }
  if (const auto* mask = file.find("loss_mask")) r.loss_mask = unbatch(file.tensor(*mask));
  if (fp8 && hidden_t.shape[0] < r.input_ids.shape[0]) {
    if (r.loss_mask && r.loss_mask->dim() == 1 && r.loss_mask->shape[0] != r.input_ids.shape[0])
      throw FormatError(path, std::nullopt, "loss_mask",
                        "shape " + r.loss_mask->shape_string() + ", expected [" + std::to_string(r.tokens()) + "]");
    r.input_ids = r.input_ids.rows(hidden_t.shape[0]);
    if (r.loss_mask) r.loss_mask = r.loss_mask->rows(hidden_t.shape[0]);
  }
  const auto norm = file.metadata().find("hidden_states_prenorm");
  if (norm != file.metadata().end()) {
    if (norm->second != "true" && norm->second != "false")
      throw FormatError(path, 8, "__metadata__.hidden_states_prenorm",
                        "is \"" + norm->second.substr(0, 32) + "\", expected \"true\" or \"false\"");
    r.hidden_states_prenorm = norm->second == "true";
  }
  r.check(path);
  return max_rows < 0 ? r : r.prefix(max_rows);
}

namespace {

class SafetensorsRecordReader final : public RecordReader {
 public:
  explicit SafetensorsRecordReader(std::shared_ptr<const SafetensorsFile> file)
      : file_(std::move(file)) {
    // Validate the record layout once, so that info() never throws on a valid header. Zero
    // rows: every check runs, and an FP8 record decodes nothing.
    info_ = info_of(safetensors_record(*file_, 0));
    const SafetensorsEntry* ids = find_any(*file_, {"input_ids", "token_ids"});
    info_.tokens = ids->shape.back();  // [T] or [1, T], checked above
    const SafetensorsEntry* hidden = find_any(*file_, {"hidden_states", "hidden_state"});
    info_.codec = hidden->dtype_code.rfind("F8_", 0) == 0 ? "fp8" : "raw";
    info_.byte_offset = 0;
    info_.byte_size = file_->source()->size();
  }
  Format format() const override { return Format::kSafetensors; }
  const std::string& path() const override { return file_->path(); }
  std::size_t size() const override { return 1; }
  RecordInfo info(std::size_t i) const override {
    check_index(i);
    return info_;
  }
  Record read_prefix(std::size_t i, std::int64_t max_rows) const override {
    check_index(i);
    return safetensors_record(*file_, max_rows).with_common_hidden_dtype();
  }

 private:
  void check_index(std::size_t i) const {
    if (i != 0)
      throw UsageError(path() + ": record " + std::to_string(i) +
                       " requested but a safetensors file holds one record");
  }
  std::shared_ptr<const SafetensorsFile> file_;
  RecordInfo info_;
};

class SafetensorsRecordWriter final : public RecordWriter {
 public:
  SafetensorsRecordWriter(std::string path, const WriterOptions& opts) : path_(std::move(path)) {
    std::error_code ec;
    if (!opts.overwrite && fs::exists(path_, ec))
      throw IoError(path_ + ": already exists (not overwriting)");
  }
  void add(const Record& r) override {
    if (record_ || finished_)
      throw UsageError(path_ + ": a safetensors record file holds one record; got a second (" +
                       r.conversation_id + ")");
    r.check(path_);
    record_ = r;
  }
  void finish() override {
    if (finished_) return;
    if (!record_) throw UsageError(path_ + ": finish() without a record");
    std::vector<NamedTensor> ts = {{"input_ids", record_->input_ids},
                                   {"hidden_states", record_->hidden_states},
                                   {"aux_hidden_states", record_->aux_hidden_states}};
    if (record_->loss_mask) ts.push_back({"loss_mask", *record_->loss_mask});
    SafetensorsMetadata meta = default_safetensors_metadata();
    meta["conversation_id"] = record_->conversation_id;
    if (record_->hidden_states_prenorm)
      meta["hidden_states_prenorm"] = *record_->hidden_states_prenorm ? "true" : "false";
    write_safetensors(path_, ts, meta);
    record_.reset();
    finished_ = true;
  }

 private:
  std::string path_;
  std::optional<Record> record_;
  bool finished_ = false;
};

}  // namespace

std::unique_ptr<RecordReader> open_safetensors_reader(const std::string& path) {
  return std::make_unique<SafetensorsRecordReader>(SafetensorsFile::open(path));
}

std::unique_ptr<RecordWriter> create_safetensors_writer(const std::string& path,
                                                        const WriterOptions& opts) {
  return std::make_unique<SafetensorsRecordWriter>(path, opts);
}

}  // namespace eaglekit
