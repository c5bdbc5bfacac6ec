// HDF5: shards and group-per-conversation files written by h5py read back equal, shards
// we write read back equal in h5py, prefix reads touch only their rows, and corrupt files
// fail with the file and dataset named.
#include <doctest/doctest.h>

#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <thread>

#include "formats/dtype.h"
#include "formats/error.h"
#include "formats/format.h"
#include "formats/hdf5_format.h"
#include "tests/support.h"

using namespace eaglekit;
namespace fs = std::filesystem;

namespace {

std::uint32_t next_random(std::uint32_t& state) {
  state = state * 1664525u + 1013904223u;
  return state >> 8;
}

HostTensor random_floats(DType dtype, std::vector<std::int64_t> shape, std::uint32_t& seed) {
  HostTensor t = HostTensor::zeros(dtype, shape);
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    const float f = static_cast<float>(next_random(seed) % 20001) / 2500.0f - 4.0f;
    std::uint8_t* p = t.mutable_data() + i * static_cast<std::int64_t>(t.itemsize());
    if (dtype == DType::kBFloat16) {
      const std::uint16_t v = float_to_bf16(f);
      std::memcpy(p, &v, 2);
    } else if (dtype == DType::kFloat16) {
      const std::uint16_t v = float_to_fp16(f);
      std::memcpy(p, &v, 2);
    } else {
      std::memcpy(p, &f, 4);
    }
  }
  return t;
}

// A record with T tokens, hidden size h, k aux layers; loss_mask of mask_dtype when given.
Record make_record(const std::string& id, std::int64_t t, std::int64_t h, std::int64_t k,
                   DType dtype, std::optional<DType> mask_dtype, std::uint32_t seed) {
  Record r;
  r.conversation_id = id;
  std::vector<std::uint8_t> ids(static_cast<std::size_t>(t) * 8);
  for (std::int64_t i = 0; i < t; ++i) {
    const std::int64_t v = 100000 + next_random(seed) % 28000;
    std::memcpy(ids.data() + 8 * i, &v, 8);
  }
  r.input_ids = HostTensor::from_bytes(DType::kInt64, {t}, std::move(ids));
  r.hidden_states = random_floats(dtype, {t, h}, seed);
  r.aux_hidden_states = random_floats(dtype, {t, k * h}, seed);
  if (mask_dtype) {
    HostTensor m = HostTensor::zeros(*mask_dtype, {t});
    for (std::int64_t i = 0; i < t; ++i) {
      const bool on = i > 1 && next_random(seed) % 4 != 0;
      if (*mask_dtype == DType::kInt64) {
        const std::int64_t v = on;
        std::memcpy(m.mutable_data() + 8 * i, &v, 8);
      } else {
        m.mutable_data()[i] = on;
      }
    }
    r.loss_mask = m;
  }
  return r;
}

std::string tensor_values(const HostTensor& t) {
  std::string s;
  for (std::int64_t i = 0; i < std::min<std::int64_t>(t.numel(), 8); ++i)
    s += std::to_string(t.get(i)) + " ";
  return s;
}

// Same id, equal tensors; loss masks compared by value (the shard stores uint8).
void check_same(const Record& got, const Record& want) {
  INFO("record " << want.conversation_id);
  CHECK(got.conversation_id == want.conversation_id);
  REQUIRE(got.input_ids.shape == want.input_ids.shape);
  for (std::int64_t i = 0; i < want.input_ids.numel(); ++i)
    REQUIRE(got.input_ids.get(i) == want.input_ids.get(i));
  CHECK(got.hidden_states.equal(want.hidden_states));
  CHECK(got.aux_hidden_states.equal(want.aux_hidden_states));
  INFO("hidden got " << tensor_values(got.hidden_states) << " want "
                     << tensor_values(want.hidden_states));
  REQUIRE(got.loss_mask.has_value() == want.loss_mask.has_value());
  if (want.loss_mask) {
    REQUIRE(got.loss_mask->shape == want.loss_mask->shape);
    for (std::int64_t i = 0; i < want.loss_mask->numel(); ++i)
      REQUIRE(got.loss_mask->get(i) == want.loss_mask->get(i));
  }
}

// Raw bytes of each record for the Python side: DIR/manifest.txt has one line per record
// "ID T H KH DTYPE MASK" (MASK: a dtype or "none"), DIR/N.{ids,hid,aux,mask} the arrays.
void dump_records(const std::string& dir, const std::vector<Record>& records) {
  fs::create_directories(dir);
  std::ofstream manifest(dir + "/manifest.txt");
  for (std::size_t i = 0; i < records.size(); ++i) {
    const Record& r = records[i];
    manifest << r.conversation_id << " " << r.tokens() << " " << r.hidden_size() << " "
             << r.aux_width() << " " << dtype_name(r.hidden_states.dtype) << " "
             << (r.loss_mask ? std::string(dtype_name(r.loss_mask->dtype)) : "none") << "\n";
    auto dump = [&](const HostTensor& t, const char* ext) {
      std::vector<std::uint8_t> bytes(t.nbytes());
      t.copy_to(bytes.data());
      test::write_bytes(dir + "/" + std::to_string(i) + "." + ext, bytes);
    };
    dump(r.input_ids, "ids");
    dump(r.hidden_states, "hid");
    dump(r.aux_hidden_states, "aux");
    if (r.loss_mask) dump(*r.loss_mask, "mask");
  }
}

// Loads what dump_records wrote. bf16 arrays stay uint16 (numpy has no bfloat16).
const char* kPyLoad = R"PY(
import sys, os
import numpy as np
import h5py

NP = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32,
      "int64": np.int64, "uint8": np.uint8, "bool": np.bool_}

