// convert (lib/convert.h) and file facts: a source's facts go to its output writer. NeMo
// AutoModel's EAGLE-3 caches (tests/data/nemo_cache/, written by NeMo 0.7.0's own producer
// code) convert to .eks, whose records and facts read back as the cache's; a target vocabulary
// another format would drop is refused; sources of one shard must state the same facts;
// DeepSpec's aux layer ids are kept by .eks and said when dropped.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "formats/bytes.h"
#include "formats/eks_format.h"
#include "formats/error.h"
#include "formats/format.h"
#include "lib/convert.h"
#include "tests/support.h"

using namespace eaglekit;
namespace fs = std::filesystem;

namespace {

std::string nemo(const std::string& sub) { return test::source_dir() + "/tests/data/nemo_cache/" + sub; }
std::string deepspec() { return test::source_dir() + "/tests/data/deepspec_v2/cache/manifest.json"; }

template <class E>
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception type: ") + e.what();
  }
  return "<no error>";
}

ConvertOptions with_codec(const std::string& codec) {
  ConvertOptions o;
  o.writer.codec = codec;
  o.jobs = 2;
  return o;
}

// A copy of a NeMo cache whose manifest is edited by f.
std::string edited_cache(const std::string& dir, const std::string& from,
                         const std::function<void(nlohmann::json&)>& f) {
  fs::copy(nemo(from), dir);
  nlohmann::json m;
  std::ifstream(dir + "/manifest.json") >> m;
  f(m);
  std::ofstream(dir + "/manifest.json", std::ios::trunc) << m.dump(2);
  return dir + "/manifest.json";
}

}  // namespace

TEST_CASE("convert: NeMo's caches become .eks shards whose records and facts read back as the cache's") {
  test::TempDir dir("convert-nemo");
  for (const std::string name : {"lossless", "topk"}) {
    for (const std::string codec : {"zstd", "fp8"}) {
      CAPTURE(name);
      CAPTURE(codec);
      const std::string src = nemo(name + "/manifest.json");
      const std::string dst = dir / (name + "-" + codec + ".eks");
      const ConvertResult res = convert_records(src, dst, with_codec(codec));
      const auto cache = open_reader(src);
      CHECK(res.format == Format::kEks);
      CHECK(res.records == 5);
      CHECK(res.notes.empty());
      CHECK(res.dropped_aux_layer_ids.empty());
      const FileFacts want = cache->facts();
      REQUIRE(want.target_vocabulary);
      CHECK(res.facts.aux_layer_ids == want.aux_layer_ids);
      CHECK(res.facts.target_vocabulary == want.target_vocabulary);
      const auto eks = open_reader(dst);
      CHECK(eks->format() == Format::kEks);
      CHECK(eks->facts().aux_layer_ids == std::vector<std::int64_t>{1, 2, 3});  // NeMo's 0, 1, 2 as HF indices
      CHECK(eks->facts().target_vocabulary == want.target_vocabulary);
      CHECK(eks->facts().target_vocabulary->topk == (name == "topk" ? 4 : 0));
      REQUIRE(eks->size() == cache->size());
      std::int64_t aux_changed = 0;
      for (std::size_t i = 0; i < cache->size(); ++i) {
        CAPTURE(i);
        const Record w = cache->read(i);
        const auto at = eks->find(w.conversation_id);
        REQUIRE(at);
        CHECK(*at == i);
        const Record g = eks->read(i);
        CHECK(g.conversation_id == w.conversation_id);
        CHECK(g.tokens() == w.tokens());
        CHECK(g.hidden_size() == w.hidden_size());
        CHECK(g.target_hidden_size == w.target_hidden_size);
        CHECK(g.hidden_states.dim() == 0);
        CHECK(g.stored_dtype() == w.stored_dtype());
        CHECK(g.input_ids.equal(w.input_ids));
        REQUIRE(g.loss_mask);
        CHECK(g.loss_mask->equal(*w.loss_mask));
        REQUIRE(g.target_probs);
        CHECK(g.target_probs->equal(*w.target_probs));  // every bit, fp8 or not
        CHECK(g.aux_hidden_states.dtype == w.aux_hidden_states.dtype);
        CHECK(g.aux_hidden_states.shape == w.aux_hidden_states.shape);
        if (codec == "zstd") {
          CHECK(g.aux_hidden_states.equal(w.aux_hidden_states));
        } else {
          // e4m3 with one scale per token: within half an e4m3 step (1/16 relative) plus the
          // rounding back to the dtype, or a subnormal step of the row's scale.
          const std::int64_t cols = w.aux_width();
          const HostTensor a = w.aux_hidden_states.contiguous(), b = g.aux_hidden_states.contiguous();
          for (std::int64_t t = 0; t < w.tokens(); ++t) {
            double amax = 0;
            for (std::int64_t c = 0; c < cols; ++c) amax = std::max(amax, std::fabs(a.get(t * cols + c)));
            for (std::int64_t c = 0; c < cols; ++c) {
              const double v = a.get(t * cols + c), q = b.get(t * cols + c);
              CHECK(std::fabs(q - v) <= std::fabs(v) / 16 + std::fabs(v) / 128 + amax / 448 * std::ldexp(1.0, -9));
              aux_changed += q != v;
            }
          }
        }
        const RecordInfo wi = cache->info(i), gi = eks->info(i);
        CHECK(gi.tokens == wi.tokens);
        CHECK(gi.hidden_size == wi.hidden_size);
        CHECK(gi.aux_width == wi.aux_width);
        CHECK(gi.target_probs_width == wi.target_probs_width);
        CHECK(gi.hidden_dtype == wi.hidden_dtype);
        CHECK(gi.has_loss_mask == wi.has_loss_mask);
        const Record gp = eks->read_prefix(i, 3), wp = cache->read_prefix(i, 3);
        CHECK(gp.target_probs->equal(*wp.target_probs));
        CHECK(gp.target_hidden_size == wp.target_hidden_size);
      }
      if (codec == "fp8") CHECK(aux_changed > 0);  // lossy: a test that could not tell would pass raw bytes
    }
  }
}

