#include "formats/hdf5_format.h"

#include <fcntl.h>
#include <hdf5.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "formats/error.h"

namespace eaglekit {

std::recursive_mutex& hdf5_mutex() {
  static std::recursive_mutex m;
  return m;
}

namespace {

namespace fs = std::filesystem;

constexpr const char* kShardTag = "hdf5-shard";
constexpr std::int64_t kShardVersion = 1;
constexpr hsize_t kMaxChunkRows = 65536;
// Reader chunk cache per dataset: a record's first and last chunk are usually shared with
// its neighbours; keeping a few decoded chunks spares decoding them twice in a scan.
constexpr std::size_t kReadCacheBytes = 8u << 20;

// Holds the HDF5 lock. The first time on each thread it also turns off HDF5's automatic
// error printing: failures become our exceptions, and the setting is per thread when the
// library is built thread-safe.
class Hdf5Lock {
 public:
  Hdf5Lock() : guard_(hdf5_mutex()) {
    thread_local bool quiet = false;
    if (!quiet) {
      H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
      quiet = true;
    }
  }

 private:
  std::lock_guard<std::recursive_mutex> guard_;
};

// Owns one HDF5 identifier. Must be reset or destroyed while the lock is held.
class Hid {
 public:
  using Closer = herr_t (*)(hid_t);
  Hid() = default;
  Hid(hid_t id, Closer close) : id_(id), close_(close) {}
  Hid(Hid&& o) noexcept : id_(o.id_), close_(o.close_) { o.id_ = H5I_INVALID_HID; }
  Hid& operator=(Hid&& o) noexcept {
    if (this != &o) {
      reset();
      id_ = o.id_;
      close_ = o.close_;
      o.id_ = H5I_INVALID_HID;
    }
    return *this;
  }
  Hid(const Hid&) = delete;
  Hid& operator=(const Hid&) = delete;
  ~Hid() { reset(); }
  void reset() {
    if (id_ >= 0 && close_ != nullptr) close_(id_);
    id_ = H5I_INVALID_HID;
  }
  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }

 private:
  hid_t id_ = H5I_INVALID_HID;
  Closer close_ = nullptr;
};

herr_t innermost_error(unsigned n, const H5E_error2_t* err, void* data) {
  if (n == 0 && err != nullptr && err->desc != nullptr)
    *static_cast<std::string*>(data) = err->desc;
  return 0;
}

// The most specific message on HDF5's error stack (then clears it), e.g.
// "truncated file: eof = 4096, sblock->base_addr = 0, stored_eof = 8192".
std::string take_hdf5_error() {
  std::string detail;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_UPWARD, innermost_error, &detail);
  H5Eclear2(H5E_DEFAULT);
  return detail;
}

[[noreturn]] void fail_h5(const std::string& path, const std::string& field,
                          const std::string& what) {
  const std::string detail = take_hdf5_error();
  throw FormatError(path, std::nullopt, field, detail.empty() ? what : what + " (" + detail + ")");
}

[[noreturn]] void fail(const std::string& path, const std::string& field, const std::string& what) {
  throw FormatError(path, std::nullopt, field, what);
}

std::string child_path(const std::string& group, const std::string& name) {
  return group == "/" ? "/" + name : group + "/" + name;
}