def load(d):
    out = []
    for i, line in enumerate(open(os.path.join(d, "manifest.txt"))):
        cid, t, h, kh, dt, mdt = line.split()
        t, h, kh = int(t), int(h), int(kh)
        r = {"id": cid, "dtype": dt,
             "ids": np.fromfile(os.path.join(d, f"{i}.ids"), np.int64),
             "hid": np.fromfile(os.path.join(d, f"{i}.hid"), NP[dt]).reshape(t, h),
             "aux": np.fromfile(os.path.join(d, f"{i}.aux"), NP[dt]).reshape(t, kh),
             "mask": None}
        if mdt != "none":
            r["mask"] = np.fromfile(os.path.join(d, f"{i}.mask"), NP[mdt])
        out.append(r)
    return out

def put_float(g, name, arr, dt, **kw):
    ds = g.create_dataset(name, data=arr, **kw)
    if dt == "bfloat16":
        ds.attrs["dtype"] = "bfloat16"
    return ds
)PY";

test::RunResult python_ok(const std::string& script, const std::vector<std::string>& args) {
  auto r = test::python(std::string(kPyLoad) + script, args);
  INFO("python stdout: " << r.out);
  INFO("python stderr: " << r.err);
  REQUIRE(r.exit_code == 0);
  return r;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

// A Python string literal.
std::string py_str(const std::string& s) {
  std::string q = "\"";
  for (char c : s) {
    if (c == '\\' || c == '"') q += '\\';
    q += c;
  }
  return q + "\"";
}

std::vector<Record> mixed_records(DType dtype) {
  return {make_record("conv-a", 7, 16, 3, dtype, DType::kUInt8, 1),
          make_record("b", 1, 16, 3, dtype, DType::kUInt8, 2),
          make_record("ünïcode-3", 40, 16, 3, dtype, DType::kUInt8, 3),
          make_record("d", 13, 16, 3, dtype, DType::kUInt8, 4)};
}

}  // namespace

TEST_CASE("hdf5: shard written by h5py reads equal (bf16 as uint16, gzip + shuffle)") {
  test::TempDir d("h5");
  const auto records = mixed_records(DType::kBFloat16);
  dump_records(d / "in", records);
  python_ok(R"PY(
recs = load(sys.argv[1])
with h5py.File(sys.argv[2], "w") as f:
    f.attrs["eaglekit_format"] = "hdf5-shard"
    f.attrs["version"] = 1
    f.attrs["hidden_size"] = recs[0]["hid"].shape[1]
    f.attrs["aux_layers"] = recs[0]["aux"].shape[1] // recs[0]["hid"].shape[1]
    f.create_dataset("conversation_ids", data=[r["id"] for r in recs],
                     dtype=h5py.string_dtype("utf-8"))
    lengths = [len(r["ids"]) for r in recs]
    f.create_dataset("offsets", data=np.cumsum([0] + lengths).astype(np.int64))
    kw = dict(chunks=True, compression="gzip", compression_opts=4, shuffle=True)
    f.create_dataset("input_ids", data=np.concatenate([r["ids"] for r in recs]), **kw)
    f.create_dataset("loss_mask", data=np.concatenate([r["mask"] for r in recs]), **kw)
    put_float(f, "hidden_states", np.concatenate([r["hid"] for r in recs]), "bfloat16",
              chunks=(5, 16), compression="gzip", shuffle=True)
    put_float(f, "aux_hidden_states", np.concatenate([r["aux"] for r in recs]), "bfloat16",
              chunks=(5, 48), compression="gzip", shuffle=True)
)PY",
            {d / "in", d / "shard.h5"});
  CHECK(detect_file_format(d / "shard.h5") == Format::kHdf5);
  auto reader = open_reader(d / "shard.h5");
  CHECK(reader->format() == Format::kHdf5);
  REQUIRE(reader->size() == records.size());
  for (std::size_t i = 0; i < records.size(); ++i) {
    const RecordInfo info = reader->info(i);
    CHECK(info.conversation_id == records[i].conversation_id);
    CHECK(info.tokens == records[i].tokens());
    CHECK(info.hidden_size == 16);
    CHECK(info.aux_width == 48);
    CHECK(info.hidden_dtype == DType::kBFloat16);
    CHECK(info.has_loss_mask);
    CHECK(info.codec == "hdf5-gzip");
    check_same(reader->read(i), records[i]);
  }
  CHECK(reader->find("ünïcode-3") == std::optional<std::size_t>(2));
  CHECK_FALSE(reader->find("nope").has_value());
  // A prefix spanning a chunk boundary of a gzip'd dataset.
  const Record p = reader->read_prefix(2, 12);
  check_same(p, records[2].prefix(12));
  CHECK(reader->read_prefix(2, 0).tokens() == 0);
  CHECK(reader->read_prefix(1, 100).tokens() == 1);
}

