#include <doctest/doctest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <vector>

#include "formats/byte_source.h"
#include "formats/error.h"
#include "formats/format.h"
#include "formats/pickle.h"
#include "formats/pt_format.h"
#include "formats/registry.h"
#include "formats/safetensors_format.h"
#include "formats/zip.h"
#include "tests/formats/zip_regions.h"
#include "tests/support.h"

using namespace eaglekit;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

std::string fixture(const std::string& name) { return test::shared_testdata("pt/" + name); }

// --- the formulas of tests/data/pt/make_variants.py (T=5, H=4, k=3) -------------------
constexpr int kT = 5, kH = 4, kK = 3;
double want_id(std::int64_t t) { return 3.0 + 7.0 * static_cast<double>(t); }
double want_hidden(std::int64_t i) { return static_cast<double>(i) / 2.0; }  // i = t*H + h
double want_aux(std::int64_t i) { return -static_cast<double>(i) / 4.0; }   // i = t*3H + j
double want_mask(std::int64_t t) { return t % 3 == 1 ? 0.0 : 1.0; }

void check_variant(const Record& r, const json& e) {
  CHECK(r.conversation_id == e["conversation_id"].get<std::string>());
  CHECK(dtype_name(r.input_ids.dtype) == e["ids_dtype"].get<std::string>());
  CHECK(dtype_name(r.hidden_states.dtype) == e["hidden_dtype"].get<std::string>());
  CHECK(r.aux_hidden_states.dtype == r.hidden_states.dtype);
  REQUIRE(r.input_ids.shape == std::vector<std::int64_t>{kT});
  REQUIRE(r.hidden_states.shape == std::vector<std::int64_t>{kT, kH});
  REQUIRE(r.aux_hidden_states.shape == std::vector<std::int64_t>{kT, kK * kH});
  for (std::int64_t t = 0; t < kT; ++t) CHECK(r.input_ids.get(t) == want_id(t));
  for (std::int64_t i = 0; i < kT * kH; ++i) CHECK(r.hidden_states.get(i) == want_hidden(i));
  for (std::int64_t i = 0; i < kT * kK * kH; ++i) CHECK(r.aux_hidden_states.get(i) == want_aux(i));
  const std::string mask = e["loss_mask"];
  if (mask == "none") {
    CHECK_FALSE(r.loss_mask.has_value());
  } else {
    REQUIRE(r.loss_mask.has_value());
    CHECK(dtype_name(r.loss_mask->dtype) == mask);
    REQUIRE(r.loss_mask->shape == std::vector<std::int64_t>{kT});
    for (std::int64_t t = 0; t < kT; ++t) CHECK(r.loss_mask->get(t) == want_mask(t));
  }
}

void check_variant_dir(const std::string& dir) {
  std::ifstream f(dir + "/variants.json");
  REQUIRE(f.good());
  const json manifest = json::parse(f);
  REQUIRE(manifest.size() >= 9);
  for (const auto& [name, e] : manifest.items()) {
    CAPTURE(name);
    const auto reader = open_reader(dir + "/" + name);
    REQUIRE(reader->format() == Format::kPt);
    REQUIRE(reader->size() == 1);
    check_variant(reader->read(0), e);
    const RecordInfo info = reader->info(0);
    CHECK(info.conversation_id == e["conversation_id"].get<std::string>());
    CHECK(info.tokens == kT);
    CHECK(info.hidden_size == kH);
    CHECK(info.aux_width == kK * kH);
    CHECK(info.has_loss_mask == (e["loss_mask"] != "none"));
    CHECK(info.byte_size == fs::file_size(dir + "/" + name));
    // The prefix is a view of the same bytes.
    const Record p = reader->read_prefix(0, 2);
    CHECK(p.tokens() == 2);
    CHECK(p.hidden_states.shape[0] == 2);
    CHECK(p.aux_hidden_states.get(2 * kK * kH - 1) == want_aux(2 * kK * kH - 1));
  }
}

// A small record with known contents.
Record make_record(std::int64_t t, std::int64_t h, DType dt, bool mask) {
  Record r;
  r.conversation_id = "rec-1";
  r.input_ids = HostTensor::zeros(DType::kInt64, {t});
  for (std::int64_t i = 0; i < t; ++i) {
    const std::int64_t v = 1000 + i;
    std::memcpy(r.input_ids.mutable_data() + 8 * i, &v, 8);
  }
  auto fill = [&](std::vector<std::int64_t> shape, float scale) {
    HostTensor x = HostTensor::zeros(dt, shape);
    for (std::int64_t i = 0; i < x.numel(); ++i) {
      const float f = scale * static_cast<float>(i % 97) - 3.0f;
      if (dt == DType::kFloat32) std::memcpy(x.mutable_data() + 4 * i, &f, 4);
      else {
        const std::uint16_t b = dt == DType::kBFloat16 ? float_to_bf16(f) : float_to_fp16(f);
        std::memcpy(x.mutable_data() + 2 * i, &b, 2);
      }
    }
    return x;
  };
  r.hidden_states = fill({t, h}, 0.5f);
  r.aux_hidden_states = fill({t, 3 * h}, -0.25f);
  if (mask) {
    r.loss_mask = HostTensor::zeros(DType::kBool, {t});
    for (std::int64_t i = 0; i < t; ++i) r.loss_mask->mutable_data()[i] = i % 2;
  }
  return r;
}

// An archive with our own data.pkl and storage records (for corruptions).
void write_archive(const std::string& path, const std::string& pkl,
                   const std::vector<std::pair<std::string, std::string>>& records,
                   const std::string& prefix = "archive/") {
  ZipWriter w(path);
  w.add(prefix + "data.pkl", pkl.data(), pkl.size());
  for (const auto& [name, bytes] : records) w.add(prefix + name, bytes.data(), bytes.size());
  w.finish();
}

// data.pkl for {'input_ids': LongStorage key '0' numel NUMEL, offset OFF, size (N,)} plus the
// float hidden/aux tensors of storage '1' (numel 8: hidden [2, 1] at 0, aux [2, 3] view at 2).
std::string record_pickle(std::int64_t numel, std::int64_t off, std::int64_t n,
                          const std::string& hidden_key = "hidden_states") {
  pickle::PickleWriter w;
  auto tensor = [&](const char* cls, const char* key, std::int64_t storage_numel,
                    std::int64_t offset, std::vector<std::int64_t> shape,
                    std::vector<std::int64_t> stride) {
    w.global("torch._utils", "_rebuild_tensor_v2");
    w.mark();
    w.mark();
    w.str("storage");
    w.global("torch", cls);
    w.str(key);
    w.str("cpu");
    w.integer(storage_numel);
    w.tuple_from_mark();
    w.binpersid();
    w.integer(offset);
    w.mark();
    for (auto s : shape) w.integer(s);
    w.tuple_from_mark();
    w.mark();
    for (auto s : stride) w.integer(s);
    w.tuple_from_mark();
    w.boolean(false);
    w.global("collections", "OrderedDict");
    w.mark();
    w.tuple_from_mark();
    w.reduce();
    w.tuple_from_mark();
    w.reduce();
  };
  w.empty_dict();
  w.mark();
  w.str("input_ids");
  tensor("LongStorage", "0", numel, off, {n}, {1});
  w.str(hidden_key);
  tensor("FloatStorage", "1", 8, 0, {2, 1}, {1, 1});
  w.str("aux_hidden_states");
  tensor("FloatStorage", "1", 8, 2, {2, 3}, {3, 1});
  w.setitems();
  w.stop();
  return w.bytes();
}