std::string dims_string(const std::vector<hsize_t>& dims) {
  std::string s = "[";
  for (std::size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

// ---------------------------------------------------------------------------------------
// Reading helpers (all called with the lock held).

std::vector<hsize_t> dataset_dims(hid_t dset, const std::string& path, const std::string& field) {
  Hid space(H5Dget_space(dset), H5Sclose);
  if (!space.valid()) fail_h5(path, field, "cannot read the dataspace");
  const int rank = H5Sget_simple_extent_ndims(space.get());
  if (rank < 0) fail_h5(path, field, "cannot read the rank (not a simple dataspace)");
  std::vector<hsize_t> dims(static_cast<std::size_t>(rank));
  if (rank > 0 && H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr) < 0)
    fail_h5(path, field, "cannot read the shape");
  return dims;
}

void expect_rank(const std::vector<hsize_t>& dims, std::size_t rank, const char* shape,
                 const std::string& path, const std::string& field) {
  if (dims.size() != rank)
    fail(path, field,
         "expected rank " + std::to_string(rank) + " " + shape + ", got rank " +
             std::to_string(dims.size()) + " " + dims_string(dims));
}

// Opens a dataset at an absolute path; nullopt-like invalid Hid when absent and !required.
Hid open_dataset(hid_t file, const std::string& dpath, bool required, const std::string& path,
                 const std::string& needs) {
  const htri_t exists = H5Lexists(file, dpath.c_str(), H5P_DEFAULT);
  if (exists < 0) fail_h5(path, dpath, "cannot look up");
  if (exists == 0) {
    if (!required) return Hid();
    take_hdf5_error();
    fail(path, dpath, "missing dataset (" + needs + ")");
  }
  Hid dapl(H5Pcreate(H5P_DATASET_ACCESS), H5Pclose);
  H5Pset_chunk_cache(dapl.get(), H5D_CHUNK_CACHE_NSLOTS_DEFAULT, kReadCacheBytes, 1.0);
  Hid d(H5Dopen2(file, dpath.c_str(), dapl.get()), H5Dclose);
  if (!d.valid()) fail_h5(path, dpath, "cannot open as a dataset");
  return d;
}

bool attr_exists(hid_t obj, const char* name, const std::string& path, const std::string& field) {
  const htri_t e = H5Aexists(obj, name);
  if (e < 0) fail_h5(path, field, std::string("cannot look up attribute ") + name);
  return e > 0;
}

// An open attribute that holds exactly one value of class `cls`, or nullopt when the
// attribute is absent. `noun` names the class in messages ("string", "integer").
struct ScalarAttr {
  Hid attr;
  Hid type;
  std::string what;
};
std::optional<ScalarAttr> open_scalar_attr(hid_t obj, const char* name, H5T_class_t cls,
                                           const std::string& noun, const std::string& path,
                                           const std::string& field) {
  if (!attr_exists(obj, name, path, field)) return std::nullopt;
  const std::string what = std::string("attribute ") + name;
  Hid attr(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose);
  if (!attr.valid()) fail_h5(path, field, "cannot open " + what);
  Hid type(H5Aget_type(attr.get()), H5Tclose);
  Hid space(H5Aget_space(attr.get()), H5Sclose);
  if (!type.valid() || !space.valid()) fail_h5(path, field, "cannot read " + what);
  const char* article = noun.front() == 'i' ? "an " : "a ";  // "an integer", "a string"
  if (H5Tget_class(type.get()) != cls) fail(path, field, what + " is not " + article + noun);
  if (H5Sget_simple_extent_npoints(space.get()) != 1)
    fail(path, field, what + " must hold exactly one " + noun);
  return ScalarAttr{std::move(attr), std::move(type), what};
}

// A string attribute (variable-length or fixed-length, any character set).
std::optional<std::string> read_string_attr(hid_t obj, const char* name, const std::string& path,
                                            const std::string& field) {
  auto a = open_scalar_attr(obj, name, H5T_STRING, "string", path, field);
  if (!a) return std::nullopt;
  const Hid& attr = a->attr;
  const Hid& type = a->type;
  const std::string& what = a->what;
  std::string out;
  if (H5Tis_variable_str(type.get()) > 0) {
    Hid mt(H5Tcopy(H5T_C_S1), H5Tclose);
    H5Tset_size(mt.get(), H5T_VARIABLE);
    H5Tset_cset(mt.get(), H5Tget_cset(type.get()));
    char* s = nullptr;
    if (H5Aread(attr.get(), mt.get(), &s) < 0) fail_h5(path, field, "cannot read " + what);
    if (s != nullptr) {
      out = s;
      H5free_memory(s);
    }
  } else {
    const std::size_t n = H5Tget_size(type.get());
    std::vector<char> buf(n + 1, '\0');
    if (H5Aread(attr.get(), type.get(), buf.data()) < 0)
      fail_h5(path, field, "cannot read " + what);
    out.assign(buf.data(), std::strlen(buf.data()));
    while (!out.empty() && out.back() == ' ') out.pop_back();  // space-padded strings
  }
  return out;
}

std::optional<std::int64_t> read_int_attr(hid_t obj, const char* name, const std::string& path,
                                          const std::string& field) {
  auto a = open_scalar_attr(obj, name, H5T_INTEGER, "integer", path, field);
  if (!a) return std::nullopt;
  std::int64_t v = 0;
  if (H5Aread(a->attr.get(), H5T_NATIVE_INT64, &v) < 0) fail_h5(path, field, "cannot read " + a->what);
  return v;
}

enum class Role { kIds, kMask, kHidden };

std::string describe_type(hid_t type) {
  const std::size_t size = H5Tget_size(type);
  switch (H5Tget_class(type)) {
    case H5T_INTEGER:
      return std::to_string(size * 8) + "-bit " +
             (H5Tget_sign(type) == H5T_SGN_NONE ? "unsigned " : "") + "integers";
    case H5T_FLOAT:
      return std::to_string(size * 8) + "-bit floats";
    case H5T_STRING:
      return "strings";
    case H5T_ENUM:
      return "an enum";
    case H5T_COMPOUND:
      return "a compound type";
    default:
      return "an unsupported HDF5 type";
  }
}

bool is_ieee_half(hid_t type) {
  std::size_t spos = 0, epos = 0, esize = 0, mpos = 0, msize = 0;
  if (H5Tget_fields(type, &spos, &epos, &esize, &mpos, &msize) < 0) return false;
  return H5Tget_size(type) == 2 && spos == 15 && epos == 10 && esize == 5 && mpos == 0 &&
         msize == 10 && H5Tget_ebias(type) == 15;
}

// The dtype a dataset reads as, from its HDF5 type and its "dtype" attribute.
DType stored_dtype(hid_t dset, Role role, const std::string& path, const std::string& field) {
  Hid type(H5Dget_type(dset), H5Tclose);
  if (!type.valid()) fail_h5(path, field, "cannot read the datatype");
  const H5T_class_t cls = H5Tget_class(type.get());
  const std::size_t size = H5Tget_size(type.get());
  const bool is_signed = H5Tget_sign(type.get()) != H5T_SGN_NONE;
  switch (role) {
    case Role::kIds:
      if (cls != H5T_INTEGER)
        fail(path, field, "expected integer token ids, got " + describe_type(type.get()));
      return size == 4 && is_signed ? DType::kInt32 : DType::kInt64;
    case Role::kMask:
      if (cls == H5T_ENUM && size == 1) return DType::kBool;  // h5py's numpy bool
      if (cls != H5T_INTEGER)
        fail(path, field, "expected an integer or bool mask, got " + describe_type(type.get()));
      return size == 1 ? DType::kUInt8 : DType::kInt64;
    case Role::kHidden:
      break;
  }
  const auto attr = read_string_attr(dset, "dtype", path, field);
  std::optional<DType> declared;
  if (attr) {
    declared = parse_dtype(*attr);
    if (!declared || !is_floating(*declared))
      fail(path, field,
           "unknown dtype attribute \"" + *attr +
               "\" (expected \"bfloat16\", \"float16\", \"float32\" or \"float64\")");
  }
  DType got;
  if (cls == H5T_INTEGER && size == 2) {
    if (!declared)
      fail(path, field,
           "16-bit integers without the attribute dtype = \"bfloat16\" (bf16 is stored as "
           "uint16 with that attribute)");
    got = DType::kBFloat16;
  } else if (cls == H5T_FLOAT && size == 2) {
    if (!is_ieee_half(type.get()))
      fail(path, field, "16-bit floats that are not IEEE half precision");
    got = DType::kFloat16;
  } else if (cls == H5T_FLOAT && size == 4) {
    got = DType::kFloat32;
  } else if (cls == H5T_FLOAT && size == 8) {
    got = DType::kFloat64;
  } else {
    fail(path, field,
         "expected bf16 (uint16 with dtype = \"bfloat16\"), fp16, fp32 or fp64, got " +
             describe_type(type.get()));
  }
  if (declared && *declared != got)
    fail(
        path, field,
        "dtype attribute \"" + *attr + "\" does not match the stored " + describe_type(type.get()));
  return got;
}

// The memory type that H5Dread fills for a dtype. fp16 and h5py's bool enum have no
// native HDF5 type: read them as the file type in little-endian order.
Hid memory_type(hid_t dset, DType dtype) {
  hid_t native = H5I_INVALID_HID;
  switch (dtype) {
    case DType::kInt64:
      native = H5T_NATIVE_INT64;
      break;
    case DType::kInt32:
      native = H5T_NATIVE_INT32;
      break;
    case DType::kUInt8:
      native = H5T_NATIVE_UINT8;
      break;
    case DType::kBFloat16:
      native = H5T_NATIVE_UINT16;
      break;
    case DType::kFloat32:
      native = H5T_NATIVE_FLOAT;
      break;
    case DType::kFloat64:
      native = H5T_NATIVE_DOUBLE;
      break;
    default:
      break;
  }
  if (native != H5I_INVALID_HID) return Hid(H5Tcopy(native), H5Tclose);
  Hid file_type(H5Dget_type(dset), H5Tclose);
  Hid t(H5Tcopy(file_type.get()), H5Tclose);
  if (t.valid() && H5Tget_size(t.get()) > 1) H5Tset_order(t.get(), H5T_ORDER_LE);
  return t;
}

// Filters on a dataset: the codec name for RecordInfo, and a clear error up front when
// this libhdf5 cannot decode one of them (e.g. h5py's lzf, a plugin).
std::string dataset_codec(hid_t dset, const std::string& path, const std::string& field) {
  Hid dcpl(H5Dget_create_plist(dset), H5Pclose);
  if (!dcpl.valid()) fail_h5(path, field, "cannot read the creation properties");
  const int n = H5Pget_nfilters(dcpl.get());
  std::string codec = "raw";
  for (int i = 0; i < n; ++i) {
    unsigned flags = 0;
    std::size_t nelmts = 0;
    char name[64] = {0};
    const H5Z_filter_t id = H5Pget_filter2(dcpl.get(), static_cast<unsigned>(i), &flags, &nelmts,
                                           nullptr, sizeof(name), name, nullptr);
    if (id < 0) fail_h5(path, field, "cannot read the filter pipeline");
    if (H5Zfilter_avail(id) <= 0) {
      take_hdf5_error();
      throw UnsupportedError(path, std::nullopt, field,
                             "compressed with HDF5 filter " + std::to_string(id) + " (" + name +
                                 ") that this libhdf5 cannot decode; re-save it with gzip or "
                                 "no compression");
    }
    if (id == H5Z_FILTER_DEFLATE)
      codec = "hdf5-gzip";
    else if (id != H5Z_FILTER_SHUFFLE && id != H5Z_FILTER_FLETCHER32 && codec == "raw")
      codec = "hdf5-filtered";
  }
  return codec;
}

// Reads rows [row0, row0 + n) of a rank-1 or rank-2 dataset into an owning tensor.
HostTensor read_rows(hid_t dset, DType dtype, std::size_t rank, hsize_t width, hsize_t row0,
                     hsize_t n, const std::string& path, const std::string& field) {
  std::vector<std::int64_t> shape{static_cast<std::int64_t>(n)};
  if (rank == 2) shape.push_back(static_cast<std::int64_t>(width));
  HostTensor t = HostTensor::zeros(dtype, shape);
  if (t.numel() == 0) return t;
  Hid fspace(H5Dget_space(dset), H5Sclose);
  const hsize_t start[2] = {row0, 0};
  const hsize_t count[2] = {n, width};
  if (!fspace.valid() ||
      H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, start, nullptr, count, nullptr) < 0)
    fail_h5(path, field, "cannot select rows");
  Hid mspace(H5Screate_simple(static_cast<int>(rank), count, nullptr), H5Sclose);
  Hid mtype = memory_type(dset, dtype);
  if (!mspace.valid() || !mtype.valid()) fail_h5(path, field, "cannot set up the read");
  if (H5Dread(dset, mtype.get(), mspace.get(), fspace.get(), H5P_DEFAULT, t.mutable_data()) < 0)
    fail_h5(path, field,
            "cannot read rows [" + std::to_string(row0) + ", " + std::to_string(row0 + n) + ")");
  return t;
}

