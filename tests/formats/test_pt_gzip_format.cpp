// .ckpt.gz: SpecForge .ckpt.gz written by Python (torch.save + gzip) reads equal, and our
// .ckpt.gz opens in Python. The gzip stream itself is tests/formats/test_gzip_source.cpp.
#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>

#include "formats/dtype.h"
#include "formats/error.h"
#include "formats/format.h"
#include "formats/pt_gzip_format.h"
#include "tests/support.h"

using namespace eaglekit;
namespace fs = std::filesystem;

namespace {

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

TEST_CASE("ckpt.gz: SpecForge .ckpt and .ckpt.gz from Python torch read equal") {
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

TEST_CASE("ckpt.gz: ours opens in Python and reads back equal") {
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
