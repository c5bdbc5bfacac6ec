#include <doctest/doctest.h>

#include <cmath>
#include <string>

#include "formats/error.h"
#include "formats/pickle.h"
#include "tests/support.h"

using namespace eaglekit;
using namespace eaglekit::pickle;

namespace {

Pickle load(const std::string& bytes, const PickleLimits& lim = {}) {
  return unpickle(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size(), "x.pt",
                  "data.pkl", lim);
}

std::string error_of(const std::string& bytes, const PickleLimits& lim = {}) {
  try {
    load(bytes, lim);
  } catch (const FormatError& e) {
    CHECK(e.path() == "x.pt");
    CHECK(e.field() == "data.pkl");
    return e.what();
  }
  return "<no error>";
}

std::string bin(std::initializer_list<int> b) {
  std::string s;
  for (int c : b) s.push_back(static_cast<char>(c));
  return s;
}

// A protocol-2 tensor pickle as torch writes it: {'t': FloatStorage key '0', numel 6,
// offset OFF, size (2, 3), stride (3, 1)}.
std::string tensor_pickle(int off = 0) {
  PickleWriter w;
  w.empty_dict();
  w.str("t");
  w.global("torch._utils", "_rebuild_tensor_v2");
  w.mark();
  w.mark();
  w.str("storage");
  w.global("torch", "FloatStorage");
  w.str("0");
  w.str("cpu");
  w.integer(6);
  w.tuple_from_mark();
  w.binpersid();
  w.integer(off);
  w.mark();
  w.integer(2);
  w.integer(3);
  w.tuple_from_mark();
  w.mark();
  w.integer(3);
  w.integer(1);
  w.tuple_from_mark();
  w.boolean(false);
  w.global("collections", "OrderedDict");
  w.mark();
  w.tuple_from_mark();
  w.reduce();
  w.tuple_from_mark();
  w.reduce();
  w.setitem();
  w.stop();
  return w.bytes();
}

}  // namespace

TEST_CASE("pickle: scalars and containers") {
  // [None, True, False, 255, 65535, -2, 2**40, -(2**63), 1.5, 'hé', b'\x00\x01', (1,), {}]
  std::string p = bin({0x80, 2, ']', 'q', 0, '('});
  p += "N" + bin({0x88, 0x89}) + bin({'K', 255}) + bin({'M', 0xff, 0xff}) +
       bin({'J', 0xfe, 0xff, 0xff, 0xff}) + bin({0x8a, 6, 0, 0, 0, 0, 0, 1}) +
       bin({0x8a, 8, 0, 0, 0, 0, 0, 0, 0, 0x80}) + bin({'G', 0x3f, 0xf8, 0, 0, 0, 0, 0, 0}) +
       bin({'X', 3, 0, 0, 0}) + "h\xc3\xa9" + bin({'C', 2, 0, 1}) + bin({'K', 1, 0x85}) + "}";
  p += "e.";
  const Pickle pk = load(p);
  const Value& r = pk.root();
  REQUIRE(r.kind == Kind::kList);
  REQUIRE(r.items.size() == 13);
  CHECK(r.items[0]->kind == Kind::kNone);
  CHECK(r.items[1]->b);
  CHECK_FALSE(r.items[2]->b);
  CHECK(r.items[3]->i == 255);
  CHECK(r.items[4]->i == 65535);
  CHECK(r.items[5]->i == -2);
  CHECK(r.items[6]->i == (std::int64_t{1} << 40));
  CHECK(r.items[7]->i == INT64_MIN);
  CHECK(r.items[8]->f == 1.5);
  CHECK(r.items[9]->s == "h\xc3\xa9");
  CHECK(r.items[10]->kind == Kind::kBytes);
  CHECK(r.items[10]->s == std::string("\0\1", 2));
  CHECK(r.items[11]->kind == Kind::kTuple);
  CHECK(r.items[12]->kind == Kind::kDict);
}

