// NeMo AutoModel's EAGLE-3 offline cache (formats/nemo_cache_format.h), on caches written by
// NeMo's own producer code (tests/data/nemo_cache/make_fixture.py, nemo-automodel 0.7.0), with
// the expected values from NeMo's own reader, CachedEagle3Dataset.
#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "formats/error.h"
#include "formats/file_walk.h"
#include "formats/format.h"
#include "formats/nemo_cache_format.h"
#include "formats/safetensors_format.h"
#include "tests/support.h"

using namespace eaglekit;
namespace fs = std::filesystem;

namespace {

std::string fixture(const std::string& sub) { return test::source_dir() + "/tests/data/nemo_cache/" + sub; }

bool same_bytes(const HostTensor& got, const HostTensor& want) {
  return got.dtype == want.dtype && got.shape == want.shape && got.is_contiguous() &&
         std::memcmp(got.data, want.data, want.nbytes()) == 0;
}

void spit(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

void put_le(std::string& bytes, std::size_t at, std::uint64_t v, int n) {
  for (int i = 0; i < n; ++i) bytes[at + static_cast<std::size_t>(i)] = static_cast<char>(v >> (8 * i));
}

// The file offset of `name`'s first byte in a safetensors file.
std::uint64_t tensor_start(const std::string& path, const char* name) {
  const auto f = SafetensorsFile::open(path);
  return f->data_start() + f->find(name)->begin;
}

}  // namespace

TEST_CASE("nemo: the caches NeMo's writer made read as NeMo's CachedEagle3Dataset reads them, bit for bit") {
  for (const std::string name : {"lossless", "topk"}) {
    CAPTURE(name);
    const std::string manifest = fixture(name + "/manifest.json");
    REQUIRE(detect_file_format(manifest) == Format::kNemoCache);
    const auto reader = open_reader(manifest);
    REQUIRE(reader->size() == 5);
    const auto* nemo = dynamic_cast<const NemoCacheReader*>(reader.get());
    REQUIRE(nemo != nullptr);
    CHECK(nemo->aux_layer_ids() == std::vector<std::int64_t>{0, 1, 2});
    CHECK(nemo->hidden_size() == 8);
    CHECK(nemo->seq_length() == 8);
    CHECK(nemo->selected_token_ids().size() == 16);
    CHECK(nemo->target_probs_topk() == (name == "topk" ? 4 : 0));
    const DType dtype = name == "topk" ? DType::kFloat32 : DType::kBFloat16;
    const std::int64_t lens[] = {5, 8, 6, 7, 5};
    for (std::size_t i = 0; i < 5; ++i) {
      CAPTURE(i);
      const auto want = SafetensorsFile::open(fixture("expected/" + name + "_sample_" + std::to_string(i) + ".safetensors"));
      const RecordInfo info = reader->info(i);
      CHECK(info.conversation_id == std::to_string(i));
      CHECK(info.tokens == lens[i]);
      CHECK(info.hidden_size == 8);
      CHECK(info.aux_width == 24);
      CHECK(info.hidden_dtype == dtype);
      CHECK(info.has_loss_mask);
      CHECK(reader->find(std::to_string(i)) == std::optional<std::size_t>(i));
      const NemoCacheSample s = nemo->sample(i);
      CHECK(s.tokens == lens[i]);
      CHECK(same_bytes(s.input_ids, *want->get("input_ids")));
      CHECK(same_bytes(s.attention_mask, *want->get("attention_mask")));
      CHECK(same_bytes(s.loss_mask, *want->get("loss_mask")));
      CHECK(same_bytes(s.aux_hidden_states, *want->get("aux_hidden_states")));
      CHECK(same_bytes(s.position_mask, *want->get("position_mask")));
      const HostTensor probs = *want->get("target_probs");
      if (name == "lossless") {
        REQUIRE(s.target_probs);
        CHECK_FALSE(s.target_probs_values);
        CHECK(same_bytes(*s.target_probs, probs));
      } else {
        // NeMo's reader scatters the top k back to full width; scattering ours must give the same.
        REQUIRE(s.target_probs_values);
        REQUIRE(s.target_probs_indices);
        CHECK_FALSE(s.target_probs);
        HostTensor full = HostTensor::zeros(DType::kFloat32, {8, 16});
        auto* p = reinterpret_cast<float*>(full.mutable_data());
        for (std::int64_t t = 0; t < 8; ++t)
          for (std::int64_t j = 0; j < 4; ++j)
            p[t * 16 + static_cast<std::int64_t>(s.target_probs_indices->get(t * 4 + j))] =
                static_cast<float>(s.target_probs_values->get(t * 4 + j));
        CHECK(same_bytes(full, probs));
      }
      // As a record: NeMo's target_probs[t] row for row (top k scattered as NeMo's reader
      // does: its expected file holds the full-width result), the ids and position_mask
      // unshifted by one, aux as stored, no hidden states.
      const Record r = reader->read(i);
      r.check(manifest);
      const std::int64_t t = lens[i];
      CHECK(r.tokens() == t);
      CHECK(r.hidden_states.dim() == 0);
      CHECK(r.hidden_size() == 8);
      CHECK(r.target_probs_width() == 16);
      CHECK(r.stored_dtype() == dtype);
      REQUIRE(r.target_probs);
      CHECK(same_bytes(r.target_probs->contiguous(), probs.rows(t).contiguous()));
      CHECK(same_bytes(r.aux_hidden_states.contiguous(), want->get("aux_hidden_states")->rows(t).contiguous()));
      REQUIRE(r.loss_mask);
      CHECK(r.input_ids.get(0) == 0);
      CHECK(r.loss_mask->get(0) == 0);
      for (std::int64_t j = 1; j < t; ++j) {
        CHECK(r.input_ids.get(j) == want->get("input_ids")->get(j - 1));
        CHECK(r.loss_mask->get(j) == want->get("position_mask")->get(j - 1));
      }
      const RecordInfo from_record = info_of(r);
      CHECK(from_record.target_probs_width == info.target_probs_width);
      CHECK(from_record.hidden_dtype == info.hidden_dtype);
      // A prefix is the first rows of the same.
      const Record head = reader->read_prefix(i, 3);
      CHECK(head.tokens() == 3);
      CHECK(head.target_probs->shape == std::vector<std::int64_t>{3, 16});
      CHECK(same_bytes(head.target_probs->contiguous(), probs.rows(3).contiguous()));
    }
    CHECK_FALSE(reader->find("5"));
    CHECK_FALSE(reader->find("01"));
    // Only the manifest is a record file: the shards and the embeddings belong to it.
    CHECK(find_record_files(fixture(name)) == std::vector<std::string>{manifest});
    CHECK(record_file_format(fixture(name + "/shard-000000.safetensors")) == std::nullopt);
    CHECK(record_file_format(fixture(name + "/target_embeddings.safetensors")) == std::nullopt);
  }
  // A safetensors file named like a shard but with no NeMo manifest beside it is a record file.
  CHECK(record_file_format(fixture("expected/lossless_sample_0.safetensors")) == Format::kSafetensors);
  CHECK(record_file_format(fixture("conversations.jsonl")) == std::nullopt);
  CHECK(detect_file_format(test::source_dir() + "/tests/data/deepspec_v2/cache/manifest.json") == Format::kDeepSpec);
}

TEST_CASE("nemo: damaged caches are refused naming the file, the byte offset and the field") {
  struct Case {
    const char* name;
    const char* cache;
    std::function<void(const std::string& cache)> damage;
    int sample;           // -1: refused at open; else info(sample) fails, the others read
    const char* file;     // the file the error names
    std::string message;  // what it says (substring)
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
  const std::string l0 = fixture("lossless/shard-000000.safetensors");
  const std::string l1 = fixture("lossless/shard-000001.safetensors");
  const std::string l2 = fixture("lossless/shard-000002.safetensors");
  const std::string t0 = fixture("topk/shard-000000.safetensors");
  const Case cases[] = {
      {"version 1", "lossless", edit_manifest([](auto& m) { m["format_version"] = 1; }), -1, "manifest.json",
       "format_version at byte ", true},
      {"fp8 dtype", "lossless", edit_manifest([](auto& m) { m["dtype"] = "fp8"; }), -1, "manifest.json",
       "dtype at byte ", true},
      {"no seq_length", "lossless", edit_manifest([](auto& m) { m.erase("seq_length"); }), -1, "manifest.json",
       "seq_length: missing", false},
      {"vocab list short", "lossless", edit_manifest([](auto& m) { m["selected_token_ids"].erase(0); }), -1,
       "manifest.json", "lists 15 ids but draft_vocab_size is 16", false},
      {"layers do not divide", "lossless", edit_manifest([](auto& m) { m["aux_layer_ids"] = {0, 1, 2, 3, 4}; }), -1,
       "manifest.json", "do not divide aux_hidden_dim 24", false},
      {"more samples than shards", "lossless", edit_manifest([](auto& m) { m["num_samples"] = 7; }), -1,
       "shard-000002.safetensors", "input_ids shape at byte 78: is [1, 8]; the manifest makes it [2, 8]", false},
      {"stray shard", "lossless", [](const std::string& c) {
         fs::copy_file(c + "/shard-000002.safetensors", c + "/shard-000003.safetensors"); }, -1,
       "shard-000003.safetensors", "beyond the 3 shards", false},
      {"shard missing", "lossless", [](const std::string& c) { fs::remove(c + "/shard-000001.safetensors"); }, -1,
       "shard-000001.safetensors", ": cannot open: No such file or directory", false},
      {"shard truncated", "lossless", edit_file("shard-000001.safetensors", [](std::string& b) { b.resize(1000); }),
       -1, "shard-000001.safetensors",
       "aux_hidden_states.data_offsets at byte 832: [384, 1152] runs past the end of the data buffer (552 bytes; "
       "truncated or corrupt)", false},
      {"topk says full", "topk", edit_manifest([](auto& m) { m["target_probs_topk"] = 0; }), -1,
       "shard-000000.safetensors", "target_probs: missing", false},
      {"shard size", "lossless", edit_manifest([](auto& m) { m["shard_size"] = 3; }), -1, "shard-000000.safetensors",
       "input_ids shape at byte ", false},
      {"dtype says fp16", "lossless", edit_manifest([](auto& m) { m["dtype"] = "fp16"; }), -1,
       "shard-000000.safetensors", "aux_hidden_states dtype at byte ", false},
      {"attention gap", "lossless", edit_file("shard-000001.safetensors", [&](std::string& b) {
         put_le(b, tensor_start(l1, "attention_mask") + 8 * 8 + 8 * 2, 0, 8); }), 3, "shard-000001.safetensors",
       "sample 3 attention_mask at byte " + std::to_string(tensor_start(l1, "attention_mask") + 8 * 8 + 8 * 3) +
           ": has a 1 after a 0", false},
      {"attention 2", "lossless", edit_file("shard-000000.safetensors", [&](std::string& b) {
         put_le(b, tensor_start(l0, "attention_mask"), 2, 8); }), 0, "shard-000000.safetensors",
       "sample 0 attention_mask at byte " + std::to_string(tensor_start(l0, "attention_mask")) + ": holds 2", false},
      {"loss mask 5", "lossless", edit_file("shard-000002.safetensors", [&](std::string& b) {
         put_le(b, tensor_start(l2, "loss_mask") + 8, 5, 8); }), 4, "shard-000002.safetensors",
       "sample 4 loss_mask at byte " + std::to_string(tensor_start(l2, "loss_mask") + 8) + ": holds 5", false},
      {"token past the vocabulary", "lossless", edit_file("shard-000000.safetensors", [&](std::string& b) {
         put_le(b, tensor_start(l0, "input_ids") + 8 * 8, 32, 8); }), 1, "shard-000000.safetensors",
       "sample 1 input_ids at byte " + std::to_string(tensor_start(l0, "input_ids") + 8 * 8) +
           ": holds 32 outside the target vocabulary of 32", false},
      {"top-k index", "topk", edit_file("shard-000000.safetensors", [&](std::string& b) {
         put_le(b, tensor_start(t0, "target_probs_indices") + 2 * 8 * 4 * 4 + 4, 16, 4); }), 2,
       "shard-000000.safetensors",
       "sample 2 target_probs_indices at byte " +
           std::to_string(tensor_start(t0, "target_probs_indices") + 2 * 8 * 4 * 4 + 4) +
           ": holds 16 outside the draft vocabulary of 16", false},
      {"position_mask outside the loss mask", "lossless", edit_file("shard-000000.safetensors", [&](std::string& b) {
         put_le(b, tensor_start(l0, "position_mask"), 1, 1); }), 0, "shard-000000.safetensors",
       "sample 0 position_mask at byte " + std::to_string(tensor_start(l0, "position_mask")) +
           ": is set at position 0 where loss_mask is 0", false},
      {"position_mask on the last token", "lossless", edit_file("shard-000000.safetensors", [&](std::string& b) {
         put_le(b, tensor_start(l0, "loss_mask") + 8 * 8 + 7 * 8, 1, 8);
         put_le(b, tensor_start(l0, "position_mask") + 8 + 7, 1, 1); }), 1, "shard-000000.safetensors",
       "sample 1 position_mask at byte " + std::to_string(tensor_start(l0, "position_mask") + 8 + 7) +
           ": is set at position 7, past the last target inside the sample's 8 tokens", false},
  };
  for (const Case& c : cases) {
    const std::string name = c.name;
    CAPTURE(name);
    test::TempDir dir("nemo");
    const std::string cache = dir.path() + "/cache";
    fs::copy(fixture(c.cache), cache);
    c.damage(cache);
    std::string what;
    bool unsupported = false;
    try {
      const auto reader = NemoCacheReader::open(cache + "/manifest.json");
      REQUIRE(c.sample >= 0);
      for (std::size_t i = 0; i < reader->size(); ++i)
        if (static_cast<int>(i) != c.sample) CHECK_NOTHROW(reader->info(i));
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

TEST_CASE("nemo: a JSON file that is not a NeMo manifest is not a record file") {
  test::TempDir dir("nemo");
  for (const std::string& text : {std::string("{\"format_version\": 2}"),
                                  std::string("{\"shard_size\": 2, \"aux_hidden_dim\": 8, \"format_version\": 2}"),
                                  std::string("{not json"), std::string("[1, 2]")}) {
    CAPTURE(text);
    spit(dir.path() + "/manifest.json", text);
    CHECK(record_file_format(dir.path() + "/manifest.json") == std::nullopt);
  }
}

TEST_CASE("nemo: a top k naming one draft id twice is refused when the record is read") {
  test::TempDir dir("nemo");
  const std::string cache = dir.path() + "/cache";
  fs::copy(fixture("topk"), cache);
  const std::string shard = cache + "/shard-000000.safetensors";
  const std::uint64_t at = tensor_start(shard, "target_probs_indices");
  std::string b = test::read_text(shard);
  // Sample 0, position 1: its second index becomes its first.
  const std::uint64_t first = at + 4 * 4, second = first + 4;
  std::memcpy(&b[second], &b[first], 4);
  spit(shard, b);
  const auto reader = NemoCacheReader::open(cache + "/manifest.json");
  CHECK_NOTHROW(reader->info(0));
  try {
    reader->read(0);
    FAIL("read a top k with a repeated id");
  } catch (const FormatError& e) {
    const std::string what = e.what();
    CAPTURE(what);
    CHECK(what.find(shard + ": sample 0 target_probs_indices at byte " + std::to_string(second)) == 0);
    CHECK(what.find("twice at position 1") != std::string::npos);
  }
}