TEST_CASE("hdf5: group-per-conversation files from h5py, nested, fp16 / fp32 / bf16, bool masks") {
  test::TempDir d("h5");
  std::vector<Record> records = {
      make_record("101", 9, 8, 3, DType::kFloat16, DType::kBool, 11),
      make_record("7", 4, 8, 3, DType::kFloat32, std::nullopt, 12),
      make_record("deep", 6, 8, 2, DType::kBFloat16, DType::kInt64, 13),
  };
  dump_records(d / "in", records);
  python_ok(R"PY(
recs = load(sys.argv[1])
def put(g, r, **kw):
    g.create_dataset("input_ids", data=r["ids"].astype(np.int32) if r["id"] == "7" else r["ids"])
    put_float(g, "hidden_states", r["hid"], r["dtype"], **kw)
    put_float(g, "aux_hidden_states", r["aux"], r["dtype"], **kw)
    if r["mask"] is not None:
        g.create_dataset("loss_mask", data=r["mask"])
with h5py.File(sys.argv[2], "w") as f:
    top = f.create_group("train")
    put(top.create_group("101"), recs[0], compression="gzip", shuffle=True)
    put(top.create_group("7"), recs[1])
    put(top.create_group("part2").create_group("deep"), recs[2], chunks=True)
    top.create_group("empty")  # not a record: no input_ids
    f.attrs["note"] = "hand-written"
# The whole file is one record when the root holds the datasets.
with h5py.File(sys.argv[3], "w") as f:
    put(f, recs[1])
)PY",
            {d / "in", d / "groups.h5", d / "single.h5"});
  auto reader = open_reader(d / "groups.h5");
  REQUIRE(reader->size() == 3);
  // Name order, depth first: /train/101, /train/7, /train/part2/deep.
  CHECK(reader->info(0).key == "/train/101");
  CHECK(reader->info(1).key == "/train/7");
  CHECK(reader->info(2).key == "/train/part2/deep");
  CHECK(reader->info(0).hidden_dtype == DType::kFloat16);
  CHECK(reader->info(0).codec == "hdf5-gzip");
  CHECK(reader->info(1).ids_dtype == DType::kInt32);
  CHECK(reader->info(1).hidden_dtype == DType::kFloat32);
  CHECK_FALSE(reader->info(1).has_loss_mask);
  CHECK(reader->info(2).hidden_dtype == DType::kBFloat16);
  CHECK(reader->info(2).aux_width == 16);
  for (std::size_t i = 0; i < 3; ++i) {
    const std::size_t at = *reader->find(records[i].conversation_id);
    const Record got = reader->read(at);
    check_same(got, records[i]);
    if (records[i].loss_mask) CHECK(got.loss_mask->dtype == records[i].loss_mask->dtype);
  }
  CHECK(reader->read(1).input_ids.dtype == DType::kInt32);
  check_same(reader->read_prefix(0, 3), records[0].prefix(3));

  auto single = open_reader(d / "single.h5");
  REQUIRE(single->size() == 1);
  Record want = records[1];
  want.conversation_id = "single";
  check_same(single->read(0), want);
}

