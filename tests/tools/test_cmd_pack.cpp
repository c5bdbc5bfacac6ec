// `eaglekit pack` and `eaglekit verify` as a user runs them: exit codes, the JSON summary,
// the bad-record report, usage errors.
#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>

#include "formats/eks_format.h"
#include "formats/format.h"
#include "tests/support.h"

using namespace eaglekit;
namespace fs = std::filesystem;

namespace {

Record cli_record(const std::string& id, std::int64_t t, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Record r;
  r.conversation_id = id;
  r.input_ids = HostTensor::zeros(DType::kInt64, {t});
  for (std::int64_t i = 0; i < t; ++i) {
    const std::int64_t v = static_cast<std::int64_t>(rng() % 1000);
    std::memcpy(r.input_ids.mutable_data() + 8 * i, &v, 8);
  }
  r.hidden_states = HostTensor::zeros(DType::kBFloat16, {t, 32});
  r.aux_hidden_states = HostTensor::zeros(DType::kBFloat16, {t, 96});
  for (HostTensor* x : {&r.hidden_states, &r.aux_hidden_states})
    for (std::int64_t i = 0; i < x->numel(); ++i) {
      const std::uint16_t b = float_to_bf16(nd(rng));
      std::memcpy(x->mutable_data() + 2 * i, &b, 2);
    }
  return r;
}

void make_source(const std::string& dir) {
  fs::create_directories(dir);
  EksWriter w1(dir + "/one.eks", EksEncodeOptions{});
  for (int i = 0; i < 3; ++i) w1.add(cli_record("one-" + std::to_string(i), 40, 1 + i));
  w1.finish();
  EksWriter w2(dir + "/two.eks", EksEncodeOptions{});
  for (int i = 0; i < 3; ++i) w2.add(cli_record("two-" + std::to_string(i), 60, 10 + i));
  w2.finish();
}

}  // namespace

TEST_CASE("cmd pack: packs, summarizes as JSON, verify passes, then reports damage") {
  test::TempDir d("cmdpack");
  make_source(d / "src");
  const std::string out = d / "out";
  auto r = test::eaglekit("pack " + test::quote(d / "src") + " --out " + test::quote(out) +
                          " --shard-size 20KiB --jobs 2 --json");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const auto j = nlohmann::json::parse(r.out);
  CHECK(j["records"] == 6);
  CHECK(j["already_packed"] == 0);
  CHECK(j["source_files"] == 2);
  CHECK(j["codec"] == "zstd");
  CHECK(j["shards_written"].get<int>() >= 2);
  CHECK(j["ratio"].get<double>() < 0.9);
  CHECK(j["bytes_in"].get<std::uint64_t>() == 3 * 40 * (8 + 256) + 3 * 60 * (8 + 256));

  r = test::eaglekit("pack " + test::quote(d / "src") + " --out " + test::quote(out));
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("packed 0 records (6 already packed)") != std::string::npos);

  r = test::eaglekit("verify " + test::quote(out));
  CHECK(r.exit_code == 0);
  CHECK(r.out.rfind("ok: " + std::to_string(j["shards_written"].get<int>()) + " files, 6 records, 0 bad", 0) == 0);

  // Wreck the first frame of the first record of the first shard.
  const std::string s0 = j["shards"][0].get<std::string>();
  auto reader = EksReader::open(s0);
  const EksRecordEntry e = reader->entry(0);
  auto bytes = test::read_bytes(s0);
  std::memset(&bytes[e.data_offset], 0, 4);
  test::write_bytes(s0, bytes);
  r = test::eaglekit("verify --json " + test::quote(out));
  CHECK(r.exit_code == 1);
  const auto v = nlohmann::json::parse(r.out);
  CHECK(v["ok"] == false);
  CHECK(v["records"] == 6);
  REQUIRE(v["bad"].size() == 1);
  CHECK(v["bad"][0]["path"] == s0);
  CHECK(v["bad"][0]["record"] == 0);
  CHECK(v["bad"][0]["conversation_id"] == "one-0");
  r = test::eaglekit("verify " + test::quote(out));
  CHECK(r.exit_code == 1);
  CHECK(r.out.find("BAD " + s0 + ": record 0 ('one-0') input_ids block 0 at byte " +
                   std::to_string(e.data_offset) + ": not a zstd frame (bad frame header)\n") !=
        std::string::npos);
  CHECK(r.out.find("FAILED: ") != std::string::npos);
}

TEST_CASE("cmd pack: usage errors exit 2") {
  test::TempDir d("cmdpack");
  make_source(d / "src");
  auto r = test::eaglekit("pack " + test::quote(d / "src"));
  CHECK(r.exit_code == 2);
  CHECK(r.err == "eaglekit pack: --out is required (see --help)\n");
  r = test::eaglekit("pack " + test::quote(d / "src") + " --out " + test::quote(d / "o") + " --codec lz4");
  CHECK(r.exit_code == 2);
  CHECK(r.err == "eaglekit pack: --codec must be zstd or fp8, not 'lz4'\n");
  r = test::eaglekit("pack " + test::quote(d / "src") + " --out " + test::quote(d / "o") + " --shard-size 1XB");
  CHECK(r.exit_code == 2);
  r = test::eaglekit("pack " + test::quote(d / "missing") + " --out " + test::quote(d / "o"));
  CHECK(r.exit_code == 1);
  CHECK(r.err == "eaglekit pack: error: " + d / "missing" + ": no such file or directory\n");
  r = test::eaglekit("verify");
  CHECK(r.exit_code == 2);
  r = test::eaglekit("pack --help");
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("--shard-size") != std::string::npos);
}