// read_rows of a column stored as `stored`, returned as `want` (common_hidden_dtype of the
// record's two columns).
HostTensor read_rows_as(hid_t dset, DType stored, DType want, std::size_t rank, hsize_t width, hsize_t row0,
                        hsize_t n, const std::string& path, const std::string& field) {
  HostTensor t = read_rows(dset, stored, rank, width, row0, n, path, field);
  return stored == want ? t : widened(t, want);
}

std::vector<std::string> read_strings(hid_t dset, hsize_t n, const std::string& path,
                                      const std::string& field) {
  Hid type(H5Dget_type(dset), H5Tclose);
  if (!type.valid()) fail_h5(path, field, "cannot read the datatype");
  if (H5Tget_class(type.get()) != H5T_STRING)
    fail(path, field, "expected strings, got " + describe_type(type.get()));
  std::vector<std::string> out;
  out.reserve(n);
  if (n == 0) return out;
  if (H5Tis_variable_str(type.get()) > 0) {
    Hid mt(H5Tcopy(H5T_C_S1), H5Tclose);
    H5Tset_size(mt.get(), H5T_VARIABLE);
    H5Tset_cset(mt.get(), H5Tget_cset(type.get()));
    std::vector<char*> ptrs(n, nullptr);
    if (H5Dread(dset, mt.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, ptrs.data()) < 0)
      fail_h5(path, field, "cannot read strings");
    for (char* p : ptrs) out.emplace_back(p != nullptr ? p : "");
    Hid space(H5Dget_space(dset), H5Sclose);
    H5Dvlen_reclaim(mt.get(), space.get(), H5P_DEFAULT, ptrs.data());
  } else {
    const std::size_t size = H5Tget_size(type.get());
    std::vector<char> buf(n * size + 1, '\0');
    Hid mt(H5Tcopy(type.get()), H5Tclose);
    if (H5Dread(dset, mt.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, buf.data()) < 0)
      fail_h5(path, field, "cannot read strings");
    for (hsize_t i = 0; i < n; ++i) {
      const char* s = buf.data() + i * size;
      std::string v(s, strnlen(s, size));
      while (!v.empty() && v.back() == ' ') v.pop_back();
      out.push_back(std::move(v));
    }
  }
  return out;
}

std::vector<std::int64_t> read_int64s(hid_t dset, hsize_t n, const std::string& path,
                                      const std::string& field) {
  Hid type(H5Dget_type(dset), H5Tclose);
  if (!type.valid()) fail_h5(path, field, "cannot read the datatype");
  if (H5Tget_class(type.get()) != H5T_INTEGER)
    fail(path, field, "expected integers, got " + describe_type(type.get()));
  std::vector<std::int64_t> out(n);
  if (n > 0 && H5Dread(dset, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()) < 0)
    fail_h5(path, field, "cannot read");
  return out;
}

// A yes/no attribute as h5py writes a Python or numpy bool (an enum over int8 with FALSE = 0
// and TRUE = 1), or an integer 0 / 1. nullopt when absent.
std::optional<bool> read_bool_attr(hid_t obj, const char* name, const std::string& path,
                                   const std::string& field) {
  if (!attr_exists(obj, name, path, field)) return std::nullopt;
  const std::string what = std::string("attribute ") + name;
  Hid attr(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose);
  if (!attr.valid()) fail_h5(path, field, "cannot open " + what);
  Hid type(H5Aget_type(attr.get()), H5Tclose);
  Hid space(H5Aget_space(attr.get()), H5Sclose);
  if (!type.valid() || !space.valid()) fail_h5(path, field, "cannot read " + what);
  const H5T_class_t cls = H5Tget_class(type.get());
  if ((cls != H5T_ENUM && cls != H5T_INTEGER) || H5Tget_size(type.get()) > 8)
    fail(path, field, what + " is " + describe_type(type.get()) + ", expected a bool (or 0 / 1)");
  if (H5Sget_simple_extent_npoints(space.get()) != 1)
    fail(path, field, what + " must hold exactly one value");
  std::int64_t v = 0;
  if (cls == H5T_INTEGER) {
    if (H5Aread(attr.get(), H5T_NATIVE_INT64, &v) < 0) fail_h5(path, field, "cannot read " + what);
  } else {
    // libhdf5 converts integers but not enums to int64: the raw bytes of the enum's base
    // integer type, little- or big-endian as that type says.
    Hid base(H5Tget_super(type.get()), H5Tclose);
    unsigned char raw[8] = {0};
    if (!base.valid() || H5Aread(attr.get(), type.get(), raw) < 0) fail_h5(path, field, "cannot read " + what);
    const std::size_t n = H5Tget_size(type.get());
    const bool big = H5Tget_order(base.get()) == H5T_ORDER_BE;
    std::uint64_t u = 0;
    for (std::size_t k = 0; k < n; ++k) u |= static_cast<std::uint64_t>(raw[big ? n - 1 - k : k]) << (8 * k);
    if (H5Tget_sign(base.get()) == H5T_SGN_2 && n < 8 && ((u >> (8 * n - 1)) & 1)) u |= ~0ull << (8 * n);
    v = static_cast<std::int64_t>(u);
  }
  if (v != 0 && v != 1) fail(path, field, what + " holds " + std::to_string(v) + ", expected 0 or 1");
  return v == 1;
}

herr_t collect_groups(hid_t, const char* name, const H5O_info_t* info, void* data) {
  if (info->type == H5O_TYPE_GROUP)
    static_cast<std::vector<std::string>*>(data)->emplace_back(name);
  return 0;
}

// ---------------------------------------------------------------------------------------

class Hdf5Reader final : public RecordReader {
 public:
  explicit Hdf5Reader(std::string path);
  ~Hdf5Reader() override {
    Hdf5Lock lock;
    for (auto* h : {&ids_, &mask_, &hidden_, &aux_}) h->dset.reset();
    file_.reset();
  }

  Format format() const override { return Format::kHdf5; }
  const std::string& path() const override { return path_; }
  std::size_t size() const override { return entries_.size(); }
  RecordInfo info(std::size_t i) const override { return entry(i).info; }
  Record read_prefix(std::size_t i, std::int64_t max_rows) const override;
  std::optional<std::size_t> find(std::string_view conversation_id) const override {
    const auto it = by_id_.find(std::string(conversation_id));
    if (it == by_id_.end()) return std::nullopt;
    return it->second;
  }

 private:
  // One per-token dataset of the shard layout, kept open for the reader's life.
  struct Column {
    Hid dset;
    DType dtype = DType::kFloat32;
    hsize_t width = 0;
    std::string field;
  };
  struct Entry {
    RecordInfo info;
    std::string group;  // group layout: absolute path of the record's group
    hsize_t row0 = 0;   // shard layout: first row
    DType mask_dtype = DType::kUInt8;
    // As stored; info.hidden_dtype is what both are read as (common_hidden_dtype).
    DType hidden_stored = DType::kFloat32;
    DType aux_stored = DType::kFloat32;
  };

  const Entry& entry(std::size_t i) const {
    if (i >= entries_.size())
      throw Error(path_ + ": record " + std::to_string(i) + " out of range (" +
                  std::to_string(entries_.size()) + " records)");
    return entries_[i];
  }
  void open_shard(hid_t root);
  void open_groups();
  void add_group_record(const std::string& group, const std::string& id);
  void index_ids();

