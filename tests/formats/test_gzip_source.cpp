// gzip: SpecForge .ckpt.gz written by Python (torch.save + gzip) reads equal, our .ckpt.gz
// opens in Python, multi-member streams, and truncated or corrupt streams fail naming the
// file and the compressed offset.
#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <functional>

#include "formats/byte_source.h"
#include "formats/dtype.h"
#include "formats/error.h"
#include "formats/format.h"
#include "formats/gzip_source.h"
#include "tests/support.h"

using namespace eaglekit;
namespace fs = std::filesystem;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.rfind(prefix, 0) == 0;
}

// SpecForge-style dicts (batch dimension of 1, singular key names), saved by torch and
// gzip'd by Python's gzip; raw bytes of every tensor beside them for comparison.
const char* kPyWriteSpecForge = R"PY(
import gzip, os, sys
import torch
d = sys.argv[1]
torch.manual_seed(0)
def dump(name, t):
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    open(os.path.join(d, name), "wb").write(t.numpy().tobytes())
for i, (T, H, dt) in enumerate([(37, 16, torch.bfloat16), (5, 8, torch.float16)]):
    rec = {
        "input_ids": torch.randint(0, 128000, (1, T), dtype=torch.long),
        "loss_mask": (torch.rand(1, T) > 0.3).long(),
        "hidden_state": torch.randn(1, T, H).to(dt),
        "aux_hidden_state": torch.randn(1, T, 3 * H).to(dt),
    }
    torch.save(rec, os.path.join(d, f"{i}.ckpt"))
    raw = open(os.path.join(d, f"{i}.ckpt"), "rb").read()
    if i == 0:
        data = gzip.compress(raw, compresslevel=6)
    else:  # two members and zero padding, as concatenated or padded archives have
        data = gzip.compress(raw[:100]) + gzip.compress(raw[100:]) + b"\0" * 16
    open(os.path.join(d, f"{i}.ckpt.gz"), "wb").write(data)
    for k, v in rec.items():
        dump(f"{i}.{k}", v[0])
)PY";

void check_tensor_bytes(const HostTensor& t, const std::string& file) {
  INFO(file);
  const auto want = test::read_bytes(file);
  REQUIRE(t.nbytes() == want.size());
  std::vector<std::uint8_t> got(t.nbytes());
  t.copy_to(got.data());
  CHECK(got == want);
}

}  // namespace

TEST_CASE("gzip: SpecForge .ckpt and .ckpt.gz from Python torch read equal") {
  test::TempDir d("gz");
  const auto py = test::python(kPyWriteSpecForge, {d.path()});
  INFO(py.err);
  REQUIRE(py.exit_code == 0);
  struct Want {
    std::int64_t t, h;
    DType dtype;
  };
  const Want wants[] = {{37, 16, DType::kBFloat16}, {5, 8, DType::kFloat16}};
  for (int i = 0; i < 2; ++i) {
    const std::string gz = d / (std::to_string(i) + ".ckpt.gz");
    CHECK(detect_file_format(gz) == Format::kPtGzip);
    auto reader = open_reader(gz);
    CHECK(reader->format() == Format::kPtGzip);
    CHECK(reader->path() == gz);
    REQUIRE(reader->size() == 1);
    const RecordInfo info = reader->info(0);
    CHECK(info.conversation_id == std::to_string(i));
    CHECK(info.tokens == wants[i].t);
    CHECK(info.hidden_size == wants[i].h);
    CHECK(info.aux_width == 3 * wants[i].h);
    CHECK(info.hidden_dtype == wants[i].dtype);
    CHECK(info.codec == "gzip");
    CHECK(info.byte_size == fs::file_size(gz));
    const Record r = reader->read(0);
    CHECK(r.conversation_id == std::to_string(i));
    CHECK(r.hidden_states.shape == std::vector<std::int64_t>{wants[i].t, wants[i].h});
    const std::string base = d / std::to_string(i);
    check_tensor_bytes(r.input_ids, base + ".input_ids");
    REQUIRE(r.loss_mask.has_value());
    check_tensor_bytes(*r.loss_mask, base + ".loss_mask");
    check_tensor_bytes(r.hidden_states, base + ".hidden_state");
    check_tensor_bytes(r.aux_hidden_states, base + ".aux_hidden_state");
    CHECK(reader->read_prefix(0, 3).hidden_states.equal(r.hidden_states.rows(3)));

    // The plain .ckpt is the .pt reader's and gives the same record.
    auto plain = open_reader(d / (std::to_string(i) + ".ckpt"));
    CHECK(plain->format() == Format::kPt);
    const Record p = plain->read(0);
    CHECK(p.hidden_states.equal(r.hidden_states));
    CHECK(p.aux_hidden_states.equal(r.aux_hidden_states));
    CHECK(p.input_ids.equal(r.input_ids));
  }
}