std::string zeros(std::size_t n) { return std::string(n, '\0'); }

template <class E>
std::string open_error(const std::string& path) {
  try {
    PtReader r(path);
    (void)r.read(0);
  } catch (const E& e) {
    CHECK(typeid(e) == typeid(E));
    return e.what();
  } catch (const std::exception& e) {
    FAIL("unexpected exception type " << typeid(e).name() << ": " << e.what());
  }
  return "<no error>";
}

bool has(const std::string& haystack, const std::string& needle) {
  if (haystack.find(needle) != std::string::npos) return true;
  MESSAGE("'" << needle << "' not in: " << haystack);
  return false;
}

}  // namespace

TEST_CASE("pt: torch 1.5 float32 bare tensor") {
  const PtContents c = read_pt(fixture("torch1.5.0_zip_float32_tensor.pt"));
  REQUIRE(c.entries.size() == 1);
  const HostTensor* t = c.tensor("");
  REQUIRE(t != nullptr);
  CHECK(t->dtype == DType::kFloat32);
  CHECK(t->shape == std::vector<std::int64_t>{4});
  const float want[] = {1.2f, -3.4f, 5.6f, -7.8f};
  for (int i = 0; i < 4; ++i) CHECK(t->get(i) == static_cast<double>(want[i]));
  // A bare tensor is no record.
  CHECK(has(open_error<FormatError>(fixture("torch1.5.0_zip_float32_tensor.pt")),
            "data.pkl: expected a dict of tensors, got a tensor"));
}

TEST_CASE("pt: torch 1.13 float16 and protocol-4 bfloat16 tensors") {
  const PtContents h = read_pt(fixture("torch1.13.1_zip_float16_tensor.pt"));
  const HostTensor* t = h.tensor("");
  REQUIRE(t != nullptr);
  CHECK(t->dtype == DType::kFloat16);
  const double want16[] = {1.2001953125, -3.400390625, 5.6015625, -7.80078125};
  for (int i = 0; i < 4; ++i) CHECK(t->get(i) == want16[i]);

  const PtContents b = read_pt(fixture("torch1.13.1_zip_proto4_bfloat16_tensor.pt"));
  t = b.tensor("");
  REQUIRE(t != nullptr);
  CHECK(t->dtype == DType::kBFloat16);
  const double wantbf[] = {1.203125, -3.40625, 5.59375, -7.8125};
  for (int i = 0; i < 4; ++i) CHECK(t->get(i) == wantbf[i]);
}

TEST_CASE("pt: torch 2.1 int64 tensor with fortran strides") {
  const PtContents c = read_pt(fixture("torch2.1-2.2_zip_int64_fortran_strides.pth"));
  const HostTensor* t = c.tensor("tensor_fortran");
  REQUIRE(t != nullptr);
  CHECK(t->dtype == DType::kInt64);
  CHECK(t->shape == std::vector<std::int64_t>{2, 3, 4});
  CHECK(t->strides == std::vector<std::int64_t>{1, 2, 6});
  CHECK_FALSE(t->is_contiguous());
  for (int i = 0; i < 24; ++i) CHECK(t->get(i) == i + 1);
  const HostTensor dense = t->contiguous();
  for (int i = 0; i < 24; ++i) CHECK(dense.get(i) == i + 1);
}

TEST_CASE("pt: torch 2.7 bfloat16 dict, parameter and nested checkpoint") {
  const PtContents d = read_pt(fixture("torch2.7plus_zip_bfloat16_dict.pt"));
  const HostTensor* t = d.tensor("tensor");
  REQUIRE(t != nullptr);
  CHECK(t->dtype == DType::kBFloat16);
  const std::uint8_t raw[] = {0xc0, 0x3f, 0x20, 0xc0, 0x60, 0x40};
  CHECK(std::memcmp(t->data, raw, 6) == 0);
  CHECK(t->get(1) == -2.5);
  CHECK(reinterpret_cast<std::uintptr_t>(t->data) % 64 == 0);  // zero-copy into the mapping

  const PtContents p = read_pt(fixture("torch2.7plus_zip_parameter.pt"));
  t = p.tensor("param");
  REQUIRE(t != nullptr);
  CHECK(t->shape == std::vector<std::int64_t>{3, 3});
  CHECK(t->strides == std::vector<std::int64_t>{3, 1});
  CHECK(t->get(0) == doctest::Approx(1.0249).epsilon(1e-4));
  CHECK(t->get(1) == doctest::Approx(0.2223).epsilon(1e-3));
  CHECK(t->get(2) == doctest::Approx(-0.7381).epsilon(1e-4));

  const PtContents n = read_pt(fixture("torch2.7plus_zip_nested_checkpoint.pt"));
  const struct {
    const char* name;
    std::vector<std::int64_t> shape;
  } want[] = {{"model_state_dict.fc1.weight", {10, 5}},
              {"model_state_dict.fc1.bias", {10}},
              {"model_state_dict.fc2.weight", {3, 10}},
              {"model_state_dict.fc2.bias", {3}},
              {"optimizer_state_dict.state.0.momentum_buffer", {10, 5}}};
  for (const auto& w : want) {
    CAPTURE(w.name);
    const HostTensor* x = n.tensor(w.name);
    REQUIRE(x != nullptr);
    CHECK(x->dtype == DType::kFloat32);
    CHECK(x->shape == w.shape);
  }
  const HostTensor* b2 = n.tensor("model_state_dict.fc2.bias");
  CHECK(b2->get(0) == doctest::Approx(1.4371).epsilon(1e-4));
  CHECK(b2->get(1) == doctest::Approx(-0.4401).epsilon(1e-3));
  CHECK(b2->get(2) == doctest::Approx(0.4996).epsilon(1e-3));
  const PtValue* epoch = n.find("epoch");
  REQUIRE(epoch != nullptr);
  CHECK(std::get<std::int64_t>(*epoch) == 42);
  CHECK(std::get<double>(*n.find("loss")) == 0.123);
}