TEST_CASE("hdf5: hidden_states and aux_hidden_states in different dtypes read as the wider, exactly") {
  // Hand-written h5py dumps mix them (fp16 last layer, fp32 aux); each converts exactly to
  // float32 (float64 when either is float64), so both are read in it.
  test::TempDir d("h5mix");
  python_ok(R"PY(
rng = np.random.default_rng(5)
hid16 = rng.standard_normal((6, 8)).astype(np.float16)
hid16[0, :3] = [np.float16(6.1e-5), np.float16(-0.0), np.float16(65504)]  # subnormal edge, -0, max
aux32 = rng.standard_normal((6, 24)).astype(np.float32)
bf = (rng.standard_normal((6, 8)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
aux64 = rng.standard_normal((6, 16))
ids = np.arange(6, dtype=np.int64)
with h5py.File(sys.argv[1], "w") as f:
    g = f.create_group("fp16-fp32")
    g["input_ids"] = ids; g["hidden_states"] = hid16; g["aux_hidden_states"] = aux32
    g = f.create_group("bf16-fp32")
    g["input_ids"] = ids; g["hidden_states"] = bf; g["hidden_states"].attrs["dtype"] = "bfloat16"
    g["aux_hidden_states"] = aux32
    g = f.create_group("fp16-fp64")
    g["input_ids"] = ids; g["hidden_states"] = hid16; g["aux_hidden_states"] = aux64
np.save(sys.argv[2] + "/hid16.npy", hid16.astype(np.float32))
np.save(sys.argv[2] + "/bf.npy", (bf.astype(np.uint32) << 16).view(np.float32))
np.save(sys.argv[2] + "/aux32.npy", aux32)
np.save(sys.argv[2] + "/aux64.npy", aux64)
)PY",
            {d / "mixed.h5", d.path()});
  // The arrays as numpy widened them, read back through the raw .npy bytes (little-endian,
  // the header ends at a 64-byte boundary in format 1.0).
  auto npy = [&](const std::string& name, std::size_t count, std::size_t item) {
    const auto bytes = test::read_bytes(d / name);
    REQUIRE(bytes.size() >= count * item);
    return std::vector<std::uint8_t>(bytes.end() - static_cast<std::ptrdiff_t>(count * item), bytes.end());
  };
  auto same_bytes = [](const HostTensor& t, const std::vector<std::uint8_t>& want) {
    const HostTensor c = t.contiguous();
    return c.nbytes() == want.size() && std::memcmp(c.data, want.data(), want.size()) == 0;
  };
  auto reader = open_reader(d / "mixed.h5");
  REQUIRE(reader->size() == 3);
  const std::size_t a = *reader->find("fp16-fp32"), b = *reader->find("bf16-fp32"), c = *reader->find("fp16-fp64");
  CHECK(reader->info(a).hidden_dtype == DType::kFloat32);
  CHECK(reader->info(b).hidden_dtype == DType::kFloat32);
  CHECK(reader->info(c).hidden_dtype == DType::kFloat64);
  const Record ra = reader->read(a), rb = reader->read(b), rc = reader->read(c);
  CHECK(ra.hidden_states.dtype == DType::kFloat32);
  CHECK(ra.aux_hidden_states.dtype == DType::kFloat32);
  CHECK(same_bytes(ra.hidden_states, npy("hid16.npy", 48, 4)));
  CHECK(same_bytes(ra.aux_hidden_states, npy("aux32.npy", 144, 4)));
  CHECK(same_bytes(rb.hidden_states, npy("bf.npy", 48, 4)));
  CHECK(same_bytes(rb.aux_hidden_states, npy("aux32.npy", 144, 4)));
  CHECK(rc.hidden_states.dtype == DType::kFloat64);
  CHECK(same_bytes(rc.aux_hidden_states, npy("aux64.npy", 96, 8)));
  CHECK(rc.hidden_states.get(2) == 65504.0);
  // A prefix reads only its rows, widened the same way.
  check_same(reader->read_prefix(a, 2), ra.prefix(2));
  // Into our own shard (one dtype per column) and back: the widened values.
  {
    auto w = create_hdf5_shard_writer(d / "shard.h5", {});
    w->add(ra);
    w->finish();
  }
  check_same(open_reader(d / "shard.h5")->read(0), ra);
}

TEST_CASE("hdf5: shards we write open in h5py with equal arrays") {
  struct Case {
    DType dtype;
    int gzip;
    bool all_masks;
  };
  for (const Case c : {Case{DType::kBFloat16, 6, true}, Case{DType::kFloat16, 0, false},
                       Case{DType::kFloat32, 1, true}}) {
    INFO("dtype " << dtype_name(c.dtype) << " gzip " << c.gzip);
    test::TempDir d("h5");
    std::vector<Record> records = mixed_records(c.dtype);
    if (!c.all_masks) {
      records[0].loss_mask.reset();  // before the first mask: backfilled with ones
      records[3].loss_mask.reset();
    }
    Hdf5WriterOptions opts;
    opts.gzip_level = c.gzip;
    opts.chunk_bytes = 16 * 48 * 2 * 3;  // a few rows per chunk: records straddle chunks
    auto w = create_hdf5_shard_writer(d / "ours.h5", opts);
    for (const auto& r : records) w->add(r);
    CHECK_FALSE(fs::exists(d / "ours.h5"));
    w->finish();
    REQUIRE(fs::exists(d / "ours.h5"));
    CHECK(std::distance(fs::directory_iterator(d.path()), {}) == 1);  // no temp left

    for (auto& r : records) {
      if (r.loss_mask) continue;
      r.loss_mask = HostTensor::zeros(DType::kUInt8, {r.tokens()});
      std::memset(r.loss_mask->mutable_data(), 1, static_cast<std::size_t>(r.tokens()));
    }
    dump_records(d / "want", records);
    python_ok(R"PY(
recs = load(sys.argv[1])
gz = int(sys.argv[3])
with h5py.File(sys.argv[2], "r") as f:
    assert f.attrs["eaglekit_format"] == "hdf5-shard", f.attrs["eaglekit_format"]
    assert f.attrs["version"] == 1 and f.attrs["hidden_size"] == 16 and f.attrs["aux_layers"] == 3
    ids = [s.decode() if isinstance(s, bytes) else s for s in f["conversation_ids"][()]]
    assert ids == [r["id"] for r in recs], ids
    assert h5py.check_string_dtype(f["conversation_ids"].dtype).encoding == "utf-8"
    off = f["offsets"][()]
    lengths = [len(r["ids"]) for r in recs]
    assert off.dtype == np.int64 and list(off) == list(np.cumsum([0] + lengths))
    assert f["input_ids"].dtype == np.int64 and f["loss_mask"].dtype == np.uint8
    hs = f["hidden_states"]
    dt = recs[0]["dtype"]
    if dt == "bfloat16":
        assert hs.dtype == np.uint16 and hs.attrs["dtype"] == "bfloat16"
        assert f["aux_hidden_states"].attrs["dtype"] == "bfloat16"
    else:
        assert hs.dtype == NP[dt], hs.dtype
        assert "dtype" not in hs.attrs
    assert hs.chunks is not None and hs.chunks[1] == 16
    assert (hs.compression == "gzip") == (gz > 0) and hs.shuffle == (gz > 0), hs.compression
    for i, r in enumerate(recs):
        a, b = off[i], off[i + 1]
        assert np.array_equal(f["input_ids"][a:b], r["ids"]), i
        assert np.array_equal(f["loss_mask"][a:b], r["mask"].astype(np.uint8)), i
        assert f["hidden_states"][a:b].tobytes() == r["hid"].tobytes(), i
        assert f["aux_hidden_states"][a:b].tobytes() == r["aux"].tobytes(), i
print("ok")
)PY",
              {d / "want", d / "ours.h5", std::to_string(c.gzip)});
    // And back through our reader.
    auto reader = open_reader(d / "ours.h5");
    REQUIRE(reader->size() == records.size());
    for (std::size_t i = 0; i < records.size(); ++i) check_same(reader->read(i), records[i]);
  }
}

TEST_CASE("hdf5: writer through the registry, int32 ids, strided input, empty shard") {
  test::TempDir d("h5");
  WriterOptions wo;
  wo.format = Format::kHdf5;
  wo.codec = "gzip";
  wo.level = 2;
  Record a = make_record("x", 30, 8, 3, DType::kFloat32, std::nullopt, 5);
  // input_ids as int32, hidden_states as a transposed (non-contiguous) view.
  {
    std::vector<std::uint8_t> ids32(30 * 4);
    for (int i = 0; i < 30; ++i) {
      const std::int32_t v = 1000 + i;
      std::memcpy(ids32.data() + 4 * i, &v, 4);
    }
    a.input_ids = HostTensor::from_bytes(DType::kInt32, {30}, ids32);
    std::uint32_t seed = 9;
    HostTensor base = random_floats(DType::kFloat32, {8, 30}, seed);
    a.hidden_states = base;
    a.hidden_states.shape = {30, 8};
    a.hidden_states.strides = {1, 30};
  }
  {
    auto w = create_writer(d / "r.h5", wo);
    w->add(a);
    w->finish();
  }
  auto reader = open_reader(d / "r.h5");
  const Record got = reader->read(0);
  CHECK(got.input_ids.dtype == DType::kInt64);
  check_same(got, a);
  CHECK(reader->info(0).codec == "hdf5-gzip");

  wo.codec = "fp8";
  CHECK_THROWS_AS(create_writer(d / "bad.h5", wo), UsageError);

  {
    auto w = create_hdf5_shard_writer(d / "empty.h5", {});
    w->finish();
  }
  CHECK(open_reader(d / "empty.h5")->size() == 0);
  python_ok(R"PY(
with h5py.File(sys.argv[1]) as f:
    assert len(f["conversation_ids"]) == 0 and list(f["offsets"][()]) == [0]
)PY",
            {d / "empty.h5"});
}