TEST_CASE("gzip: our .ckpt.gz opens in Python and reads back equal") {
  test::TempDir d("gz");
  Record r;
  r.conversation_id = "conv-9";
  const std::int64_t t = 11, h = 8;
  std::vector<std::uint8_t> ids(t * 8), hid(t * h * 2), aux(t * 3 * h * 2);
  for (std::int64_t i = 0; i < t; ++i) {
    const std::int64_t v = 1000 + 7 * i;
    std::memcpy(ids.data() + 8 * i, &v, 8);
  }
  for (std::size_t i = 0; i < hid.size() / 2; ++i) {
    const std::uint16_t v = float_to_bf16(static_cast<float>(i % 97) / 13.0f - 3.0f);
    std::memcpy(hid.data() + 2 * i, &v, 2);
  }
  for (std::size_t i = 0; i < aux.size() / 2; ++i) {
    const std::uint16_t v = float_to_bf16(static_cast<float>(i % 89) / 7.0f - 6.0f);
    std::memcpy(aux.data() + 2 * i, &v, 2);
  }
  r.input_ids = HostTensor::from_bytes(DType::kInt64, {t}, ids);
  r.hidden_states = HostTensor::from_bytes(DType::kBFloat16, {t, h}, hid);
  r.aux_hidden_states = HostTensor::from_bytes(DType::kBFloat16, {t, 3 * h}, aux);
  WriterOptions opts;
  opts.format = Format::kPtGzip;
  {
    auto w = create_writer(d / "conv-9.ckpt.gz", opts);
    w->add(r);
    CHECK(std::distance(fs::directory_iterator(d.path()), {}) == 0);
  }
  CHECK(std::distance(fs::directory_iterator(d.path()), {}) == 0);  // abandoned: nothing
  {
    auto w = create_writer(d / "conv-9.ckpt.gz", opts);
    w->add(r);
    w->finish();
  }
  CHECK(std::distance(fs::directory_iterator(d.path()), {}) == 1);  // no temp left
  test::write_bytes(d / "ids", ids);
  test::write_bytes(d / "hid", hid);
  test::write_bytes(d / "aux", aux);
  const auto py = test::python(R"PY(
import gzip, io, sys
import torch
d = sys.argv[1]
raw = gzip.open(d + "/conv-9.ckpt.gz", "rb").read()  # checks CRC and length
x = torch.load(io.BytesIO(raw))
assert x["conversation_id"] == "conv-9", x["conversation_id"]
assert x["input_ids"].numpy().tobytes() == open(d + "/ids", "rb").read()
assert x["hidden_states"].dtype == torch.bfloat16
assert x["hidden_states"].view(torch.int16).numpy().tobytes() == open(d + "/hid", "rb").read()
assert x["aux_hidden_states"].view(torch.int16).numpy().tobytes() == open(d + "/aux", "rb").read()
assert "loss_mask" not in x
)PY",
                               {d.path()});
  INFO(py.err);
  CHECK(py.exit_code == 0);
  const Record back = open_reader(d / "conv-9.ckpt.gz")->read(0);
  CHECK(back.conversation_id == "conv-9");
  CHECK(back.hidden_states.equal(r.hidden_states));
  CHECK(back.aux_hidden_states.equal(r.aux_hidden_states));
  CHECK(back.input_ids.equal(r.input_ids));

  opts.codec = "gzip";
  opts.level = 12;
  CHECK_THROWS_AS(create_writer(d / "x.ckpt.gz", opts), UsageError);
}