TEST_CASE("pt: legacy (non-zip) torch file is refused clearly") {
  const std::string path = fixture("torch2.x_legacy_shared_storage_views.pt");
  CHECK(detect_file_format(path) == Format::kTorchLegacy);
  try {
    (void)open_reader(path);
    FAIL("legacy file opened");
  } catch (const UnsupportedError& e) {
    CHECK(has(e.what(), path + ": magic at byte 0: legacy (pre-1.6, non-zip) torch.save file"));
  }
  CHECK(has(open_error<UnsupportedError>(path), "legacy (pre-1.6, non-zip) torch.save file"));
  CHECK_THROWS_AS(read_pt(path), UnsupportedError);
}

TEST_CASE("pt: every torch.save variant reads equal (committed files)") {
  check_variant_dir(test::source_dir() + "/tests/data/pt/variants");
}

TEST_CASE("pt: every torch.save variant reads equal (written now by Python torch)") {
  test::require_python("torch");
  test::TempDir d("ptvar");
  const auto r = test::run(test::python_bin() + " " +
                           test::quote(test::source_dir() + "/tests/data/pt/make_variants.py") +
                           " " + test::quote(d.path()));
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  check_variant_dir(d.path());
}

TEST_CASE("pt: files we write load in torch.load bit-exactly") {
  test::require_python("torch");
  test::TempDir d("ptw");
  json manifest = json::object();
  auto describe = [](const std::vector<PtEntry>& entries) {
    json list = json::array();
    for (const auto& e : entries) {
      json j;
      j["name"] = e.name;
      if (const auto* t = std::get_if<HostTensor>(&e.value)) {
        j["kind"] = "tensor";
        j["dtype"] = std::string(dtype_name(t->dtype));
        j["shape"] = t->shape;
        const HostTensor c = t->contiguous();
        static const char* kHex = "0123456789abcdef";
        std::string hex;
        for (std::size_t i = 0; i < c.nbytes(); ++i) {
          hex.push_back(kHex[c.data[i] >> 4]);
          hex.push_back(kHex[c.data[i] & 15]);
        }
        j["hex"] = hex;
      } else if (std::holds_alternative<std::monostate>(e.value)) {
        j["kind"] = "none";
      } else if (const auto* b = std::get_if<bool>(&e.value)) {
        j["kind"] = "bool";
        j["value"] = *b;
      } else if (const auto* i = std::get_if<std::int64_t>(&e.value)) {
        j["kind"] = "int";
        j["value"] = std::to_string(*i);
      } else if (const auto* f = std::get_if<double>(&e.value)) {
        j["kind"] = "float";
        j["value"] = *f;
      } else {
        j["kind"] = "str";
        j["value"] = std::get<std::string>(e.value);
      }
      list.push_back(j);
    }
    return list;
  };

  // 1. Every dtype, 0-d, empty, strided and offset views, and scalar values.
  std::vector<PtEntry> all;
  const DType dtypes[] = {DType::kBool,    DType::kUInt8,   DType::kInt8,    DType::kInt16,
                          DType::kInt32,   DType::kInt64,   DType::kFloat16, DType::kBFloat16,
                          DType::kFloat32, DType::kFloat64};
  for (DType dt : dtypes) {
    HostTensor t = HostTensor::zeros(dt, {3, 5});
    for (std::size_t i = 0; i < t.nbytes(); ++i)
      t.mutable_data()[i] = static_cast<std::uint8_t>(dt == DType::kBool ? i % 2 : (i * 37 + 11) & 0xff);
    all.push_back({"t_" + std::string(dtype_name(dt)), t});
  }
  HostTensor base = HostTensor::zeros(DType::kFloat32, {4, 6});
  for (int i = 0; i < 24; ++i) {
    const float f = static_cast<float>(i) * 1.5f - 7.f;
    std::memcpy(base.mutable_data() + 4 * i, &f, 4);
  }
  HostTensor transposed = base;
  transposed.shape = {6, 4};
  transposed.strides = {1, 6};
  all.push_back({"transposed", transposed});
  all.push_back({"rows_1_3", base.slice_rows(1, 3)});
  all.push_back({"scalar", HostTensor::zeros(DType::kFloat64, {})});
  all.push_back({"empty", HostTensor::zeros(DType::kBFloat16, {0, 3})});
  all.push_back({"none", std::monostate{}});
  all.push_back({"flag", true});
  all.push_back({"small", std::int64_t{-5}});
  all.push_back({"big", std::int64_t{1} << 40});
  all.push_back({"ratio", 0.123});
  all.push_back({"text", std::string("h\xc3\xa9llo")});
  write_pt(d / "all.pt", all);
  manifest["all.pt"] = describe(all);

  // 2. The same with ZIP64 fields on every entry.
  PtWriteOptions z64;
  z64.force_zip64 = true;
  z64.archive_name = "renamed";
  write_pt(d / "zip64.pt", all, z64);
  manifest["zip64.pt"] = describe(all);

  // 3. More than 1000 entries (SETITEMS in batches).
  std::vector<PtEntry> many;
  for (int i = 0; i < 1201; ++i) many.push_back({"k" + std::to_string(i), std::int64_t{i * 3}});
  many.push_back({"ids", HostTensor::zeros(DType::kInt64, {2})});
  write_pt(d / "many.pt", many);
  manifest["many.pt"] = describe(many);

  // 4. A record through the registry's writer (ModelOpt schema).
  const Record rec = make_record(7, 8, DType::kBFloat16, true);
  {
    auto w = create_writer(d / "rec-1.pt", WriterOptions{});
    w->add(rec);
    w->finish();
  }
  manifest["rec-1.pt"] = describe({{"input_ids", rec.input_ids},
                                   {"hidden_states", rec.hidden_states},
                                   {"aux_hidden_states", rec.aux_hidden_states},
                                   {"conversation_id", rec.conversation_id},
                                   {"loss_mask", *rec.loss_mask}});
  std::ofstream(d / "manifest.json") << manifest.dump();

  const auto r = test::python(R"(
import json, sys, torch
d = sys.argv[1]
manifest = json.load(open(d + '/manifest.json'))
for name, entries in manifest.items():
    # torch 1.13's weights_only unpickler lacks BINFLOAT; use it where no float values are.
    safe = not any(e['kind'] == 'float' for e in entries)
    obj = torch.load(d + '/' + name, weights_only=safe)
    assert isinstance(obj, dict), name
    assert list(obj.keys()) == [e['name'] for e in entries], name
    for e in entries:
        v = obj[e['name']]
        where = name + ':' + e['name']
        if e['kind'] == 'tensor':
            assert isinstance(v, torch.Tensor), where
            assert str(v.dtype) == 'torch.' + e['dtype'], (where, v.dtype)
            assert list(v.shape) == e['shape'], (where, v.shape)
            raw = v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            assert raw.hex() == e['hex'], where
        elif e['kind'] == 'none':
            assert v is None, where
        elif e['kind'] == 'int':
            assert type(v) is int and v == int(e['value']), where
        elif e['kind'] == 'float':
            assert type(v) is float and v == e['value'], where
        else:
            assert type(v) is type(e['value']) and v == e['value'], (where, v)
print('ok', len(manifest))
)",
                              {d.path()});
  INFO(r.out);
  INFO(r.err);
  CHECK(r.exit_code == 0);
  CHECK(r.out == "ok 4\n");

  // Our reader agrees with what we wrote, and the output is deterministic.
  const PtContents back = read_pt(d / "zip64.pt");
  REQUIRE(back.entries.size() == all.size());
  for (std::size_t i = 0; i < all.size(); ++i) {
    CAPTURE(all[i].name);
    CHECK(back.entries[i].name == all[i].name);
    if (const auto* t = std::get_if<HostTensor>(&all[i].value)) {
      const HostTensor* u = std::get_if<HostTensor>(&back.entries[i].value);
      REQUIRE(u != nullptr);
      CHECK(u->equal(*t));
    } else {
      CHECK(back.entries[i].value.index() == all[i].value.index());
      CHECK(std::visit(
          [&](const auto& want) {
            using V = std::decay_t<decltype(want)>;
            if constexpr (std::is_same_v<V, HostTensor>) return false;
            else return std::get<V>(back.entries[i].value) == want;
          },
          all[i].value));
    }
  }
  write_pt(d / "again.pt", all);
  CHECK(test::read_bytes(d / "again.pt") == test::read_bytes(d / "all.pt"));
}