TEST_CASE("hdf5: writer refuses mixed shapes and duplicate ids; unfinished leaves nothing") {
  test::TempDir d("h5");
  const std::string p = d / "s.h5";
  {
    auto w = create_hdf5_shard_writer(p, {});
    w->add(make_record("a", 5, 8, 3, DType::kBFloat16, std::nullopt, 1));
    CHECK(error_of([&] {
            w->add(make_record("b", 5, 16, 3, DType::kBFloat16, std::nullopt, 2));
          }) == p + ": record \"b\": hidden size 16, aux width 48, dtype bfloat16 differ from the "
                    "shard's 8, 24, bfloat16 (records in one shard share them)");
    CHECK(error_of([&] { w->add(make_record("c", 5, 8, 3, DType::kFloat16, std::nullopt, 2)); }) ==
          p + ": record \"c\": hidden size 8, aux width 24, dtype float16 differ from the "
              "shard's 8, 24, bfloat16 (records in one shard share them)");
    CHECK(error_of([&] { w->add(make_record("a", 2, 8, 3, DType::kBFloat16, std::nullopt, 3)); }) ==
          p + ": record \"a\": conversation id already in the shard");
    CHECK_THROWS_AS(w->add(make_record("c", 5, 8, 3, DType::kFloat16, std::nullopt, 2)),
                    UsageError);
    CHECK(std::distance(fs::directory_iterator(d.path()), {}) == 1);  // the temp file
  }
  CHECK(std::distance(fs::directory_iterator(d.path()), {}) == 0);
  CHECK_FALSE(fs::exists(p));

  // After a refused record the shard still finishes with the good ones.
  auto w = create_hdf5_shard_writer(p, {});
  w->add(make_record("a", 5, 8, 3, DType::kBFloat16, std::nullopt, 1));
  CHECK_THROWS_AS(w->add(make_record("b", 5, 16, 3, DType::kBFloat16, std::nullopt, 2)),
                  UsageError);
  w->add(make_record("c", 3, 8, 3, DType::kBFloat16, std::nullopt, 3));
  w->finish();
  auto reader = open_reader(p);
  REQUIRE(reader->size() == 2);
  check_same(reader->read(1), make_record("c", 3, 8, 3, DType::kBFloat16, std::nullopt, 3));
  Hdf5WriterOptions keep;
  keep.overwrite = false;
  CHECK_THROWS_AS(create_hdf5_shard_writer(p, keep), UsageError);
}

TEST_CASE("hdf5: a prefix read touches only its chunks") {
  // Two records of 8 rows in gzip chunks of 4 rows; the last chunk of record 1 is garbage.
  test::TempDir d("h5");
  const std::vector<Record> records = {
      make_record("r0", 8, 8, 1, DType::kFloat32, std::nullopt, 1),
      make_record("r1", 8, 8, 1, DType::kFloat32, std::nullopt, 2)};
  dump_records(d / "in", records);
  python_ok(R"PY(
recs = load(sys.argv[1])
with h5py.File(sys.argv[2], "w") as f:
    f.attrs["eaglekit_format"] = "hdf5-shard"
    f.attrs["version"] = 1
    f.attrs["hidden_size"] = 8
    f.attrs["aux_layers"] = 1
    f["conversation_ids"] = np.array([r["id"] for r in recs], dtype=h5py.string_dtype())
    f["offsets"] = np.array([0, 8, 16], dtype=np.int64)
    f["input_ids"] = np.concatenate([r["ids"] for r in recs])
    for name, key in (("hidden_states", "hid"), ("aux_hidden_states", "aux")):
        f.create_dataset(name, data=np.concatenate([r[key] for r in recs]), chunks=(4, 8),
                         compression="gzip")
    info = f["hidden_states"].id.get_chunk_info_by_coord((12, 0))
with open(sys.argv[2], "r+b") as g:
    g.seek(info.byte_offset)
    g.write(b"\xff" * info.size)
)PY",
            {d / "in", d / "s.h5"});
  const std::string p = d / "s.h5";
  auto reader = open_reader(p);
  check_same(reader->read(0), records[0]);
  check_same(reader->read_prefix(1, 4), records[1].prefix(4));
  const std::string err = error_of([&] { reader->read(1); });
  CHECK(err.rfind(p + ": /hidden_states: cannot read rows [8, 16) (", 0) == 0);
  CHECK_THROWS_AS(reader->read(1), FormatError);
  check_same(reader->read(0), records[0]);  // the reader still works
}