TEST_CASE("gzip: multi-megabyte and multi-member streams round trip") {
  // Larger than zlib's input slices, compressible like hidden states are (a little).
  std::vector<std::uint8_t> a(3u << 20), b(777);
  std::uint32_t s = 1;
  for (auto& x : a) {
    s = s * 1103515245u + 12345u;
    x = static_cast<std::uint8_t>((s >> 16) & 0x3f);
  }
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<std::uint8_t>(i * 7);
  const auto ga = gzip_bytes(a.data(), a.size(), 1);
  const auto gb = gzip_bytes(b.data(), b.size(), 9);
  CHECK(ga.size() < a.size());
  auto one = gunzip(*ByteSource::from_bytes(ga, "a.gz"), kDefaultGunzipLimit);
  CHECK(one->name() == "a.gz (decompressed)");
  REQUIRE(one->size() == a.size());
  CHECK(std::memcmp(one->data(), a.data(), a.size()) == 0);

  std::vector<std::uint8_t> both = ga;
  both.insert(both.end(), gb.begin(), gb.end());
  auto two = gunzip(*ByteSource::from_bytes(both, "ab.gz"), kDefaultGunzipLimit);
  REQUIRE(two->size() == a.size() + b.size());
  CHECK(std::memcmp(two->data() + a.size(), b.data(), b.size()) == 0);

  // An empty member is valid; the cap is inclusive.
  const auto empty = gzip_bytes(nullptr, 0);
  CHECK(gunzip(*ByteSource::from_bytes(empty, "e.gz"), 0)->size() == 0);
  CHECK(gunzip(*ByteSource::from_bytes(gb, "b.gz"), b.size())->size() == b.size());
  CHECK(error_of([&] { gunzip(*ByteSource::from_bytes(gb, "b.gz"), b.size() - 1); }) ==
        "b.gz: gzip stream at byte " + std::to_string(gb.size()) + ": decompresses to more than " +
            std::to_string(b.size() - 1) +
            " bytes, the in-memory limit (EAGLEKIT_GUNZIP_MAX_BYTES raises it)");
  CHECK_THROWS_AS(gunzip(*ByteSource::from_bytes(gb, "b.gz"), 100), UnsupportedError);

  // gzip_file streams a file through deflate; Python's gzip and ours agree on the bytes.
  test::TempDir d("gz");
  test::write_bytes(d / "a.bin", a);
  gzip_file(d / "a.bin", d / "a.bin.gz", 6);
  const auto py = test::python(
      "import gzip, sys\n"
      "assert gzip.open(sys.argv[1] + '.gz').read() == open(sys.argv[1], 'rb').read()\n",
      {d / "a.bin"});
  CHECK(py.exit_code == 0);
  auto back = gunzip_file(d / "a.bin.gz", kDefaultGunzipLimit);
  CHECK(back->size() == a.size());
}