TEST_CASE("pt: record round trip through our writer and reader") {
  test::TempDir d("ptrt");
  for (DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    for (bool mask : {false, true}) {
      CAPTURE(dtype_name(dt));
      CAPTURE(mask);
      const Record rec = make_record(6, 4, dt, mask);
      const std::string path = d / "x.pt";
      PtWriter w(path);
      w.add(rec);
      CHECK_THROWS_AS(w.add(rec), UsageError);
      w.finish();
      PtReader r(path);
      const Record back = r.read(0);
      CHECK(back.conversation_id == "rec-1");
      CHECK(back.input_ids.equal(rec.input_ids));
      CHECK(back.hidden_states.equal(rec.hidden_states));
      CHECK(back.aux_hidden_states.equal(rec.aux_hidden_states));
      REQUIRE(back.loss_mask.has_value() == mask);
      if (mask) CHECK(back.loss_mask->equal(*rec.loss_mask));
      ZipArchive z(ByteSource::open_file(path));
      for (const auto& e : z.entries()) CHECK(e.data_offset % 64 == 0);
      std::vector<std::string> names;
      for (const auto& e : z.entries()) names.push_back(e.name);
      std::vector<std::string> want = {"archive/data.pkl", "archive/byteorder", "archive/data/0",
                                       "archive/data/1", "archive/data/2"};
      if (mask) want.push_back("archive/data/3");
      want.push_back("archive/version");
      want.push_back("archive/.data/serialization_id");
      CHECK(names == want);
      CHECK(z.text(*z.find("archive/version")) == "3\n");
    }
  }
  {  // A writer dropped before finish() leaves nothing behind.
    PtWriter w(d / "never.pt");
    w.add(make_record(2, 2, DType::kFloat32, false));
  }
  CHECK_FALSE(fs::exists(d / "never.pt"));
  WriterOptions keep;
  keep.overwrite = false;
  CHECK_THROWS_WITH_AS(create_writer(d / "x.pt", keep), doctest::Contains("x.pt: exists"), UsageError);
  CHECK_THROWS_AS(write_pt(d / "dup.pt", {{"a", true}, {"a", false}}), UsageError);
  CHECK_FALSE(fs::exists(d / "dup.pt"));
}

TEST_CASE("pt: hidden_states and aux_hidden_states of different dtypes read as the wider (float32)") {
  test::TempDir d("ptmix");
  Record rec = make_record(5, 4, DType::kFloat16, true);
  const Record aux32 = make_record(5, 4, DType::kFloat32, true);
  rec.aux_hidden_states = aux32.aux_hidden_states;
  rec.check("mixed");  // allowed: each tensor keeps its dtype on disk
  {
    PtWriter w(d / "m.pt");
    w.add(rec);
    w.finish();
  }
  PtReader r(d / "m.pt");
  CHECK(r.info(0).hidden_dtype == DType::kFloat32);
  const Record back = r.read(0);
  CHECK(back.hidden_states.dtype == DType::kFloat32);
  CHECK(back.hidden_states.equal(widened(rec.hidden_states, DType::kFloat32)));
  CHECK(back.aux_hidden_states.equal(aux32.aux_hidden_states));
  for (std::int64_t i = 0; i < rec.hidden_states.numel(); ++i)
    CHECK(back.hidden_states.get(i) == rec.hidden_states.get(i));  // exact
  CHECK(r.read_prefix(0, 2).hidden_states.equal(widened(rec.hidden_states, DType::kFloat32).rows(2)));
  CHECK(common_hidden_dtype(DType::kBFloat16, DType::kFloat16) == DType::kFloat32);
  CHECK(common_hidden_dtype(DType::kFloat32, DType::kFloat64) == DType::kFloat64);
  CHECK(common_hidden_dtype(DType::kBFloat16, DType::kBFloat16) == DType::kBFloat16);
  Record bad = rec;
  bad.aux_hidden_states = rec.input_ids;
  CHECK_THROWS_AS(bad.check("x"), FormatError);
}

namespace {

// A file image in page-aligned memory whose pages can be protected.
class ProtectableBytes final : public ByteSource {
 public:
  static std::shared_ptr<ProtectableBytes> make(const std::vector<std::uint8_t>& bytes) {
    const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    const std::size_t len = (bytes.size() + page - 1) / page * page;
    void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    REQUIRE(p != MAP_FAILED);
    std::memcpy(p, bytes.data(), bytes.size());
    return std::shared_ptr<ProtectableBytes>(
        new ProtectableBytes(static_cast<std::uint8_t*>(p), bytes.size(), len));
  }
  ~ProtectableBytes() override { ::munmap(map_, len_); }
  // Makes every whole page inside [begin, end) unreadable.
  void protect(std::uint64_t begin, std::uint64_t end) const {
    const std::uint64_t page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
    const std::uint64_t b = (begin + page - 1) / page * page;
    const std::uint64_t e = end / page * page;
    REQUIRE(e > b);
    REQUIRE(::mprotect(map_ + b, e - b, PROT_NONE) == 0);
  }
  void unprotect() const { REQUIRE(::mprotect(map_, len_, PROT_READ | PROT_WRITE) == 0); }

 private:
  ProtectableBytes(std::uint8_t* p, std::size_t n, std::size_t len)
      : ByteSource(p, n, "protected.pt"), map_(p), len_(len) {}
  std::uint8_t* map_;
  std::size_t len_;
};

}  // namespace

