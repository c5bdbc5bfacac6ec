#include <doctest/doctest.h>

#include <filesystem>
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

TEST_CASE("stats: plan_dump counts the text, reads the base's width, measures on a sample and suggests") {
  test::TempDir dir("plan");
  // Four conversations of 100, 200, 300 and 400 text bytes ("user" + the content); the ids
  // are not text.
  std::string jsonl;
  for (int i = 0; i < 4; ++i)
    jsonl += "{\"conversation_id\": \"c" + std::to_string(i) + "\", \"messages\": [{\"role\": \"user\", \"content\": \"" +
             std::string(static_cast<std::size_t>(100 * (i + 1) - 4), 'x') + "\"}]}\n";
  test::write_text(dir / "conversations.jsonl", jsonl);
  std::filesystem::create_directories(dir / "base");
  test::write_text(dir / "base/config.json", R"({"hidden_size": 64, "num_hidden_layers": 8})");

  DumpPlanOptions o;
  o.conversations = dir / "conversations.jsonl";
  o.base = dir / "base";
  o.text_bytes_per_token = 4;
  DumpPlan p = plan_dump(o);
  CHECK(p.conversations == 4);
  CHECK(p.text_bytes == 1000);
  CHECK(p.tokens == doctest::Approx(250));
  CHECK(p.hidden_size == 64);
  CHECK(p.num_hidden_layers == 8);
  CHECK(p.base_config == dir / "base/config.json");
  REQUIRE(p.formats.size() == 3);
  // raw: int64 id + bf16 of (3 aux + the last) x 64; fp8: id + one byte a value + two f32 scales.
  CHECK(p.formats[0].name == "raw-bf16");
  CHECK(p.formats[0].bytes_per_token == 8 + 2 * 4 * 64);
  CHECK(p.formats[0].bytes == doctest::Approx(250.0 * 520));
  CHECK(p.formats[1].name == "eks-zstd");
  CHECK_FALSE(p.formats[1].measured);
  CHECK(p.formats[1].bytes_per_token == doctest::Approx(0.70 * 520));
  CHECK(p.formats[1].basis.find("an estimate") == 0);
  CHECK(p.formats[2].name == "eks-fp8");
  CHECK_FALSE(p.formats[2].lossless);
  CHECK(p.formats[2].bytes_per_token == 8 + 4 * 64 + 8);
  CHECK(p.suggestion == "eks-zstd");
  o.aux_layers = 1;
  CHECK(plan_dump(o).formats[0].bytes_per_token == 8 + 2 * 2 * 64);
  o.aux_layers = 3;

  // --disk: the lossless .eks if it fits (364 x 250 = 91000), else fp8 (272 x 250 = 68000), else none.
  o.disk_bytes = 91000;
  CHECK(plan_dump(o).suggestion == "eks-zstd");
  o.disk_bytes = 80000;
  p = plan_dump(o);
  CHECK(p.suggestion == "eks-fp8");
  CHECK(p.suggestion_why.find("does not fit") != std::string::npos);
  o.disk_bytes = 1000;
  p = plan_dump(o);
  CHECK(p.suggestion.empty());
  CHECK(p.suggestion_why.find("none fits") == 0);
  o.disk_bytes = 0;

  // A sample: c0 and c1 dumped as raw .pt (25 and 50 tokens) measure 300 text bytes over 75
  // tokens; c9 matches no conversation and counts for nothing.
  {
    std::vector<IndexedFile> files = {one(dir / "c0.pt", 25, 13000), one(dir / "c1.pt", 50, 26000),
                                      one(dir / "c9.pt", 1000, 520000)};
    for (auto& f : files) f.records[0].info.conversation_id = std::filesystem::path(f.path).stem().string();
    write_index(dir / "raw.eki", {dir.path()}, files);
  }
  const DatasetIndex raw_sample = DatasetIndex::load(dir / "raw.eki");
  o.text_bytes_per_token = 0;
  p = plan_dump(o, &raw_sample);
  CHECK(p.text_bytes_per_token == doctest::Approx(4.0));
  CHECK(p.tokens == doctest::Approx(250));
  CHECK(p.tokens_basis.find("measured on 2 conversations of the sample (75 tokens, matched by id)") == 0);
  CHECK_FALSE(p.formats[1].measured);  // raw records measure no codec
  // The same conversations packed into a zstd shard half their raw size: the codec's ratio.
  {
    IndexedFile shard;
    shard.path = dir / "s.eks";
    shard.size = 75 * 520 / 2;
    shard.format = Format::kEks;
    for (int i = 0; i < 2; ++i) {
      IndexedRecord r;
      r.record = static_cast<std::uint32_t>(i);
      r.info.conversation_id = "c" + std::to_string(i);
      r.info.tokens = 25 * (i + 1);
      r.info.hidden_size = 64;
      r.info.aux_width = 192;
      r.info.hidden_dtype = DType::kBFloat16;
      r.info.codec = "zstd";
      shard.records.push_back(r);
    }
    write_index(dir / "eks.eki", {dir.path()}, {shard});
  }
  const DatasetIndex eks_sample = DatasetIndex::load(dir / "eks.eki");
  p = plan_dump(o, &eks_sample);
  CHECK(p.formats[1].measured);
  CHECK(p.formats[1].bytes_per_token == doctest::Approx(0.5 * 520));
  CHECK(p.formats[1].basis.find("measured") == 0);
  CHECK_FALSE(p.formats[2].measured);
  // Given and sampled: the given ratio wins, the sample still measures the codec.
  o.text_bytes_per_token = 2;
  p = plan_dump(o, &eks_sample);
  CHECK(p.tokens == doctest::Approx(500));
  CHECK(p.tokens_basis == "given (--text-bytes-per-token)");
  CHECK(p.formats[1].measured);

  const std::string text = dump_plan_to_text(p);
  CHECK(text.find("conversations: 4, 1000 B of text\ntokens: about 500 (2.00 text bytes per token, given") == 0);
  CHECK(text.find("  eks-fp8 (lossy): 272 bytes per token") != std::string::npos);
  CHECK(text.find("suggest: eks-zstd: lossless") != std::string::npos);
  const auto j = nlohmann::json::parse(dump_plan_to_json(p));
  CHECK(j["tokens"] == 500);
  CHECK(j["formats"][1]["name"] == "eks-zstd");
  CHECK(j["formats"][1]["measured"] == true);
  CHECK(j["suggestion"] == "eks-zstd");

  // A multimodal config keeps its width under text_config.
  test::write_text(dir / "mm.json", R"({"text_config": {"hidden_size": 32}})");
  o.base = dir / "mm.json";
  p = plan_dump(o);
  CHECK(p.hidden_size == 32);
  CHECK(p.num_hidden_layers == 0);

  // Errors name what to pass, or the file and field.
  auto message = [&](const DumpPlanOptions& x, const DatasetIndex* s = nullptr) {
    try {
      plan_dump(x, s);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  DumpPlanOptions none = o;
  none.base = dir / "base";
  none.text_bytes_per_token = 0;
  CHECK(message(none).find("pass --index SAMPLE (an index of some of these conversations already dumped, to "
                           "measure it) or --text-bytes-per-token X") != std::string::npos);
  CHECK_THROWS_AS(plan_dump(none), UsageError);
  // Counted by the base's tokenizer (the CLI's eaglekit_dump.py --count-tokens): the tokens are
  // the count, and the ratio follows from them.
  DumpPlanOptions counted = none;
  counted.counted_tokens = 125;
  counted.counted_basis = "counted with the base's tokenizer (test)";
  const DumpPlan pc = plan_dump(counted);
  CHECK(pc.tokens == 125);
  CHECK(pc.text_bytes_per_token == doctest::Approx(8));
  CHECK(pc.tokens_basis == "counted with the base's tokenizer (test)");
  // The CLI runs the counter when the base folder holds a tokenizer.json: here a stand-in
  // Python that prints what eaglekit_dump.py --count-tokens prints, and one that fails.
  std::filesystem::create_directories(dir / "tok-base");
  test::write_text(dir / "tok-base/config.json", R"({"hidden_size": 64, "num_hidden_layers": 8})");
  test::write_text(dir / "tok-base/tokenizer.json", "{}");
  test::write_text(dir / "fake-python", "#!/bin/sh\necho '{\"conversations\": 4, \"tokens\": 125}'\n");
  std::filesystem::permissions(dir / "fake-python", std::filesystem::perms::owner_all);
  const std::string plan_cli = "stats --plan-dump --data " + test::quote(dir / "conversations.jsonl") + " --base " +
                               test::quote(dir / "tok-base") + " --json --python ";
  auto cli = test::eaglekit(plan_cli + test::quote(dir / "fake-python"));
  REQUIRE_MESSAGE(cli.exit_code == 0, cli.err);
  const auto counted_json = nlohmann::json::parse(cli.out);
  CHECK(counted_json["tokens"] == 125);
  CHECK(counted_json["tokens_basis"].get<std::string>().find("counted with the base's tokenizer (") == 0);
  cli = test::eaglekit(plan_cli + "/bin/false");
  CHECK(cli.exit_code == 2);
  CHECK_MESSAGE(cli.err.find("tokenizer.json failed (") != std::string::npos, cli.err);
  CHECK_MESSAGE(cli.err.find("pass --text-bytes-per-token X or --index SAMPLE instead") != std::string::npos, cli.err);
  {
    std::vector<IndexedFile> files = {one(dir / "zz.pt", 25, 13000)};
    files[0].records[0].info.conversation_id = "zz";
    write_index(dir / "other.eki", {dir.path()}, files);
  }
  const DatasetIndex other = DatasetIndex::load(dir / "other.eki");
  CHECK(message(none, &other).find("matches none of the conversations") != std::string::npos);
  test::write_text(dir / "bad.json", R"({"hidden_size": "4096"})");
  DumpPlanOptions bad = o;
  bad.base = dir / "bad.json";
  CHECK(message(bad) == dir / "bad.json" + ": hidden_size: expected a positive integer, got \"4096\"");
  CHECK_THROWS_AS(plan_dump(bad), FormatError);
  test::write_text(dir / "none.json", R"({"vocab_size": 10})");
  bad.base = dir / "none.json";
  CHECK(message(bad) == dir / "none.json" + ": hidden_size: missing (also under text_config)");
}