TEST_CASE("gzip: truncated and corrupt streams name the file and the compressed offset") {
  test::TempDir d("gz");
  std::vector<std::uint8_t> plain(5000);
  for (std::size_t i = 0; i < plain.size(); ++i)
    plain[i] = static_cast<std::uint8_t>((i * i) % 251);
  const auto good = gzip_bytes(plain.data(), plain.size(), 6);
  const std::size_t n = good.size();
  auto variant = [&](const std::string& name, std::vector<std::uint8_t> bytes) {
    const std::string p = d / name;
    test::write_bytes(p, bytes);
    return p;
  };
  auto cut = [&](std::size_t keep) {
    return std::vector<std::uint8_t>(good.begin(), good.begin() + static_cast<long>(keep));
  };
  auto flip = [&](std::size_t at) {
    auto b = good;
    b[at] ^= 0x55;
    return b;
  };
  const std::string truncated =
      ": truncated: the input ends inside the gzip member that started at byte 0 (";
  for (std::size_t keep : {n / 2, n - 3, std::size_t{5}, std::size_t{2}}) {
    INFO("kept " << keep);
    const std::string p = variant("cut" + std::to_string(keep) + ".gz", cut(keep));
    const std::string err = error_of([&] { gunzip_file(p, 1u << 20); });
    CHECK(starts_with(err, p + ": gzip stream at byte " + std::to_string(keep) + truncated));
    CHECK_THROWS_AS(gunzip_file(p, 1u << 20), FormatError);
  }
  {
    const std::string p = variant("crc.gz", flip(n - 8));
    CHECK(error_of([&] { gunzip_file(p, 1u << 20); }) ==
          p + ": gzip trailer at byte " + std::to_string(n - 4) +
              ": CRC-32 of the member that started at byte 0 does not match its decompressed "
              "bytes (incorrect data check)");
    CHECK_THROWS_AS(gunzip_file(p, 1u << 20), ChecksumError);
  }
  {
    const std::string p = variant("len.gz", flip(n - 1));
    CHECK(error_of([&] { gunzip_file(p, 1u << 20); }) ==
          p + ": gzip trailer at byte " + std::to_string(n) +
              ": length of the member that started at byte 0 does not match its decompressed "
              "bytes (incorrect length check)");
    CHECK_THROWS_AS(gunzip_file(p, 1u << 20), ChecksumError);
  }
  {
    auto bytes = good;
    bytes.insert(bytes.end(), {'x', 'y', 'z'});
    const std::string p = variant("trailing.gz", bytes);
    CHECK(error_of([&] { gunzip_file(p, 1u << 20); }) ==
          p + ": gzip stream at byte " + std::to_string(n) +
              ": 3 bytes after the gzip member that started at byte 0 are not another gzip "
              "member");
  }
  {
    auto bytes = good;
    bytes[3] = 0xe0;  // reserved header flag bits
    const std::string p = variant("flags.gz", bytes);
    CHECK(starts_with(error_of([&] { gunzip_file(p, 1u << 20); }), p + ": gzip stream at byte "));
    CHECK_THROWS_AS(gunzip_file(p, 1u << 20), FormatError);
  }
  {
    const std::string p = variant("notgz.gz", {'P', 'K', 3, 4});
    CHECK(error_of([&] { gunzip_file(p, 1u << 20); }) ==
          p + ": gzip header at byte 0: not a gzip file (no 1f 8b magic)");
  }
  {
    // Damage inside the deflate data: either invalid codes or a CRC mismatch, never success.
    for (std::size_t at : {std::size_t{12}, n / 3, n / 2}) {
      const std::string p = variant("mid" + std::to_string(at) + ".gz", flip(at));
      CHECK_THROWS_AS(gunzip_file(p, 1u << 20), FormatError);
    }
  }
  // Through the registry, a truncated .ckpt.gz is a FormatError naming the file.
  {
    const std::string p = variant("0.ckpt.gz", cut(n / 2));
    CHECK(starts_with(error_of([&] { open_reader(p); }), p + ": gzip stream at byte "));
    CHECK_THROWS_AS(open_reader(p), FormatError);
  }
  // Decompressed bytes that are not a torch zip: the .pt reader's error, on the
  // decompressed source.
  {
    const std::string p = variant("1.ckpt.gz", good);
    CHECK(starts_with(error_of([&] { open_reader(p); }), p + " (decompressed): "));
  }
}
