// DeepSpec's target cache v2 (formats/deepspec_format.h), on a cache written by DeepSpec's
// own writer (tests/data/deepspec_v2/make_fixture.py), with the expected values from
// DeepSpec's own reader (CacheDataset, numpy over the mapped shards).
#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "formats/byte_source.h"
#include "formats/bytes.h"
#include "formats/deepspec_format.h"
#include "formats/error.h"
#include "formats/file_walk.h"
#include "formats/format.h"
#include "formats/safetensors_format.h"
#include "tests/support.h"

using namespace eaglekit;
namespace fs = std::filesystem;

namespace {

std::string fixture(const std::string& sub) { return test::source_dir() + "/tests/data/deepspec_v2/" + sub; }

bool same_bytes(const HostTensor& got, const HostTensor& want, std::int64_t rows) {
  const HostTensor w = want.rows(rows);
  return got.dtype == w.dtype && got.shape == w.shape && got.is_contiguous() &&
         std::memcmp(got.data, w.data, w.nbytes()) == 0;
}

void spit(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A copy of the fixture's cache in `dir`.
std::string copy_cache(const test::TempDir& dir) {
  const std::string out = dir.path() + "/cache";
  fs::copy(fixture("cache"), out);
  return out;
}

void put_le(std::string& bytes, std::size_t at, std::uint64_t v, int n) {
  for (int i = 0; i < n; ++i) bytes[at + static_cast<std::size_t>(i)] = static_cast<char>(v >> (8 * i));
}

}  // namespace

TEST_CASE("deepspec: the cache DeepSpec's writer made reads as DeepSpec's CacheDataset reads it, bit for bit") {
  const std::string manifest = fixture("cache/manifest.json");
  REQUIRE(detect_file_format(manifest) == Format::kDeepSpec);
  const auto reader = open_reader(manifest);
  REQUIRE(reader->size() == 4);
  const auto* ds = dynamic_cast<const DeepSpecReader*>(reader.get());
  REQUIRE(ds != nullptr);
  CHECK(ds->target_layer_ids() == std::vector<std::int64_t>{1, 2, 3});
  CHECK(ds->hidden_size() == 8);
  const std::int64_t lens[] = {5, 3, 7, 2};
  for (std::size_t i = 0; i < 4; ++i) {
    CAPTURE(i);
    const auto want = SafetensorsFile::open(fixture("expected/sample_" + std::to_string(i) + ".safetensors"));
    const RecordInfo info = reader->info(i);
    CHECK(info.conversation_id == std::to_string(i));
    CHECK(info.tokens == lens[i]);
    CHECK(info.hidden_size == 8);
    CHECK(info.aux_width == 24);
    CHECK(info.ids_dtype == DType::kInt32);
    CHECK(info.hidden_dtype == DType::kBFloat16);
    CHECK(info.has_loss_mask);
    CHECK(info.layout_prenorm == std::optional<bool>(false));  // AutoModel's last_hidden_state: post-norm
    CHECK(reader->find(std::to_string(i)) == std::optional<std::size_t>(i));
    for (std::int64_t rows : {lens[i], std::int64_t{2}}) {
      CAPTURE(rows);
      const Record r = reader->read_prefix(i, rows == lens[i] ? -1 : rows);
      r.check("deepspec");
      CHECK(r.conversation_id == std::to_string(i));
      CHECK(same_bytes(r.input_ids, *want->get("input_ids"), rows));
      CHECK(same_bytes(*r.loss_mask, *want->get("loss_mask"), rows));
      CHECK(same_bytes(r.hidden_states, *want->get("target_last_hidden_states"), rows));
      CHECK(same_bytes(r.aux_hidden_states, *want->get("target_hidden_states"), rows));
      CHECK(r.layout_prenorm == std::optional<bool>(false));
    }
  }
  CHECK_FALSE(reader->find("4"));
  CHECK_FALSE(reader->find("01"));
  CHECK_FALSE(reader->find("x"));
  // Only the manifest is a record file: samples.idx and the shards carry no magic.
  CHECK(find_record_files(fixture("cache")) == std::vector<std::string>{manifest});
  CHECK(record_file_format(fixture("cache/samples.idx")) == std::nullopt);
  CHECK(record_file_format(fixture("cache/shard-00000.bin")) == std::nullopt);
  CHECK(record_file_format(fixture("conversations.jsonl")) == std::nullopt);  // '{' but no manifest
  // The first bytes alone never name it: the row's content test needs the file.
  const std::string head = test::read_text(manifest).substr(0, 16);
  CHECK(detect_format(reinterpret_cast<const std::uint8_t*>(head.data()), head.size()) == Format::kUnknown);
}

TEST_CASE("deepspec: a JSON file that is not a DeepSpec manifest is not a record file") {
  test::TempDir dir("ds");
  for (const std::string& text : {std::string("{\"version\": 2}"), std::string("{\"shards\": [], \"target_layer_ids\": [1]}"),
                                  std::string("{not json"), std::string("[1, 2]")}) {
    CAPTURE(text);
    spit(dir.path() + "/m.json", text);
    CHECK(record_file_format(dir.path() + "/m.json") == std::nullopt);
  }
}

TEST_CASE("deepspec: damaged caches are refused naming the file, the byte offset and the field") {
  struct Case {
    const char* name;
    std::function<void(const std::string& cache)> damage;
    int sample;            // -1: refused at open; else read(sample) fails, the others read
    const char* file;      // the file the error names
    const char* message;   // what it says (substring)
    bool unsupported;
  };
  const auto edit_manifest = [](const std::function<void(nlohmann::json&)>& f) {
    return [f](const std::string& cache) {
      nlohmann::json m = nlohmann::json::parse(test::read_text(cache + "/manifest.json"));
      f(m);
      spit(cache + "/manifest.json", m.dump(2));
    };
  };
  const auto edit_file = [](const char* file, const std::function<void(std::string&)>& f) {
    return [file, f](const std::string& cache) {
      std::string b = test::read_text(cache + "/" + file);
      f(b);
      spit(cache + "/" + file, b);
    };
  };
  const Case cases[] = {
      {"version 1", edit_manifest([](auto& m) { m["version"] = 1; }), -1, "manifest.json",
       "version at byte ", true},
      {"fp8 states", edit_manifest([](auto& m) { m["hidden_dtype"] = "float8_e4m3fn"; }), -1, "manifest.json",
       "hidden_dtype at byte ", true},
      {"record size", edit_manifest([](auto& m) { m["index_record_size"] = 48; }), -1, "manifest.json",
       "index_record_size at byte ", true},
      {"token dtype", edit_manifest([](auto& m) { m["token_dtype"] = "int64"; }), -1, "manifest.json",
       "token_dtype at byte ", true},
      {"no hidden size", edit_manifest([](auto& m) { m.erase("hidden_size"); }), -1, "manifest.json",
       "hidden_size: missing", false},
      {"unsorted layers", edit_manifest([](auto& m) { m["target_layer_ids"] = {3, 1, 2}; }), -1, "manifest.json",
       "target_layer_ids at byte ", false},
      {"shard count", edit_manifest([](auto& m) { m["num_shards"] = 4; }), -1, "manifest.json",
       "shards at byte ", false},
      {"shard id", edit_manifest([](auto& m) { m["shards"][1]["shard_id"] = 5; }), -1, "manifest.json",
       "shards[1].shard_id", false},
      {"shard path", edit_manifest([](auto& m) { m["shards"][2]["file_name"] = "../shard-00002.bin"; }), -1,
       "manifest.json", "shards[2].file_name", false},
      {"index truncated", edit_file("samples.idx", [](std::string& b) { b.pop_back(); }), -1, "samples.idx",
       "samples.idx size at byte 223: is 223 bytes but num_samples 4 needs 224", false},
      {"shard missing", [](const std::string& c) { fs::remove(c + "/shard-00002.bin"); }, -1, "shard-00002.bin",
       ": cannot open: No such file or directory", false},
      {"sample id", edit_file("samples.idx", [](std::string& b) { put_le(b, 2 * 56, 7, 8); }), 2, "samples.idx",
       "sample 2 sample_id at byte 112: is 7, expected 2", false},
      {"shard id in index", edit_file("samples.idx", [](std::string& b) { put_le(b, 3 * 56 + 8, 9, 4); }), 3,
       "samples.idx", "sample 3 shard_id at byte 176: is 9 but the manifest lists 3 shards", false},
      {"seq_len 0", edit_file("samples.idx", [](std::string& b) { put_le(b, 12, 0, 4); }), 0, "samples.idx",
       "sample 0 seq_len at byte 12: is 0", false},
      {"seq_len past the shard", edit_file("samples.idx", [](std::string& b) { put_le(b, 56 + 12, 0xffffffffu, 4); }),
       1, "shard-00000.bin", "sample 1 input_ids at byte 350: needs 17179869180 bytes", false},
      {"offset past the shard", edit_file("samples.idx", [](std::string& b) { put_le(b, 2 * 56 + 48, 1u << 20, 8); }),
       2, "shard-00001.bin", "sample 2 target_last_hidden_states at byte 1048576: needs 112 bytes but the shard has 490 "
       "(samples.idx byte 160)", false},
      {"shard truncated", edit_file("shard-00000.bin", [](std::string& b) { b.resize(500); }), 1, "shard-00000.bin",
       "sample 1 target_hidden_states at byte 368: needs 144 bytes but the shard has 500", false},
  };
  for (const Case& c : cases) {
    CAPTURE(c.name);
    test::TempDir dir("ds");
    const std::string cache = copy_cache(dir);
    c.damage(cache);
    const std::string manifest = cache + "/manifest.json";
    std::string what;
    bool unsupported = false;
    try {
      const auto reader = DeepSpecReader::open(manifest);
      REQUIRE(c.sample >= 0);
      for (std::size_t i = 0; i < reader->size(); ++i)
        if (static_cast<int>(i) != c.sample) CHECK_NOTHROW(reader->read(i));
      try {
        reader->info(static_cast<std::size_t>(c.sample));
      } catch (const UnsupportedError& e) {
        what = e.what(), unsupported = true;
      } catch (const Error& e) {
        what = e.what();
      }
    } catch (const UnsupportedError& e) {
      CHECK(c.sample < 0);
      what = e.what(), unsupported = true;
    } catch (const Error& e) {
      CHECK(c.sample < 0);
      what = e.what();
    }
    CAPTURE(what);
    CHECK(what.find(cache + "/" + c.file) == 0);
    CHECK(what.find(c.message) != std::string::npos);
    CHECK(unsupported == c.unsupported);
  }
}

TEST_CASE("deepspec: a manifest that is not JSON, from memory, names the manifest") {
  CHECK_THROWS_WITH_AS(DeepSpecReader::open("m.json", "{\"version\": ", [](const std::string&) {
    return std::shared_ptr<const ByteSource>();
  }), "m.json: manifest at byte 0: is not a JSON object", FormatError);
}
