#include "formats/pickle.h"

#include <cmath>
#include <cstring>
#include <optional>
#include <unordered_map>

#include "formats/error.h"

namespace eaglekit::pickle {

namespace {

// Opcode names as pickletools spells them, for error messages.
const char* opcode_name(std::uint8_t op) {
  switch (op) {
    case '(': return "MARK";
    case '.': return "STOP";
    case '0': return "POP";
    case '1': return "POP_MARK";
    case '2': return "DUP";
    case 'F': return "FLOAT";
    case 'I': return "INT";
    case 'J': return "BININT";
    case 'K': return "BININT1";
    case 'L': return "LONG";
    case 'M': return "BININT2";
    case 'N': return "NONE";
    case 'P': return "PERSID";
    case 'Q': return "BINPERSID";
    case 'R': return "REDUCE";
    case 'S': return "STRING";
    case 'T': return "BINSTRING";
    case 'U': return "SHORT_BINSTRING";
    case 'V': return "UNICODE";
    case 'X': return "BINUNICODE";
    case 'a': return "APPEND";
    case 'b': return "BUILD";
    case 'c': return "GLOBAL";
    case 'd': return "DICT";
    case '}': return "EMPTY_DICT";
    case 'e': return "APPENDS";
    case 'g': return "GET";
    case 'h': return "BINGET";
    case 'i': return "INST";
    case 'j': return "LONG_BINGET";
    case 'l': return "LIST";
    case ']': return "EMPTY_LIST";
    case 'o': return "OBJ";
    case 'p': return "PUT";
    case 'q': return "BINPUT";
    case 'r': return "LONG_BINPUT";
    case 's': return "SETITEM";
    case 't': return "TUPLE";
    case ')': return "EMPTY_TUPLE";
    case 'u': return "SETITEMS";
    case 'G': return "BINFLOAT";
    case 0x80: return "PROTO";
    case 0x81: return "NEWOBJ";
    case 0x82: return "EXT1";
    case 0x83: return "EXT2";
    case 0x84: return "EXT4";
    case 0x85: return "TUPLE1";
    case 0x86: return "TUPLE2";
    case 0x87: return "TUPLE3";
    case 0x88: return "NEWTRUE";
    case 0x89: return "NEWFALSE";
    case 0x8a: return "LONG1";
    case 0x8b: return "LONG4";
    case 'B': return "BINBYTES";
    case 'C': return "SHORT_BINBYTES";
    case 0x8c: return "SHORT_BINUNICODE";
    case 0x8d: return "BINUNICODE8";
    case 0x8e: return "BINBYTES8";
    case 0x8f: return "EMPTY_SET";
    case 0x90: return "ADDITEMS";
    case 0x91: return "FROZENSET";
    case 0x92: return "NEWOBJ_EX";
    case 0x93: return "STACK_GLOBAL";
    case 0x94: return "MEMOIZE";
    case 0x95: return "FRAME";
    case 0x96: return "BYTEARRAY8";
    case 0x97: return "NEXT_BUFFER";
    case 0x98: return "READONLY_BUFFER";
    default: return nullptr;
  }
}

std::string hex_byte(std::uint8_t b) {
  static const char* kHex = "0123456789abcdef";
  return std::string("0x") + kHex[b >> 4] + kHex[b & 15];
}

struct GlobalInfo {
  const char* name;
  std::optional<DType> dtype;
};

// The only callables and classes a pickle may name. Storage classes carry their element
// type; torch dtypes appear as arguments of _rebuild_tensor_v3.
const GlobalInfo kGlobals[] = {
    {"torch._utils._rebuild_tensor", std::nullopt},
    {"torch._utils._rebuild_tensor_v2", std::nullopt},
    {"torch._utils._rebuild_tensor_v3", std::nullopt},
    {"torch._utils._rebuild_parameter", std::nullopt},
    {"torch._utils._rebuild_parameter_with_state", std::nullopt},
    {"collections.OrderedDict", std::nullopt},
    {"torch.device", std::nullopt},
    {"_codecs.encode", std::nullopt},
    {"torch.FloatStorage", DType::kFloat32},
    {"torch.DoubleStorage", DType::kFloat64},
    {"torch.HalfStorage", DType::kFloat16},
    {"torch.BFloat16Storage", DType::kBFloat16},
    {"torch.LongStorage", DType::kInt64},
    {"torch.IntStorage", DType::kInt32},
    {"torch.ShortStorage", DType::kInt16},
    {"torch.CharStorage", DType::kInt8},
    {"torch.ByteStorage", DType::kUInt8},
    {"torch.BoolStorage", DType::kBool},
    {"torch.UntypedStorage", DType::kUInt8},
    {"torch.storage.UntypedStorage", DType::kUInt8},
    {"torch.float32", DType::kFloat32},
    {"torch.float64", DType::kFloat64},
    {"torch.float16", DType::kFloat16},
    {"torch.bfloat16", DType::kBFloat16},
    {"torch.int64", DType::kInt64},
    {"torch.int32", DType::kInt32},
    {"torch.int16", DType::kInt16},
    {"torch.int8", DType::kInt8},
    {"torch.uint8", DType::kUInt8},
    {"torch.bool", DType::kBool},
};

}  // namespace

std::string_view kind_name(Kind k) {
  switch (k) {
    case Kind::kNone: return "None";
    case Kind::kBool: return "bool";
    case Kind::kInt: return "int";
    case Kind::kFloat: return "float";
    case Kind::kStr: return "str";
    case Kind::kBytes: return "bytes";
    case Kind::kTuple: return "tuple";
    case Kind::kList: return "list";
    case Kind::kDict: return "dict";
    case Kind::kGlobal: return "global";
    case Kind::kStorage: return "storage";
    case Kind::kTensor: return "tensor";
  }
  return "?";
}

const Value* Value::get(std::string_view key) const {
  if (kind != Kind::kDict) return nullptr;
  for (const auto& kv : dict)
    if (kv.first->kind == Kind::kStr && kv.first->s == key) return kv.second;
  return nullptr;
}

class Unpickler {
 public:
  Unpickler(const std::uint8_t* data, std::size_t n, const std::string& path,
            const std::string& field, const PickleLimits& limits)
      : p_(data), n_(n), path_(path), field_(field), limits_(limits) {}