TEST_CASE("pt: read_prefix touches only the rows it returns") {
  test::TempDir d("ptpre");
  const std::int64_t T = 16, H = 1024, n = 3;  // fp32 rows of 4 KiB (hidden) and 12 KiB (aux)
  const Record rec = make_record(T, H, DType::kFloat32, true);
  write_pt(d / "big.pt", {{"input_ids", rec.input_ids},
                          {"hidden_states", rec.hidden_states},
                          {"aux_hidden_states", rec.aux_hidden_states},
                          {"loss_mask", *rec.loss_mask}});
  const auto bytes = test::read_bytes(d / "big.pt");
  const auto mem = ProtectableBytes::make(bytes);
  {
    ZipArchive z(mem);
    const ZipEntry* hid = z.find("archive/data/1");
    const ZipEntry* aux = z.find("archive/data/2");
    REQUIRE(hid != nullptr);
    REQUIRE(aux != nullptr);
    mem->protect(hid->data_offset + n * H * 4, hid->data_offset + hid->size);
    mem->protect(aux->data_offset + n * 3 * H * 4, aux->data_offset + aux->size);
  }
  PtReader reader(mem, "big.pt");
  CHECK(reader.info(0).tokens == T);
  CHECK(reader.info(0).conversation_id == "big");
  const Record p = reader.read_prefix(0, n);
  CHECK(p.tokens() == n);
  CHECK(p.hidden_states.shape == std::vector<std::int64_t>{n, H});
  CHECK(p.aux_hidden_states.shape == std::vector<std::int64_t>{n, 3 * H});
  // Zero-copy: the views point into the protected image; copying them reads only rows < n.
  CHECK(p.hidden_states.data >= mem->data());
  CHECK(p.hidden_states.data < mem->data() + mem->size());
  CHECK(p.hidden_states.contiguous().equal(rec.hidden_states.rows(n)));
  CHECK(p.aux_hidden_states.contiguous().equal(rec.aux_hidden_states.rows(n)));
  CHECK(p.input_ids.equal(rec.input_ids.rows(n)));
  CHECK(p.loss_mask->equal(rec.loss_mask->rows(n)));
  // A read that covers every row checks the storages' CRC-32, so it touches every byte.
  mem->unprotect();
  const Record whole = reader.read_prefix(0, 100);  // clamped, still views
  CHECK(whole.tokens() == T);
  CHECK(whole.hidden_states.data >= mem->data());
  CHECK(whole.hidden_states.data < mem->data() + mem->size());
}

TEST_CASE("pt: a byte changed inside a storage fails its CRC-32 on a whole read, naming the entry") {
  // What a damaged copy looks like: the file still opens and its metadata reads (index and
  // a plain validate pass), but the values are not those torch.save wrote.
  test::TempDir d("ptcrc");
  const Record rec = make_record(8, 16, DType::kBFloat16, true);
  write_pt(d / "good.pt", {{"input_ids", rec.input_ids},
                           {"hidden_states", rec.hidden_states},
                           {"aux_hidden_states", rec.aux_hidden_states},
                           {"conversation_id", std::string("c7")}});
  auto bytes = test::read_bytes(d / "good.pt");
  std::uint64_t at = 0;
  {
    ZipArchive z(ByteSource::from_bytes(bytes, "good.pt"));
    const ZipEntry* hid = z.find("archive/data/1");
    REQUIRE(hid != nullptr);
    at = hid->data_offset + 6 * 16 * 2;  // row 6 of the hidden states
    for (std::uint64_t i = 0; i < 64; ++i) bytes[at + i] ^= 0x5a;
  }
  test::write_bytes(d / "bad.pt", bytes);
  PtReader reader(d / "bad.pt");
  CHECK(reader.info(0).tokens == 8);
  CHECK(reader.read_prefix(0, 4).tokens() == 4);  // a prefix before the damage reads
  std::string msg;
  try {
    (void)reader.read(0);
  } catch (const ChecksumError& e) {
    msg = e.what();
  }
  CHECK(has(msg, d / "bad.pt" + ": zip entry 'archive/data/1' at byte "));
  CHECK(has(msg, "CRC-32 stored "));
  CHECK(has(msg, "the bytes changed after the archive was written"));
  // Every whole read checks again (the reader does not remember a failure as success).
  CHECK_THROWS_AS((void)reader.read_prefix(0, 8), ChecksumError);
  // The undamaged file reads whole.
  CHECK(PtReader(d / "good.pt").read(0).tokens() == 8);
}

// Floors of the flipped-byte test per region (see there): the least share refused over four
// masks less the spread between them (max - min), rounded down, as measured when written:
// local headers 174-175 of 614 (most of them torch's alignment padding), central directory
// 314-321 of 442, end records 45-46 of 98, pickle 370 of 370, other entries (version,
// byteorder) 6 of 48, storage payload 160 of 160 (a whole read checks its CRC-32).
constexpr double kPtFloorLocal = 0.28, kPtFloorCentral = 0.69, kPtFloorEnd = 0.44, kPtFloorPickle = 1.0,
                 kPtFloorOther = 0.12, kPtFloorPayload = 1.0;

