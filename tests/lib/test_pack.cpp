// pack and verify: source order, shard size limit, resuming after an interruption to the
// same bytes as one uninterrupted run, codec mismatch, bad sources, and verify's report.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "formats/eks_format.h"
#include "formats/error.h"
#include "formats/format.h"
#include "lib/pack.h"
#include "tests/support.h"

using namespace eaglekit;
namespace fs = std::filesystem;

namespace {

Record pack_record(const std::string& id, std::int64_t t, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const std::int64_t h = 32;
  Record r;
  r.conversation_id = id;
  r.input_ids = HostTensor::zeros(DType::kInt64, {t});
  r.hidden_states = HostTensor::zeros(DType::kBFloat16, {t, h});
  r.aux_hidden_states = HostTensor::zeros(DType::kBFloat16, {t, 3 * h});
  for (std::int64_t i = 0; i < t; ++i) {
    const std::int64_t tok = static_cast<std::int64_t>(rng() % 32000);
    std::memcpy(r.input_ids.mutable_data() + 8 * i, &tok, 8);
  }
  for (HostTensor* x : {&r.hidden_states, &r.aux_hidden_states})
    for (std::int64_t i = 0; i < x->numel(); ++i) {
      const std::uint16_t b = float_to_bf16(nd(rng));
      std::memcpy(x->mutable_data() + 2 * i, &b, 2);
    }
  return r;
}

// A source folder of mixed formats: single-record safetensors files (one nested) and a
// multi-record .eks shard. Returns the records in pack order (path order, then record).
std::vector<Record> make_source(const std::string& dir) {
  fs::create_directories(dir + "/a/deeper");
  std::vector<Record> order;
  WriterOptions st;
  st.format = Format::kSafetensors;
  auto write_one = [&](const std::string& path, const Record& r) {
    auto w = create_writer(path, st);
    w->add(r);
    w->finish();
  };
  // Sorted paths: a/deeper/x.safetensors, a/y.safetensors, b.eks, c.safetensors
  const Record x = pack_record("x", 50, 1), y = pack_record("y", 70, 2),
               c = pack_record("c", 30, 3);
  write_one(dir + "/a/deeper/x.safetensors", x);
  write_one(dir + "/a/y.safetensors", y);
  EksEncodeOptions eo;
  EksWriter shard(dir + "/b.eks", eo);
  std::vector<Record> in_b;
  for (int i = 0; i < 5; ++i) in_b.push_back(pack_record("b" + std::to_string(i), 20 + 10 * i, 10 + i));
  for (const auto& r : in_b) shard.add(r);
  shard.finish();
  write_one(dir + "/c.safetensors", c);
  test::write_text(dir + "/notes.txt", "not a record");
  order = {x, y};
  order.insert(order.end(), in_b.begin(), in_b.end());
  order.push_back(c);
  return order;
}

std::vector<Record> read_shards(const std::string& out) {
  std::vector<Record> all;
  for (const auto& f : find_record_files(out)) {
    auto r = open_reader(f);
    for (std::size_t i = 0; i < r->size(); ++i) all.push_back(r->read(i));
  }
  return all;
}

void check_same_records(const std::vector<Record>& a, const std::vector<Record>& b) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].conversation_id == b[i].conversation_id);
    CHECK(a[i].input_ids.equal(b[i].input_ids.contiguous()));
    CHECK(a[i].hidden_states.equal(b[i].hidden_states.contiguous()));
    CHECK(a[i].aux_hidden_states.equal(b[i].aux_hidden_states.contiguous()));
  }
}

PackOptions options(const std::string& src, const std::string& out) {
  PackOptions o;
  o.src = src;
  o.out_dir = out;
  o.shard_bytes = 16 * 1024;
  o.jobs = 2;
  return o;
}

