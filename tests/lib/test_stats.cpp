#include <doctest/doctest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "formats/error.h"
#include "lib/index.h"
#include "lib/stats.h"
#include "tests/support.h"

using namespace eaglekit;

namespace {

IndexedFile one(const std::string& path, std::int64_t tokens, std::uint64_t size,
                DType dtype = DType::kBFloat16, std::int64_t h = 64, Format f = Format::kPt) {
  IndexedFile file;
  file.path = path;
  file.size = size;
  file.format = f;
  IndexedRecord r;
  r.info.conversation_id = path;
  r.info.tokens = tokens;
  r.info.hidden_size = h;
  r.info.aux_width = 3 * h;
  r.info.hidden_dtype = dtype;
  file.records.push_back(r);
  return file;
}

}  // namespace

TEST_CASE("stats: token percentiles, histogram, bytes per token and plan") {
  test::TempDir dir("stats");
  const std::string path = dir / "i.ekidx";
  std::vector<IndexedFile> files;
  // Tokens 1..100 in files of 1000 bytes each; one fp16 record; one eks shard of two.
  for (int t = 1; t <= 100; ++t)
    files.push_back(one("/d/" + std::to_string(t) + ".pt", t, 1000,
                        t == 50 ? DType::kFloat16 : DType::kBFloat16));
  IndexedFile shard;
  shard.path = "/d/s.eks";
  shard.size = 5000;
  shard.format = Format::kEks;
  for (int i = 0; i < 2; ++i) {
    IndexedRecord r;
    r.record = static_cast<std::uint32_t>(i);
    r.info.conversation_id = "s" + std::to_string(i);
    r.info.tokens = 1000;
    r.info.hidden_size = 64;
    r.info.aux_width = 192;
    r.info.codec = "zstd";
    shard.records.push_back(r);
  }
  files.push_back(shard);
  IndexedFile bad;
  bad.path = "/d/bad.pt";
  bad.size = 77;
  bad.error = "broken";
  bad.records.resize(1);
  bad.records[0].error = "broken";
  files.push_back(bad);
  write_index(path, {"/d"}, files);

  const DatasetIndex index = DatasetIndex::load(path);
  StatsOptions o;
  o.plan_conversations = 1000;
  o.plan_tokens = 2000;
  const DatasetStats s = compute_stats(index, o);
  CHECK(s.records == 102);
  CHECK(s.bad_records == 1);
  CHECK(s.files == 101);
  CHECK(s.total_tokens == 5050 + 2000);
  CHECK(s.min_tokens == 1);
  CHECK(s.max_tokens == 1000);
  // Nearest rank over 102 values: 1..100, 1000, 1000.
  CHECK(s.median_tokens == 51);   // rank 51
  CHECK(s.p90_tokens == 92);      // rank ceil(91.8) = 92
  CHECK(s.p99_tokens == 1000);    // rank ceil(100.98) = 101
  CHECK(s.mean_tokens == doctest::Approx(7050.0 / 102));
  CHECK(s.bytes_on_disk == 100 * 1000 + 5000);
  CHECK(s.bytes_per_token == doctest::Approx(105000.0 / 7050));
  CHECK(s.per_format == std::map<std::string, std::size_t>{{"eks", 2}, {"pt", 100}});
  CHECK(s.per_dtype == std::map<std::string, std::size_t>{{"bfloat16", 101}, {"float16", 1}});
  CHECK(s.per_codec == std::map<std::string, std::size_t>{{"raw", 100}, {"zstd", 2}});
  CHECK(s.hidden_size == 64);
  CHECK(s.aux_width == 192);
  CHECK(s.dtype == "bfloat16");
  CHECK(s.raw_bytes_per_token == 8 + 256 * 2);
  // Bins [1,1], [2,3], [4,7], ..., [512,1023].
  REQUIRE(s.histogram.size() == 10);
  CHECK(s.histogram[0].lo == 1);
  CHECK(s.histogram[0].hi == 1);
  CHECK(s.histogram[0].count == 1);
  CHECK(s.histogram[1].count == 2);
  CHECK(s.histogram[6].lo == 64);
  CHECK(s.histogram[6].hi == 127);
  CHECK(s.histogram[6].count == 37);  // 64..100
  CHECK(s.histogram[7].count == 0);
  CHECK(s.histogram[9].count == 2);
  CHECK(s.has_plan);
  CHECK(s.plan_bytes_raw == doctest::Approx(1000.0 * 2000 * 520));
  CHECK(s.plan_bytes_on_disk == doctest::Approx(1000.0 * 2000 * 105000.0 / 7050));

  const std::string text = stats_to_text(s);
  CHECK(text.find("records: 102 in 101 files (+1 bad, not counted)") != std::string::npos);
  CHECK(text.find("tokens: 7050 total; per record min 1, median 51, p90 92, p99 1000, max 1000") !=
        std::string::npos);
  CHECK(text.find("formats: eks 2; pt 100\n") != std::string::npos);
  CHECK(text.find("      64-127      |") != std::string::npos);
  CHECK(text.find("plan: 1000 conversations x 2000.0 tokens = 991.8 MiB raw") != std::string::npos);
  const auto j = nlohmann::json::parse(stats_to_json(s));
  CHECK(j["tokens"]["median"] == 51);
  CHECK(j["histogram"].size() == 10);
  CHECK(j["plan"]["conversations"] == 1000);
  CHECK(j["per_hidden_size"]["64"] == 102);

  // The plan defaults to the dataset's own size and mean.
  StatsOptions only_tokens;
  only_tokens.plan_tokens = 10;
  const DatasetStats p = compute_stats(index, only_tokens);
  CHECK(p.plan_conversations == 102);
  CHECK_FALSE(compute_stats(index).has_plan);
  StatsOptions bad_opts;
  bad_opts.plan_conversations = -1;
  CHECK_THROWS_AS(compute_stats(index, bad_opts), UsageError);
}

TEST_CASE("stats: an empty index") {
  test::TempDir dir("stats");
  const std::string path = dir / "i.ekidx";
  write_index(path, {"/d"}, {});
  const DatasetStats s = compute_stats(DatasetIndex::load(path));
  CHECK(s.records == 0);
  CHECK(s.histogram.empty());
  CHECK(s.bytes_per_token == 0);
  CHECK(stats_to_text(s).find("records: 0 in 0 files") != std::string::npos);
}