TEST_CASE("pt: corruption table") {
  test::TempDir d("ptbad");
  const std::string good_path = d / "good.pt";
  write_pt(good_path, {{"input_ids", make_record(4, 2, DType::kFloat32, true).input_ids},
                       {"hidden_states", make_record(4, 2, DType::kFloat32, true).hidden_states},
                       {"aux_hidden_states", make_record(4, 2, DType::kFloat32, true).aux_hidden_states},
                       {"conversation_id", std::string("c")}});
  const auto good = test::read_bytes(good_path);
  REQUIRE(PtReader(good_path).read(0).tokens() == 4);

  SUBCASE("bad magic") {
    auto b = good;
    std::memcpy(b.data(), "XXXX", 4);
    test::write_bytes(d / "magic.pt", b);
    CHECK(open_error<FormatError>(d / "magic.pt") ==
          d / "magic.pt" + ": magic at byte 0: not a torch.save zip archive (no PK\\3\\4 at byte 0)");
    CHECK_THROWS_WITH_AS(open_reader(d / "magic.pt"),
                         doctest::Contains("magic at byte 0: not a record file"), FormatError);
  }
  SUBCASE("truncated at every byte") {
    for (std::size_t cut = 0; cut < good.size(); ++cut) {
      CAPTURE(cut);
      std::vector<std::uint8_t> b(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(cut));
      try {
        PtReader r(ByteSource::from_bytes(b, "cut.pt"), "cut.pt");
        FAIL("truncated file opened");
      } catch (const FormatError& e) {
        CHECK(std::string(e.what()).rfind("cut.pt: ", 0) == 0);
      }
    }
  }
  SUBCASE("a hole cut out before the central directory") {
    std::size_t cd = 0;
    for (std::size_t i = 0; i + 4 <= good.size(); ++i)
      if (std::memcmp(good.data() + i, "PK\1\2", 4) == 0) {
        cd = i;
        break;
      }
    REQUIRE(cd > 0);
    for (std::size_t cut = 0; cut < cd; cut += 3) {
      CAPTURE(cut);
      std::vector<std::uint8_t> b(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(cut));
      b.insert(b.end(), good.begin() + static_cast<std::ptrdiff_t>(cd), good.end());
      CHECK_THROWS_AS(PtReader(ByteSource::from_bytes(b, "hole.pt"), "hole.pt"), FormatError);
    }
  }
  SUBCASE("every flipped byte is a FormatError naming the file, or a clean read; never a crash") {
    // Any other exception escapes and fails the case. Counted per region of the file, for four
    // flip masks: a floor on the whole file (1077 of 1732 refused) would pass with one
    // region's detection lost (the central directory is a quarter of the bytes).
    const auto region = test::zip_regions(good, [](const std::string& name) {
      if (name.size() >= 8 && name.compare(name.size() - 8, 8, "data.pkl") == 0) return std::string("pickle");
      if (name.find("/data/") != std::string::npos) return std::string("storage payload");
      return std::string("other entries");
    });
    const std::map<std::string, double> floor = {{"local headers", kPtFloorLocal},
                                                 {"central directory", kPtFloorCentral},
                                                 {"end records", kPtFloorEnd},
                                                 {"pickle", kPtFloorPickle},
                                                 {"other entries", kPtFloorOther},
                                                 {"storage payload", kPtFloorPayload}};
    for (const std::uint8_t mask : {0x41, 0x01, 0x80, 0xff}) {
      CAPTURE(int(mask));
      std::map<std::string, test::RegionCounts> counts;
      std::size_t clean = 0;
      for (std::size_t i = 0; i < good.size(); ++i) {
        CAPTURE(i);
        auto b = good;
        b[i] ^= mask;
        test::RegionCounts& c = counts[region[i]];
        ++c.total;
        try {
          PtReader r(ByteSource::from_bytes(b, "flip.pt"), "flip.pt");
          const Record rec = r.read(0);
          (void)rec.hidden_states.contiguous();
          (void)rec.aux_hidden_states.contiguous();
          ++clean;
        } catch (const FormatError& e) {
          ++c.refused;
          CHECK(e.path() == "flip.pt");
          CHECK_MESSAGE(std::string(e.what()).rfind("flip.pt: ", 0) == 0, e.what());
        }
      }
      std::ostringstream said;
      for (const auto& [name, c] : counts) {
        said << "; " << name << " " << c.refused << " of " << c.total;
        REQUIRE_MESSAGE(floor.count(name), name);
        CHECK_MESSAGE(c.share() >= floor.at(name), "mask " << int(mask) << ": " << name << " refused " << c.refused
                                                             << " of " << c.total << ", floor " << floor.at(name));
      }
      MESSAGE("mask " << int(mask) << ": " << good.size() - clean << " of " << good.size() << " refused" << said.str());
      CHECK(counts.size() == floor.size());
      CHECK(clean > 0);
    }
  }
  SUBCASE("central directory past the end") {
    auto b = good;
    std::size_t end64 = 0;
    for (std::size_t i = 0; i + 4 <= b.size(); ++i)
      if (std::memcmp(b.data() + i, "PK\6\6", 4) == 0) end64 = i;
    for (int k = 0; k < 8; ++k) b[end64 + 48 + k] = k == 3 ? 1 : 0;  // cd offset 16 MiB
    test::write_bytes(d / "cd.pt", b);
    const std::string m = open_error<FormatError>(d / "cd.pt");
    CHECK(has(m, d / "cd.pt" + ": zip central directory at byte "));
    CHECK(has(m, "offset 16777216 + size "));
  }
  SUBCASE("oversized entry count") {
    auto b = good;
    std::size_t end64 = 0;
    for (std::size_t i = 0; i + 4 <= b.size(); ++i)
      if (std::memcmp(b.data() + i, "PK\6\6", 4) == 0) end64 = i;
    for (int k = 0; k < 8; ++k) b[end64 + 32 + k] = 0x7f;
    test::write_bytes(d / "count.pt", b);
    CHECK(has(open_error<FormatError>(d / "count.pt"), "entry count 9187201950435737471 does not fit"));
  }
  SUBCASE("wrong storage numel (record shorter than declared)") {
    write_archive(d / "numel.pt", record_pickle(10, 0, 2), {{"data/0", zeros(16)}, {"data/1", zeros(32)}});
    const std::string m = open_error<FormatError>(d / "numel.pt");
    CHECK(has(m, d / "numel.pt" + ": storage 'archive/data/0' at byte "));
    CHECK(has(m, "wrong storage numel: data.pkl says 10 x int64 but the record holds 16 bytes"));
  }
  SUBCASE("wrong storage numel (tensor reaches past its storage)") {
    write_archive(d / "extent.pt", record_pickle(4, 2, 3), {{"data/0", zeros(32)}, {"data/1", zeros(32)}});
    const std::string m = open_error<FormatError>(d / "extent.pt");
    CHECK(has(m, "tensor 'input_ids' at byte "));
    CHECK(has(m, "wrong storage numel: offset 2, size [3], stride [1] need 5 elements of int64 "
                 "but storage 'archive/data/0' holds 4"));
  }
  SUBCASE("views sharing one storage inside it read fine") {
    write_archive(d / "ok.pt", record_pickle(4, 2, 2), {{"data/0", zeros(32)}, {"data/1", zeros(32)}});
    const Record r = PtReader(d / "ok.pt").read(0);
    CHECK(r.tokens() == 2);
    CHECK(r.conversation_id == "ok");
    CHECK(r.aux_hidden_states.data == r.hidden_states.data + 8);  // same storage, offset 2
  }
  SUBCASE("missing storage record") {
    write_archive(d / "nostore.pt", record_pickle(4, 0, 2), {{"data/1", zeros(32)}});
    CHECK(has(open_error<FormatError>(d / "nostore.pt"),
              "its storage 'archive/data/0' is missing from the archive"));
  }
  SUBCASE("unknown opcode") {
    std::string pkl = record_pickle(4, 0, 2);
    pkl[2] = static_cast<char>(0xfe);
    write_archive(d / "op.pt", pkl, {{"data/0", zeros(32)}, {"data/1", zeros(32)}});
    CHECK(open_error<FormatError>(d / "op.pt") ==
          d / "op.pt" + ": data.pkl at byte 2: unknown opcode 0xfe");
  }
  SUBCASE("a pickle naming os.system") {
    const std::string pkl = std::string("\x80\x02") + "cos\nsystem\n" + "X\x02" + std::string(3, '\0') +
                            "ls\x85R.";
    write_archive(d / "evil.pt", pkl, {});
    CHECK(open_error<FormatError>(d / "evil.pt") ==
          d / "evil.pt" + ": data.pkl at byte 2: global 'os.system' is not allowed (only tensor "
                          "dicts can be read)");
    CHECK_THROWS_AS(read_pt(d / "evil.pt"), FormatError);
  }
  SUBCASE("big-endian archive") {
    ZipWriter w(d / "big.pt");
    const std::string pkl = record_pickle(4, 0, 2);
    w.add("archive/data.pkl", pkl.data(), pkl.size());
    w.add("archive/byteorder", "big", 3);
    w.finish();
    const std::string m = open_error<UnsupportedError>(d / "big.pt");
    CHECK(has(m, d / "big.pt" + ": byteorder at byte "));
    CHECK(has(m, "big-endian archive; only little-endian torch.save files are read"));
  }
  SUBCASE("deflated data.pkl") {
    auto b = good;
    for (std::size_t i = 0; i + 4 <= b.size(); ++i)
      if (std::memcmp(b.data() + i, "PK\1\2", 4) == 0) {
        b[i + 10] = 8;  // method of the first central entry (data.pkl)
        break;
      }
    test::write_bytes(d / "deflate.pt", b);
    CHECK(has(open_error<UnsupportedError>(d / "deflate.pt"),
              "zip entry 'archive/data.pkl' at byte 0: compressed with method 8 (deflate)"));
  }
  SUBCASE("records not inside a folder") {
    ZipWriter w(d / "flat.pt");
    w.add("data.pkl", "\x80\x02N.", 4);
    w.finish();
    CHECK(open_error<FormatError>(d / "flat.pt") ==
          d / "flat.pt" + ": zip entry 'data.pkl' at byte 0: not inside a folder, so this is not a "
                          "torch.save archive");
  }
  SUBCASE("missing and mistyped keys") {
    write_pt(d / "noaux.pt", {{"input_ids", HostTensor::zeros(DType::kInt64, {2})},
                              {"hidden_states", HostTensor::zeros(DType::kFloat32, {2, 2})}});
    CHECK(has(open_error<FormatError>(d / "noaux.pt"),
              d / "noaux.pt" + ": aux_hidden_states at byte "));
    CHECK(has(open_error<FormatError>(d / "noaux.pt"), "holds 'hidden_states' and no aux layers"));
    write_pt(d / "noaux2.pt", {{"input_ids", HostTensor::zeros(DType::kInt64, {2})},
                               {"hidden_state", HostTensor::zeros(DType::kFloat32, {2, 2})}});
    CHECK(open_error<FormatError>(d / "noaux2.pt") ==
          d / "noaux2.pt" + ": aux_hidden_states: missing from the record (looked for "
                            "'aux_hidden_states', 'aux_hidden_state', 'hidden_state_features')");
    write_pt(d / "strhid.pt", {{"input_ids", HostTensor::zeros(DType::kInt64, {2})},
                               {"hidden_states", std::string("oops")},
                               {"aux_hidden_states", HostTensor::zeros(DType::kFloat32, {2, 2})}});
    CHECK(has(open_error<FormatError>(d / "strhid.pt"), "hidden_states at byte "));
    CHECK(has(open_error<FormatError>(d / "strhid.pt"), "is a str, expected a tensor"));
    write_pt(d / "rows.pt", {{"input_ids", HostTensor::zeros(DType::kInt64, {3})},
                             {"hidden_states", HostTensor::zeros(DType::kFloat32, {2, 2})},
                             {"aux_hidden_states", HostTensor::zeros(DType::kFloat32, {2, 2})}});
    CHECK(open_error<FormatError>(d / "rows.pt") ==
          d / "rows.pt" + ": hidden_states: 2 rows but input_ids has 3 tokens");
  }
}