  Pickle run() {
    while (true) {
      if (pos_ >= n_) fail(pos_, "ends before STOP (truncated)");
      op_at_ = pos_;
      const std::uint8_t op = p_[pos_++];
      if (op == '.') break;
      step(op);
    }
    if (stack_.size() != 1)
      fail(op_at_, "STOP with " + std::to_string(stack_.size()) +
                       " values on the stack (expected exactly 1)");
    if (!marks_.empty()) fail(op_at_, "STOP with an open MARK");
    out_.root_ = stack_.back();
    return std::move(out_);
  }

 private:
  [[noreturn]] void fail(std::uint64_t at, const std::string& what) const {
    throw FormatError(path_, at, field_, what);
  }

  // --- input -------------------------------------------------------------------------
  const std::uint8_t* take(std::uint64_t len, const char* what) {
    if (len > n_ - pos_)
      fail(op_at_, std::string(what) + " needs " + std::to_string(len) + " bytes but only " +
                       std::to_string(n_ - pos_) + " are left (truncated or corrupt)");
    const std::uint8_t* q = p_ + pos_;
    pos_ += len;
    return q;
  }
  std::uint64_t u8() { return *take(1, opcode_name(p_[op_at_])); }
  std::uint64_t u16() { return load16(take(2, opcode_name(p_[op_at_]))); }
  std::uint64_t u32() { return load32(take(4, opcode_name(p_[op_at_]))); }
  std::uint64_t u64() {
    const std::uint8_t* q = take(8, opcode_name(p_[op_at_]));
    return load32(q) | (static_cast<std::uint64_t>(load32(q + 4)) << 32);
  }
  static std::uint64_t load16(const std::uint8_t* q) { return q[0] | (q[1] << 8); }
  static std::uint64_t load32(const std::uint8_t* q) {
    return static_cast<std::uint64_t>(q[0]) | (static_cast<std::uint64_t>(q[1]) << 8) |
           (static_cast<std::uint64_t>(q[2]) << 16) | (static_cast<std::uint64_t>(q[3]) << 24);
  }
  std::string line() {
    const std::uint8_t* start = p_ + pos_;
    const void* nl = std::memchr(start, '\n', n_ - pos_);
    if (nl == nullptr) fail(op_at_, std::string(opcode_name(p_[op_at_])) + ": unterminated line");
    const std::size_t len = static_cast<const std::uint8_t*>(nl) - start;
    pos_ += len + 1;
    return std::string(reinterpret_cast<const char*>(start), len);
  }