  std::string path_;
  bool shard_ = false;
  Hid file_;
  Column ids_, mask_, hidden_, aux_;
  std::vector<Entry> entries_;
  std::unordered_map<std::string, std::size_t> by_id_;
};

Hdf5Reader::Hdf5Reader(std::string path) : path_(std::move(path)) {
  if (::access(path_.c_str(), R_OK) != 0) throw IoError::from_errno(path_, "cannot open", errno);
  Hdf5Lock lock;
  try {
    Hid fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
    // File locks fail on some network file systems; a reader does not need them there.
    H5Pset_file_locking(fapl.get(), true, true);
    file_ = Hid(H5Fopen(path_.c_str(), H5F_ACC_RDONLY, fapl.get()), H5Fclose);
    if (!file_.valid()) fail_h5(path_, "HDF5 file", "cannot open");
    Hid root(H5Gopen2(file_.get(), "/", H5P_DEFAULT), H5Gclose);
    if (!root.valid()) fail_h5(path_, "/", "cannot open the root group");
    const auto tag =
        read_string_attr(root.get(), "eaglekit_format", path_, "root attribute eaglekit_format");
    if (tag) {
      if (*tag != kShardTag)
        fail(path_, "root attribute eaglekit_format",
             "unknown value \"" + *tag + "\" (expected \"" + kShardTag + "\")");
      shard_ = true;
      open_shard(root.get());
    } else {
      open_groups();
    }
    index_ids();
  } catch (...) {
    for (auto* h : {&ids_, &mask_, &hidden_, &aux_}) h->dset.reset();
    file_.reset();
    throw;
  }
}

void Hdf5Reader::open_shard(hid_t root) {
  const std::string& p = path_;
  const auto version = read_int_attr(root, "version", p, "root attribute version");
  if (!version)
    fail(p, "root attribute version", "missing (an eaglekit HDF5 shard has version = 1)");
  if (*version != kShardVersion)
    throw UnsupportedError(
        p, std::nullopt, "root attribute version",
        "shard version " + std::to_string(*version) + "; this eaglekit reads version 1");
  const auto hidden_size = read_int_attr(root, "hidden_size", p, "root attribute hidden_size");
  if (!hidden_size) fail(p, "root attribute hidden_size", "missing");
  const auto aux_layers = read_int_attr(root, "aux_layers", p, "root attribute aux_layers");
  if (!aux_layers) fail(p, "root attribute aux_layers", "missing");
  if (*hidden_size < 0 || *aux_layers < 0)
    fail(p, *hidden_size < 0 ? "root attribute hidden_size" : "root attribute aux_layers",
         "negative value");

  const std::string needs =
      "an eaglekit HDF5 shard holds conversation_ids, offsets, input_ids, hidden_states and "
      "aux_hidden_states";
  Hid ids_ds = open_dataset(file_.get(), "/conversation_ids", true, p, needs);
  Hid off_ds = open_dataset(file_.get(), "/offsets", true, p, needs);
  ids_.dset = open_dataset(file_.get(), "/input_ids", true, p, needs);
  hidden_.dset = open_dataset(file_.get(), "/hidden_states", true, p, needs);
  aux_.dset = open_dataset(file_.get(), "/aux_hidden_states", true, p, needs);
  mask_.dset = open_dataset(file_.get(), "/loss_mask", false, p, needs);
  ids_.field = "/input_ids";
  hidden_.field = "/hidden_states";
  aux_.field = "/aux_hidden_states";
  mask_.field = "/loss_mask";

  const auto cid_dims = dataset_dims(ids_ds.get(), p, "/conversation_ids");
  expect_rank(cid_dims, 1, "[N]", p, "/conversation_ids");
  const auto off_dims = dataset_dims(off_ds.get(), p, "/offsets");
  expect_rank(off_dims, 1, "[N+1]", p, "/offsets");
  const auto tok_dims = dataset_dims(ids_.dset.get(), p, "/input_ids");
  expect_rank(tok_dims, 1, "[total_T]", p, "/input_ids");
  const auto hid_dims = dataset_dims(hidden_.dset.get(), p, "/hidden_states");
  expect_rank(hid_dims, 2, "[total_T, H]", p, "/hidden_states");
  const auto aux_dims = dataset_dims(aux_.dset.get(), p, "/aux_hidden_states");
  expect_rank(aux_dims, 2, "[total_T, k*H]", p, "/aux_hidden_states");
  std::vector<hsize_t> mask_dims;
  if (mask_.dset.valid()) {
    mask_dims = dataset_dims(mask_.dset.get(), p, "/loss_mask");
    expect_rank(mask_dims, 1, "[total_T]", p, "/loss_mask");
  }

  const hsize_t n = cid_dims[0];
  if (off_dims[0] != n + 1)
    fail(p, "/offsets",
         std::to_string(off_dims[0]) + " entries, expected N+1 = " + std::to_string(n + 1) +
             " for " + std::to_string(n) + " conversation ids");
  const hsize_t total = tok_dims[0];
  const std::vector<std::int64_t> offsets = read_int64s(off_ds.get(), n + 1, p, "/offsets");
  if (offsets[0] != 0)
    fail(p, "/offsets", "offsets[0] = " + std::to_string(offsets[0]) + ", expected 0");
  for (hsize_t i = 1; i <= n; ++i) {
    if (offsets[i] > static_cast<std::int64_t>(total))
      fail(p, "/offsets",
           "offsets[" + std::to_string(i) + "] = " + std::to_string(offsets[i]) +
               " is past the end of input_ids (" + std::to_string(total) + " rows)");
    if (offsets[i] < offsets[i - 1])
      fail(p, "/offsets",
           "not monotone: offsets[" + std::to_string(i) + "] = " + std::to_string(offsets[i]) +
               " < offsets[" + std::to_string(i - 1) + "] = " + std::to_string(offsets[i - 1]));
  }
  if (offsets[n] != static_cast<std::int64_t>(total))
    fail(p, "/offsets",
         "offsets[" + std::to_string(n) + "] = " + std::to_string(offsets[n]) +
             " but input_ids has " + std::to_string(total) + " rows");

  const auto h = static_cast<hsize_t>(*hidden_size);
  const auto kh = static_cast<hsize_t>(*aux_layers) * h;
  auto check_rows = [&](const std::vector<hsize_t>& dims, const std::string& field) {
    if (dims[0] != total)
      fail(p, field, std::to_string(dims[0]) + " rows but input_ids has " + std::to_string(total));
  };
  check_rows(hid_dims, "/hidden_states");
  check_rows(aux_dims, "/aux_hidden_states");
  if (mask_.dset.valid()) check_rows(mask_dims, "/loss_mask");
  if (hid_dims[1] != h)
    fail(p, "/hidden_states",
         "width " + std::to_string(hid_dims[1]) + " but root attribute hidden_size is " +
             std::to_string(h));
  if (aux_dims[1] != kh)
    fail(p, "/aux_hidden_states",
         "width " + std::to_string(aux_dims[1]) + " but aux_layers * hidden_size is " +
             std::to_string(kh));
  if (n > 0 && (h == 0 || kh == 0))
    fail(p, h == 0 ? "root attribute hidden_size" : "root attribute aux_layers",
         "must be positive in a shard that holds records");
  hidden_.width = h;
  aux_.width = kh;

  ids_.dtype = stored_dtype(ids_.dset.get(), Role::kIds, p, "/input_ids");
  hidden_.dtype = stored_dtype(hidden_.dset.get(), Role::kHidden, p, "/hidden_states");
  aux_.dtype = stored_dtype(aux_.dset.get(), Role::kHidden, p, "/aux_hidden_states");
  if (mask_.dset.valid())
    mask_.dtype = stored_dtype(mask_.dset.get(), Role::kMask, p, "/loss_mask");

  std::string codec = "raw";
  for (const Column* c : {&ids_, &hidden_, &aux_, &mask_}) {
    if (!c->dset.valid()) continue;
    const std::string cc = dataset_codec(c->dset.get(), p, c->field);
    if (cc != "raw") codec = cc;
  }

  const std::vector<std::string> ids = read_strings(ids_ds.get(), n, p, "/conversation_ids");
  // Optional per-record norm form: -1 not stated, 0 post-norm, 1 pre-norm.
  std::vector<std::int64_t> norms;
  if (Hid nd = open_dataset(file_.get(), "/hidden_states_prenorm", false, p, needs); nd.valid()) {
    const auto dims = dataset_dims(nd.get(), p, "/hidden_states_prenorm");
    expect_rank(dims, 1, "[N]", p, "/hidden_states_prenorm");
    if (dims[0] != n)
      fail(p, "/hidden_states_prenorm",
           std::to_string(dims[0]) + " entries but the shard holds " + std::to_string(n) + " records");
    norms = read_int64s(nd.get(), n, p, "/hidden_states_prenorm");
    for (hsize_t i = 0; i < n; ++i)
      if (norms[i] < -1 || norms[i] > 1)
        fail(p, "/hidden_states_prenorm",
             "entry " + std::to_string(i) + " is " + std::to_string(norms[i]) +
                 ", expected -1 (not stated), 0 (post-norm) or 1 (pre-norm)");
  }
  const std::size_t row_bytes = dtype_size(ids_.dtype) + h * dtype_size(hidden_.dtype) + kh * dtype_size(aux_.dtype) +
                                (mask_.dset.valid() ? dtype_size(mask_.dtype) : 0);
  entries_.resize(n);
  for (hsize_t i = 0; i < n; ++i) {
    Entry& e = entries_[i];
    e.row0 = static_cast<hsize_t>(offsets[i]);
    e.mask_dtype = mask_.dtype;
    RecordInfo& info = e.info;
    info.conversation_id = ids[i];
    info.key = ids[i];
    info.tokens = offsets[i + 1] - offsets[i];
    info.hidden_size = static_cast<std::int64_t>(h);
    info.aux_width = static_cast<std::int64_t>(kh);
    info.ids_dtype = ids_.dtype;
    info.hidden_dtype = common_hidden_dtype(hidden_.dtype, aux_.dtype);
    e.hidden_stored = hidden_.dtype;
    e.aux_stored = aux_.dtype;
    info.has_loss_mask = mask_.dset.valid();
    if (!norms.empty() && norms[i] >= 0) info.hidden_states_prenorm = norms[i] == 1;
    info.codec = codec;
    info.byte_size = codec == "raw" ? static_cast<std::uint64_t>(info.tokens) * row_bytes : 0;
  }
}