TEST_CASE("hdf5: corrupt shards fail naming the file and the dataset") {
  test::TempDir d("h5");
  // Each case: a Python mutation of a valid 3-record shard (T = 4, 6, 5; H = 8; k = 3).
  struct Case {
    const char* name;
    const char* mutate;
    const char* message;  // after "PATH: "
    bool unsupported;
  };
  const Case cases[] = {
      {"missing_hidden", "del f['hidden_states']",
       "/hidden_states: missing dataset (an eaglekit HDF5 shard holds conversation_ids, offsets, "
       "input_ids, hidden_states and aux_hidden_states)",
       false},
      {"missing_offsets", "del f['offsets']",
       "/offsets: missing dataset (an eaglekit HDF5 shard holds conversation_ids, offsets, "
       "input_ids, hidden_states and aux_hidden_states)",
       false},
      {"missing_ids", "del f['conversation_ids']",
       "/conversation_ids: missing dataset (an eaglekit HDF5 shard holds conversation_ids, "
       "offsets, input_ids, hidden_states and aux_hidden_states)",
       false},
      {"not_monotone", "f['offsets'][...] = [0, 6, 4, 15]",
       "/offsets: not monotone: offsets[2] = 4 < offsets[1] = 6", false},
      {"past_end", "f['offsets'][...] = [0, 4, 20, 15]",
       "/offsets: offsets[2] = 20 is past the end of input_ids (15 rows)", false},
      {"short_last", "f['offsets'][...] = [0, 4, 10, 14]",
       "/offsets: offsets[3] = 14 but input_ids has 15 rows", false},
      {"first_not_zero", "f['offsets'][...] = [1, 4, 10, 15]",
       "/offsets: offsets[0] = 1, expected 0", false},
      {"offsets_count", "del f['offsets']; f['offsets'] = np.array([0, 4, 15], np.int64)",
       "/offsets: 3 entries, expected N+1 = 4 for 3 conversation ids", false},
      {"hidden_rank", "del f['hidden_states']; f['hidden_states'] = np.zeros(15 * 8, np.float32)",
       "/hidden_states: expected rank 2 [total_T, H], got rank 1 [120]", false},
      {"ids_rank", "del f['input_ids']; f['input_ids'] = np.zeros((15, 1), np.int64)",
       "/input_ids: expected rank 1 [total_T], got rank 2 [15, 1]", false},
      {"hidden_rows", "del f['hidden_states']; f['hidden_states'] = np.zeros((14, 8), np.float32)",
       "/hidden_states: 14 rows but input_ids has 15", false},
      {"mask_rows", "f['loss_mask'] = np.ones(16, np.uint8)",
       "/loss_mask: 16 rows but input_ids has 15", false},
      {"hidden_width", "f.attrs['hidden_size'] = 4",
       "/hidden_states: width 8 but root attribute hidden_size is 4", false},
      {"aux_width", "f.attrs['aux_layers'] = 2",
       "/aux_hidden_states: width 24 but aux_layers * hidden_size is 16", false},
      {"unknown_dtype_attr", "f['hidden_states'].attrs['dtype'] = 'bfloat17'",
       "/hidden_states: unknown dtype attribute \"bfloat17\" (expected \"bfloat16\", \"float16\", "
       "\"float32\" or \"float64\")",
       false},
      {"uint16_without_attr", "del f['aux_hidden_states'].attrs['dtype']",
       "/aux_hidden_states: 16-bit integers without the attribute dtype = \"bfloat16\" (bf16 is "
       "stored as uint16 with that attribute)",
       false},
      {"attr_mismatch", "f['hidden_states'].attrs['dtype'] = 'float32'",
       "/hidden_states: dtype attribute \"float32\" does not match the stored 16-bit unsigned "
       "integers",
       false},
      {"float_ids", "del f['input_ids']; f['input_ids'] = np.zeros(15, np.float32)",
       "/input_ids: expected integer token ids, got 32-bit floats", false},
      {"duplicate_id",
       "del f['conversation_ids']; f['conversation_ids'] = np.array(['a', 'b', 'a'], "
       "dtype=h5py.string_dtype())",
       "/conversation_ids: duplicate conversation id \"a\" (records 0 and 2)", false},
      {"version", "f.attrs['version'] = 2",
       "root attribute version: shard version 2; this eaglekit reads version 1", true},
      {"no_version", "del f.attrs['version']",
       "root attribute version: missing (an eaglekit HDF5 shard has version = 1)", false},
      {"no_hidden_size", "del f.attrs['hidden_size']", "root attribute hidden_size: missing",
       false},
      {"tag", "f.attrs['eaglekit_format'] = 'hdf5-other'",
       "root attribute eaglekit_format: unknown value \"hdf5-other\" (expected \"hdf5-shard\")",
       false},
      {"tag_not_string", "f.attrs['eaglekit_format'] = 3",
       "root attribute eaglekit_format: attribute eaglekit_format is not a string", false},
      {"lzf",
       "x = f['hidden_states'][()]; del f['hidden_states']; "
       "f.create_dataset('hidden_states', data=x, compression='lzf').attrs['dtype'] = 'bfloat16'",
       "/hidden_states: compressed with HDF5 filter 32000 (lzf) that this libhdf5 cannot decode; "
       "re-save it with gzip or no compression",
       true},
      {"no_records_no_tag", "del f.attrs['eaglekit_format']; del f['hidden_states']",
       "/: neither an eaglekit HDF5 shard (no root attribute eaglekit_format) nor a file with "
       "record groups (no group holds both input_ids and hidden_states)",
       false},
  };
  std::string script = R"PY(
import shutil
base = os.path.join(sys.argv[1], "base.h5")
with h5py.File(base, "w") as f:
    f.attrs["eaglekit_format"] = "hdf5-shard"
    f.attrs["version"] = 1
    f.attrs["hidden_size"] = 8
    f.attrs["aux_layers"] = 3
    f["conversation_ids"] = np.array(["a", "b", "c"], dtype=h5py.string_dtype())
    f["offsets"] = np.array([0, 4, 10, 15], np.int64)
    f["input_ids"] = np.arange(15, dtype=np.int64)
    put_float(f, "hidden_states", np.zeros((15, 8), np.uint16), "bfloat16")
    put_float(f, "aux_hidden_states", np.zeros((15, 24), np.uint16), "bfloat16")
def case(name, code):
    p = os.path.join(sys.argv[1], name + ".h5")
    shutil.copy(base, p)
    with h5py.File(p, "r+") as f:
        exec(code)
)PY";
  for (const Case& c : cases) script += "case(" + py_str(c.name) + ", " + py_str(c.mutate) + ")\n";
  python_ok(script, {d.path()});
  REQUIRE(open_reader(d / "base.h5")->size() == 3);
  for (const Case& c : cases) {
    INFO("case " << c.name);
    const std::string p = d / (std::string(c.name) + ".h5");
    try {
      open_reader(p);
      FAIL("no error");
    } catch (const UnsupportedError& e) {
      CHECK(c.unsupported);
      CHECK(std::string(e.what()) == p + ": " + c.message);
    } catch (const FormatError& e) {
      CHECK_FALSE(c.unsupported);
      CHECK(std::string(e.what()) == p + ": " + c.message);
    }
  }
}