TEST_CASE("pickle: writer output is what torch writes and reads back as a tensor") {
  const Pickle pk = load(tensor_pickle(0));
  const Value* t = pk.root().get("t");
  REQUIRE(t != nullptr);
  REQUIRE(t->kind == Kind::kTensor);
  CHECK(t->dtype == DType::kFloat32);
  CHECK(t->shape == std::vector<std::int64_t>{2, 3});
  CHECK(t->strides == std::vector<std::int64_t>{3, 1});
  CHECK(t->storage_offset == 0);
  REQUIRE(t->storage->kind == Kind::kStorage);
  CHECK(t->storage->s == "0");
  CHECK(t->storage->i == 6);
  CHECK(t->storage->location == "cpu");
  // Globals and repeated strings are memoized: the second tensor of a dict would BINGET them.
  const std::string b = tensor_pickle(0);
  CHECK(b.find("ctorch._utils\n_rebuild_tensor_v2\nq") != std::string::npos);
  CHECK(b.find(bin({'K', 2, 'K', 3, 0x86})) != std::string::npos);  // (2, 3) as TUPLE2
}

TEST_CASE("pickle: _rebuild_tensor_v3 over an UntypedStorage takes its dtype argument") {
  PickleWriter w;
  w.global("torch._utils", "_rebuild_tensor_v3");
  w.mark();
  w.mark();
  w.str("storage");
  w.global("torch", "UntypedStorage");
  w.str("0");
  w.str("cpu");
  w.integer(12);  // bytes
  w.tuple_from_mark();
  w.binpersid();
  w.integer(1);
  w.mark();
  w.integer(5);
  w.tuple_from_mark();
  w.mark();
  w.integer(1);
  w.tuple_from_mark();
  w.boolean(false);
  w.global("collections", "OrderedDict");
  w.mark();
  w.tuple_from_mark();
  w.reduce();
  w.global("torch", "bfloat16");
  w.tuple_from_mark();
  w.reduce();
  w.stop();
  const Pickle pk = load(w.bytes());
  const Value& t = pk.root();
  REQUIRE(t.kind == Kind::kTensor);
  CHECK(t.dtype == DType::kBFloat16);
  CHECK(t.storage->dtype == DType::kUInt8);
  CHECK(t.storage->i == 12);
  CHECK(t.storage_offset == 1);
  CHECK(t.shape == std::vector<std::int64_t>{5});
}

TEST_CASE("pickle: Python pickles of protocols 2-5 parse to the same tree") {
  test::require_python("pickle");
  test::TempDir d("pk");
  const auto r = test::python(R"(
import collections, pickle, sys
obj = {'a': [1, -1, 300, 70000, -(2**31), 2**62, 1.25, None, True, False],
       'b': ('x' * 300, 'ü', b'bytes'), 'c': collections.OrderedDict([('k', {})]),
       7: [[[]]]}
for proto in (2, 3, 4, 5):
    with open(sys.argv[1] + '/p%d.pkl' % proto, 'wb') as f:
        pickle.dump(obj, f, protocol=proto)
)",
                              {d.path()});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  for (int proto = 2; proto <= 5; ++proto) {
    CAPTURE(proto);
    const auto bytes = test::read_bytes(d / ("p" + std::to_string(proto) + ".pkl"));
    const Pickle pk = unpickle(bytes.data(), bytes.size(), "p.pkl", "data.pkl");
    const Value& root = pk.root();
    REQUIRE(root.kind == Kind::kDict);
    REQUIRE(root.dict.size() == 4);
    const Value* a = root.get("a");
    REQUIRE(a != nullptr);
    REQUIRE(a->items.size() == 10);
    const std::int64_t ints[] = {1, -1, 300, 70000, -(std::int64_t{1} << 31), std::int64_t{1} << 62};
    for (int k = 0; k < 6; ++k) CHECK(a->items[k]->i == ints[k]);
    CHECK(a->items[6]->f == 1.25);
    CHECK(a->items[7]->kind == Kind::kNone);
    CHECK(a->items[8]->b);
    const Value* b = root.get("b");
    REQUIRE(b->kind == Kind::kTuple);
    CHECK(b->items[0]->s == std::string(300, 'x'));
    CHECK(b->items[1]->s == "\xc3\xbc");
    CHECK(b->items[2]->kind == Kind::kBytes);  // protocol 2: _codecs.encode('bytes', 'latin1')
    CHECK(b->items[2]->s == "bytes");
    const Value* c = root.get("c");
    REQUIRE(c->kind == Kind::kDict);
    CHECK(c->get("k")->kind == Kind::kDict);
    CHECK(root.dict[3].first->i == 7);
    CHECK(root.dict[3].second->items[0]->items[0]->kind == Kind::kList);
  }
}