TEST_CASE("convert: a target vocabulary the output would drop is refused; dropped aux layer ids are said") {
  test::TempDir dir("convert-facts");
  const std::string src = nemo("lossless/manifest.json");
  const std::string refused = src + ": target vocabulary: its records store the target's distribution over a draft "
                                    "vocabulary of 16 tokens instead of a last hidden state (NeMo AutoModel's EAGLE-3 "
                                    "cache), and the ";
  const std::string advice = " format has no field for the distribution or its vocabulary; convert to .eks (DST "
                             "ending in .eks, or --format eks), which keeps both and trains as the cache does";
  // Five records to a folder of .pt files, one to a .safetensors file, all to one HDF5 shard.
  CHECK(error_of<UnsupportedError>([&] { convert_records(src, dir / "out.pt", {}); }) == refused + ".pt" + advice);
  CHECK(error_of<UnsupportedError>([&] { convert_records(src + "#2", dir / "two.safetensors", {}); }) ==
        refused + ".safetensors" + advice);
  CHECK(error_of<UnsupportedError>([&] { convert_records(src, dir / "all.h5", {}); }) == refused + ".h5" + advice);
  // Refused before anything is written: no output, no folder, no temp file.
  CHECK(fs::is_empty(dir.path()));

  // DeepSpec's aux layer ids (its target_layer_ids + 1): kept by .eks, said when dropped.
  ConvertResult r = convert_records(deepspec(), dir / "ds.eks", {});
  CHECK(r.facts.aux_layer_ids == std::vector<std::int64_t>{2, 3, 4});
  CHECK_FALSE(r.facts.target_vocabulary);
  CHECK(r.notes.empty());
  CHECK(open_reader(dir / "ds.eks")->facts().aux_layer_ids == std::vector<std::int64_t>{2, 3, 4});
  r = convert_records(deepspec(), dir / "ds-pt/", {});
  CHECK(r.files_written == 4);
  CHECK(r.facts.empty());
  CHECK(r.dropped_aux_layer_ids == std::vector<std::vector<std::int64_t>>{{2, 3, 4}});
  CHECK(r.notes == std::vector<std::string>{"the .pt format has no field for the aux layer ids [2, 3, 4] " + deepspec() +
                                            " states; pass --aux-layer-ids 2,3,4 when training"});
  // A shard of files that state no facts is written as before: no facts block (flag 1 only:
  // the .pt records state the post-norm form DeepSpec's layout implies).
  r = convert_records(dir / "ds-pt", dir / "plain.eks", {});
  CHECK(r.facts.empty());
  CHECK(r.notes.empty());
  const auto plain = test::read_bytes(dir / "plain.eks");
  CHECK(load_le16(&plain[10]) == kEksFlagHiddenNorm);
}

TEST_CASE("convert: the sources of one shard must state the same facts") {
  test::TempDir dir("convert-mixed");
  const auto refused = [&](const std::string& src) {
    return error_of<UsageError>([&] { convert_records(src, dir / "out.eks", {}); });
  };
  // Two caches over draft vocabularies that differ in one place (ids 0 and 1 swapped).
  fs::create_directories(dir / "a");
  edited_cache(dir / "a/other", "lossless", [](nlohmann::json& m) {
    std::swap(m["selected_token_ids"][0], m["selected_token_ids"][1]);
  });
  fs::copy(nemo("lossless"), dir / "a/same");
  const std::int64_t id0 = open_reader(nemo("lossless/manifest.json"))->facts().target_vocabulary->selected[0];
  const std::int64_t id1 = open_reader(nemo("lossless/manifest.json"))->facts().target_vocabulary->selected[1];
  CHECK(refused(dir / "a") == dir / "a/other/manifest.json" + " and " + dir / "a/same/manifest.json" +
                                  " would go into one shard (" + dir / "out.eks" +
                                  ") but state different file facts: target vocabularies whose draft id 0 is target id " +
                                  std::to_string(id1) + " against " + std::to_string(id0) +
                                  "; a shard states one set for all its records, so convert them to two shards");
  // The same samples, stored whole and as the top 4.
  fs::create_directories(dir / "b");
  fs::copy(nemo("lossless"), dir / "b/full");
  fs::copy(nemo("topk"), dir / "b/top");
  CHECK(refused(dir / "b").find("state different file facts: a target vocabulary of 16 draft tokens of 32 (full "
                                "distribution) against a target vocabulary of 16 draft tokens of 32 (top 4 kept)") !=
        std::string::npos);
  // DeepSpec's cache (aux layer ids stated) beside records that state none.
  fs::create_directories(dir / "c/records");
  convert_records(deepspec() + "#1", dir / "c/records/one.pt", {});
  fs::copy(fs::path(deepspec()).parent_path(), dir / "c/ds");
  CHECK(refused(dir / "c").find("state different file facts: aux layer ids [2, 3, 4] against none stated") !=
        std::string::npos);
  CHECK_FALSE(fs::exists(dir / "out.eks"));
  // Caches that agree go into one shard, stating their facts once.
  fs::remove_all(dir / "a/other");
  fs::copy(nemo("lossless"), dir / "a/again");
  const ConvertResult r = convert_records(dir / "a", dir / "out.eks", {});
  CHECK(r.records == 10);
  CHECK(open_reader(dir / "out.eks")->facts().target_vocabulary ==
        open_reader(nemo("lossless/manifest.json"))->facts().target_vocabulary);
}
