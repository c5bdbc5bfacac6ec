// safetensors: byte-exact writer, strict reader, weights folders, record form.
// Debian has no python3-safetensors, so the Python side is a small reference implementation
// of the published format with the reference library's ordering and validation rules (json +
// struct + numpy; numpy rather than torch because importing torch costs seconds).
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "formats/byte_source.h"
#include "formats/bytes.h"
#include "formats/error.h"
#include "formats/format.h"
#include "formats/safetensors_format.h"
#include "tests/support.h"

using namespace eaglekit;
namespace fs = std::filesystem;

namespace {

// The reference serializer and a strict loader, following the format description.
const char* kPyReference = R"PY(
import json, struct, sys
import numpy as np

RANK = ["BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
        "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64",
        "F64", "I64", "U64"]
CODE = {np.dtype(np.bool_): "BOOL", np.dtype(np.uint8): "U8", np.dtype(np.int8): "I8",
        np.dtype(np.int16): "I16", np.dtype(np.int32): "I32", np.dtype(np.int64): "I64",
        np.dtype(np.float16): "F16", np.dtype(np.float32): "F32", np.dtype(np.float64): "F64"}
DTYPE = {v: k for k, v in CODE.items()}

class BF16:
    """numpy has no bfloat16: the raw 16-bit patterns, rounded to nearest even."""
    def __init__(self, x=None, bits=None):
        if bits is None:
            b = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
            bits = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
        self.bits = bits
        self.shape = bits.shape
    def float(self):
        return (self.bits.astype(np.uint32) << 16).view(np.float32)

def code(t):
    return "BF16" if isinstance(t, BF16) else CODE[t.dtype]

def raw(t):
    return np.ascontiguousarray(t.bits if isinstance(t, BF16) else t).tobytes()

def save(tensors, path, metadata=None):
    items = sorted(tensors.items(), key=lambda kv: (-RANK.index(code(kv[1])), kv[0].encode()))
    header, off = {}, 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, t in items:
        n = len(raw(t))
        header[name] = {"dtype": code(t), "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for _, t in items:
            f.write(raw(t))

def load(path):
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    assert n <= 100_000_000 and 8 + n <= len(data), "header length"
    text = data[8:8 + n].decode("utf-8")
    assert text.startswith("{"), "header start"
    h = json.loads(text)
    meta = h.pop("__metadata__", None)
    start, out = 0, {}
    for name, e in sorted(h.items(), key=lambda kv: kv[1]["data_offsets"]):
        b, end = e["data_offsets"]
        assert b == start, "gap or overlap at " + name
        numel = int(np.prod(e["shape"], dtype=np.int64))
        dt = np.dtype(np.uint16) if e["dtype"] == "BF16" else DTYPE[e["dtype"]]
        assert end - b == numel * dt.itemsize, "size of " + name
        a = np.frombuffer(data[8 + n + b:8 + n + end], dtype=dt).reshape(e["shape"])
        out[name] = BF16(bits=a) if e["dtype"] == "BF16" else a
        start = end
    assert 8 + n + start == len(data), "incomplete buffer"
    return out, meta
)PY";

std::string py(const std::string& body) { return std::string(kPyReference) + body; }

void require_python() {
  test::require_python("numpy");
}

std::vector<std::uint8_t> file_bytes(const std::string& header, std::size_t data_bytes,
                                     std::uint8_t fill = 0xab) {
  std::vector<std::uint8_t> b(8 + header.size() + data_bytes, fill);
  const std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) b[i] = static_cast<std::uint8_t>(n >> (8 * i));
  std::memcpy(b.data() + 8, header.data(), header.size());
  return b;
}

std::shared_ptr<const SafetensorsFile> parse_bytes(std::vector<std::uint8_t> b) {
  return SafetensorsFile::parse(ByteSource::from_bytes(std::move(b), "bad.safetensors"));
}

HostTensor f32_tensor(std::vector<std::int64_t> shape, float start = 0.f) {
  HostTensor t = HostTensor::zeros(DType::kFloat32, std::move(shape));
  auto* p = reinterpret_cast<float*>(t.mutable_data());
  for (std::int64_t i = 0; i < t.numel(); ++i) p[i] = start + static_cast<float>(i);
  return t;
}

template <class T>
HostTensor typed(DType dt, std::vector<std::int64_t> shape, std::vector<T> v) {
  std::vector<std::uint8_t> bytes(v.size() * sizeof(T));
  std::memcpy(bytes.data(), v.data(), bytes.size());
  return HostTensor::from_bytes(dt, std::move(shape), std::move(bytes));
}

}  // namespace

TEST_CASE("safetensors: writer output matches the reference bytes") {
  // One F32 [1, 2, 3] tensor "attn.0" holding 0..5 and no metadata: the reference library's
  // own serialization test pins these bytes (64-byte header, data at byte 72).
  const auto out = serialize_safetensors({{"attn.0", f32_tensor({1, 2, 3})}}, {});
  const std::string json = R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})";
  REQUIRE(out.size() == 8 + 64 + 24);
  CHECK(load_le64(out.data()) == 64);
  CHECK(std::string(out.begin() + 8, out.begin() + 8 + 64) ==
        json + std::string(64 - json.size(), ' '));
  const float one = 1.f;
  CHECK(std::memcmp(out.data() + 72 + 4, &one, 4) == 0);

  // No tensors, metadata only (also pinned by the reference tests: 40-byte header).
  const auto empty = serialize_safetensors({}, {{"framework", "pt"}});
  const std::string meta = R"({"__metadata__":{"framework":"pt"}})";
  CHECK(load_le64(empty.data()) == 40);
  CHECK(std::string(empty.begin() + 8, empty.end()) == meta + std::string(40 - meta.size(), ' '));
}