void Hdf5Reader::open_groups() {
  std::vector<std::string> groups;
  if (H5Ovisit2(file_.get(), H5_INDEX_NAME, H5_ITER_INC, collect_groups, &groups, H5O_INFO_BASIC) <
      0)
    fail_h5(path_, "/", "cannot list the groups");
  for (const std::string& name : groups) {
    const std::string group = name == "." ? "/" : "/" + name;
    const htri_t a = H5Lexists(file_.get(), child_path(group, "input_ids").c_str(), H5P_DEFAULT);
    const htri_t b =
        H5Lexists(file_.get(), child_path(group, "hidden_states").c_str(), H5P_DEFAULT);
    if (a < 0 || b < 0) fail_h5(path_, group, "cannot look up");
    if (a == 0 || b == 0) continue;
    const std::string id =
        group == "/" ? fs::path(path_).stem().string() : group.substr(group.rfind('/') + 1);
    add_group_record(group, id);
  }
  if (entries_.empty())
    fail(path_, "/",
         "neither an eaglekit HDF5 shard (no root attribute eaglekit_format) nor a file with "
         "record groups (no group holds both input_ids and hidden_states)");
}

void Hdf5Reader::add_group_record(const std::string& group, const std::string& id) {
  const std::string& p = path_;
  const std::string needs = "a record group holds input_ids, hidden_states and aux_hidden_states";
  const std::string f_ids = child_path(group, "input_ids");
  const std::string f_hid = child_path(group, "hidden_states");
  const std::string f_aux = child_path(group, "aux_hidden_states");
  const std::string f_mask = child_path(group, "loss_mask");
  Hid ids = open_dataset(file_.get(), f_ids, true, p, needs);
  Hid hid = open_dataset(file_.get(), f_hid, true, p, needs);
  Hid aux = open_dataset(file_.get(), f_aux, true, p, needs);
  Hid mask = open_dataset(file_.get(), f_mask, false, p, needs);

  const auto d_ids = dataset_dims(ids.get(), p, f_ids);
  expect_rank(d_ids, 1, "[T]", p, f_ids);
  const auto d_hid = dataset_dims(hid.get(), p, f_hid);
  expect_rank(d_hid, 2, "[T, H]", p, f_hid);
  const auto d_aux = dataset_dims(aux.get(), p, f_aux);
  expect_rank(d_aux, 2, "[T, k*H]", p, f_aux);
  const hsize_t t = d_ids[0];
  auto check_rows = [&](const std::vector<hsize_t>& dims, const std::string& field) {
    if (dims[0] != t)
      fail(p, field, std::to_string(dims[0]) + " rows but input_ids has " + std::to_string(t));
  };
  check_rows(d_hid, f_hid);
  check_rows(d_aux, f_aux);
  if (mask.valid()) {
    const auto d_mask = dataset_dims(mask.get(), p, f_mask);
    expect_rank(d_mask, 1, "[T]", p, f_mask);
    check_rows(d_mask, f_mask);
  }
  if (d_hid[1] == 0) fail(p, f_hid, "hidden size is 0");
  if (d_aux[1] == 0 || d_aux[1] % d_hid[1] != 0)
    fail(p, f_aux,
         "width " + std::to_string(d_aux[1]) + " is not a positive multiple of hidden size " +
             std::to_string(d_hid[1]));

  Entry e;
  e.group = group;
  RecordInfo& info = e.info;
  info.conversation_id = id;
  info.key = group;
  info.tokens = static_cast<std::int64_t>(t);
  info.hidden_size = static_cast<std::int64_t>(d_hid[1]);
  info.aux_width = static_cast<std::int64_t>(d_aux[1]);
  info.ids_dtype = stored_dtype(ids.get(), Role::kIds, p, f_ids);
  e.hidden_stored = stored_dtype(hid.get(), Role::kHidden, p, f_hid);
  e.aux_stored = stored_dtype(aux.get(), Role::kHidden, p, f_aux);
  info.hidden_dtype = common_hidden_dtype(e.hidden_stored, e.aux_stored);
  info.has_loss_mask = mask.valid();
  {
    Hid g(H5Gopen2(file_.get(), group.c_str(), H5P_DEFAULT), H5Gclose);
    if (!g.valid()) fail_h5(p, group, "cannot open the group");
    info.hidden_states_prenorm =
        read_bool_attr(g.get(), "hidden_states_prenorm", p, group + " attribute hidden_states_prenorm");
  }
  if (mask.valid()) e.mask_dtype = stored_dtype(mask.get(), Role::kMask, p, f_mask);
  std::string codec = "raw";
  const std::initializer_list<std::pair<hid_t, const std::string*>> datasets = {
      {ids.get(), &f_ids}, {hid.get(), &f_hid}, {aux.get(), &f_aux}, {mask.get(), &f_mask}};
  for (const auto& [d, f] : datasets) {
    if (d < 0) continue;
    const std::string cc = dataset_codec(d, p, *f);
    if (cc != "raw") codec = cc;
  }
  info.codec = codec;
  entries_.push_back(std::move(e));
}