TEST_CASE("pt: conversation id from the file name") {
  CHECK(conversation_id_from_path("/a/b/123.pt") == "123");
  CHECK(conversation_id_from_path("7.ckpt.gz") == "7");
  CHECK(conversation_id_from_path("conv.1.pt") == "conv.1");
  CHECK(conversation_id_from_path("noext") == "noext");
  CHECK(conversation_id_from_path(".hidden") == ".hidden");
}

// What tests/fuzz checks at scale (fuzz_pt), pinned here: sizes in data.pkl far past the
// file fail on the numbers alone, before a byte is allocated or touched.
TEST_CASE("pt: absurd storage and tensor sizes fail before any allocation") {
  test::TempDir d("ptbig");
  const std::vector<std::pair<std::string, std::string>> data = {{"data/0", zeros(32)},
                                                                 {"data/1", zeros(32)}};
  write_archive(d / "numel.pt", record_pickle(std::int64_t{1} << 60, 0, 2), data);
  CHECK(has(open_error<FormatError>(d / "numel.pt"),
            "wrong storage numel: data.pkl says 1152921504606846976 x int64 but the record "
            "holds 32 bytes"));
  // 2^62 x 8 bytes overflows 64 bits.
  write_archive(d / "overflow.pt", record_pickle(std::int64_t{1} << 62, 0, 2), data);
  CHECK(has(open_error<FormatError>(d / "overflow.pt"),
            "wrong storage numel: data.pkl says 4611686018427387904 x int64 but the record "
            "holds 32 bytes"));
  write_archive(d / "rows.pt", record_pickle(4, 0, std::int64_t{1} << 60), data);
  CHECK(has(open_error<FormatError>(d / "rows.pt"),
            "wrong storage numel: offset 0, size [1152921504606846976], stride [1] need "
            "1152921504606846976 elements of int64 but storage 'archive/data/0' holds 4"));
}