std::vector<std::string> listing(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

TEST_CASE("pack: every record in source order, shards under the size limit, manifest") {
  test::TempDir d("pack");
  const auto want = make_source(d / "src");
  const PackResult r = pack_records(options(d / "src", d / "out"));
  CHECK(r.records == 8);
  CHECK(r.already_packed == 0);
  CHECK(r.source_files == 4);
  CHECK(r.shards_written >= 3);
  CHECK(r.shards_total == r.shards_written);
  CHECK(r.bad.empty());
  std::uint64_t raw = 0;
  for (const auto& x : want)
    raw += x.input_ids.nbytes() + x.hidden_states.nbytes() + x.aux_hidden_states.nbytes();
  CHECK(r.bytes_in == raw);
  std::uint64_t out = 0;
  for (const auto& s : r.shards) {
    const auto size = fs::file_size(s);
    out += size;
    CHECK(size <= 16 * 1024);
  }
  CHECK(r.bytes_out == out);
  CHECK(r.ratio() < 0.9);
  check_same_records(read_shards(d / "out"), want);
  CHECK(fs::path(r.shards[0]).filename() == "shard-000000.eks");

  std::ifstream mf(d / "out/pack-manifest.json");
  const auto m = nlohmann::json::parse(mf);
  CHECK(m["codec"] == "zstd");
  REQUIRE(m["shards"].size() == static_cast<std::size_t>(r.shards_written));
  CHECK(m["shards"][0]["sources"][0] == "a/deeper/x.safetensors#0");
  std::vector<std::string> sources;
  for (const auto& s : m["shards"])
    for (const auto& k : s["sources"]) sources.push_back(k.get<std::string>());
  CHECK(sources.size() == 8);
  CHECK(sources[2] == "b.eks#0");
  CHECK(sources[7] == "c.safetensors#0");

  // A rerun finds everything packed and writes nothing.
  const PackResult again = pack_records(options(d / "src", d / "out"));
  CHECK(again.records == 0);
  CHECK(again.already_packed == 8);
  CHECK(again.shards_written == 0);
  CHECK(again.shards_total == r.shards_total);

  // Packing into a folder inside the source does not pack its own shards.
  const PackResult inside = pack_records(options(d / "src", d / "src/packed"));
  CHECK(inside.records == 8);
  CHECK(inside.source_files == 4);
}

TEST_CASE("pack: a rerun after an interruption ends with the same shards as one run") {
  test::TempDir d("pack");
  make_source(d / "src");
  pack_records(options(d / "src", d / "ref"));
  const auto ref_files = listing(d / "ref");
  REQUIRE(ref_files.size() >= 4);  // manifest + at least 3 shards

  SUBCASE("killed after a shard was renamed but before the manifest listed it") {
    fs::create_directories(d / "out");
    fs::copy_file(d / "ref/shard-000000.eks", d / "out/shard-000000.eks");
    fs::copy_file(d / "ref/shard-000001.eks", d / "out/shard-000001.eks");  // not listed
    std::ifstream mf(d / "ref/pack-manifest.json");
    auto m = nlohmann::json::parse(mf);
    m["shards"] = nlohmann::json::array({m["shards"][0]});
    test::write_text(d / "out/pack-manifest.json", m.dump());
    const std::size_t first = m["shards"][0]["sources"].size();
    // The temp file of a writer whose process is gone.
    const std::string stale = ".shard-000002.eks.tmp." + test::dead_pid() + ".0";
    test::write_text(d / ("out/" + stale), "half a shard");

    const PackResult r = pack_records(options(d / "src", d / "out"));
    CHECK(r.already_packed == static_cast<std::int64_t>(first));
    CHECK(r.records == 8 - static_cast<std::int64_t>(first));
    CHECK_FALSE(fs::exists(d / ("out/" + stale)));
  }
  SUBCASE("stopped by a bad source record in the middle") {
    // Break one record of b.eks: packing stops there, after finishing the shards before it.
    const auto good = test::read_bytes(d / "src/b.eks");
    auto b_reader = EksReader::open(d / "src/b.eks");
    const EksRecordEntry e2 = b_reader->entry(2);
    const auto& blk = e2.tensor(EksRole::kHiddenStates)->blocks[0];
    auto bad = good;
    std::memset(&bad[e2.data_offset + blk.offset], 0, 4);
    test::write_bytes(d / "src/b.eks", bad);
    const std::string msg = [&] {
      try {
        pack_records(options(d / "src", d / "out"));
      } catch (const FormatError& e) {
        return std::string(e.what());
      }
      return std::string("no error");
    }();
    CHECK(msg == d / "src/b.eks" + ": record 2 ('b2') hidden_states block 0 at byte " +
                     std::to_string(e2.data_offset + blk.offset) +
                     ": not a zstd frame (bad frame header)");
    // Shards finished before the bad record stay; no temp file is left behind.
    for (const auto& n : listing(d / "out")) CHECK(n.find(".tmp.") == std::string::npos);
    test::write_bytes(d / "src/b.eks", good);
    const PackResult r = pack_records(options(d / "src", d / "out"));
    CHECK(r.already_packed > 0);
    CHECK(r.records + r.already_packed == 8);
  }
  // Either way, the end state is byte-identical to the uninterrupted run.
  CHECK(listing(d / "out") == ref_files);
  for (const auto& n : ref_files)
    CHECK_MESSAGE(test::read_bytes(d / ("out/" + n)) == test::read_bytes(d / ("ref/" + n)), n);
}

TEST_CASE("pack: options, codec mismatch, fp8 and skipping bad records") {
  test::TempDir d("pack");
  make_source(d / "src");
  auto o = options(d / "src", d / "out");
  o.encode.codec = EksCodec::kFp8;
  const PackResult r = pack_records(o);
  CHECK(r.records == 8);
  auto shard = open_reader(r.shards.at(0));
  CHECK(shard->info(0).codec == "fp8");
  o.encode.codec = EksCodec::kZstd;
  try {
    pack_records(o);
    FAIL("expected UsageError");
  } catch (const UsageError& e) {
    CHECK(std::string(e.what()) == d / "out" + " holds shards packed with codec fp8; rerun with "
                                               "--codec fp8 or pack into another --out");
  }
  o.out_dir = d / "out2";
  o.shard_bytes = 0;
  CHECK_THROWS_AS(pack_records(o), UsageError);
  o.shard_bytes = 1 << 20;
  o.encode.level = 0;
  CHECK_THROWS_AS(pack_records(o), UsageError);
  CHECK_FALSE(fs::exists(d / "out2"));  // bad options never touch the output

  // A file that is not a record (magic of a zip, but garbage) and a truncated shard.
  test::write_text(d / "src/broken.safetensors", std::string("\x10\0\0\0\0\0\0\0{garbage", 17));
  auto bytes = test::read_bytes(d / "src/b.eks");
  bytes.resize(bytes.size() / 2);
  test::write_bytes(d / "src/b.eks", bytes);
  o = options(d / "src", d / "out3");
  CHECK_THROWS_AS(pack_records(o), FormatError);
  o.skip_bad = true;
  const PackResult s = pack_records(o);
  CHECK(s.records == 3);  // x, y, c
  REQUIRE(s.bad.size() == 2);
  CHECK(s.bad[0].path == d / "src/b.eks");
  CHECK(s.bad[0].error.find("no 'EKSINDEX' trailer") != std::string::npos);
  CHECK(s.bad[1].path == d / "src/broken.safetensors");
}

TEST_CASE("verify: lists every bad record and checks all the others") {
  test::TempDir d("pack");
  const auto recs = make_source(d / "src");
  const PackResult p = pack_records(options(d / "src", d / "out"));
  VerifyOptions vo;
  vo.jobs = 2;
  VerifyResult ok = verify_records({d / "out"}, vo);
  CHECK(ok.ok());
  CHECK(ok.files == p.shards_written);
  CHECK(ok.records == 8);
  CHECK(ok.bytes == p.bytes_in);
  // Other formats are checked by reading them.
  VerifyResult src = verify_records({d / "src"}, vo);
  CHECK(src.ok());
  CHECK(src.records == 8);

  // Damage: a flipped checksum-covered byte in one record, a truncated shard.
  const std::string s0 = p.shards[0];
  auto reader = EksReader::open(s0);
  REQUIRE(reader->size() >= 1);
  const std::size_t victim = reader->size() - 1;
  const EksRecordEntry e = reader->entry(victim);
  const auto& blk = e.tensor(EksRole::kInputIds)->blocks[0];
  auto bytes = test::read_bytes(s0);
  std::memset(&bytes[e.data_offset + blk.offset], 0, 4);
  test::write_bytes(s0, bytes);
  bytes = test::read_bytes(p.shards[1]);
  bytes.resize(bytes.size() - 10);
  test::write_bytes(p.shards[1], bytes);

  const VerifyResult bad = verify_records({d / "out"}, vo);
  CHECK_FALSE(bad.ok());
  REQUIRE(bad.bad.size() == 2);
  CHECK(bad.bad[0].path == s0);
  CHECK(bad.bad[0].record == static_cast<std::int64_t>(victim));
  CHECK(bad.bad[0].conversation_id == e.conversation_id);
  CHECK(bad.bad[0].error == s0 + ": record " + std::to_string(victim) + " ('" + e.conversation_id +
                                "') input_ids block 0 at byte " +
                                std::to_string(e.data_offset + blk.offset) +
                                ": not a zstd frame (bad frame header)");
  CHECK(bad.bad[1].path == p.shards[1]);
  CHECK(bad.bad[1].record == -1);
  // Every record of the shards that open was still checked.
  std::ifstream mf(d / "out/pack-manifest.json");
  const auto m = nlohmann::json::parse(mf);
  CHECK(bad.records == 8 - m["shards"][1]["records"].get<std::int64_t>());
  CHECK_THROWS_AS(verify_records({d / "missing"}, vo), IoError);
}