  // --- values and stack --------------------------------------------------------------
  Value* make(Kind k) {
    if (out_.arena_.size() >= limits_.max_values)
      fail(op_at_, "more than " + std::to_string(limits_.max_values) +
                       " values (not a tensor dict, or hostile)");
    out_.arena_.emplace_back();
    Value* v = &out_.arena_.back();
    v->kind = k;
    v->offset = op_at_;
    return v;
  }
  void push(const Value* v) { stack_.push_back(v); }
  const Value* pop() {
    if (stack_.size() <= floor()) fail(op_at_, std::string(opcode_name(p_[op_at_])) + ": stack underflow");
    const Value* v = stack_.back();
    stack_.pop_back();
    return v;
  }
  const Value* top() {
    if (stack_.size() <= floor()) fail(op_at_, std::string(opcode_name(p_[op_at_])) + ": stack underflow");
    return stack_.back();
  }
  // Values below the innermost MARK belong to enclosing constructs.
  std::size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  std::vector<const Value*> pop_mark() {
    if (marks_.empty()) fail(op_at_, std::string(opcode_name(p_[op_at_])) + " without a MARK");
    const std::size_t m = marks_.back();
    marks_.pop_back();
    std::vector<const Value*> items(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return items;
  }
  // Containers are built in place; the arena owns them, so a const_cast is ours to make.
  Value* mut(const Value* v) { return const_cast<Value*>(v); }

  void push_str(Kind k, const std::uint8_t* q, std::uint64_t len) {
    Value* v = make(k);
    v->s.assign(reinterpret_cast<const char*>(q), static_cast<std::size_t>(len));
    push(v);
  }
  void push_int(std::int64_t x) {
    Value* v = make(Kind::kInt);
    v->i = x;
    push(v);
  }
  void push_long(std::uint64_t len) {
    if (len > 8)
      fail(op_at_, "integer of " + std::to_string(len) + " bytes does not fit in 64 bits");
    const std::uint8_t* q = take(len, "LONG");
    std::uint64_t x = 0;
    for (std::uint64_t k = 0; k < len; ++k) x |= static_cast<std::uint64_t>(q[k]) << (8 * k);
    if (len > 0 && len < 8 && (q[len - 1] & 0x80)) x |= ~std::uint64_t{0} << (8 * len);
    push_int(static_cast<std::int64_t>(x));
  }
  void memo_put(std::uint64_t idx) { memo_[idx] = top(); }
  void memo_get(std::uint64_t idx) {
    auto it = memo_.find(idx);
    if (it == memo_.end()) fail(op_at_, "memo key " + std::to_string(idx) + " was never stored");
    push(it->second);
  }
  void make_tuple(std::vector<const Value*> items) {
    Value* v = make(Kind::kTuple);
    v->items = std::move(items);
    push(v);
  }

  void set_items(const Value* d, const std::vector<const Value*>& kv) {
    if (d->kind != Kind::kDict)
      fail(op_at_, std::string(opcode_name(p_[op_at_])) + " on a " +
                       std::string(kind_name(d->kind)) + ", expected a dict");
    if (kv.size() % 2 != 0) fail(op_at_, "SETITEMS with an odd number of values");
    Value* m = mut(d);
    for (std::size_t k = 0; k < kv.size(); k += 2) {
      // A repeated key replaces the value in place, as a Python dict does.
      bool replaced = false;
      if (kv[k]->kind == Kind::kStr || kv[k]->kind == Kind::kInt) {
        for (auto& e : m->dict)
          if (e.first->kind == kv[k]->kind && e.first->s == kv[k]->s && e.first->i == kv[k]->i) {
            e.second = kv[k + 1];
            replaced = true;
            break;
          }
      }
      if (!replaced) m->dict.emplace_back(kv[k], kv[k + 1]);
    }
  }
  void append_items(const Value* l, const std::vector<const Value*>& items) {
    if (l->kind != Kind::kList)
      fail(op_at_, std::string(opcode_name(p_[op_at_])) + " on a " +
                       std::string(kind_name(l->kind)) + ", expected a list");
    auto& dst = mut(l)->items;
    dst.insert(dst.end(), items.begin(), items.end());
  }

  // --- globals and calls -------------------------------------------------------------
  void push_global(const std::string& module, const std::string& name) {
    const std::string full = module + "." + name;
    for (const auto& g : kGlobals) {
      if (full != g.name) continue;
      Value* v = make(Kind::kGlobal);
      v->s = full;
      if (g.dtype) {
        v->dtype = *g.dtype;
        v->has_dtype = true;
      }
      push(v);
      return;
    }
    // Valid torch files whose element types we have no DType for: say so, not "unsafe".
    static const char* const kOtherDtypes[] = {
        "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
        "float8_e5m2fnuz", "complex32", "complex64", "complex128", "qint8", "quint8", "qint32"};
    bool other = module == "torch" && name.size() > 7 &&
                 name.compare(name.size() - 7, 7, "Storage") == 0;
    for (const char* d : kOtherDtypes) other = other || (module == "torch" && name == d);
    if (other)
      throw UnsupportedError(path_, op_at_, field_,
                             "'" + full + "': this element type is not supported (eaglekit reads "
                             "bool, uint8, int8-int64, float16, bfloat16, float32, float64)");
    fail(op_at_, "global '" + full + "' is not allowed (only tensor dicts can be read)");
  }

  const Value* arg(const std::vector<const Value*>& a, std::size_t k, Kind want,
                   const std::string& fn, const char* what) {
    if (a[k]->kind != want)
      fail(op_at_, fn + ": " + what + " is a " + std::string(kind_name(a[k]->kind)) +
                       ", expected " + std::string(kind_name(want)));
    return a[k];
  }
  std::vector<std::int64_t> int_tuple(const Value* t, const std::string& fn, const char* what) {
    if (t->kind != Kind::kTuple && t->kind != Kind::kList)
      fail(op_at_, fn + ": " + what + " is a " + std::string(kind_name(t->kind)) +
                       ", expected a tuple of ints");
    if (t->items.size() > static_cast<std::size_t>(kMaxTensorDims))
      fail(op_at_, fn + ": " + what + " has " + std::to_string(t->items.size()) +
                       " dimensions (at most " + std::to_string(kMaxTensorDims) + ")");
    std::vector<std::int64_t> out;
    for (const Value* x : t->items) {
      if (x->kind != Kind::kInt) fail(op_at_, fn + ": " + what + " holds a " + std::string(kind_name(x->kind)));
      if (x->i < 0) fail(op_at_, fn + ": " + what + " holds the negative value " + std::to_string(x->i));
      out.push_back(x->i);
    }
    return out;
  }

  const Value* rebuild_tensor(const std::string& fn, const std::vector<const Value*>& a,
                              std::optional<DType> dtype) {
    const Value* st = arg(a, 0, Kind::kStorage, fn, "argument 1 (storage)");
    const Value* off = arg(a, 1, Kind::kInt, fn, "argument 2 (storage offset)");
    if (off->i < 0) fail(op_at_, fn + ": negative storage offset " + std::to_string(off->i));
    Value* t = make(Kind::kTensor);
    t->storage = st;
    t->dtype = dtype ? *dtype : st->dtype;
    t->has_dtype = true;
    t->storage_offset = off->i;
    t->shape = int_tuple(a[2], fn, "argument 3 (size)");
    t->strides = int_tuple(a[3], fn, "argument 4 (stride)");
    if (t->shape.size() != t->strides.size())
      fail(op_at_, fn + ": size has " + std::to_string(t->shape.size()) + " dimensions but stride has " +
                       std::to_string(t->strides.size()));
    return t;
  }

  const Value* call(const Value* fn, const Value* args_v) {
    if (fn->kind != Kind::kGlobal)
      fail(op_at_, "REDUCE on a " + std::string(kind_name(fn->kind)) + ", expected a global");
    if (args_v->kind != Kind::kTuple)
      fail(op_at_, "REDUCE arguments are a " + std::string(kind_name(args_v->kind)) +
                       ", expected a tuple");
    const auto& a = args_v->items;
    const std::string& name = fn->s;
    auto want_args = [&](std::size_t lo, std::size_t hi) {
      if (a.size() < lo || a.size() > hi)
        fail(op_at_, name + " called with " + std::to_string(a.size()) + " arguments (expected " +
                         std::to_string(lo) + (hi != lo ? ".." + std::to_string(hi) : "") + ")");
    };
    if (name == "torch._utils._rebuild_tensor") {
      want_args(4, 4);
      return rebuild_tensor(name, a, std::nullopt);
    }
    if (name == "torch._utils._rebuild_tensor_v2") {
      want_args(6, 7);  // (storage, offset, size, stride, requires_grad, hooks[, metadata])
      return rebuild_tensor(name, a, std::nullopt);
    }
    if (name == "torch._utils._rebuild_tensor_v3") {
      want_args(7, 8);  // (..., hooks, dtype[, metadata])
      const Value* d = arg(a, 6, Kind::kGlobal, name, "argument 7 (dtype)");
      if (!d->has_dtype || d->s.rfind("torch.", 0) != 0 || d->s.find("Storage") != std::string::npos)
        fail(op_at_, name + ": argument 7 is '" + d->s + "', expected a torch dtype");
      return rebuild_tensor(name, a, d->dtype);
    }
    if (name == "torch._utils._rebuild_parameter" ||
        name == "torch._utils._rebuild_parameter_with_state") {
      if (name == "torch._utils._rebuild_parameter") want_args(3, 3);
      else want_args(4, 4);
      return arg(a, 0, Kind::kTensor, name, "argument 1 (data)");
    }
    if (name == "collections.OrderedDict") {
      if (!a.empty()) fail(op_at_, "collections.OrderedDict called with arguments");
      return make(Kind::kDict);
    }
    if (name == "torch.device") {
      want_args(1, 2);
      Value* v = make(Kind::kStr);
      v->s = arg(a, 0, Kind::kStr, name, "argument 1 (type)")->s;
      if (a.size() == 2 && a[1]->kind == Kind::kInt) v->s += ":" + std::to_string(a[1]->i);
      return v;
    }
    if (name == "_codecs.encode") {  // protocol 2 pickles bytes as encode(str, 'latin1')
      want_args(2, 2);
      const Value* text = arg(a, 0, Kind::kStr, name, "argument 1");
      const Value* enc = arg(a, 1, Kind::kStr, name, "argument 2");
      if (enc->s != "latin1" && enc->s != "latin-1")
        fail(op_at_, "_codecs.encode with encoding '" + enc->s + "' (only latin1 is read)");
      Value* v = make(Kind::kBytes);
      // str holds UTF-8; latin1 maps code points 0..255 to bytes.
      const std::string& u = text->s;
      for (std::size_t k = 0; k < u.size(); ++k) {
        const auto c = static_cast<std::uint8_t>(u[k]);
        if (c < 0x80) {
          v->s.push_back(static_cast<char>(c));
        } else if ((c == 0xc2 || c == 0xc3) && k + 1 < u.size()) {
          v->s.push_back(static_cast<char>(((c & 0x03) << 6) | (static_cast<std::uint8_t>(u[k + 1]) & 0x3f)));
          ++k;
        } else {
          fail(op_at_, "_codecs.encode: text is not latin1");
        }
      }
      return v;
    }
    fail(op_at_, "global '" + name + "' cannot be called");
  }

  const Value* persistent(const Value* pid) {
    if (pid->kind != Kind::kTuple)
      fail(op_at_, "BINPERSID id is a " + std::string(kind_name(pid->kind)) + ", expected a tuple");
    const auto& a = pid->items;
    if (a.size() < 5 || a.size() > 6 || a[0]->kind != Kind::kStr || a[0]->s != "storage")
      fail(op_at_, "BINPERSID id is not ('storage', type, key, location, numel)");
    const Value* cls = a[1];
    if (cls->kind != Kind::kGlobal || !cls->has_dtype || cls->s.find("Storage") == std::string::npos)
      fail(op_at_, "BINPERSID storage type is not a storage class");
    if (a[2]->kind != Kind::kStr && a[2]->kind != Kind::kInt)
      fail(op_at_, "BINPERSID storage key is a " + std::string(kind_name(a[2]->kind)));
    if (a[3]->kind != Kind::kStr)
      fail(op_at_, "BINPERSID location is a " + std::string(kind_name(a[3]->kind)));
    if (a[4]->kind != Kind::kInt || a[4]->i < 0)
      fail(op_at_, "BINPERSID numel is not a non-negative int");
    Value* v = make(Kind::kStorage);
    v->s = a[2]->kind == Kind::kStr ? a[2]->s : std::to_string(a[2]->i);
    v->location = a[3]->s;
    v->i = a[4]->i;
    v->dtype = cls->dtype;
    v->has_dtype = true;
    return v;
  }

  // --- the opcode loop ---------------------------------------------------------------
  void step(std::uint8_t op) {
    switch (op) {
      case 0x80: {  // PROTO
        const auto v = u8();
        if (v > 5) fail(op_at_, "pickle protocol " + std::to_string(v) + " is newer than 5");
        break;
      }
      case 0x95: {  // FRAME: a length prefix; the opcodes inside are read inline
        const auto len = u64();
        if (len > n_ - pos_)
          fail(op_at_, "FRAME of " + std::to_string(len) + " bytes but only " +
                           std::to_string(n_ - pos_) + " are left (truncated)");
        break;
      }
      case '(': marks_.push_back(stack_.size()); break;
      case '}': push(make(Kind::kDict)); break;
      case ']': push(make(Kind::kList)); break;
      case ')': make_tuple({}); break;
      case 't': make_tuple(pop_mark()); break;
      case 0x85: { auto a = pop(); make_tuple({a}); break; }
      case 0x86: { auto b = pop(); auto a = pop(); make_tuple({a, b}); break; }
      case 0x87: { auto c = pop(); auto b = pop(); auto a = pop(); make_tuple({a, b, c}); break; }
      case 'l': {
        Value* v = make(Kind::kList);
        v->items = pop_mark();
        push(v);
        break;
      }
      case 'd': {
        auto kv = pop_mark();
        Value* v = make(Kind::kDict);
        push(v);
        set_items(v, kv);
        break;
      }
      case 's': {
        auto val = pop();
        auto key = pop();
        set_items(top(), {key, val});
        break;
      }
      case 'u': {
        auto kv = pop_mark();
        set_items(top(), kv);
        break;
      }
      case 'a': {
        auto x = pop();
        append_items(top(), {x});
        break;
      }
      case 'e': {
        auto items = pop_mark();
        append_items(top(), items);
        break;
      }
      case 'J': push_int(static_cast<std::int32_t>(static_cast<std::uint32_t>(u32()))); break;
      case 'K': push_int(static_cast<std::int64_t>(u8())); break;
      case 'M': push_int(static_cast<std::int64_t>(u16())); break;
      case 0x8a: push_long(u8()); break;
      case 0x8b: push_long(u32()); break;
      case 'G': {
        const std::uint8_t* q = take(8, "BINFLOAT");
        std::uint64_t bits = 0;
        for (int k = 0; k < 8; ++k) bits = (bits << 8) | q[k];  // big-endian
        Value* v = make(Kind::kFloat);
        std::memcpy(&v->f, &bits, 8);
        push(v);
        break;
      }
      case 0x8c: { const auto len = u8(); push_str(Kind::kStr, take(len, "SHORT_BINUNICODE"), len); break; }
      case 'X': { const auto len = u32(); push_str(Kind::kStr, take(len, "BINUNICODE"), len); break; }
      case 0x8d: { const auto len = u64(); push_str(Kind::kStr, take(len, "BINUNICODE8"), len); break; }
      // Python 2 str: read as text, which is what torch's loaders do (encoding='utf-8').
      case 'U': { const auto len = u8(); push_str(Kind::kStr, take(len, "SHORT_BINSTRING"), len); break; }
      case 'T': {
        const auto len = static_cast<std::int32_t>(static_cast<std::uint32_t>(u32()));
        if (len < 0) fail(op_at_, "BINSTRING with negative length");
        push_str(Kind::kStr, take(static_cast<std::uint64_t>(len), "BINSTRING"), static_cast<std::uint64_t>(len));
        break;
      }
      case 'C': { const auto len = u8(); push_str(Kind::kBytes, take(len, "SHORT_BINBYTES"), len); break; }
      case 'B': { const auto len = u32(); push_str(Kind::kBytes, take(len, "BINBYTES"), len); break; }
      case 0x8e: { const auto len = u64(); push_str(Kind::kBytes, take(len, "BINBYTES8"), len); break; }
      case 0x96: { const auto len = u64(); push_str(Kind::kBytes, take(len, "BYTEARRAY8"), len); break; }
      case 'N': push(make(Kind::kNone)); break;
      case 0x88:
      case 0x89: {
        Value* v = make(Kind::kBool);
        v->b = op == 0x88;
        push(v);
        break;
      }
      case 'q': memo_put(u8()); break;
      case 'r': memo_put(u32()); break;
      case 0x94: memo_put(memo_.size()); break;
      case 'h': memo_get(u8()); break;
      case 'j': memo_get(u32()); break;
      case 'p':
      case 'g': {
        const std::string l = line();
        char* end = nullptr;
        const unsigned long long idx = std::strtoull(l.c_str(), &end, 10);
        if (l.empty() || end != l.c_str() + l.size())
          fail(op_at_, std::string(opcode_name(op)) + ": bad memo key '" + l + "'");
        if (op == 'p') memo_put(idx);
        else memo_get(idx);
        break;
      }
      case '0': pop(); break;
      case '1': pop_mark(); break;
      case '2': push(top()); break;
      case 'c': {
        const std::string module = line();
        const std::string name = line();
        push_global(module, name);
        break;
      }
      case 0x93: {
        const Value* name = pop();
        const Value* module = pop();
        if (name->kind != Kind::kStr || module->kind != Kind::kStr)
          fail(op_at_, "STACK_GLOBAL needs two strs");
        push_global(module->s, name->s);
        break;
      }
      case 'R': {
        const Value* args = pop();
        const Value* fn = pop();
        push(call(fn, args));
        break;
      }
      case 0x81:
      case 0x92: {  // NEWOBJ / NEWOBJ_EX: cls.__new__(cls, *args)
        if (op == 0x92) pop();  // kwargs
        pop();                  // args
        const Value* cls = pop();
        if (cls->kind != Kind::kGlobal || cls->s != "collections.OrderedDict")
          fail(op_at_, std::string(opcode_name(op)) + " of '" +
                           (cls->kind == Kind::kGlobal ? cls->s : std::string(kind_name(cls->kind))) +
                           "' is not allowed (only OrderedDict)");
        push(make(Kind::kDict));
        break;
      }
      case 'b': {  // BUILD: attribute state of an OrderedDict (state_dict's _metadata) or a tensor
        pop();
        const Value* obj = top();
        if (obj->kind != Kind::kDict && obj->kind != Kind::kTensor)
          fail(op_at_, "BUILD on a " + std::string(kind_name(obj->kind)) + " is not supported");
        break;
      }
      case 'Q': {
        const Value* pid = pop();
        push(persistent(pid));
        break;
      }
      default: {
        const char* nm = opcode_name(op);
        if (nm != nullptr)
          fail(op_at_, std::string("opcode ") + nm + " (" + hex_byte(op) +
                           ") is not supported in a tensor pickle");
        fail(op_at_, "unknown opcode " + hex_byte(op));
      }
    }
  }

  const std::uint8_t* p_;
  std::size_t n_;
  const std::string& path_;
  const std::string& field_;
  PickleLimits limits_;
  std::size_t pos_ = 0;
  std::size_t op_at_ = 0;
  Pickle out_;
  std::vector<const Value*> stack_;
  std::vector<std::size_t> marks_;
  std::unordered_map<std::uint64_t, const Value*> memo_;
};

Pickle unpickle(const std::uint8_t* data, std::size_t n, const std::string& path,
                const std::string& field, const PickleLimits& limits) {
  return Unpickler(data, n, path, field, limits).run();
}

// ---------------------------------------------------------------------------------------

PickleWriter::PickleWriter() {
  out_.push_back(static_cast<char>(0x80));
  out_.push_back(2);
}

void PickleWriter::none() {
  out_.push_back('N');
  ++depth_;
}

void PickleWriter::boolean(bool v) {
  out_.push_back(static_cast<char>(v ? 0x88 : 0x89));
  ++depth_;
}

void PickleWriter::integer(std::int64_t v) {
  auto le = [&](std::uint64_t x, int bytes) {
    for (int k = 0; k < bytes; ++k) out_.push_back(static_cast<char>((x >> (8 * k)) & 0xff));
  };
  if (v >= 0 && v <= 0xff) {
    out_.push_back('K');
    le(static_cast<std::uint64_t>(v), 1);
  } else if (v >= 0 && v <= 0xffff) {
    out_.push_back('M');
    le(static_cast<std::uint64_t>(v), 2);
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    out_.push_back('J');
    le(static_cast<std::uint64_t>(static_cast<std::uint32_t>(static_cast<std::int32_t>(v))), 4);
  } else {
    // LONG1 with the shortest two's complement form, as Python's encode_long does.
    int bytes = 8;
    while (bytes > 1) {
      const std::int64_t lo = -(std::int64_t{1} << (8 * (bytes - 1) - 1));
      const std::int64_t hi = (std::int64_t{1} << (8 * (bytes - 1) - 1)) - 1;
      if (v < lo || v > hi) break;
      --bytes;
    }
    out_.push_back(static_cast<char>(0x8a));
    out_.push_back(static_cast<char>(bytes));
    le(static_cast<std::uint64_t>(v), bytes);
  }
  ++depth_;
}

void PickleWriter::real(double v) {
  std::uint64_t bits;
  std::memcpy(&bits, &v, 8);
  out_.push_back('G');
  for (int k = 7; k >= 0; --k) out_.push_back(static_cast<char>((bits >> (8 * k)) & 0xff));
  ++depth_;
}

void PickleWriter::put_memo_ref(std::uint32_t idx) {
  if (idx < 256) {
    out_.push_back('h');
    out_.push_back(static_cast<char>(idx));
  } else {
    out_.push_back('j');
    for (int k = 0; k < 4; ++k) out_.push_back(static_cast<char>((idx >> (8 * k)) & 0xff));
  }
  ++depth_;
}

void PickleWriter::memoize() {
  const std::uint32_t idx = next_memo_++;
  if (idx < 256) {
    out_.push_back('q');
    out_.push_back(static_cast<char>(idx));
  } else {
    out_.push_back('r');
    for (int k = 0; k < 4; ++k) out_.push_back(static_cast<char>((idx >> (8 * k)) & 0xff));
  }
}

void PickleWriter::str(std::string_view v) {
  const std::string key = "s:" + std::string(v);
  auto it = memo_.find(key);
  if (it != memo_.end()) {
    put_memo_ref(it->second);
    return;
  }
  out_.push_back('X');
  const auto len = static_cast<std::uint32_t>(v.size());
  for (int k = 0; k < 4; ++k) out_.push_back(static_cast<char>((len >> (8 * k)) & 0xff));
  out_.append(v.data(), v.size());
  ++depth_;
  memo_[key] = next_memo_;
  memoize();
}

void PickleWriter::global(std::string_view module, std::string_view name) {
  const std::string key = "g:" + std::string(module) + "." + std::string(name);
  auto it = memo_.find(key);
  if (it != memo_.end()) {
    put_memo_ref(it->second);
    return;
  }
  out_.push_back('c');
  out_.append(module.data(), module.size());
  out_.push_back('\n');
  out_.append(name.data(), name.size());
  out_.push_back('\n');
  ++depth_;
  memo_[key] = next_memo_;
  memoize();
}

void PickleWriter::mark() {
  marks_.push_back(out_.size());
  mark_depths_.push_back(depth_);
  out_.push_back('(');
}

void PickleWriter::tuple_from_mark() {
  if (marks_.empty()) throw Error("PickleWriter::tuple_from_mark without a mark");
  const std::size_t at = marks_.back();
  const std::size_t n = depth_ - mark_depths_.back();
  marks_.pop_back();
  mark_depths_.pop_back();
  if (n <= 3) {
    // Python writes short tuples without a MARK: drop it, then use the fixed-size opcode.
    out_.erase(at, 1);
    static const char kOps[4] = {')', static_cast<char>(0x85), static_cast<char>(0x86),
                                 static_cast<char>(0x87)};
    out_.push_back(kOps[n]);
  } else {
    out_.push_back('t');
  }
  depth_ = depth_ - n + 1;
  if (n > 0) memoize();  // Python does not memoize the empty tuple
}

void PickleWriter::empty_dict() {
  out_.push_back('}');
  ++depth_;
  memoize();
}

void PickleWriter::setitem() {
  out_.push_back('s');
  depth_ -= 2;
}

void PickleWriter::setitems() {
  if (marks_.empty()) throw Error("PickleWriter::setitems without a mark");
  out_.push_back('u');
  depth_ = mark_depths_.back();
  marks_.pop_back();
  mark_depths_.pop_back();
}

void PickleWriter::reduce() {
  out_.push_back('R');
  depth_ -= 1;
  memoize();
}

void PickleWriter::binpersid() { out_.push_back('Q'); }

void PickleWriter::stop() { out_.push_back('.'); }

}  // namespace eaglekit::pickle