TEST_CASE("safetensors: writer orders by dtype alignment, then name, and tiles the buffer") {
  std::vector<NamedTensor> ts = {
      {"z_bool", typed<std::uint8_t>(DType::kBool, {3}, {1, 0, 1})},
      {"b_f16", HostTensor::zeros(DType::kFloat16, {3})},
      {"a_bf16", HostTensor::zeros(DType::kBFloat16, {5})},
      {"c_i64", typed<std::int64_t>(DType::kInt64, {2}, {-1, 1ll << 62})},
      {"b_f32", f32_tensor({2})},
      {"a_f32", f32_tensor({1})},
      {"u8", HostTensor::zeros(DType::kUInt8, {1})},
      {"i16", HostTensor::zeros(DType::kInt16, {1})},
      {"f64", HostTensor::zeros(DType::kFloat64, {1})},
      {"empty", HostTensor::zeros(DType::kFloat32, {0, 4})},
  };
  const auto file = parse_bytes(serialize_safetensors(ts));
  std::vector<std::string> order;
  std::uint64_t expect_begin = 0;
  for (const auto& e : file->entries()) {
    order.push_back(e.name);
    CHECK(e.begin == expect_begin);
    expect_begin = e.end;
  }
  // I64 > F64 > F32 (by name, the empty one included) > BF16 > F16 > I16 > U8 > BOOL.
  CHECK(order == std::vector<std::string>{"c_i64", "f64", "a_f32", "b_f32", "empty", "a_bf16",
                                          "b_f16", "i16", "u8", "z_bool"});
  CHECK(file->data_start() % 8 == 0);
  CHECK(file->data_start() + expect_begin == file->source()->size());
  CHECK(file->metadata() == SafetensorsMetadata{{"format", "pt"}});
  CHECK(file->get("c_i64")->get(1) == static_cast<double>(1ll << 62));
}

TEST_CASE("safetensors: round trip of every dtype, strided input, empty and 0-d tensors") {
  test::TempDir dir("st");
  HostTensor col = f32_tensor({3, 4});  // a transposed view [4, 3]
  col.shape = {4, 3};
  col.strides = {1, 4};
  std::vector<NamedTensor> ts = {
      {"bool", typed<std::uint8_t>(DType::kBool, {2, 2}, {1, 0, 0, 1})},
      {"u8", typed<std::uint8_t>(DType::kUInt8, {3}, {0, 128, 255})},
      {"i8", typed<std::int8_t>(DType::kInt8, {3}, {-128, 0, 127})},
      {"i16", typed<std::int16_t>(DType::kInt16, {2}, {-32768, 32767})},
      {"i32", typed<std::int32_t>(DType::kInt32, {2}, {-7, 1 << 30})},
      {"i64", typed<std::int64_t>(DType::kInt64, {2}, {-3, 1ll << 60})},
      {"f16", typed<std::uint16_t>(DType::kFloat16, {2}, {float_to_fp16(1.5f), 0x7c00})},
      {"bf16", typed<std::uint16_t>(DType::kBFloat16, {2}, {float_to_bf16(-2.25f), 0x7fc0})},
      {"f32", f32_tensor({2, 3}, -1.5f)},
      {"f64", typed<double>(DType::kFloat64, {1}, {3.141592653589793})},
      {"transposed", col},
      {"empty", HostTensor::zeros(DType::kBFloat16, {0})},
      {"scalar", typed<float>(DType::kFloat32, {}, {42.f})},
  };
  const std::string path = dir / "rt.safetensors";
  write_safetensors(path, ts, {{"format", "pt"}, {"note", "ünïcode ✓"}});
  const auto file = SafetensorsFile::open(path);
  CHECK(file->metadata().at("note") == "ünïcode ✓");
  for (const auto& nt : ts) {
    CAPTURE(nt.name);
    const auto back = file->get(nt.name);
    REQUIRE(back);
    CHECK(back->equal(nt.tensor));
    CHECK(back->is_contiguous());
  }
  CHECK(file->get("transposed")->get(1) == 4.0);  // [0][1] of the transpose = [1][0]
  CHECK_FALSE(file->get("missing"));
  // Zero-copy: the view points into the mapping.
  const auto* base = file->source()->data();
  const auto view = *file->get("f32");
  CHECK(view.data == base + file->data_start() + file->find("f32")->begin);
  // Identical input gives identical bytes (deterministic header).
  write_safetensors(dir / "rt2.safetensors", ts, {{"note", "ünïcode ✓"}, {"format", "pt"}});
  CHECK(test::read_bytes(path) == test::read_bytes(dir / "rt2.safetensors"));
  // The writer refuses names the format cannot hold.
  CHECK_THROWS_WITH_AS(write_safetensors(dir / "x.safetensors", {{"a", col}, {"a", col}}),
                       "safetensors: tensor name 'a' given twice", UsageError);
  CHECK_THROWS_WITH_AS(write_safetensors(dir / "x.safetensors", {{"__metadata__", col}}),
                       "safetensors: '__metadata__' cannot name a tensor", UsageError);
  CHECK_FALSE(fs::exists(dir / "x.safetensors"));
}