// The flipped-byte test's floor (see there): the least share refused over four masks less the
// spread between them (max - min), rounded down, as measured when written: 139-141 of 166.
constexpr double kPickleFlipFloor = 0.82;

TEST_CASE("pickle: hostile and broken pickles") {
  SUBCASE("os.system") {
    const std::string p = bin({0x80, 2}) + "cos\nsystem\n" + bin({'q', 0, 'X', 2, 0, 0, 0}) + "ls" +
                          bin({'q', 1, 0x85, 'q', 2, 'R', '.'});
    CHECK(error_of(p) ==
          "x.pt: data.pkl at byte 2: global 'os.system' is not allowed (only tensor dicts can be "
          "read)");
  }
  SUBCASE("builtins.eval through STACK_GLOBAL") {
    const std::string p = bin({0x80, 4, 0x8c, 8}) + "builtins" + bin({0x8c, 4}) + "eval" + bin({0x93, '.'});
    CHECK(error_of(p) ==
          "x.pt: data.pkl at byte 18: global 'builtins.eval' is not allowed (only tensor dicts "
          "can be read)");
  }
  SUBCASE("a storage class of an element type we do not read") {
    try {
      load(std::string("\x80\x02") + "ctorch\nComplexFloatStorage\n.");
      FAIL("no error");
    } catch (const UnsupportedError& e) {
      CHECK(std::string(e.what()) ==
            "x.pt: data.pkl at byte 2: 'torch.ComplexFloatStorage': this element type is not "
            "supported (eaglekit reads bool, uint8, int8-int64, float16, bfloat16, float32, "
            "float64)");
    }
  }
  SUBCASE("unknown opcode") {
    CHECK(error_of(bin({0x80, 2, 'N', 0xff})) == "x.pt: data.pkl at byte 3: unknown opcode 0xff");
  }
  SUBCASE("known but unsupported opcode") {
    CHECK(error_of(bin({0x80, 2, 'i'})) ==
          "x.pt: data.pkl at byte 2: opcode INST (0x69) is not supported in a tensor pickle");
  }
  SUBCASE("stack underflow") {
    CHECK(error_of(bin({0x80, 2, 'N', 's'})) == "x.pt: data.pkl at byte 3: SETITEM: stack underflow");
    CHECK(error_of(bin({0x80, 2, 'N', '(', 0x85})) == "x.pt: data.pkl at byte 4: TUPLE1: stack underflow");
  }
  SUBCASE("no STOP") {
    CHECK(error_of(bin({0x80, 2, 'N'})) == "x.pt: data.pkl at byte 3: ends before STOP (truncated)");
  }
  SUBCASE("two values at STOP") {
    CHECK(error_of(bin({0x80, 2, 'N', 'N', '.'})).find("STOP with 2 values on the stack") !=
          std::string::npos);
  }
  SUBCASE("memo key never stored") {
    CHECK(error_of(bin({0x80, 2, 'h', 9, '.'})) ==
          "x.pt: data.pkl at byte 2: memo key 9 was never stored");
  }
  SUBCASE("oversized string length") {
    CHECK(error_of(bin({0x80, 2, 'X', 0xff, 0xff, 0xff, 0x7f, 'a', '.'})) ==
          "x.pt: data.pkl at byte 2: BINUNICODE needs 2147483647 bytes but only 2 are left "
          "(truncated or corrupt)");
    CHECK(error_of(bin({0x80, 4, 0x8d, 0, 0, 0, 0, 0, 0, 0, 0x80, '.'})).find(
              "BINUNICODE8 needs 9223372036854775808 bytes") != std::string::npos);
  }
  SUBCASE("integer too wide") {
    CHECK(error_of(bin({0x80, 2, 0x8a, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, '.'})).find(
              "integer of 9 bytes does not fit in 64 bits") != std::string::npos);
  }
  SUBCASE("too many values") {
    std::string p = bin({0x80, 2, ']', '('});
    for (int i = 0; i < 100; ++i) p += "N";
    p += "e.";
    PickleLimits lim;
    lim.max_values = 50;
    CHECK(error_of(p, lim).find("more than 50 values") != std::string::npos);
  }
  SUBCASE("a list containing itself parses (the arena owns it) without leaking") {
    const Pickle pk = load(bin({0x80, 2, ']', 'q', 0, 'h', 0, 'a', '.'}));
    CHECK(pk.root().items.size() == 1);
    CHECK(pk.root().items[0] == &pk.root());
  }
  SUBCASE("SETITEM on a list") {
    CHECK(error_of(bin({0x80, 2, ']', 'N', 'N', 's', '.'})) ==
          "x.pt: data.pkl at byte 5: SETITEM on a list, expected a dict");
  }
  SUBCASE("tensor with negative stride") {
    std::string p = tensor_pickle();
    // stride (3, 1) -> (3, -1): replace "K\x01" after "K\x03" of the stride tuple
    const std::string from = bin({'K', 3, 'K', 1, 0x86});
    const auto at = p.find(from);
    REQUIRE(at != std::string::npos);
    p.replace(at, from.size(), bin({'K', 3, 'J', 0xff, 0xff, 0xff, 0xff, 0x86}));
    CHECK(error_of(p).find("torch._utils._rebuild_tensor_v2: argument 4 (stride) holds the "
                           "negative value -1") != std::string::npos);
  }
  SUBCASE("REDUCE of OrderedDict with arguments") {
    CHECK(error_of(std::string("\x80\x02") + "ccollections\nOrderedDict\nN\x85R.").find(
              "collections.OrderedDict called with arguments") != std::string::npos);
  }
  SUBCASE("every truncation of a tensor pickle is a FormatError") {
    const std::string p = tensor_pickle();
    for (std::size_t cut = 0; cut < p.size(); ++cut) {
      CAPTURE(cut);
      CHECK(error_of(p.substr(0, cut)) != "<no error>");
    }
  }
  SUBCASE("every flipped byte is a FormatError naming the file, or a clean parse") {
    // Any other exception escapes and fails the case. Four flip masks; the floor is the least
    // share refused over them less the spread between them, as measured when written.
    const std::string p = tensor_pickle();
    for (const std::uint8_t mask : {0x5a, 0x01, 0x80, 0xff}) {
      CAPTURE(int(mask));
      std::size_t errors = 0, clean = 0;
      for (std::size_t i = 0; i < p.size(); ++i) {
        CAPTURE(i);
        std::string q = p;
        q[i] = static_cast<char>(q[i] ^ mask);
        try {
          load(q);
          ++clean;
        } catch (const FormatError& e) {
          ++errors;
          CHECK(e.path() == "x.pt");
          CHECK(e.field() == "data.pkl");
          CHECK_MESSAGE(std::string(e.what()).rfind("x.pt: data.pkl", 0) == 0, e.what());
        }
      }
      MESSAGE("mask " << int(mask) << ": " << errors << " of " << p.size() << " flipped bytes refused, " << clean
                      << " parsed clean");
      CHECK(static_cast<double>(errors) >= kPickleFlipFloor * static_cast<double>(p.size()));
    }
  }
}

TEST_CASE("pickle: writer integers use Python's encodings") {
  struct Case {
    std::int64_t v;
    std::string enc;
  };
  const Case cases[] = {
      {0, bin({'K', 0})},
      {256, bin({'M', 0, 1})},
      {-1, bin({'J', 0xff, 0xff, 0xff, 0xff})},
      {std::int64_t{1} << 31, bin({0x8a, 5, 0, 0, 0, 0x80, 0})},
      {-(std::int64_t{1} << 31) - 1, bin({0x8a, 5, 0xff, 0xff, 0xff, 0x7f, 0xff})},
      {INT64_MAX, bin({0x8a, 8, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f})},
  };
  for (const auto& c : cases) {
    CAPTURE(c.v);
    PickleWriter w;
    w.integer(c.v);
    w.stop();
    CHECK(w.bytes() == bin({0x80, 2}) + c.enc + ".");
    CHECK(load(w.bytes()).root().i == c.v);
  }
}