void Hdf5Reader::index_ids() {
  by_id_.reserve(entries_.size());
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    const auto [it, inserted] = by_id_.emplace(entries_[i].info.conversation_id, i);
    if (!inserted) {
      const std::string& id = entries_[i].info.conversation_id;
      if (shard_)
        fail(path_, "/conversation_ids",
             "duplicate conversation id \"" + id + "\" (records " + std::to_string(it->second) +
                 " and " + std::to_string(i) + ")");
      fail(path_, entries_[i].group,
           "conversation id \"" + id + "\" is also the name of group " +
               entries_[it->second].group + "; record ids in one file must be unique");
    }
  }
}

Record Hdf5Reader::read_prefix(std::size_t i, std::int64_t max_rows) const {
  const Entry& e = entry(i);
  const RecordInfo& info = e.info;
  const hsize_t n = static_cast<hsize_t>(
      max_rows < 0 ? info.tokens : std::min<std::int64_t>(max_rows, info.tokens));
  const auto h = static_cast<hsize_t>(info.hidden_size);
  const auto kh = static_cast<hsize_t>(info.aux_width);
  Record r;
  r.conversation_id = info.conversation_id;
  r.hidden_states_prenorm = info.hidden_states_prenorm;
  Hdf5Lock lock;
  if (shard_) {
    r.input_ids = read_rows(ids_.dset.get(), info.ids_dtype, 1, 1, e.row0, n, path_, ids_.field);
    r.hidden_states = read_rows_as(hidden_.dset.get(), e.hidden_stored, info.hidden_dtype, 2, h, e.row0, n, path_,
                                   hidden_.field);
    r.aux_hidden_states =
        read_rows_as(aux_.dset.get(), e.aux_stored, info.hidden_dtype, 2, kh, e.row0, n, path_, aux_.field);
    if (mask_.dset.valid())
      r.loss_mask = read_rows(mask_.dset.get(), e.mask_dtype, 1, 1, e.row0, n, path_, mask_.field);
    return r;
  }
  auto read_ds = [&](const char* name, DType stored, DType dtype, std::size_t rank, hsize_t width) {
    const std::string field = child_path(e.group, name);
    Hid d = open_dataset(file_.get(), field, true, path_, "the file changed since it was opened");
    return read_rows_as(d.get(), stored, dtype, rank, width, 0, n, path_, field);
  };
  r.input_ids = read_ds("input_ids", info.ids_dtype, info.ids_dtype, 1, 1);
  r.hidden_states = read_ds("hidden_states", e.hidden_stored, info.hidden_dtype, 2, h);
  r.aux_hidden_states = read_ds("aux_hidden_states", e.aux_stored, info.hidden_dtype, 2, kh);
  if (info.has_loss_mask) r.loss_mask = read_ds("loss_mask", e.mask_dtype, e.mask_dtype, 1, 1);
  return r;
}

// ---------------------------------------------------------------------------------------
// Writer

std::atomic<unsigned> g_temp_counter{0};

class Hdf5Writer final : public RecordWriter {
 public:
  Hdf5Writer(std::string path, Hdf5WriterOptions opts);
  ~Hdf5Writer() override;
  void add(const Record& r) override;
  void finish() override;

 private:
  // One per-token dataset being appended to. Rows are written in whole chunks (so a
  // compressed chunk is encoded once); the tail of a partial chunk waits in buf.
  struct Column {
    std::string name;
    Hid dset;
    Hid file_type;
    Hid mem_type;
    std::size_t row_bytes = 0;
    int rank = 1;
    hsize_t width = 0;  // columns of a rank-2 dataset
    hsize_t chunk_rows = 1;
    hsize_t written = 0;
    std::vector<std::uint8_t> buf;
  };

  void create_column(Column& c, const std::string& name, hid_t file_type, hid_t mem_type, int rank,
                     hsize_t width, std::size_t itemsize, const char* dtype_attr);
  void append(Column& c, const std::uint8_t* p, hsize_t rows);
  void write_rows(Column& c, const std::uint8_t* p, hsize_t rows);
  void append_ones(Column& c, hsize_t rows);
  void write_string_attr(hid_t obj, const char* name, const std::string& value);
  void write_int_attr(hid_t obj, const char* name, std::int64_t value);
  [[noreturn]] void fail_write(const std::string& what);
  void close_all();

  std::string path_;
  std::string temp_path_;
  Hdf5WriterOptions opts_;
  Hid file_;
  Column ids_, mask_, hidden_, aux_;
  bool started_ = false;  // first record seen: shapes fixed, columns created
  bool has_mask_ = false;
  bool finished_ = false;
  bool broken_ = false;  // a write failed: the file is not trustworthy
  DType dtype_ = DType::kFloat32;
  std::int64_t hidden_size_ = 0;
  std::int64_t aux_width_ = 0;
  std::vector<std::string> conversation_ids_;
  std::vector<std::int64_t> offsets_{0};
  std::vector<std::int8_t> prenorm_;  // per record: -1 not stated, 0 post-norm, 1 pre-norm
  std::unordered_set<std::string> seen_;
};

Hdf5Writer::Hdf5Writer(std::string path, Hdf5WriterOptions opts)
    : path_(std::move(path)), opts_(opts) {
  if (opts_.gzip_level < 0 || opts_.gzip_level > 9)
    throw UsageError("HDF5 gzip level must be 0 (off) to 9, got " +
                     std::to_string(opts_.gzip_level));
  if (opts_.chunk_bytes == 0) throw UsageError("HDF5 chunk size must be positive");
  const fs::path fp(path_);
  const std::string dir = fp.parent_path().empty() ? "." : fp.parent_path().string();
  temp_path_ = dir + "/." + fp.filename().string() + ".tmp." + std::to_string(::getpid()) + "." +
               std::to_string(g_temp_counter++);
  Hdf5Lock lock;
  if (opts_.gzip_level > 0 && H5Zfilter_avail(H5Z_FILTER_DEFLATE) <= 0) {
    take_hdf5_error();
    throw UsageError("this libhdf5 has no gzip filter; write without compression");
  }
  // The file creation list is also the root group's: no object time on it either.
  Hid fcpl(H5Pcreate(H5P_FILE_CREATE), H5Pclose);
  if (fcpl.valid() && H5Pset_obj_track_times(fcpl.get(), false) >= 0)
    file_ = Hid(H5Fcreate(temp_path_.c_str(), H5F_ACC_EXCL, fcpl.get(), H5P_DEFAULT), H5Fclose);
  if (!file_.valid()) {
    const std::string detail = take_hdf5_error();
    throw IoError(temp_path_ + ": cannot create HDF5 file" +
                  (detail.empty() ? std::string() : ": " + detail));
  }
}

void Hdf5Writer::close_all() {
  for (Column* c : {&ids_, &mask_, &hidden_, &aux_}) {
    c->dset.reset();
    c->file_type.reset();
    c->mem_type.reset();
  }
  file_.reset();
}

Hdf5Writer::~Hdf5Writer() {
  if (finished_) return;
  try {
    Hdf5Lock lock;
    close_all();
    take_hdf5_error();
  } catch (...) {
  }
  ::unlink(temp_path_.c_str());
}

void Hdf5Writer::fail_write(const std::string& what) {
  broken_ = true;
  const std::string detail = take_hdf5_error();
  throw IoError(temp_path_ + ": " + what + (detail.empty() ? std::string() : ": " + detail));
}

// Creation property list of a dataset we write. No object times: HDF5 would otherwise
// stamp each object header with the wall clock, so identical records written twice would
// give different bytes (and `convert` / `pack` reruns would not be byte-identical).
Hid untimed_dcpl() {
  Hid dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  if (dcpl.valid() && H5Pset_obj_track_times(dcpl.get(), false) < 0) return Hid();
  return dcpl;
}