TEST_CASE("hdf5: group files with bad records fail naming the group's dataset") {
  test::TempDir d("h5");
  python_ok(R"PY(
def rec(g, t=4, h=8, aux=24):
    g["input_ids"] = np.arange(t, dtype=np.int64)
    g["hidden_states"] = np.zeros((t, h), np.float32)
    if aux:
        g["aux_hidden_states"] = np.zeros((t, aux), np.float32)
with h5py.File(sys.argv[1] + "/no_aux.h5", "w") as f:
    rec(f.create_group("data/1"))
    rec(f.create_group("data/2"), aux=0)
with h5py.File(sys.argv[1] + "/bad_width.h5", "w") as f:
    rec(f.create_group("data/1"), aux=20)
with h5py.File(sys.argv[1] + "/dup.h5", "w") as f:
    rec(f.create_group("a/x"))
    rec(f.create_group("b/x"))
with h5py.File(sys.argv[1] + "/rows.h5", "w") as f:
    rec(f.create_group("g"))
    f["g/loss_mask"] = np.ones(5, np.bool_)
)PY",
            {d.path()});
  auto msg = [&](const char* name) { return error_of([&] { open_reader(d / name); }); };
  CHECK(msg("no_aux.h5") == d / "no_aux.h5" +
                                ": /data/2/aux_hidden_states: missing dataset (a record group "
                                "holds input_ids, hidden_states and aux_hidden_states)");
  CHECK(msg("bad_width.h5") ==
        d / "bad_width.h5" +
            ": /data/1/aux_hidden_states: width 20 is not a positive multiple of hidden size 8");
  CHECK(msg("dup.h5") == d / "dup.h5" +
                             ": /b/x: conversation id \"x\" is also the name of group /a/x; "
                             "record ids in one file must be unique");
  CHECK(msg("rows.h5") == d / "rows.h5" + ": /g/loss_mask: 5 rows but input_ids has 4");
}

TEST_CASE("hdf5: truncated and non-HDF5 files give clean errors") {
  test::TempDir d("h5");
  const std::string p = d / "s.h5";
  {
    auto w = create_hdf5_shard_writer(p, {});
    for (const auto& r : mixed_records(DType::kBFloat16)) w->add(r);
    w->finish();
  }
  auto bytes = test::read_bytes(p);
  for (std::size_t keep : {bytes.size() / 2, bytes.size() - 1, std::size_t{600}}) {
    INFO("kept " << keep << " of " << bytes.size());
    const std::string t = d / ("t" + std::to_string(keep) + ".h5");
    test::write_bytes(t, std::vector<std::uint8_t>(bytes.begin(), bytes.begin() + keep));
    const std::string err = error_of([&] { open_reader(t); });
    CHECK(err.rfind(t + ": HDF5 file: cannot open (truncated file: eof = " + std::to_string(keep),
                    0) == 0);
    CHECK_THROWS_AS(open_reader(t), FormatError);
  }
  CHECK_THROWS_AS(open_hdf5_reader(d / "missing.h5"), IoError);
  test::write_bytes(d / "junk.h5", std::vector<std::uint8_t>(100, 7));
  CHECK(error_of([&] {
          open_hdf5_reader(d / "junk.h5");
        }).rfind(d / "junk.h5" + ": HDF5 file: cannot open (", 0) == 0);
}