TEST_CASE("safetensors: files from the Python reference implementation read back equal") {
  require_python();
  test::TempDir dir("st");
  const auto r = test::python(py(R"PY(
out = sys.argv[1]
ts = {
    "model.embed_tokens.weight": BF16((np.arange(24, dtype=np.float32) * 0.37 - 4).reshape(4, 6)),
    "lm_head.weight": (np.arange(12, dtype=np.float32) / 7).reshape(3, 4).astype(np.float16),
    "w32": np.linspace(-1, 1, 10, dtype=np.float32),
    "w64": np.array([1e-300, -2.5], dtype=np.float64),
    "ids": np.array([0, -1, 2**62 + 1], dtype=np.int64),
    "i32": np.array([[-5, 6]], dtype=np.int32),
    "i16": np.array([-300], dtype=np.int16),
    "i8": np.array([-100, 100], dtype=np.int8),
    "u8": np.array([200], dtype=np.uint8),
    "mask": np.array([True, False, True]),
    "ünï/codé": np.ones(2, dtype=np.float32),
    "nothing": np.zeros((0, 3), dtype=np.float32),
}
save(ts, out + "/ref.safetensors", {"format": "pt"})
def values(v):
    v = v.float() if isinstance(v, BF16) else v
    return [repr(x) for x in v.flatten().tolist()]
exp = {k: {"shape": list(v.shape), "values": values(v)} for k, v in ts.items()}
json.dump(exp, open(out + "/expected.json", "w"))
)PY"),
                              {dir.path()});
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const auto expected = nlohmann::json::parse(test::read_bytes(dir / "expected.json"));
  const auto file = SafetensorsFile::open(dir / "ref.safetensors");
  CHECK(file->entries().size() == expected.size());
  for (auto it = expected.begin(); it != expected.end(); ++it) {
    CAPTURE(it.key());
    const auto t = file->get(it.key());
    REQUIRE(t);
    CHECK(t->shape == it.value()["shape"].get<std::vector<std::int64_t>>());
    const auto& values = it.value()["values"];
    REQUIRE(static_cast<std::size_t>(t->numel()) == values.size());
    for (std::int64_t i = 0; i < t->numel(); ++i) {
      const std::string v = values[static_cast<std::size_t>(i)].get<std::string>();
      if (t->dtype == DType::kInt64) {
        std::int64_t x;
        std::memcpy(&x, t->data + 8 * i, 8);
        CHECK(std::to_string(x) == v);
      } else if (t->dtype == DType::kBool) {
        CHECK(t->get(i) == (v == "True" ? 1.0 : 0.0));
      } else {
        CHECK(t->get(i) == std::stod(v));
      }
    }
  }
  // And we write the same bytes for the same tensors.
  std::vector<NamedTensor> ts;
  for (const auto& e : file->entries()) ts.push_back({e.name, file->tensor(e)});
  write_safetensors(dir / "ours.safetensors", ts);
  CHECK(test::read_bytes(dir / "ours.safetensors") == test::read_bytes(dir / "ref.safetensors"));
}

TEST_CASE("safetensors: our files pass the reference loader's checks and load equal") {
  require_python();
  test::TempDir dir("st");
  std::vector<NamedTensor> ts = {
      {"fc.weight", f32_tensor({4, 12}, -20.f)},
      {"midlayer.hidden_norm.weight", typed<std::uint16_t>(DType::kBFloat16, {3},
                                                           {float_to_bf16(1.f), float_to_bf16(-0.5f),
                                                            float_to_bf16(3.f)})},
      {"d2t", typed<std::int64_t>(DType::kInt64, {3}, {0, 5, -2})},
      {"t2d", typed<std::uint8_t>(DType::kBool, {5}, {1, 0, 0, 1, 1})},
      {"h", typed<std::uint16_t>(DType::kFloat16, {1}, {float_to_fp16(0.25f)})},
  };
  write_safetensors(dir / "model.safetensors", ts);
  const auto r = test::python(py(R"PY(
out, meta = load(sys.argv[1] + "/model.safetensors")
assert meta == {"format": "pt"}, meta
assert out["fc.weight"].dtype == np.float32
assert out["fc.weight"].tolist() == (np.arange(48, dtype=np.float32) - 20).reshape(4, 12).tolist()
assert isinstance(out["midlayer.hidden_norm.weight"], BF16)
assert out["midlayer.hidden_norm.weight"].float().tolist() == [1.0, -0.5, 3.0]
assert out["d2t"].tolist() == [0, 5, -2]
assert out["t2d"].tolist() == [True, False, False, True, True]
assert out["h"].tolist() == [0.25]
# Byte-identical to the reference serializer.
save(out, sys.argv[1] + "/ref.safetensors", {"format": "pt"})
assert open(sys.argv[1] + "/ref.safetensors", "rb").read() == open(sys.argv[1] + "/model.safetensors", "rb").read()
print("ok")
)PY"),
                              {dir.path()});
  CHECK_MESSAGE(r.exit_code == 0, r.err);
  CHECK(r.out == "ok\n");
}