void Hdf5Writer::create_column(Column& c, const std::string& name, hid_t file_type, hid_t mem_type,
                               int rank, hsize_t width, std::size_t itemsize,
                               const char* dtype_attr) {
  c.name = name;
  c.file_type = Hid(H5Tcopy(file_type), H5Tclose);
  c.mem_type = Hid(H5Tcopy(mem_type), H5Tclose);
  c.rank = rank;
  c.width = width;
  c.row_bytes = itemsize * (rank == 2 ? width : 1);
  const bool empty = started_ == false;  // finish() of a shard without records
  hsize_t dims[2] = {0, width};
  hsize_t maxdims[2] = {empty ? 0 : H5S_UNLIMITED, width};
  Hid space(H5Screate_simple(rank, dims, maxdims), H5Sclose);
  Hid dcpl = untimed_dcpl();
  if (!space.valid() || !dcpl.valid()) fail_write("cannot create dataset " + name);
  if (!empty) {
    c.chunk_rows = std::clamp<hsize_t>(opts_.chunk_bytes / c.row_bytes, 1, kMaxChunkRows);
    const hsize_t chunk[2] = {c.chunk_rows, width};
    if (H5Pset_chunk(dcpl.get(), rank, chunk) < 0 ||
        H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER) < 0)
      fail_write("cannot set chunking of " + name);
    if (opts_.gzip_level > 0 &&
        (H5Pset_shuffle(dcpl.get()) < 0 ||
         H5Pset_deflate(dcpl.get(), static_cast<unsigned>(opts_.gzip_level)) < 0))
      fail_write("cannot set gzip on " + name);
  }
  c.dset = Hid(H5Dcreate2(file_.get(), name.c_str(), c.file_type.get(), space.get(), H5P_DEFAULT,
                          dcpl.get(), H5P_DEFAULT),
               H5Dclose);
  if (!c.dset.valid()) fail_write("cannot create dataset " + name);
  if (dtype_attr != nullptr) write_string_attr(c.dset.get(), "dtype", dtype_attr);
}

void Hdf5Writer::write_rows(Column& c, const std::uint8_t* p, hsize_t rows) {
  if (rows == 0) return;
  const int rank = c.rank;
  const hsize_t new_dims[2] = {c.written + rows, c.width};
  if (H5Dset_extent(c.dset.get(), new_dims) < 0) fail_write("cannot extend " + c.name);
  Hid fspace(H5Dget_space(c.dset.get()), H5Sclose);
  const hsize_t start[2] = {c.written, 0};
  const hsize_t count[2] = {rows, c.width};
  if (!fspace.valid() ||
      H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, start, nullptr, count, nullptr) < 0)
    fail_write("cannot select rows of " + c.name);
  Hid mspace(H5Screate_simple(rank, count, nullptr), H5Sclose);
  if (!mspace.valid() ||
      H5Dwrite(c.dset.get(), c.mem_type.get(), mspace.get(), fspace.get(), H5P_DEFAULT, p) < 0)
    fail_write("cannot write " + c.name);
  c.written += rows;
}

void Hdf5Writer::append(Column& c, const std::uint8_t* p, hsize_t rows) {
  if (!c.buf.empty()) {
    const hsize_t have = c.buf.size() / c.row_bytes;
    const hsize_t take = std::min(rows, c.chunk_rows - have);
    c.buf.insert(c.buf.end(), p, p + take * c.row_bytes);
    p += take * c.row_bytes;
    rows -= take;
    if (c.buf.size() / c.row_bytes < c.chunk_rows) return;
    write_rows(c, c.buf.data(), c.chunk_rows);
    c.buf.clear();
  }
  const hsize_t whole = rows / c.chunk_rows * c.chunk_rows;
  write_rows(c, p, whole);
  p += whole * c.row_bytes;
  c.buf.insert(c.buf.end(), p, p + (rows - whole) * c.row_bytes);
}

void Hdf5Writer::append_ones(Column& c, hsize_t rows) {
  const std::vector<std::uint8_t> ones(static_cast<std::size_t>(std::min(rows, c.chunk_rows)), 1);
  while (rows > 0) {
    const hsize_t k = std::min<hsize_t>(rows, ones.size());
    append(c, ones.data(), k);
    rows -= k;
  }
}