TEST_CASE("hdf5: concurrent reads from many threads agree") {
  test::TempDir d("h5");
  const auto records = mixed_records(DType::kBFloat16);
  Hdf5WriterOptions opts;
  opts.gzip_level = 1;
  opts.chunk_bytes = 1024;
  {
    auto w = create_hdf5_shard_writer(d / "s.h5", opts);
    for (const auto& r : records) w->add(r);
    w->finish();
  }
  auto reader = open_reader(d / "s.h5");
  std::vector<int> bad(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 25; ++round) {
        const std::size_t i = static_cast<std::size_t>(round + t) % records.size();
        const Record got = reader->read_prefix(i, round % 3 == 0 ? 5 : -1);
        const Record want = round % 3 == 0 ? records[i].prefix(5) : records[i];
        if (!got.hidden_states.equal(want.hidden_states) ||
            !got.aux_hidden_states.equal(want.aux_hidden_states))
          ++bad[t];
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(bad == std::vector<int>(4, 0));
}

TEST_CASE("hdf5: the same records give the same bytes (no object times in the file)") {
  // HDF5 stamps object headers with the wall clock (32-bit seconds) unless told not to. Two
  // writes inside one second would match anyway, so look for the clock itself: no 4 bytes
  // of the file may read as a second of the write window. The data here (small ids, floats
  // in [-4, 4], no compression) cannot hold such a value by chance.
  test::TempDir d("h5");
  const auto records = mixed_records(DType::kFloat32);
  const auto write = [&](const std::string& path) {
    auto w = create_hdf5_shard_writer(path, {});
    for (const auto& r : records) w->add(r);
    w->finish();
  };
  const auto t0 = static_cast<std::uint32_t>(std::time(nullptr));
  write(d / "a.h5");
  const auto t1 = static_cast<std::uint32_t>(std::time(nullptr));
  write(d / "b.h5");
  const auto a = test::read_bytes(d / "a.h5");
  REQUIRE(a.size() > 4);
  std::vector<std::size_t> stamped;
  for (std::size_t i = 0; i + 4 <= a.size(); ++i) {
    std::uint32_t v;
    std::memcpy(&v, a.data() + i, 4);  // little-endian, as HDF5 stores it
    if (v + 1 >= t0 && v <= t1 + 1) stamped.push_back(i);
  }
  INFO("first offset holding a time of the write: " << (stamped.empty() ? 0 : stamped[0]));
  CHECK(stamped.empty());
  CHECK(test::read_bytes(d / "b.h5") == a);
  // The shard still reads back (the root group and every dataset were created untimed).
  auto reader = open_reader(d / "b.h5");
  REQUIRE(reader->size() == records.size());
  for (std::size_t i = 0; i < records.size(); ++i) check_same(reader->read(i), records[i]);
}

// The stated norm form: a group attribute written by h5py (a Python bool becomes an HDF5
// enum over int8), and in our shards a per-record int8 dataset.
TEST_CASE("hdf5: hidden_states_prenorm from h5py group attributes and through our shards") {
  test::TempDir d("h5");
  python_ok(R"PY(
import numpy as np
def rec(g, **attrs):
    g.create_dataset("input_ids", data=np.arange(4, dtype=np.int64))
    g.create_dataset("hidden_states", data=np.ones((4, 8), np.float32))
    g.create_dataset("aux_hidden_states", data=np.ones((4, 16), np.float32))
    for k, v in attrs.items():
        g.attrs[k] = v
with h5py.File(sys.argv[1] + "/groups.h5", "w") as f:
    rec(f.create_group("pre"), hidden_states_prenorm=True)
    rec(f.create_group("post"), hidden_states_prenorm=np.bool_(False))
    rec(f.create_group("one"), hidden_states_prenorm=np.int64(1))
    rec(f.create_group("unstated"))
with h5py.File(sys.argv[1] + "/bad-str.h5", "w") as f:
    rec(f.create_group("x"), hidden_states_prenorm="yes")
with h5py.File(sys.argv[1] + "/bad-int.h5", "w") as f:
    rec(f.create_group("x"), hidden_states_prenorm=np.int8(3))
)PY",
            {d.path()});
  const auto r = open_hdf5_reader(d / "groups.h5");
  auto flag = [&](const char* id) { return r->read(*r->find(id)).hidden_states_prenorm; };
  CHECK(flag("pre") == std::optional<bool>(true));
  CHECK(flag("post") == std::optional<bool>(false));
  CHECK(flag("one") == std::optional<bool>(true));
  CHECK_FALSE(flag("unstated").has_value());
  CHECK(r->info(*r->find("pre")).hidden_states_prenorm == std::optional<bool>(true));
  CHECK(error_of([&] { open_hdf5_reader(d / "bad-str.h5"); }) ==
        d / "bad-str.h5" + ": /x attribute hidden_states_prenorm: attribute hidden_states_prenorm is strings, expected a bool (or 0 / 1)");
  CHECK(error_of([&] { open_hdf5_reader(d / "bad-int.h5"); }) ==
        d / "bad-int.h5" + ": /x attribute hidden_states_prenorm: attribute hidden_states_prenorm holds 3, expected 0 or 1");

  // Into a shard (convert keeps it) and back; a shard where nothing states one has no dataset.
  {
    auto w = create_hdf5_shard_writer(d / "shard.h5", {});
    for (const char* id : {"pre", "post", "unstated"}) w->add(r->read(*r->find(id)));
    w->finish();
    auto plain = create_hdf5_shard_writer(d / "plain.h5", {});
    plain->add(r->read(*r->find("unstated")));
    plain->finish();
  }
  const auto s = open_hdf5_reader(d / "shard.h5");
  CHECK(s->read(0).hidden_states_prenorm == std::optional<bool>(true));
  CHECK(s->read(1).hidden_states_prenorm == std::optional<bool>(false));
  CHECK_FALSE(s->read(2).hidden_states_prenorm.has_value());
  CHECK(s->read_prefix(0, 1).hidden_states_prenorm == std::optional<bool>(true));
  const auto py = python_ok(R"PY(
with h5py.File(sys.argv[1] + "/shard.h5", "r") as f:
    print(f["hidden_states_prenorm"].dtype, f["hidden_states_prenorm"][...].tolist())
with h5py.File(sys.argv[1] + "/plain.h5", "r") as f:
    print("hidden_states_prenorm" in f)
)PY",
                            {d.path()});
  CHECK(py.out == "int8 [1, 0, -1]\nFalse\n");

  SUBCASE("corrupt per-record dataset") {
    python_ok(R"PY(
import shutil
shutil.copy(sys.argv[1] + "/shard.h5", sys.argv[1] + "/value.h5")
with h5py.File(sys.argv[1] + "/value.h5", "a") as f:
    f["hidden_states_prenorm"][1] = 5
shutil.copy(sys.argv[1] + "/shard.h5", sys.argv[1] + "/len.h5")
with h5py.File(sys.argv[1] + "/len.h5", "a") as f:
    del f["hidden_states_prenorm"]
    f["hidden_states_prenorm"] = np.array([1, 0], np.int8)
)PY",
              {d.path()});
    CHECK(error_of([&] { open_hdf5_reader(d / "value.h5"); }) ==
          d / "value.h5" + ": /hidden_states_prenorm: entry 1 is 5, expected -1 (not stated), 0 (post-norm) or 1 (pre-norm)");
    CHECK(error_of([&] { open_hdf5_reader(d / "len.h5"); }) ==
          d / "len.h5" + ": /hidden_states_prenorm: 2 entries but the shard holds 3 records");
  }
}
