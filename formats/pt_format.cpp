#include "formats/pt_format.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <set>

#include "formats/byte_source.h"
#include "formats/error.h"
#include "formats/pickle.h"
#include "formats/zip.h"

namespace eaglekit {

namespace {

using pickle::Kind;
using pickle::Value;

std::string dims_string(const std::vector<std::int64_t>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// A parsed torch.save archive: the zip directory, the prefix and the unpickled data.pkl.
struct Archive {
  std::shared_ptr<const ByteSource> src;
  std::unique_ptr<ZipArchive> zip;
  std::string prefix;  // "archive/" (with the slash)
  pickle::Pickle pk;

  const std::string& path() const { return src->name(); }
};

Archive open_archive(std::shared_ptr<const ByteSource> src) {
  Archive a;
  a.src = std::move(src);
  const std::string& path = a.src->name();
  const std::size_t head = static_cast<std::size_t>(std::min<std::uint64_t>(a.src->size(), 16));
  const Format f = detect_format(a.src->data(), head);
  if (f == Format::kTorchLegacy) throw_torch_legacy(path);
  if (f != Format::kPt)
    throw FormatError(path, 0, "magic", "not a torch.save zip archive (no PK\\3\\4 at byte 0)");
  a.zip = std::make_unique<ZipArchive>(a.src);
  const auto& entries = a.zip->entries();
  if (entries.empty())
    throw FormatError(path, std::nullopt, "zip central directory",
                      "the archive is empty (no data.pkl)");
  // torch takes the prefix from the first record's folder; so do we.
  const std::string& first = entries.front().name;
  const auto slash = first.find('/');
  if (slash == std::string::npos || slash == 0)
    throw FormatError(path, entries.front().local_header_offset, "zip entry " + squote(first),
                      "not inside a folder, so this is not a torch.save archive");
  a.prefix = first.substr(0, slash + 1);
  const ZipEntry* pkl = a.zip->find(a.prefix + "data.pkl");
  if (pkl == nullptr)
    throw FormatError(path, std::nullopt, "data.pkl",
                      "no " + squote(a.prefix + "data.pkl") +
                          " record, so this is not a torch.save archive");
  if (const ZipEntry* bo = a.zip->find(a.prefix + "byteorder")) {
    const std::string_view order = a.zip->text(*bo);
    if (order == "big")
      throw UnsupportedError(path, bo->data_offset, "byteorder",
                             "big-endian archive; only little-endian torch.save files are read "
                             "(re-save it on a little-endian machine)");
    if (order != "little")
      throw FormatError(path, bo->data_offset, "byteorder",
                        "expected 'little' or 'big', got " + squote(order.substr(0, 32)));
  }
  a.zip->verify_crc(*pkl);  // a few hundred bytes; the storages are checked when read whole
  a.pk = pickle::unpickle(a.zip->data(*pkl), static_cast<std::size_t>(pkl->size), path, "data.pkl");
  return a;
}

bool mul_ok(std::uint64_t a, std::uint64_t b, std::uint64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}

// A zero-copy view of a tensor value. Checks the storage record against its declared numel
// and the tensor's extent against the storage.
HostTensor tensor_view(const Archive& a, const Value& t, const std::string& name) {
  const Value& st = *t.storage;
  const std::string& path = a.path();
  const std::string entry = a.prefix + "data/" + st.s;
  const std::string field = "tensor " + squote(name);
  const ZipEntry* e = a.zip->find(entry);
  if (e == nullptr)
    throw FormatError(path, t.offset, field,
                      "its storage " + squote(entry) + " is missing from the archive");
  std::uint64_t storage_bytes = 0;
  const std::uint64_t sitem = dtype_size(st.dtype);
  if (!mul_ok(static_cast<std::uint64_t>(st.i), sitem, &storage_bytes) || storage_bytes != e->size)
    throw FormatError(path, e->data_offset, "storage " + squote(entry),
                      "wrong storage numel: data.pkl says " + std::to_string(st.i) + " x " +
                          std::string(dtype_name(st.dtype)) + " but the record holds " +
                          std::to_string(e->size) + " bytes");
  const std::uint8_t* base = a.zip->data(*e);
  const std::uint64_t item = dtype_size(t.dtype);
  const std::uint64_t capacity = e->size / item;  // elements of the tensor's dtype
  std::uint64_t numel = 1;
  std::uint64_t last = static_cast<std::uint64_t>(t.storage_offset);
  bool ok = true;
  for (std::size_t d = 0; d < t.shape.size(); ++d) {
    const auto n = static_cast<std::uint64_t>(t.shape[d]);
    ok = ok && mul_ok(numel, n, &numel);
    if (n > 0) {
      std::uint64_t step = 0;
      ok = ok && mul_ok(n - 1, static_cast<std::uint64_t>(t.strides[d]), &step) &&
           !__builtin_add_overflow(last, step, &last);
    }
  }
  const bool fits = numel == 0 ? static_cast<std::uint64_t>(t.storage_offset) <= capacity
                               : last < capacity;
  if (!ok || !fits)
    throw FormatError(path, t.offset, field,
                      "wrong storage numel: offset " + std::to_string(t.storage_offset) +
                          ", size " + dims_string(t.shape) + ", stride " +
                          dims_string(t.strides) + " need " +
                          (ok ? std::to_string(last + 1) : std::string("more than 2^64")) +
                          " elements of " + std::string(dtype_name(t.dtype)) + " but storage " +
                          squote(entry) + " holds " + std::to_string(capacity));
  // A view with more elements than its storage (stride 0, overlapping as_strided) would
  // let a tiny file expand into an arbitrarily large copy.
  if (numel > capacity)
    throw FormatError(path, t.offset, field,
                      "size " + dims_string(t.shape) + " has " + std::to_string(numel) +
                          " elements but storage " + squote(entry) + " holds " +
                          std::to_string(capacity) +
                          " (an expanded or overlapping view; not supported)");
  HostTensor h;
  h.dtype = t.dtype;
  h.shape = t.shape;
  h.strides = t.strides;
  h.data = base + (numel == 0 ? 0 : static_cast<std::uint64_t>(t.storage_offset) * item);
  h.owner = a.src;
  return h;
}

// Views whose address is not a multiple of the element size (an unaligned writer) become
// aligned copies, so that typed loads downstream are well-defined.
HostTensor aligned(const HostTensor& t) {
  if (t.data == nullptr || reinterpret_cast<std::uintptr_t>(t.data) % t.itemsize() == 0) return t;
  return t.contiguous();
}

void flatten(const Archive& a, const Value& v, const std::string& name, int depth,
             std::vector<PtEntry>& out) {
  if (depth > pickle::kMaxPickleDepth)
    throw FormatError(a.path(), v.offset, "data.pkl",
                      "nesting deeper than " + std::to_string(pickle::kMaxPickleDepth) +
                          " levels at " + squote(name));
  auto child = [&](const std::string& key) { return name.empty() ? key : name + "." + key; };
  switch (v.kind) {
    case Kind::kNone: out.push_back({name, std::monostate{}}); return;
    case Kind::kBool: out.push_back({name, v.b}); return;
    case Kind::kInt: out.push_back({name, v.i}); return;
    case Kind::kFloat: out.push_back({name, v.f}); return;
    case Kind::kStr: out.push_back({name, v.s}); return;
    case Kind::kTensor: out.push_back({name, aligned(tensor_view(a, v, name))}); return;
    case Kind::kDict:
      for (const auto& kv : v.dict) {
        std::string key;
        if (kv.first->kind == Kind::kStr) key = kv.first->s;
        else if (kv.first->kind == Kind::kInt) key = std::to_string(kv.first->i);
        else
          throw FormatError(a.path(), kv.first->offset, "data.pkl",
                            "a dict key of " + squote(name) + " is a " +
                                std::string(pickle::kind_name(kv.first->kind)) +
                                "; only str and int keys are read");
        flatten(a, *kv.second, child(key), depth + 1, out);
      }
      return;
    case Kind::kList:
    case Kind::kTuple:
      for (std::size_t i = 0; i < v.items.size(); ++i)
        flatten(a, *v.items[i], child(std::to_string(i)), depth + 1, out);
      return;
    case Kind::kBytes:
    case Kind::kGlobal:
    case Kind::kStorage:
      throw FormatError(a.path(), v.offset, "data.pkl",
                        squote(name) + " is a " + std::string(pickle::kind_name(v.kind)) +
                            "; only tensors, numbers, strings, booleans and None are read");
  }
}

}  // namespace

const PtValue* PtContents::find(std::string_view name) const {
  for (const auto& e : entries)
    if (e.name == name) return &e.value;
  return nullptr;
}

const HostTensor* PtContents::tensor(std::string_view name) const {
  const PtValue* v = find(name);
  return v ? std::get_if<HostTensor>(v) : nullptr;
}

PtContents read_pt(const std::string& path) { return read_pt(ByteSource::open_file(path)); }

PtContents read_pt(std::shared_ptr<const ByteSource> source) {
  const Archive a = open_archive(std::move(source));
  PtContents c;
  flatten(a, a.pk.root(), "", 0, c.entries);
  return c;
}

// ---------------------------------------------------------------------------------------

namespace {

const char* storage_class(DType t) {
  switch (t) {
    case DType::kBool: return "BoolStorage";
    case DType::kUInt8: return "ByteStorage";
    case DType::kInt8: return "CharStorage";
    case DType::kInt16: return "ShortStorage";
    case DType::kInt32: return "IntStorage";
    case DType::kInt64: return "LongStorage";
    case DType::kFloat16: return "HalfStorage";
    case DType::kBFloat16: return "BFloat16Storage";
    case DType::kFloat32: return "FloatStorage";
    case DType::kFloat64: return "DoubleStorage";
  }
  return "?";
}

std::uint64_t fnv1a(std::uint64_t h, const void* data, std::size_t n) {
  const auto* p = static_cast<const std::uint8_t*>(data);
  for (std::size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

void write_tensor_bytes(ZipWriter& zw, const std::string& name, const HostTensor& t) {
  const std::uint64_t n = t.nbytes();
  zw.begin_entry(name, n);
  if (n > 0 && t.is_contiguous()) {
    zw.write(t.data, static_cast<std::size_t>(n));
  } else if (n > 0) {
    // Strided: gather row blocks of about 4 MiB at a time.
    const std::int64_t rows = t.dim() == 0 ? 1 : t.shape[0];
    const std::uint64_t row_bytes = t.dim() == 0 ? n : n / static_cast<std::uint64_t>(rows);
    const std::int64_t per = std::max<std::int64_t>(1, static_cast<std::int64_t>((4u << 20) / row_bytes));
    std::vector<std::uint8_t> buf(static_cast<std::size_t>(row_bytes * static_cast<std::uint64_t>(std::min(per, rows))));
    for (std::int64_t r = 0; r < rows; r += per) {
      const HostTensor block = t.dim() == 0 ? t : t.slice_rows(r, std::min(rows, r + per));
      block.copy_to(buf.data());
      zw.write(buf.data(), block.nbytes());
    }
  }
  zw.end_entry();
}

}  // namespace

void write_pt(const std::string& path, const std::vector<PtEntry>& entries,
              const PtWriteOptions& opts) {
  std::set<std::string> seen;
  for (const auto& e : entries) {
    if (e.name.empty()) throw UsageError(path + ": an entry has an empty name");
    if (!seen.insert(e.name).second)
      throw UsageError(path + ": entry " + squote(e.name) + " given twice");
  }
  if (opts.archive_name.empty() || opts.archive_name.find('/') != std::string::npos)
    throw UsageError("archive name must be a non-empty name without '/', got " +
                     squote(opts.archive_name));

  // data.pkl: {name: value}, tensors as _rebuild_tensor_v2 over storages "0", "1", ...
  pickle::PickleWriter pw;
  pw.empty_dict();
  std::vector<const HostTensor*> tensors;
  auto emit_value = [&](const PtValue& v) {
    if (std::holds_alternative<std::monostate>(v)) pw.none();
    else if (auto* b = std::get_if<bool>(&v)) pw.boolean(*b);
    else if (auto* i = std::get_if<std::int64_t>(&v)) pw.integer(*i);
    else if (auto* d = std::get_if<double>(&v)) pw.real(*d);
    else if (auto* s = std::get_if<std::string>(&v)) pw.str(*s);
    else {
      const HostTensor& t = std::get<HostTensor>(v);
      if (!t.defined()) throw UsageError(path + ": a tensor entry has no data");
      const std::string key = std::to_string(tensors.size());
      tensors.push_back(&t);
      pw.global("torch._utils", "_rebuild_tensor_v2");
      pw.mark();
      pw.mark();
      pw.str("storage");
      pw.global("torch", storage_class(t.dtype));
      pw.str(key);
      pw.str("cpu");
      pw.integer(t.numel());
      pw.tuple_from_mark();
      pw.binpersid();
      pw.integer(0);
      pw.mark();
      for (auto s : t.shape) pw.integer(s);
      pw.tuple_from_mark();
      pw.mark();
      for (auto s : HostTensor::contiguous_strides(t.shape)) pw.integer(s);
      pw.tuple_from_mark();
      pw.boolean(false);
      pw.global("collections", "OrderedDict");
      pw.mark();
      pw.tuple_from_mark();
      pw.reduce();
      pw.tuple_from_mark();
      pw.reduce();
    }
  };
  if (entries.size() == 1) {
    pw.str(entries[0].name);
    emit_value(entries[0].value);
    pw.setitem();
  } else {
    for (std::size_t b = 0; b < entries.size(); b += 1000) {  // Python's batch size
      pw.mark();
      for (std::size_t i = b; i < std::min(entries.size(), b + 1000); ++i) {
        pw.str(entries[i].name);
        emit_value(entries[i].value);
      }
      pw.setitems();
    }
  }
  pw.stop();
  const std::string& pkl = pw.bytes();

  ZipWriterOptions zo;
  zo.force_zip64 = opts.force_zip64;
  ZipWriter zw(path, zo);
  const std::string p = opts.archive_name + "/";
  zw.add(p + "data.pkl", pkl.data(), pkl.size());
  zw.add(p + "byteorder", "little", 6);
  std::uint64_t id_hash = fnv1a(14695981039346656037ull, pkl.data(), pkl.size());
  for (std::size_t k = 0; k < tensors.size(); ++k) {
    write_tensor_bytes(zw, p + "data/" + std::to_string(k), *tensors[k]);
    const std::uint32_t crc = zw.last_crc32();
    id_hash = fnv1a(id_hash, &crc, sizeof crc);
  }
  zw.add(p + "version", "3\n", 2);
  // torch writes 40 decimal digits; ours are derived from the content, so equal inputs give
  // equal files.
  std::string id;
  std::uint64_t h = id_hash;
  for (int k = 0; k < 40; ++k) {
    if (k == 20) h = fnv1a(id_hash, "serialization_id", 16);
    id.push_back(static_cast<char>('0' + h % 10));
    h /= 10;
    if (h == 0) h = fnv1a(id_hash, &k, sizeof k);
  }
  zw.add(p + ".data/serialization_id", id.data(), id.size());
  zw.finish();
}

// ---------------------------------------------------------------------------------------

std::string conversation_id_from_path(const std::string& path) {
  std::string name = std::filesystem::path(path).filename().string();
  if (name.size() > 3 && name.compare(name.size() - 3, 3, ".gz") == 0) name.resize(name.size() - 3);
  const auto dot = name.rfind('.');
  if (dot != std::string::npos && dot > 0) name.resize(dot);
  return name;
}

struct PtReader::Impl {
  std::string path;
  Record record;
  std::uint64_t file_size = 0;
  // The storages the record's tensors view, checked against their CRC-32 on the first
  // whole read (a prefix read cannot check them without touching the rows it skips).
  std::unique_ptr<ZipArchive> zip;
  std::vector<const ZipEntry*> storages;
  mutable std::atomic<bool> verified{false};
};

namespace {

const Value* pick(const Value& dict, std::initializer_list<const char*> names,
                  std::string* found) {
  for (const char* n : names)
    if (const Value* v = dict.get(n)) {
      *found = n;
      return v;
    }
  return nullptr;
}

// The optional `hidden_states_prenorm` key (ModelOpt's reader takes bool(value), absent
// meaning post-norm; we keep absent as "not stated"): a bool, an int 0/1, or a tensor of
// one such element. None counts as absent.
std::optional<bool> prenorm_flag(const Archive& a, const Value& root) {
  const Value* v = root.get("hidden_states_prenorm");
  if (v == nullptr || v->kind == Kind::kNone) return std::nullopt;
  auto fail = [&](const std::string& what) -> std::optional<bool> {
    throw FormatError(a.path(), v->offset, "hidden_states_prenorm", what);
  };
  if (v->kind == Kind::kBool) return v->b;
  if (v->kind == Kind::kInt) {
    if (v->i == 0 || v->i == 1) return v->i == 1;
    return fail("is the int " + std::to_string(v->i) + ", expected a bool (or 0 / 1)");
  }
  if (v->kind == Kind::kTensor) {
    const HostTensor t = tensor_view(a, *v, "hidden_states_prenorm");
    if (t.numel() != 1 || is_floating(t.dtype))
      return fail("is a " + std::string(dtype_name(t.dtype)) + " tensor of shape " + t.shape_string() +
                  ", expected a bool (or a one-element bool / integer tensor)");
    const double x = t.contiguous().get(0);
    if (x == 0 || x == 1) return x == 1;
    return fail("holds " + std::to_string(static_cast<long long>(x)) + ", expected 0 or 1");
  }
  return fail("is a " + std::string(pickle::kind_name(v->kind)) + ", expected a bool");
}

Record normalize(const Archive& a, const std::string& id_path, std::vector<const ZipEntry*>* storages) {
  const std::string& path = a.path();
  const Value* root = &a.pk.root();
  if (root->kind == Kind::kList || root->kind == Kind::kTuple) {
    if (root->items.size() != 1 || root->items[0]->kind != Kind::kDict)
      throw FormatError(path, std::nullopt, "data.pkl",
                        "expected a dict (or a list holding one dict), got a " +
                            std::string(pickle::kind_name(root->kind)) + " of " +
                            std::to_string(root->items.size()) + " items");
    root = root->items[0];
  }
  if (root->kind != Kind::kDict)
    throw FormatError(path, std::nullopt, "data.pkl",
                      "expected a dict of tensors, got a " +
                          std::string(pickle::kind_name(root->kind)));
  auto tensor = [&](std::initializer_list<const char*> names, bool required,
                    std::size_t batched_dim) -> std::optional<HostTensor> {
    std::string key;
    const Value* v = pick(*root, names, &key);
    if (v == nullptr) {
      if (!required) return std::nullopt;
      std::string all;
      for (const char* n : names) all += (all.empty() ? "" : ", ") + squote(n);
      throw FormatError(path, std::nullopt, *names.begin(),
                        "missing from the record (looked for " + all + ")");
    }
    if (v->kind != Kind::kTensor)
      throw FormatError(path, v->offset, key,
                        "is a " + std::string(pickle::kind_name(v->kind)) + ", expected a tensor");
    HostTensor t = tensor_view(a, *v, key);
    const ZipEntry* e = a.zip->find(a.prefix + "data/" + v->storage->s);
    if (std::find(storages->begin(), storages->end(), e) == storages->end()) storages->push_back(e);
    // SpecForge keeps the batch dimension of 1.
    if (t.shape.size() == batched_dim && t.shape[0] == 1) t = t.squeeze0();
    return t;
  };
  Record r;
  r.input_ids = *tensor({"input_ids"}, true, 2);
  const char* const kAuxKeys[] = {"aux_hidden_states", "aux_hidden_state", "hidden_state_features"};
  if (root->get("target_last_hidden_states") != nullptr) {
    // SpecForge 0.2's DSpark layout: `hidden_states` holds the k target layers side by side
    // (the DFlash family's name for them) and `target_last_hidden_states` the last layer.
    // Another last-layer or aux key beside them leaves no single reading.
    for (const char* k : {"hidden_state", "aux_hidden_states", "aux_hidden_state", "hidden_state_features"})
      if (const Value* v = root->get(k))
        throw FormatError(path, v->offset, k,
                          "beside 'target_last_hidden_states' (SpecForge's DSpark layout, whose "
                          "'hidden_states' are the aux layers): two readings of the record");
    r.hidden_states = *tensor({"target_last_hidden_states"}, true, 3);
    r.aux_hidden_states = *tensor({"hidden_states"}, true, 3);
  } else {
    r.hidden_states = *tensor({"hidden_states", "hidden_state"}, true, 3);
    bool has_aux = false;
    for (const char* k : kAuxKeys) has_aux = has_aux || root->get(k) != nullptr;
    if (!has_aux && root->get("hidden_states") && !root->get("hidden_state"))
      throw FormatError(path, root->get("hidden_states")->offset, "aux_hidden_states",
                        "missing: the record holds 'hidden_states' and no aux layers, as SpecForge 0.2's "
                        "DFlash / Domino records do ('hidden_states' = the aux layers side by side, no "
                        "last layer); EAGLE-3 needs both: capture with --strategy eagle3 or dspark");
    r.aux_hidden_states =
        *tensor({"aux_hidden_states", "aux_hidden_state", "hidden_state_features"}, true, 3);
  }
  r.loss_mask = tensor({"loss_mask"}, false, 2);
  // ModelOpt and SpecForge name it conversation_id; TensorRT-LLM's raw dumps keep "id".
  const Value* id = root->get("conversation_id");
  if (id == nullptr || id->kind == Kind::kNone) id = root->get("id");
  if (id == nullptr || id->kind == Kind::kNone) r.conversation_id = conversation_id_from_path(id_path);
  else if (id->kind == Kind::kStr) r.conversation_id = id->s;
  else if (id->kind == Kind::kInt) r.conversation_id = std::to_string(id->i);
  else
    throw FormatError(path, id->offset, root->get("conversation_id") ? "conversation_id" : "id",
                      "is a " + std::string(pickle::kind_name(id->kind)) + ", expected str or int");
  r.hidden_states_prenorm = prenorm_flag(a, *root);
  r.check(path);
  return r;
}

}  // namespace

PtReader::PtReader(const std::string& path) : PtReader(ByteSource::open_file(path), path) {}

PtReader::PtReader(std::shared_ptr<const ByteSource> source, const std::string& id_path)
    : impl_(std::make_unique<Impl>()) {
  impl_->path = source->name();
  impl_->file_size = source->size();
  Archive a = open_archive(std::move(source));
  impl_->record = normalize(a, id_path, &impl_->storages);
  impl_->zip = std::move(a.zip);
}

PtReader::~PtReader() = default;

const std::string& PtReader::path() const { return impl_->path; }

RecordInfo PtReader::info(std::size_t i) const {
  if (i != 0) throw Error(impl_->path + ": record " + std::to_string(i) + " out of range (a .pt file holds 1)");
  RecordInfo info = info_of(impl_->record);
  info.byte_size = impl_->file_size;
  return info;
}

Record PtReader::read_prefix(std::size_t i, std::int64_t max_rows) const {
  if (i != 0) throw Error(impl_->path + ": record " + std::to_string(i) + " out of range (a .pt file holds 1)");
  const bool whole = max_rows < 0 || max_rows >= impl_->record.tokens();
  if (whole && !impl_->verified.load(std::memory_order_acquire)) {
    for (const ZipEntry* e : impl_->storages) impl_->zip->verify_crc(*e);
    impl_->verified.store(true, std::memory_order_release);
  }
  Record r = (whole ? impl_->record : impl_->record.prefix(max_rows)).with_common_hidden_dtype();
  r.input_ids = aligned(r.input_ids);
  r.hidden_states = aligned(r.hidden_states);
  r.aux_hidden_states = aligned(r.aux_hidden_states);
  if (r.loss_mask) r.loss_mask = aligned(*r.loss_mask);
  return r;
}

PtWriter::PtWriter(std::string path, PtWriteOptions opts)
    : path_(std::move(path)), opts_(std::move(opts)) {}

void PtWriter::add(const Record& r) {
  if (record_ || finished_) throw UsageError(path_ + ": a .pt file holds one record");
  r.check(path_);
  record_ = r;
}

void PtWriter::finish() {
  if (finished_) return;
  if (!record_) throw UsageError(path_ + ": no record was added");
  const Record& r = *record_;
  std::vector<PtEntry> e;
  e.push_back({"input_ids", r.input_ids});
  e.push_back({"hidden_states", r.hidden_states});
  e.push_back({"aux_hidden_states", r.aux_hidden_states});
  e.push_back({"conversation_id", r.conversation_id});
  if (r.loss_mask) e.push_back({"loss_mask", *r.loss_mask});
  if (r.hidden_states_prenorm) e.push_back({"hidden_states_prenorm", *r.hidden_states_prenorm});
  write_pt(path_, e, opts_);
  finished_ = true;
  record_.reset();
}

std::unique_ptr<RecordReader> open_pt_reader(const std::string& path) {
  return std::make_unique<PtReader>(path);
}

void throw_torch_legacy(const std::string& path) {
  throw UnsupportedError(path, 0, "magic",
                         "legacy (pre-1.6, non-zip) torch.save file; re-save it with "
                         "torch.save(obj, path) from torch >= 1.6");
}

std::unique_ptr<RecordWriter> create_pt_writer(const std::string& path, const WriterOptions& opts) {
  std::error_code ec;
  if (!opts.overwrite && std::filesystem::exists(path, ec))
    throw UsageError(path + ": exists (pass overwrite to replace it)");
  return std::make_unique<PtWriter>(path);
}

}  // namespace eaglekit