TEST_CASE("safetensors: corrupt headers and offsets are refused with the field named") {
  const std::string ok_entry = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  struct Case {
    const char* what;
    std::vector<std::uint8_t> bytes;
    std::string message;
  };
  auto with = [](const std::string& header, std::size_t data) { return file_bytes(header, data); };
  std::vector<std::uint8_t> past_eof = file_bytes("{}", 0);
  past_eof[0] = 0xff;
  std::vector<std::uint8_t> huge = file_bytes("{}", 0);
  huge[6] = 1;  // 2^48
  const std::vector<Case> cases = {
      {"shorter than the length field", {1, 0, 0}, "bad.safetensors: header length at byte 0: the file has 3 bytes, fewer than the 8-byte header length (not a safetensors file)"},
      {"header length past EOF", past_eof, "bad.safetensors: header length at byte 0: 255 bytes of header but only 2 bytes follow the length field (truncated or corrupt)"},
      {"header length absurd", huge, "bad.safetensors: header length at byte 0: 281474976710658 bytes exceeds the limit of 100000000 (corrupt length)"},
      {"empty header", file_bytes("", 4), "bad.safetensors: header at byte 8: empty header (expected a JSON object)"},
      {"not JSON", with("{\"a\": nope}", 0), "bad.safetensors: header at byte 15: not valid JSON: parse error at line 1, column 8: syntax error while parsing value - invalid literal; last read: '\"a\": no'"},
      {"not an object", with("[1, 2]", 0), "bad.safetensors: header at byte 8: expected a JSON object, got array"},
      {"unknown dtype", with(R"({"w":{"dtype":"F17","shape":[1],"data_offsets":[0,4]}})", 4), "bad.safetensors: w.dtype at byte 8: unknown dtype 'F17' (known: BOOL, F4, F6_E2M3, F6_E3M2, U8, I8, F8_E5M2, F8_E4M3, F8_E8M0, F8_E4M3FNUZ, F8_E5M2FNUZ, I16, U16, F16, BF16, I32, U32, F32, C64, F64, I64, U64)"},
      {"dtype missing", with(R"({"w":{"shape":[1],"data_offsets":[0,4]}})", 4), "bad.safetensors: w.dtype at byte 8: missing or not a string"},
      {"negative dim", with(R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4), "bad.safetensors: w.shape at byte 8: expected non-negative integers, got [-1]"},
      {"shape overflow", with(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}})", 4), "bad.safetensors: w.shape at byte 8: [4294967296,4294967296] overflows the element count"},
      {"shape and offsets disagree", with(R"({"w":{"dtype":"BF16","shape":[3,2],"data_offsets":[0,8]}})", 8), "bad.safetensors: w.data_offsets at byte 8: [0, 8] holds 8 bytes but BF16 [3, 2] needs 12"},
      {"offsets reversed", with(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", 8), "bad.safetensors: w.data_offsets at byte 8: [8, 4]: begin is after end"},
      {"offsets malformed", with(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", 8), "bad.safetensors: w.data_offsets at byte 8: expected [begin, end] with non-negative integers, got [0]"},
      {"offsets past the data", with("{" + ok_entry + R"(,"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", 12), "bad.safetensors: b.data_offsets at byte 124: [8, 16] runs past the end of the data buffer (12 bytes; truncated or corrupt)"},
      {"overlapping tensors", with("{" + ok_entry + R"(,"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12), "bad.safetensors: b.data_offsets at byte 120: [4, 12] overlaps a [0, 8]"},
      {"duplicate name", with("{" + ok_entry + "," + ok_entry + "}", 8), "bad.safetensors: a at byte 8: appears more than once in the header"},
      {"metadata not strings", with(R"({"__metadata__":{"format":1}})", 0), "bad.safetensors: __metadata__.format at byte 8: expected a string value, got number"},
      {"metadata not an object", with(R"({"__metadata__":"pt"})", 0), "bad.safetensors: __metadata__ at byte 8: expected an object of strings, got string"},
      {"entry not an object", with(R"({"w":[0,4]})", 4), "bad.safetensors: w at byte 8: expected an object with dtype, shape and data_offsets, got array"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.what);
    CHECK_THROWS_WITH_AS(parse_bytes(c.bytes), c.message.c_str(), FormatError);
  }
}

TEST_CASE("safetensors: every truncation of a valid file is refused, never read past the end") {
  const auto good = serialize_safetensors({{"a", f32_tensor({3, 2})},
                                           {"b", typed<std::int64_t>(DType::kInt64, {2}, {1, 2})}});
  CHECK_NOTHROW(parse_bytes(good));
  for (std::size_t cut = 0; cut < good.size(); ++cut) {
    CAPTURE(cut);
    std::vector<std::uint8_t> b(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(cut));
    CHECK_THROWS_AS(parse_bytes(b), FormatError);
  }
}

TEST_CASE("safetensors: dtypes eaglekit cannot hold open, but reading them is refused") {
  const auto f = parse_bytes(file_bytes(
      R"({"q":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
      8));
  CHECK(f->find("q")->dtype_code == "F8_E4M3");
  CHECK_FALSE(f->find("q")->dtype);
  CHECK(f->get("w")->numel() == 1);
  CHECK_THROWS_WITH_AS(f->get("q"),
                       "bad.safetensors: q.dtype at byte 119: dtype F8_E4M3 is not supported by "
                       "eaglekit (supported: BOOL, U8, I8, I16, I32, I64, F16, BF16, F32, F64)",
                       UnsupportedError);
  // Gaps and trailing bytes are tolerated on read.
  const auto gap = parse_bytes(file_bytes(
      R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 16));
  CHECK(gap->get("w")->numel() == 1);
}

TEST_CASE("safetensors: weights from a single file and from a sharded index") {
  test::TempDir dir("st");
  const std::string single = dir / "single";
  fs::create_directories(single);
  write_safetensors(single + "/model.safetensors",
                    {{"model.embed_tokens.weight", f32_tensor({4, 2})},
                     {"lm_head.weight", f32_tensor({4, 2}, 100.f)}});
  const auto w = SafetensorsWeights::open_folder(single);
  CHECK(w.names() == std::vector<std::string>{"lm_head.weight", "model.embed_tokens.weight"});
  CHECK(w.get("lm_head.weight")->get(7) == 107.0);
  CHECK_FALSE(w.get("model.norm.weight"));
  CHECK(SafetensorsWeights::open_folder(single + "/model.safetensors").contains("lm_head.weight"));

  // Sharded: the second shard is garbage, so reading from the first proves it is never opened.
  const std::string sharded = dir / "sharded";
  fs::create_directories(sharded);
  write_safetensors(sharded + "/model-00001-of-00002.safetensors",
                    {{"model.embed_tokens.weight", f32_tensor({4, 2}, 1.f)}});
  test::write_text(sharded + "/model-00002-of-00002.safetensors", "garbage");
  test::write_text(sharded + "/model.safetensors.index.json", R"({
    "metadata": {"total_size": 64},
    "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                   "lm_head.weight": "model-00002-of-00002.safetensors",
                   "model.norm.weight": "model-00001-of-00002.safetensors"}})");
  // A stray model.safetensors must not win over the index.
  write_safetensors(sharded + "/model.safetensors", {{"x", f32_tensor({1})}});
  const auto s = SafetensorsWeights::open_folder(sharded);
  CHECK(s.names().size() == 3);
  CHECK(s.get("model.embed_tokens.weight")->get(0) == 1.0);
  CHECK(s.file_of("lm_head.weight") == sharded + "/model-00002-of-00002.safetensors");
  CHECK_THROWS_WITH_AS(s.get("lm_head.weight"),
                       (sharded + "/model-00002-of-00002.safetensors: header length at byte 0: "
                                  "the file has 7 bytes, fewer than the 8-byte header length (not a safetensors file)")
                           .c_str(),
                       FormatError);
  CHECK_THROWS_WITH_AS(s.get("model.norm.weight"),
                       (sharded + "/model-00001-of-00002.safetensors: model.norm.weight: not in "
                                  "this file, although " + sharded +
                        "/model.safetensors.index.json names it")
                           .c_str(),
                       FormatError);

  test::write_text(sharded + "/model.safetensors.index.json",
                   R"({"weight_map": {"a": "../../etc/passwd"}})");
  CHECK_THROWS_WITH_AS(SafetensorsWeights::open_folder(sharded),
                       (sharded + "/model.safetensors.index.json: weight_map.a: file name "
                                  "'../../etc/passwd' must be relative to the model folder")
                           .c_str(),
                       FormatError);
  test::write_text(sharded + "/model.safetensors.index.json", R"({"weights": {}})");
  CHECK_THROWS_WITH_AS(SafetensorsWeights::open_folder(sharded),
                       (sharded + "/model.safetensors.index.json: weight_map: missing or not an "
                                  "object of tensor name -> file name")
                           .c_str(),
                       FormatError);
  CHECK_THROWS_WITH_AS(SafetensorsWeights::open_folder(dir.path()),
                       (dir.path() + ": no model.safetensors or model.safetensors.index.json in "
                                     "this folder")
                           .c_str(),
                       IoError);
  CHECK_THROWS_WITH_AS(SafetensorsWeights::open_folder(dir / "nope"),
                       (dir / "nope" + ": no such file or directory").c_str(), IoError);
}

TEST_CASE("safetensors: speculators records read as zero-copy strided views") {
  require_python();
  test::TempDir dir("st");
  const auto r = test::python(py(R"PY(
out = sys.argv[1]
T, H = 5, 8
hs = BF16((np.arange(T * 4 * H, dtype=np.float32) * 0.01 - 0.5).reshape(T, 4, H))
save({"token_ids": np.arange(T, dtype=np.int64) + 100, "hidden_states": hs}, out + "/17.safetensors")
save({"token_ids": np.arange(T, dtype=np.int32).reshape(1, T), "hidden_states": BF16(bits=hs.bits.reshape(1, T, 4, H)),
      "loss_mask": np.array([[0, 1, 1, 1, 0]], dtype=np.int64)}, out + "/batched.safetensors", {"conversation_id": "conv-b"})
f = hs.float()
aux = f[:, :3, :].reshape(T, 3 * H).flatten().tolist()
last = f[:, 3, :].flatten().tolist()
json.dump({"aux": aux, "last": last}, open(out + "/expected.json", "w"))
)PY"),
                              {dir.path()});
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const auto expected = nlohmann::json::parse(test::read_bytes(dir / "expected.json"));
  const auto aux = expected["aux"].get<std::vector<double>>();
  const auto last = expected["last"].get<std::vector<double>>();

  const auto reader = open_reader(dir / "17.safetensors");
  CHECK(reader->format() == Format::kSafetensors);
  REQUIRE(reader->size() == 1);
  const RecordInfo info = reader->info(0);
  CHECK(info.conversation_id == "17");
  CHECK(info.tokens == 5);
  CHECK(info.hidden_size == 8);
  CHECK(info.aux_width == 24);
  CHECK(info.hidden_dtype == DType::kBFloat16);
  CHECK_FALSE(info.has_loss_mask);
  const Record rec = reader->read(0);
  CHECK(rec.input_ids.get(4) == 104);
  CHECK(rec.aux_hidden_states.shape == std::vector<std::int64_t>{5, 24});
  CHECK(rec.aux_hidden_states.strides == std::vector<std::int64_t>{32, 1});
  CHECK(rec.hidden_states.strides == std::vector<std::int64_t>{32, 1});
  CHECK(rec.hidden_states.data == rec.aux_hidden_states.data + 24 * 2);  // no copy
  for (std::size_t i = 0; i < aux.size(); ++i) CHECK(rec.aux_hidden_states.get(static_cast<std::int64_t>(i)) == aux[i]);
  for (std::size_t i = 0; i < last.size(); ++i) CHECK(rec.hidden_states.get(static_cast<std::int64_t>(i)) == last[i]);
  const Record pre = reader->read_prefix(0, 2);
  CHECK(pre.tokens() == 2);
  CHECK(pre.hidden_states.get(8) == last[8]);

  const Record b = open_reader(dir / "batched.safetensors")->read(0);
  CHECK(b.conversation_id == "conv-b");
  CHECK(b.input_ids.dtype == DType::kInt32);
  CHECK(b.tokens() == 5);
  REQUIRE(b.loss_mask);
  CHECK(b.loss_mask->get(0) == 0);
  CHECK(b.loss_mask->get(1) == 1);
  CHECK(b.aux_hidden_states.contiguous().equal(rec.aux_hidden_states.contiguous()));

  // Re-written with our key names (copies the strided views), read back equal.
  auto w = create_writer(dir / "ours.safetensors", WriterOptions{Format::kSafetensors});
  w->add(rec);
  CHECK_THROWS_AS(w->add(rec), UsageError);
  w->finish();
  const Record back = open_reader(dir / "ours.safetensors")->read(0);
  CHECK(back.conversation_id == "17");
  CHECK(back.input_ids.equal(rec.input_ids));
  CHECK(back.hidden_states.equal(rec.hidden_states));
  CHECK(back.aux_hidden_states.equal(rec.aux_hidden_states));
  CHECK_FALSE(back.loss_mask);
  const auto f = SafetensorsFile::open(dir / "ours.safetensors");
  CHECK(f->metadata() == SafetensorsMetadata{{"conversation_id", "17"}, {"format", "pt"}});
}

TEST_CASE("safetensors: our record files load in Python with the expected keys") {
  require_python();
  test::TempDir dir("st");
  Record r;
  r.conversation_id = "abc";
  r.input_ids = typed<std::int64_t>(DType::kInt64, {3}, {7, 8, 9});
  r.hidden_states = f32_tensor({3, 2});
  r.aux_hidden_states = f32_tensor({3, 6}, 10.f);
  r.loss_mask = typed<std::int64_t>(DType::kInt64, {3}, {0, 1, 1});
  auto w = create_writer(dir / "abc.safetensors", WriterOptions{Format::kSafetensors});
  w->add(r);
  w->finish();
  const auto res = test::python(py(R"PY(
out, meta = load(sys.argv[1] + "/abc.safetensors")
assert meta == {"format": "pt", "conversation_id": "abc"}, meta
assert sorted(out) == ["aux_hidden_states", "hidden_states", "input_ids", "loss_mask"], sorted(out)
assert out["input_ids"].tolist() == [7, 8, 9]
assert out["aux_hidden_states"].shape == (3, 6) and out["aux_hidden_states"][2, 5].item() == 27.0
assert out["loss_mask"].tolist() == [0, 1, 1]
print("ok")
)PY"),
                                {dir.path()});
  CHECK_MESSAGE(res.exit_code == 0, res.err);
  CHECK(res.out == "ok\n");
}

TEST_CASE("safetensors: record files missing their tensors say what was expected") {
  test::TempDir dir("st");
  write_safetensors(dir / "w.safetensors", {{"lm_head.weight", f32_tensor({2, 2})}});
  CHECK_THROWS_WITH_AS(open_reader(dir / "w.safetensors"),
                       (dir / "w.safetensors" +
                        ": input_ids: no input_ids or token_ids tensor (expected token_ids + "
                        "hidden_states [T, k+1, H] (speculators) or input_ids + hidden_states "
                        "[T, H] + aux_hidden_states [T, k*H])")
                           .c_str(),
                       FormatError);
  write_safetensors(dir / "h.safetensors",
                    {{"input_ids", typed<std::int64_t>(DType::kInt64, {2}, {1, 2})},
                     {"hidden_states", f32_tensor({2, 4})}});
  CHECK_THROWS_WITH_AS(open_reader(dir / "h.safetensors"),
                       (dir / "h.safetensors" +
                        ": aux_hidden_states: no aux_hidden_states tensor and hidden_states is "
                        "[2, 4], not stacked [T, k+1, H] (expected token_ids + hidden_states "
                        "[T, k+1, H] (speculators) or input_ids + hidden_states [T, H] + "
                        "aux_hidden_states [T, k*H])")
                           .c_str(),
                       FormatError);
  write_safetensors(dir / "t.safetensors",
                    {{"token_ids", typed<std::int64_t>(DType::kInt64, {3}, {1, 2, 3})},
                     {"hidden_states", f32_tensor({2, 4, 2})}});
  CHECK_THROWS_WITH_AS(open_reader(dir / "t.safetensors"),
                       (dir / "t.safetensors" +
                        ": hidden_states: 2 rows but input_ids has 3 tokens")
                           .c_str(),
                       FormatError);
}

// Found by tests/fuzz (fuzz_safetensors): a number too large for a double in the header made
// nlohmann throw out_of_range 406 past the parser instead of a FormatError.
TEST_CASE("safetensors: a header number that overflows a double is a FormatError (fuzz regression)") {
  CHECK_THROWS_WITH_AS(
      parse_bytes(file_bytes(R"({"w":{"dtype":"F32","shape":[1E400],"data_offsets":[0,4]}})", 4)),
      "bad.safetensors: header at byte 8: not valid JSON: number overflow parsing '1E400'",
      FormatError);
  // The exact fuzz input.
  const auto fuzzed = test::read_bytes(
      test::source_dir() + "/tests/fuzz/regressions/safetensors-number-overflow.safetensors");
  CHECK_THROWS_WITH_AS(
      SafetensorsFile::parse(ByteSource::from_bytes(fuzzed, "fuzzed.safetensors")),
      doctest::Contains("fuzzed.safetensors: header at byte 8: not valid JSON: number overflow "
                        "parsing '999E9999999999999999999999999999999999999"),
      FormatError);
}

TEST_CASE("safetensors: a weight index number that overflows a double is a FormatError") {
  test::TempDir d("stidx");
  test::write_text(d / "model.safetensors.index.json",
                   R"({"metadata": {"total_size": 1E400}, "weight_map": {}})");
  CHECK_THROWS_WITH_AS(SafetensorsWeights::open_folder(d.path()),
                       (d / "model.safetensors.index.json" +
                        ": index: not valid JSON: number overflow parsing '1E400'")
                           .c_str(),
                       FormatError);
}

TEST_CASE("safetensors: __metadata__ hidden_states_prenorm states a record's norm form; ours write it when stated") {
  require_python();
  test::TempDir dir("st");
  const auto r = test::python(py(R"PY(
out = sys.argv[1]
T, H = 4, 8
rec = {"input_ids": np.arange(T, dtype=np.int64), "hidden_states": np.ones((T, H), np.float32),
       "aux_hidden_states": np.ones((T, 2 * H), np.float32)}
save(rec, out + "/pre.safetensors", {"hidden_states_prenorm": "true"})
save(rec, out + "/post.safetensors", {"hidden_states_prenorm": "false"})
save(rec, out + "/unstated.safetensors", {"format": "pt"})
save(rec, out + "/bad.safetensors", {"hidden_states_prenorm": "yes"})
hs = np.ones((T, 3, H), np.float32)
save({"token_ids": np.arange(T, dtype=np.int64), "hidden_states": hs}, out + "/spec.safetensors",
     {"hidden_states_prenorm": "true"})
)PY"),
                              {dir.path()});
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  auto flag = [&](const char* name) { return open_reader(dir / name)->read(0).hidden_states_prenorm; };
  CHECK(flag("pre.safetensors") == std::optional<bool>(true));
  CHECK(flag("post.safetensors") == std::optional<bool>(false));
  CHECK_FALSE(flag("unstated.safetensors").has_value());
  CHECK(flag("spec.safetensors") == std::optional<bool>(true));
  CHECK(open_reader(dir / "pre.safetensors")->info(0).hidden_states_prenorm == std::optional<bool>(true));
  CHECK_THROWS_WITH_AS(open_reader(dir / "bad.safetensors"),
                       (dir / "bad.safetensors" +
                        ": __metadata__.hidden_states_prenorm at byte 8: is \"yes\", expected \"true\" or \"false\"")
                           .c_str(),
                       FormatError);

  for (const char* name : {"pre", "post", "unstated"}) {
    CAPTURE(name);
    const Record rec = open_reader(dir / (std::string(name) + ".safetensors"))->read(0);
    const std::string path = dir / (std::string("ours-") + name + ".safetensors");
    auto w = create_writer(path, WriterOptions{Format::kSafetensors});
    w->add(rec);
    w->finish();
    CHECK(open_reader(path)->read(0).hidden_states_prenorm == rec.hidden_states_prenorm);
  }
  const auto res = test::python(py(R"PY(
for name in ["pre", "post", "unstated"]:
    _, meta = load(sys.argv[1] + "/ours-" + name + ".safetensors")
    print(name, meta.get("hidden_states_prenorm", "-"))
)PY"),
                                {dir.path()});
  REQUIRE_MESSAGE(res.exit_code == 0, res.err);
  CHECK(res.out == "pre true\npost false\nunstated -\n");
}

// speculators' FP8 records, written by the producers' own code (tests/data/speculators_fp8/
// make_fixture.py: hs_connectors 0.9.0's FP8HiddenStatesConnector, and the expected values
// from its reader, FP8Transfer, dequantising to float32).
namespace {

std::string fp8_fixture(const std::string& sub, int i) {
  return test::source_dir() + "/tests/data/speculators_fp8/" + sub + "/hs_" + std::to_string(i) + ".safetensors";
}

std::vector<std::uint8_t> bytes_of(const std::string& path) {
  const auto src = ByteSource::open_file(path);
  return std::vector<std::uint8_t>(src->data(), src->data() + src->size());
}

// The file with its header changed by `edit` (data offsets are relative to the data, so the
// tensors stay where they were).
std::vector<std::uint8_t> with_header(const std::vector<std::uint8_t>& file,
                                      const std::function<void(nlohmann::json&)>& edit) {
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<std::uint64_t>(file[static_cast<std::size_t>(i)]) << (8 * i);
  nlohmann::json h = nlohmann::json::parse(file.begin() + 8, file.begin() + 8 + static_cast<std::ptrdiff_t>(n));
  edit(h);
  const std::string text = h.dump();
  std::vector<std::uint8_t> out = file_bytes(text, 0);
  out.insert(out.end(), file.begin() + 8 + static_cast<std::ptrdiff_t>(n), file.end());
  return out;
}

}  // namespace

TEST_CASE("safetensors: speculators' FP8 records read as the producer's reader dequantises them, bit for bit") {
  for (int i : {0, 1}) {
    CAPTURE(i);
    const auto reader = open_reader(fp8_fixture("dump", i));
    const auto expected = SafetensorsFile::open(fp8_fixture("expected", i));
    const HostTensor want = *expected->get("hidden_states");  // float32 [T, 3, 8]
    const std::int64_t t = want.shape[0];
    const RecordInfo info = reader->info(0);
    CHECK(info.tokens == t);
    CHECK(info.hidden_size == 8);
    CHECK(info.aux_width == 16);
    CHECK(info.hidden_dtype == DType::kFloat32);
    CHECK(info.codec == "fp8");
    CHECK(info.layout_prenorm == std::optional<bool>(true));  // vLLM's capture: before the final norm
    CHECK_FALSE(info.hidden_states_prenorm.has_value());
    for (std::int64_t rows : {t, std::int64_t{2}}) {
      CAPTURE(rows);
      const Record r = rows == t ? reader->read(0) : reader->read_prefix(0, rows);
      REQUIRE(r.tokens() == rows);
      CHECK(std::memcmp(r.input_ids.data, expected->get("token_ids")->data, static_cast<std::size_t>(8 * rows)) == 0);
      const auto* w = reinterpret_cast<const float*>(want.data);
      std::int64_t differ = 0;
      for (std::int64_t tok = 0; tok < rows; ++tok)
        for (std::int64_t c = 0; c < 24; ++c) {
          const HostTensor& part = c < 16 ? r.aux_hidden_states : r.hidden_states;
          const std::int64_t col = c < 16 ? c : c - 16;
          float got;
          std::memcpy(&got, part.data + 4 * (tok * part.strides[0] + col), 4);
          differ += std::memcmp(&got, &w[tok * 24 + c], 4) != 0;
        }
      CHECK(differ == 0);
    }
  }
  // Record 1 has an all-zero token: scale 1e-12 (the producer's clamp), codes 0, read back 0.
  const Record r = open_reader(fp8_fixture("dump", 1))->read(0);
  const auto* z = reinterpret_cast<const float*>(r.hidden_states.data + 4 * 2 * r.hidden_states.strides[0]);
  CHECK(z[0] == 0.0f);
}

TEST_CASE("safetensors: FP8 records that are truncated or corrupt are refused with the file, offset and field") {
  const std::vector<std::uint8_t> good = bytes_of(fp8_fixture("dump", 0));
  const auto ok = parse_bytes(good);
  const SafetensorsEntry* scales = ok->find("hidden_states_scales");
  REQUIRE(scales != nullptr);
  CHECK_NOTHROW(safetensors_record(*ok));
  // Every cut of the file is refused by the header checks before any byte is decoded.
  for (std::size_t cut = 0; cut < good.size(); cut += 7) {
    CAPTURE(cut);
    std::vector<std::uint8_t> b(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(cut));
    CHECK_THROWS_AS(safetensors_record(*parse_bytes(b)), FormatError);
  }
  // A scale that the producer cannot have written (it clamps to >= 1e-12): NaN, 0, negative.
  const std::uint64_t at = ok->data_start() + scales->begin + 4 * 3;  // token 3's scale
  for (float bad : {std::nanf(""), 0.0f, -0.5f}) {
    CAPTURE(bad);
    std::vector<std::uint8_t> b = good;
    std::memcpy(b.data() + at, &bad, 4);
    CHECK_THROWS_WITH_AS(safetensors_record(*parse_bytes(b)),
                         doctest::Contains(("bad.safetensors: hidden_states_scales[3] at byte " + std::to_string(at) +
                                            ": scale ")
                                               .c_str()),
                         FormatError);
    // Reading only the rows before it does not decode it.
    CHECK(safetensors_record(*parse_bytes(b), 3).tokens() == 3);
  }
  struct Case {
    const char* what;
    std::function<void(nlohmann::json&)> edit;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"no scales", [](nlohmann::json& h) { h.erase("hidden_states_scales"); },
       "bad.safetensors: hidden_states at byte 8: is F8_E4M3 but the file has no hidden_states_scales (speculators' "
       "FP8 records store one float32 scale per token beside it)"},
      {"scales not F32", [](nlohmann::json& h) { h["hidden_states_scales"]["dtype"] = "I32"; },
       "bad.safetensors: hidden_states_scales at byte 8: dtype I32, expected F32"},
      {"scales of another length",
       [](nlohmann::json& h) {
         h["hidden_states_scales"]["shape"] = {3, 2};
       },
       "bad.safetensors: hidden_states_scales at byte 8: shape [3, 2], expected one scale per token ([6, 1, 1], "
       "[6, 1] or [6]) or one for the tensor ([1])"},
      {"not stacked",
       [](nlohmann::json& h) {
         h["hidden_states"]["shape"] = {6, 24};
       },
       "bad.safetensors: hidden_states at byte 8: F8_E4M3 of shape [6, 24], expected [T, L, H] with T = 6 (the ids' "
       "length), as speculators' FP8 connector writes it"},
      {"ids of another length",
       [](nlohmann::json& h) {
         h["token_ids"]["shape"] = {3};
         h["token_ids"]["data_offsets"][1] = h["token_ids"]["data_offsets"][0].get<int>() + 24;
       },
       "bad.safetensors: hidden_states at byte 8: F8_E4M3 of shape [6, 3, 8], expected [T, L, H] with T = 3 (the "
       "ids' length), as speculators' FP8 connector writes it"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.what);
    CHECK_THROWS_WITH_AS(safetensors_record(*parse_bytes(with_header(good, c.edit))), c.message.c_str(), FormatError);
  }
  // Another FP8 type is refused as one eaglekit does not read; scales beside BF16 states too.
  CHECK_THROWS_WITH_AS(safetensors_record(*parse_bytes(with_header(good, [](nlohmann::json& h) {
                         h["hidden_states"]["dtype"] = "F8_E5M2";
                       }))),
                       "bad.safetensors: hidden_states at byte 8: F8_E5M2 hidden states cannot be read (speculators' FP8 "
                       "records are F8_E4M3)",
                       UnsupportedError);
  const auto bf16 = bytes_of(fp8_fixture("bf16", 0));
  CHECK_NOTHROW(safetensors_record(*parse_bytes(bf16)));
  CHECK_THROWS_WITH_AS(safetensors_record(*parse_bytes(with_header(good, [](nlohmann::json& h) {
                         h["hidden_states"]["dtype"] = "U8";
                       }))),
                       "bad.safetensors: hidden_states_scales at byte 8: present but hidden_states is U8, not F8_E4M3",
                       FormatError);
}
