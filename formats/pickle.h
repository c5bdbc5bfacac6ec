// A minimal, safe Python unpickler for torch.save's data.pkl, and the matching protocol-2
// pickle writer.
//
// Reading: protocols 2-5 (the binary opcodes torch.save and Python's pickler emit, plus the
// few protocol-0/1 container opcodes that cost nothing) into a small value model: None,
// bool, int (64-bit), float, str, bytes, tuple, list, dict (ordered), and three torch kinds:
// a whitelisted global, a storage reference (BINPERSID) and a tensor (a rebuild call).
// Nothing is ever imported or called: a GLOBAL names one of a fixed list (tensor rebuild
// functions, storage classes, dtypes, collections.OrderedDict, torch.device,
// _codecs.encode), anything else is a FormatError naming it, e.g.
//   "x.pt: data.pkl at byte 42: global 'os.system' is not allowed (only tensor dicts can
//    be read)".
// Every length is checked against the bytes left before anything is allocated; the
// stack, mark stack and memo are bounds-checked; the number of values is capped
// (PickleLimits). Values live in an arena owned by the Pickle, so cycles and deep nesting
// made through the memo cannot leak or recurse on destruction; code walking the tree must
// bound its own depth (kMaxPickleDepth).
//
// Thread safety: a Pickle is immutable after unpickle(); share it freely.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "formats/dtype.h"

namespace eaglekit::pickle {

enum class Kind : std::uint8_t {
  kNone,
  kBool,
  kInt,
  kFloat,
  kStr,
  kBytes,
  kTuple,
  kList,
  kDict,
  kGlobal,   // a whitelisted callable or class, by "module.name"
  kStorage,  // ('storage', StorageClass, key, location, numel) from BINPERSID
  kTensor,   // the result of a whitelisted tensor rebuild
};
std::string_view kind_name(Kind k);  // "None", "int", "str", "tensor", ...

constexpr int kMaxPickleDepth = 64;  // nesting a consumer walks before giving up
constexpr int kMaxTensorDims = 32;

struct Value {
  Kind kind = Kind::kNone;
  bool b = false;
  std::int64_t i = 0;
  double f = 0.0;
  std::string s;  // str / bytes contents; global name ("torch.FloatStorage"); storage key
  std::vector<const Value*> items;                           // tuple, list
  std::vector<std::pair<const Value*, const Value*>> dict;   // dict, in insertion order
  // kGlobal naming a storage class or a torch dtype, kStorage, kTensor: the element type.
  DType dtype = DType::kUInt8;
  bool has_dtype = false;
  // kStorage: `i` is numel (elements of dtype), `s` the key, `location` the device.
  std::string location;
  // kTensor
  const Value* storage = nullptr;
  std::int64_t storage_offset = 0;  // elements of dtype
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;
  std::uint64_t offset = 0;  // byte in the pickle where this value was made (for errors)

  // For a dict: the value under a str key, nullptr when absent (or not a dict).
  const Value* get(std::string_view key) const;
};

struct PickleLimits {
  std::size_t max_values = std::size_t{1} << 22;  // a tensor dict holds ~20 per tensor
};

class Pickle {
 public:
  const Value& root() const { return *root_; }
  std::size_t value_count() const { return arena_.size(); }

 private:
  friend class Unpickler;
  std::deque<Value> arena_;
  const Value* root_ = nullptr;
};

// Parses a whole pickle (up to STOP). `path` and `field` name it in errors ("x.pt",
// "data.pkl"); offsets in errors are relative to the pickle's first byte. Throws
// FormatError.
Pickle unpickle(const std::uint8_t* data, std::size_t n, const std::string& path,
                const std::string& field, const PickleLimits& limits = {});

// Writes protocol-2 pickles the way Python's pickler does for torch.save (memoizing
// globals and repeated strings with BINPUT, SETITEMS in batches of 1000).
// Not thread-safe; build one pickle per instance.
class PickleWriter {
 public:
  PickleWriter();  // emits PROTO 2

  void none();
  void boolean(bool v);
  void integer(std::int64_t v);  // BININT1/BININT2/BININT/LONG1 like Python
  void real(double v);           // BINFLOAT
  void str(std::string_view v);  // BINUNICODE, memoized
  void global(std::string_view module, std::string_view name);  // GLOBAL, memoized
  void mark();
  void tuple_from_mark();   // TUPLE (or EMPTY_TUPLE/TUPLE1-3 when the mark holds 0-3 items)
  void empty_dict();
  void setitem();
  void setitems();
  void reduce();
  void binpersid();
  void stop();
  // Memoizes the value on top of the stack (BINPUT/LONG_BINPUT).
  void memoize();
  const std::string& bytes() const { return out_; }

 private:
  void put_memo_ref(std::uint32_t idx);
  std::string out_;
  std::uint32_t next_memo_ = 0;
  std::map<std::string, std::uint32_t> memo_;  // "g:module.name" / "s:text" -> index
  std::vector<std::size_t> marks_;             // out_ sizes and stack depths at MARK
  std::vector<std::size_t> mark_depths_;
  std::size_t depth_ = 0;                      // values on the (virtual) stack
};

}  // namespace eaglekit::pickle