void Hdf5Writer::write_string_attr(hid_t obj, const char* name, const std::string& value) {
  Hid type(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(type.get(), H5T_VARIABLE);
  H5Tset_cset(type.get(), H5T_CSET_UTF8);
  Hid space(H5Screate(H5S_SCALAR), H5Sclose);
  Hid attr(H5Acreate2(obj, name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  const char* s = value.c_str();
  if (!attr.valid() || H5Awrite(attr.get(), type.get(), &s) < 0)
    fail_write(std::string("cannot write attribute ") + name);
}

void Hdf5Writer::write_int_attr(hid_t obj, const char* name, std::int64_t value) {
  Hid space(H5Screate(H5S_SCALAR), H5Sclose);
  Hid attr(H5Acreate2(obj, name, H5T_STD_I64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  if (!attr.valid() || H5Awrite(attr.get(), H5T_NATIVE_INT64, &value) < 0)
    fail_write(std::string("cannot write attribute ") + name);
}

void Hdf5Writer::add(const Record& in) {
  // A shard holds one dtype for both columns.
  const Record r = in.with_common_hidden_dtype();
  if (finished_) throw UsageError(path_ + ": add() after finish()");
  if (broken_) throw IoError(path_ + ": an earlier write failed; the shard cannot be finished");
  const std::string where = path_ + ": record \"" + r.conversation_id + "\"";
  if (r.conversation_id.empty())
    throw UsageError(path_ + ": a record without a conversation id cannot go into a shard");
  r.check(where);
  if (seen_.count(r.conversation_id) != 0)
    throw UsageError(where + ": conversation id already in the shard");
  if (started_) {
    if (r.hidden_size() != hidden_size_ || r.aux_width() != aux_width_ ||
        r.hidden_states.dtype != dtype_)
      throw UsageError(where + ": hidden size " + std::to_string(r.hidden_size()) + ", aux width " +
                       std::to_string(r.aux_width()) + ", dtype " +
                       std::string(dtype_name(r.hidden_states.dtype)) +
                       " differ from the shard's " + std::to_string(hidden_size_) + ", " +
                       std::to_string(aux_width_) + ", " + std::string(dtype_name(dtype_)) +
                       " (records in one shard share them)");
  }
  const auto t = static_cast<hsize_t>(r.tokens());

  // Convert before touching the file, so that a bad record leaves the shard intact.
  std::vector<std::int64_t> ids(t);
  if (r.input_ids.dtype == DType::kInt64) {
    r.input_ids.copy_to(ids.data());
  } else {
    std::vector<std::int32_t> narrow(t);
    r.input_ids.copy_to(narrow.data());
    std::copy(narrow.begin(), narrow.end(), ids.begin());
  }
  std::vector<std::uint8_t> mask;
  if (r.loss_mask) {
    mask.resize(t);
    for (hsize_t i = 0; i < t; ++i) {
      const double v = r.loss_mask->get(static_cast<std::int64_t>(i));
      if (v < 0 || v > 255 || v != static_cast<double>(static_cast<int>(v)))
        throw UsageError(where + ": loss_mask value " + std::to_string(v) +
                         " does not fit the shard's uint8 loss_mask");
      mask[i] = static_cast<std::uint8_t>(v);
    }
  }
  const HostTensor hidden =
      r.hidden_states.is_contiguous() ? r.hidden_states : r.hidden_states.contiguous();
  const HostTensor aux =
      r.aux_hidden_states.is_contiguous() ? r.aux_hidden_states : r.aux_hidden_states.contiguous();

  Hdf5Lock lock;
  if (!started_) {
    started_ = true;
    dtype_ = r.hidden_states.dtype;
    hidden_size_ = r.hidden_size();
    aux_width_ = r.aux_width();
    if (aux_width_ % hidden_size_ != 0)
      throw UsageError(where + ": aux width is not a multiple of the hidden size");
    Hid half;
    hid_t ftype = H5T_IEEE_F32LE, mtype = H5T_NATIVE_FLOAT;
    const char* attr = nullptr;
    switch (dtype_) {
      case DType::kBFloat16:
        ftype = H5T_STD_U16LE;
        mtype = H5T_NATIVE_UINT16;
        attr = "bfloat16";
        break;
      case DType::kFloat16:
        // IEEE half the way h5py builds it (HDF5 1.10 predefines none).
        half = Hid(H5Tcopy(H5T_IEEE_F32LE), H5Tclose);
        H5Tset_fields(half.get(), 15, 10, 5, 0, 10);
        H5Tset_size(half.get(), 2);
        H5Tset_ebias(half.get(), 15);
        ftype = mtype = half.get();
        break;
      case DType::kFloat64:
        ftype = H5T_IEEE_F64LE;
        mtype = H5T_NATIVE_DOUBLE;
        break;
      default:
        break;
    }
    create_column(ids_, "/input_ids", H5T_STD_I64LE, H5T_NATIVE_INT64, 1, 0, 8, nullptr);
    create_column(hidden_, "/hidden_states", ftype, mtype, 2, static_cast<hsize_t>(hidden_size_),
                  dtype_size(dtype_), attr);
    create_column(aux_, "/aux_hidden_states", ftype, mtype, 2, static_cast<hsize_t>(aux_width_),
                  dtype_size(dtype_), attr);
  }
  if (r.loss_mask && !has_mask_) {
    has_mask_ = true;
    create_column(mask_, "/loss_mask", H5T_STD_U8LE, H5T_NATIVE_UINT8, 1, 0, 1, nullptr);
    append_ones(mask_, static_cast<hsize_t>(offsets_.back()));  // records before had none
  }
  append(ids_, reinterpret_cast<const std::uint8_t*>(ids.data()), t);
  append(hidden_, hidden.data, t);
  append(aux_, aux.data, t);
  if (has_mask_) {
    if (r.loss_mask)
      append(mask_, mask.data(), t);
    else
      append_ones(mask_, t);
  }
  seen_.insert(r.conversation_id);
  conversation_ids_.push_back(r.conversation_id);
  prenorm_.push_back(!r.hidden_states_prenorm ? -1 : *r.hidden_states_prenorm ? 1 : 0);
  offsets_.push_back(offsets_.back() + static_cast<std::int64_t>(t));
}

void Hdf5Writer::finish() {
  if (finished_) throw UsageError(path_ + ": finish() called twice");
  if (broken_) throw IoError(path_ + ": an earlier write failed; the shard cannot be finished");
  {
    Hdf5Lock lock;
    if (!started_) {
      // No records: an empty but valid shard.
      create_column(ids_, "/input_ids", H5T_STD_I64LE, H5T_NATIVE_INT64, 1, 0, 8, nullptr);
      create_column(hidden_, "/hidden_states", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, 2, 0, 4, nullptr);
      create_column(aux_, "/aux_hidden_states", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, 2, 0, 4, nullptr);
    }
    for (Column* c : {&ids_, &mask_, &hidden_, &aux_}) {
      if (!c->dset.valid() || c->buf.empty()) continue;
      write_rows(*c, c->buf.data(), c->buf.size() / c->row_bytes);
      c->buf.clear();
      c->buf.shrink_to_fit();
    }

    const auto n = static_cast<hsize_t>(conversation_ids_.size());
    {
      Hid type(H5Tcopy(H5T_C_S1), H5Tclose);
      H5Tset_size(type.get(), H5T_VARIABLE);
      H5Tset_cset(type.get(), H5T_CSET_UTF8);
      Hid space(H5Screate_simple(1, &n, nullptr), H5Sclose);
      Hid dcpl = untimed_dcpl();
      Hid d(dcpl.valid() ? H5Dcreate2(file_.get(), "/conversation_ids", type.get(), space.get(),
                                      H5P_DEFAULT, dcpl.get(), H5P_DEFAULT)
                         : H5I_INVALID_HID,
            H5Dclose);
      std::vector<const char*> ptrs;
      ptrs.reserve(n);
      for (const auto& s : conversation_ids_) ptrs.push_back(s.c_str());
      if (!d.valid() ||
          (n > 0 && H5Dwrite(d.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, ptrs.data()) < 0))
        fail_write("cannot write /conversation_ids");
    }
    // A 1-D dataset of `count` values from `data` (memory type `mem`, stored as `stored`).
    auto write_vector = [&](const char* name, hid_t stored, hid_t mem, hsize_t count, const void* data) {
      Hid space(H5Screate_simple(1, &count, nullptr), H5Sclose);
      Hid dcpl = untimed_dcpl();
      Hid d(dcpl.valid() ? H5Dcreate2(file_.get(), name, stored, space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT)
                         : H5I_INVALID_HID,
            H5Dclose);
      if (!d.valid() || H5Dwrite(d.get(), mem, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0)
        fail_write(std::string("cannot write ") + name);
    };
    write_vector("/offsets", H5T_STD_I64LE, H5T_NATIVE_INT64, n + 1, offsets_.data());
    if (std::any_of(prenorm_.begin(), prenorm_.end(), [](std::int8_t v) { return v >= 0; }))
      write_vector("/hidden_states_prenorm", H5T_STD_I8LE, H5T_NATIVE_INT8, n, prenorm_.data());
    {
      Hid root(H5Gopen2(file_.get(), "/", H5P_DEFAULT), H5Gclose);
      if (!root.valid()) fail_write("cannot open the root group");
      write_string_attr(root.get(), "eaglekit_format", kShardTag);
      write_int_attr(root.get(), "version", kShardVersion);
      write_int_attr(root.get(), "hidden_size", hidden_size_);
      write_int_attr(root.get(), "aux_layers", hidden_size_ == 0 ? 0 : aux_width_ / hidden_size_);
    }
    for (Column* c : {&ids_, &mask_, &hidden_, &aux_}) {
      c->dset.reset();
      c->file_type.reset();
      c->mem_type.reset();
    }
    if (H5Fclose(file_.get()) < 0) {
      file_ = Hid();  // the identifier is gone either way
      fail_write("cannot close");
    }
    file_ = Hid();
  }
  // Durable before it becomes visible, like AtomicFile.
  const int fd = ::open(temp_path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError::from_errno(temp_path_, "cannot reopen to fsync", errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) throw IoError::from_errno(temp_path_, "cannot fsync", err);
  if (!opts_.overwrite && fs::exists(path_))
    throw UsageError(path_ + ": exists (pass overwrite to replace it)");
  if (::rename(temp_path_.c_str(), path_.c_str()) != 0)
    throw IoError::from_errno(path_, "cannot rename temp file into place", errno);
  finished_ = true;
  const fs::path parent = fs::path(path_).parent_path();
  const int dfd = ::open(parent.empty() ? "." : parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace

std::unique_ptr<RecordReader> open_hdf5_reader(const std::string& path) {
  return std::make_unique<Hdf5Reader>(path);
}

std::unique_ptr<RecordWriter> create_hdf5_shard_writer(const std::string& path,
                                                       const Hdf5WriterOptions& opts) {
  if (!opts.overwrite && fs::exists(path))
    throw UsageError(path + ": exists (pass overwrite to replace it)");
  return std::make_unique<Hdf5Writer>(path, opts);
}

std::unique_ptr<RecordWriter> create_hdf5_writer(const std::string& path,
                                                 const WriterOptions& opts) {
  Hdf5WriterOptions h;
  h.overwrite = opts.overwrite;
  if (opts.codec == "gzip") {
    if (opts.level < 1 || opts.level > 9)
      throw UsageError("HDF5 gzip level must be 1 to 9, got " + std::to_string(opts.level));
    h.gzip_level = opts.level;
  } else if (opts.codec != "raw" && opts.codec != "none" && opts.codec != "zstd") {
    throw UsageError("HDF5 shards take codec gzip or raw, not \"" + opts.codec + "\"");
  }
  return create_hdf5_shard_writer(path, h);
}

}  // namespace eaglekit