// ModelOpt's reader takes bool(record.get("hidden_states_prenorm", False)); we keep "absent"
// apart from False (docs/data.md, pre- and post-norm dumps).
TEST_CASE("pt: hidden_states_prenorm as torch.save writes it, read back and written by us") {
  test::require_python("torch");
  test::TempDir d("ptnorm");
  const auto r = test::python(R"PY(
import sys, torch
out = sys.argv[1]
def rec(**extra):
    g = torch.Generator().manual_seed(3)
    d = {"input_ids": torch.arange(5), "hidden_states": torch.randn(5, 4, generator=g),
         "aux_hidden_states": torch.randn(5, 12, generator=g), "conversation_id": "c"}
    d.update(extra)
    return d
torch.save(rec(hidden_states_prenorm=True), out + "/true.pt")
torch.save(rec(hidden_states_prenorm=False), out + "/false.pt")
torch.save(rec(), out + "/absent.pt")
torch.save(rec(hidden_states_prenorm=None), out + "/none.pt")
torch.save(rec(hidden_states_prenorm=1), out + "/one.pt")
torch.save(rec(hidden_states_prenorm=torch.tensor(True)), out + "/tensor.pt")
torch.save([rec(hidden_states_prenorm=True)], out + "/list.pt")
torch.save(rec(hidden_states_prenorm="yes"), out + "/str.pt")
torch.save(rec(hidden_states_prenorm=2), out + "/two.pt")
torch.save(rec(hidden_states_prenorm=torch.tensor([0.5])), out + "/float.pt")
torch.save(rec(hidden_states_prenorm=torch.tensor([1, 0])), out + "/pair.pt")
)PY", {d.path()});
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  auto flag = [&](const std::string& name) { return PtReader(d / name).read(0).hidden_states_prenorm; };
  CHECK(flag("true.pt") == std::optional<bool>(true));
  CHECK(flag("false.pt") == std::optional<bool>(false));
  CHECK_FALSE(flag("absent.pt").has_value());
  CHECK_FALSE(flag("none.pt").has_value());
  CHECK(flag("one.pt") == std::optional<bool>(true));
  CHECK(flag("tensor.pt") == std::optional<bool>(true));
  CHECK(flag("list.pt") == std::optional<bool>(true));
  CHECK(PtReader(d / "true.pt").info(0).hidden_states_prenorm == std::optional<bool>(true));
  CHECK(PtReader(d / "true.pt").read_prefix(0, 2).hidden_states_prenorm == std::optional<bool>(true));
  CHECK(has(open_error<FormatError>(d / "str.pt"), "hidden_states_prenorm at byte "));
  CHECK(has(open_error<FormatError>(d / "str.pt"), ": is a str, expected a bool"));
  CHECK(has(open_error<FormatError>(d / "two.pt"), ": is the int 2, expected a bool (or 0 / 1)"));
  CHECK(has(open_error<FormatError>(d / "float.pt"),
            ": is a float32 tensor of shape [1], expected a bool (or a one-element bool / integer tensor)"));
  CHECK(has(open_error<FormatError>(d / "pair.pt"), ": is a int64 tensor of shape [2]"));

  // Ours: written as a Python bool only when stated, and torch.load sees exactly that.
  for (const std::optional<bool> v : {std::optional<bool>(true), std::optional<bool>(false), std::optional<bool>()}) {
    Record rec = PtReader(d / "absent.pt").read(0);
    rec.hidden_states_prenorm = v;
    const std::string path = d / (v ? (*v ? "w-true.pt" : "w-false.pt") : "w-absent.pt");
    PtWriter w(path);
    w.add(rec);
    w.finish();
    CHECK(PtReader(path).read(0).hidden_states_prenorm == v);
  }
  const auto back = test::python(R"PY(
import sys, torch
for name in ["w-true", "w-false", "w-absent"]:
    d = torch.load(sys.argv[1] + "/" + name + ".pt")
    v = d.get("hidden_states_prenorm", "absent")
    print(name, type(v).__name__, v)
)PY", {d.path()});
  REQUIRE_MESSAGE(back.exit_code == 0, back.err);
  CHECK(back.out == "w-true bool True\nw-false bool False\nw-absent str absent\n");
}

// SpecForge 0.2's per-strategy .ckpt keys, written with SpecForge's own layouts
// (tests/data/specforge/make_fixture.py); expected values from its own reader and DSpark
// normalizer.
namespace {

std::string specforge_fixture(const std::string& name) {
  return test::source_dir() + "/tests/data/specforge/" + name;
}

}  // namespace

TEST_CASE("pt: SpecForge 0.2 DSpark .ckpt / .ckpt.gz read as SpecForge's normalizer sees them") {
  const auto want = SafetensorsFile::open(specforge_fixture("expected/dspark_0.safetensors"));
  for (const char* name : {"dspark_0.ckpt", "dspark_0.ckpt.gz"}) {
    CAPTURE(name);
    const auto reader = open_reader(specforge_fixture(name));
    const Record r = reader->read(0);
    CHECK(r.conversation_id == "dspark_0");
    CHECK(r.tokens() == 5);
    CHECK(r.hidden_size() == 8);  // target_last_hidden_states [1, 5, 8]
    CHECK(r.aux_hidden_states.shape == std::vector<std::int64_t>{5, 24});  // hidden_states [1, 5, 24]
    CHECK(r.input_ids.equal(*want->get("input_ids")));
    REQUIRE(r.loss_mask.has_value());
    CHECK(r.loss_mask->equal(*want->get("loss_mask")));
    CHECK(r.hidden_states.dtype == DType::kBFloat16);
    CHECK(r.hidden_states.equal(*want->get("hidden_states")));
    CHECK(r.aux_hidden_states.equal(*want->get("aux_hidden_states")));
  }
}

TEST_CASE("pt: SpecForge 0.2 DFlash / DSpark records refused where they cannot be read one way") {
  test::TempDir dir("specforge");
  const std::string d = dir.path();
  // DFlash / Domino: the aux layers only, no last layer.
  for (const char* name : {"dflash_0.ckpt", "dflash_0.ckpt.gz"}) {
    CAPTURE(name);
    std::string msg = "<no error>";
    try {
      (void)open_reader(specforge_fixture(name))->read(0);
    } catch (const FormatError& e) {
      msg = e.what();
    }
    CHECK(has(msg, ": aux_hidden_states at byte "));
    CHECK(has(msg, "as SpecForge 0.2's DFlash / Domino records do"));
  }
  // DSpark's keys beside an EAGLE-3 last-layer key.
  const HostTensor ids = HostTensor::zeros(DType::kInt64, {2});
  const HostTensor h = HostTensor::zeros(DType::kFloat32, {1, 2, 4});
  const HostTensor aux = HostTensor::zeros(DType::kFloat32, {1, 2, 12});
  write_pt(d + "/both.ckpt", {{"input_ids", ids}, {"hidden_states", aux},
                              {"target_last_hidden_states", h}, {"hidden_state", h}});
  const std::string both = open_error<FormatError>(d + "/both.ckpt");
  CHECK(has(both, d + "/both.ckpt: hidden_state at byte "));
  CHECK(has(both, "beside 'target_last_hidden_states'"));
  // DSpark's last layer with the wrong token count.
  write_pt(d + "/rows.ckpt", {{"input_ids", ids}, {"hidden_states", aux},
                              {"target_last_hidden_states", HostTensor::zeros(DType::kFloat32, {1, 3, 4})}});
  CHECK(open_error<FormatError>(d + "/rows.ckpt") ==
        d + "/rows.ckpt: hidden_states: 3 rows but input_ids has 2 tokens");
  // Truncated: the zip's end records are gone.
  const auto src = ByteSource::open_file(specforge_fixture("dspark_0.ckpt"));
  std::vector<char> bytes(reinterpret_cast<const char*>(src->data()),
                          reinterpret_cast<const char*>(src->data()) + src->size() / 2);
  std::ofstream(d + "/cut.ckpt", std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  CHECK(has(open_error<FormatError>(d + "/cut.ckpt"), d + "/cut.ckpt: "));
}
