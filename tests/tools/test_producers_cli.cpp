// Dumps as other producers write them, made here with Python (torch.save, and the
// safetensors byte layout by hand), then indexed and trained on as a user would: SpecForge
// (rows_A-B/data_{i}.ckpt, named by row, padded to the batch's longest sample with
// loss_mask 0), TensorRT-LLM (dp_{rank}_{iter}.pt: a list of one dict that keeps the
// conversation id under "id") and vLLM/speculators (hs_{i}.safetensors, named by row).
// docs/data.md, matching.
#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "formats/format.h"
#include "formats/record.h"
#include "formats/safetensors_format.h"
#include "tests/support.h"

using namespace eaglekit;
namespace fs = std::filesystem;

namespace {

constexpr int kConversations = 12;


struct Dumps {
  test::TempDir dir{"producers"};
  std::string conversations = dir / "conversations.jsonl";
  std::string base = dir / "base";
};

std::unique_ptr<Dumps> make_dumps() {
  test::require_python("torch");
  auto d = std::make_unique<Dumps>();
  const auto py = test::run("/usr/bin/env " + test::quote(test::python_bin()) + " " +
                            test::quote(test::source_dir() + "/tests/tools/make_producer_dumps.py") + " " +
                            test::quote(d->dir.path()));
  REQUIRE_MESSAGE(py.exit_code == 0, py.err);
  // A base of the same widths (synth writes one; its records are not used).
  const auto r = test::eaglekit("synth --out " + test::quote(d->dir / "unused") +
                                " --conversations 2 --hidden 32 --vocab 48 --base-out " + test::quote(d->base));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  for (const char* p : {"specforge", "trtllm", "speculators"}) {
    const auto ix = test::eaglekit("index " + test::quote(d->dir / p) + " --out " +
                                   test::quote(d->dir / (std::string(p) + ".eki")));
    REQUIRE_MESSAGE(ix.exit_code == 0, ix.err);
  }
  return d;
}

// The conversation ids of the batches collate wrote, in order.
std::string joined(const std::vector<std::string>& ids) {
  std::string s;
  for (const auto& id : ids) s += (s.empty() ? "" : ",") + id;
  return s;
}

std::vector<std::string> collated_ids(const std::string& dir) {
  std::vector<std::string> ids;
  std::ifstream f(dir + "/batches.jsonl");
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty()) continue;
    const auto batch = nlohmann::json::parse(line);  // alive for the loop (not a temporary's member)
    for (const auto& id : batch["conversation_ids"]) ids.push_back(id.get<std::string>());
  }
  return ids;
}

// How many elements of two float32 [T, W] views (any row stride) differ in their bits; -1
// when shapes or dtypes differ.
std::int64_t differing(const HostTensor& a, const HostTensor& b) {
  if (a.shape != b.shape || a.dtype != DType::kFloat32 || b.dtype != DType::kFloat32 || a.dim() != 2) return -1;
  std::int64_t n = 0;
  for (std::int64_t t = 0; t < a.shape[0]; ++t)
    for (std::int64_t c = 0; c < a.shape[1]; ++c)
      n += std::memcmp(a.data + 4 * (t * a.strides[0] + c * a.strides[1]),
                       b.data + 4 * (t * b.strides[0] + c * b.strides[1]), 4) != 0;
  return n;
}

}  // namespace

TEST_CASE("producers: SpecForge, TensorRT-LLM and speculators dumps are matched, ordered and trained on") {
  auto d = make_dumps();
  // The dumps hold random states, not of this base: their norm form cannot be measured, so it is named.
  const std::string train_flags = " --base " + test::quote(d->base) +
                                  " --max-steps 2 --batch-size 4 --max-length 32 --jobs 2 --threads 2 --eval-every -1"
                                  " --hidden-states-norm post";
  std::vector<std::string> reference;  // conv-0 .. conv-11 in --data order
  for (int i = 0; i < kConversations; ++i) reference.push_back("conv-" + std::to_string(i));

  SUBCASE("SpecForge: row-named records match conversations by row, said on stderr; train two steps") {
    const std::string index = d->dir / "specforge.eki";
    auto r = test::eaglekit("collate --data " + test::quote(d->conversations) + " --index " + test::quote(index) +
                            " --split all --batch-size 3 --max-length 32 --out " + test::quote(d->dir / "c1"));
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    CHECK(r.err.find("matched a record by row") != std::string::npos);
    CHECK(joined(collated_ids(d->dir / "c1")) == joined(reference));
    r = test::eaglekit("train --data " + test::quote(d->conversations) + " --index " + test::quote(index) +
                       " --out " + test::quote(d->dir / "run-sf") + train_flags + " --json");
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    CHECK(nlohmann::json::parse(r.out)["steps"] == 2);
    CHECK(fs::exists(d->dir / "run-sf/final/model.safetensors"));
    // train takes --match-by too: by id, nothing matches.
    r = test::eaglekit("train --data " + test::quote(d->conversations) + " --index " + test::quote(index) +
                       " --match-by id --out " + test::quote(d->dir / "run-id") + train_flags);
    CHECK(r.exit_code == 1);
    CHECK(r.err.find("--match-by row") != std::string::npos);
    // Asked to match by id, it refuses and says what to pass.
    r = test::eaglekit("collate --data " + test::quote(d->conversations) + " --index " + test::quote(index) +
                       " --match-by id --split all --out " + test::quote(d->dir / "c2"));
    CHECK(r.exit_code == 1);
    CHECK(r.err.find("--match-by row") != std::string::npos);
  }
  SUBCASE("SpecForge without --data: every record, in row order (data_2 before data_10)") {
    const std::string index = d->dir / "specforge.eki";
    auto r = test::eaglekit("collate --index " + test::quote(index) + " --split all --batch-size 5 --max-length 32"
                            " --out " + test::quote(d->dir / "c3"));
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    CHECK(r.err.find("no --data: every usable record, in row order") != std::string::npos);
    std::vector<std::string> rows;
    for (int i = 0; i < kConversations; ++i) rows.push_back("data_" + std::to_string(i));
    CHECK(joined(collated_ids(d->dir / "c3")) == joined(rows));
    r = test::eaglekit("train --index " + test::quote(index) + " --out " + test::quote(d->dir / "run-sf2") + train_flags);
    CHECK_MESSAGE(r.exit_code == 0, r.err);
  }
  SUBCASE("SpecForge padding: stats and validate (by row, and without --data) count what the dumper padded") {
    const std::string index = d->dir / "specforge.eki";
    const auto want = nlohmann::json::parse(test::read_bytes(d->dir / "expected_padding.json"));
    std::int64_t want_tokens = 0;
    for (const auto& [id, n] : want.items()) want_tokens += n.get<std::int64_t>();
    REQUIRE(want.size() > 0);
    REQUIRE(want.size() < kConversations);  // the longer record of each pair has none
    // `record_of` maps an id the report names to its record's file stem (data_N).
    auto check_padding = [&](const nlohmann::json& p, const std::function<std::string(const std::string&)>& record_of) {
      CHECK(p["scanned"] == kConversations);
      CHECK(p["padded_records"] == want.size());
      CHECK(p["padding_tokens"] == want_tokens);
      for (const auto& rec : p["records"]) {
        CAPTURE(rec.dump());
        const std::string stem = record_of(rec["id"].get<std::string>());
        CHECK(want.contains(stem));
        if (want.contains(stem)) CHECK(rec["padding"] == want[stem]);
      }
    };
    const auto same = [](const std::string& id) { return id; };
    auto r = test::eaglekit("stats --index " + test::quote(index) + " --json");
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    check_padding(nlohmann::json::parse(r.out)["padding"], same);
    r = test::eaglekit("stats --index " + test::quote(index));
    CHECK(r.out.find("padded: " + std::to_string(want.size()) + " of 12 records read end in padding") != std::string::npos);
    r = test::eaglekit("stats --index " + test::quote(index) + " --skip-padding --json");
    CHECK(nlohmann::json::parse(r.out)["padding"].is_null());

    // Without --data: every record of the index, named by its own id.
    r = test::eaglekit("validate --index " + test::quote(index) + " --json");
    REQUIRE_MESSAGE(r.exit_code == 0, r.err << r.out);
    auto j = nlohmann::json::parse(r.out);
    CHECK(j["matched_by"] == "index");
    CHECK(j["matched"] == kConversations);
    CHECK(j["missing"].empty());
    CHECK(j["orphans"].empty());
    check_padding(j["padding"], same);
    r = test::eaglekit("validate --index " + test::quote(index));
    CHECK(r.out.find("no --data: every usable record of the index") != std::string::npos);
    CHECK(r.out.find("padded: ") != std::string::npos);

    // With --data, by row (auto-detected): nothing missing, no orphans (by id all 12 would be
    // both), and the padded records named by their conversations.
    r = test::eaglekit("validate --data " + test::quote(d->conversations) + " --index " + test::quote(index) + " --json");
    REQUIRE_MESSAGE(r.exit_code == 0, r.err << r.out);
    j = nlohmann::json::parse(r.out);
    CHECK(j["matched_by"] == "row");
    CHECK(j["matched"] == kConversations);
    CHECK(j["missing"].empty());
    CHECK(j["orphans"].empty());
    check_padding(j["padding"], [](const std::string& id) { return "data_" + id.substr(id.find('-') + 1); });  // conv-3: row 3
    // Must fail: forced to match by id, nothing matches and every record is an orphan.
    r = test::eaglekit("validate --data " + test::quote(d->conversations) + " --index " + test::quote(index) +
                       " --match-by id --json");
    CHECK(r.exit_code == 1);
    j = nlohmann::json::parse(r.out);
    CHECK(j["matched"] == 0);
    CHECK(j["orphans"].size() == kConversations);
    CHECK(j["missing"].size() == kConversations);
  }
  SUBCASE("TensorRT-LLM: the id kept inside the record matches, whatever the file names") {
    const std::string index = d->dir / "trtllm.eki";
    auto r = test::eaglekit("collate --data " + test::quote(d->conversations) + " --index " + test::quote(index) +
                            " --split all --max-length 32 --out " + test::quote(d->dir / "c4"));
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    CHECK(r.err.find("12 of 12 conversations matched a record;") != std::string::npos);
    CHECK(joined(collated_ids(d->dir / "c4")) == joined(reference));
    r = test::eaglekit("train --data " + test::quote(d->conversations) + " --index " + test::quote(index) +
                       " --out " + test::quote(d->dir / "run-trt") + train_flags);
    CHECK_MESSAGE(r.exit_code == 0, r.err);
    r = test::eaglekit("validate --data " + test::quote(d->conversations) + " --index " + test::quote(index) + " --json");
    CHECK_MESSAGE(r.exit_code == 0, r.out);
    const auto j = nlohmann::json::parse(r.out);
    CHECK(j["matched_by"] == "id");
    CHECK(j["matched"] == kConversations);
  }
  SUBCASE("speculators: hs_{i} by row, asked for explicitly; the same batches as TensorRT-LLM's") {
    auto r = test::eaglekit("collate --data " + test::quote(d->conversations) + " --index " +
                            test::quote(d->dir / "speculators.eki") +
                            " --match-by row --split all --batch-size 12 --max-length 32 --out " +
                            test::quote(d->dir / "c5"));
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    CHECK(joined(collated_ids(d->dir / "c5")) == joined(reference));
    r = test::eaglekit("collate --data " + test::quote(d->conversations) + " --index " +
                       test::quote(d->dir / "trtllm.eki") + " --split all --batch-size 12 --max-length 32 --out " +
                       test::quote(d->dir / "c6"));
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    // Same values in both layouts (float32 both): the batch files are equal tensor by tensor.
    const auto py = test::python(R"PY(
import sys, torch
a = torch.load(sys.argv[1]); b = torch.load(sys.argv[2])
# The speculators layout implies pre-norm states (its row's norm fact): only its batches say
# each token's form, 1 on every token.
flags = "hidden_states_prenorm"
for x in (a, b):
    if flags in x:
        assert bool((x[flags][x["attention_mask"] == 1] == 1).all()), x[flags]
        del x[flags]
assert a.keys() == b.keys(), (a.keys(), b.keys())
for k in a:
    if k == "loss_mask":
        continue  # speculators dumps carry no loss mask: all ones there
    assert torch.equal(a[k], b[k]), k
print("ok")
)PY",
                                 {d->dir / "c5/batch_00000.pt", d->dir / "c6/batch_00000.pt"});
    CHECK_MESSAGE(py.exit_code == 0, py.err);
    // Validated (by row, as asked) and trained two steps like the others.
    r = test::eaglekit("validate --data " + test::quote(d->conversations) + " --index " +
                       test::quote(d->dir / "speculators.eki") + " --match-by row --json");
    CHECK_MESSAGE(r.exit_code == 0, r.out);
    const auto j = nlohmann::json::parse(r.out);
    CHECK(j["matched_by"] == "row");
    CHECK(j["matched"] == kConversations);
    CHECK(j["padding"]["scanned"] == 0);  // no loss mask in these records: nothing to tell padding by
    r = test::eaglekit("train --data " + test::quote(d->conversations) + " --index " +
                       test::quote(d->dir / "speculators.eki") + " --match-by row --out " +
                       test::quote(d->dir / "run-spec") + train_flags + " --json");
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    CHECK(nlohmann::json::parse(r.out)["steps"] == 2);
  }
}

// speculators' FP8 records as its connector writes them (tests/data/speculators_fp8/, made by
// the producers' own code: make_fixture.py), through every command a user runs on a dump.
TEST_CASE("producers cli: speculators' FP8 records index, validate, stats, inspect, convert and train") {
  test::TempDir dir("producers-fp8");
  const std::string fx = test::source_dir() + "/tests/data/speculators_fp8";
  const std::string index = dir / "fp8.eki";
  // A base of the fixture's widths (H 8, vocabulary 32; its records are not used).
  auto r = test::eaglekit("synth --out " + test::quote(dir / "unused") + " --conversations 2 --hidden 8 --vocab 32"
                          " --base-out " + test::quote(dir / "base"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  r = test::eaglekit("index " + test::quote(fx + "/dump") + " --out " + test::quote(index));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  r = test::eaglekit("index --show " + test::quote(index) + " --json");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  {
    const auto j = nlohmann::json::parse(r.out);
    REQUIRE(j["entries"].size() == 2);
    for (const auto& e : j["entries"]) {
      CHECK(e["codec"] == "fp8");
      CHECK(e["hidden_dtype"] == "float32");
      CHECK(e["hidden_size"] == 8);
      CHECK(e["aux_width"] == 16);
      CHECK(e["layout_prenorm"] == true);
      CHECK(e["hidden_states_prenorm"].is_null());
    }
  }
  const std::string data = " --data " + test::quote(fx + "/conversations.jsonl") + " --index " + test::quote(index);
  r = test::eaglekit("validate" + data + " --deep");
  CHECK_MESSAGE(r.exit_code == 0, std::string(r.out + r.err));
  // The connector writes no loss mask: said once, with the share of tokens trained.
  const std::string no_mask = "no loss mask found: none of the 2 records stores one, so every token is trained: 8 of "
                              "the 10 tokens read (80.0%, all but each record's first)";
  CHECK_MESSAGE(r.out.find(no_mask) != std::string::npos, r.out);
  r = test::eaglekit("stats --index " + test::quote(index) + " --json");
  CHECK_MESSAGE(r.exit_code == 0, r.err);
  r = test::eaglekit("inspect " + test::quote(fx + "/dump/hs_0.safetensors"));
  CHECK_MESSAGE(r.exit_code == 0, r.err);
  CHECK(r.out.find("norm form:       pre-norm (not stated; implied by its layout)") != std::string::npos);
  // convert: to .eks and .pt, values as the producer's reader gives them, the form stated.
  for (const char* ext : {".eks", ".pt"}) {
    CAPTURE(ext);
    const std::string out = dir / (std::string("hs_0") + ext);
    r = test::eaglekit("convert " + test::quote(fx + "/dump/hs_0.safetensors") + " " + test::quote(out));
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    const Record got = open_reader(out)->read(0);
    const Record want = open_reader(fx + "/expected/hs_0.safetensors")->read(0);
    CHECK(got.hidden_states_prenorm == std::optional<bool>(true));
    REQUIRE(got.tokens() == want.tokens());
    CHECK(differing(got.hidden_states, want.hidden_states) == 0);
    CHECK(differing(got.aux_hidden_states, want.aux_hidden_states) == 0);
  }
  // train: matched by row, pre-norm by the layout, no mask said once.
  r = test::eaglekit("train" + data + " --base " + test::quote(dir / "base") + " --out " + test::quote(dir / "run") +
                     " --aux-layer-ids 1,2 --max-steps 2 --batch-size 2 --max-length 16 --eval-fraction 0"
                     " --eval-every -1 --jobs 2 --threads 2 --json");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(nlohmann::json::parse(r.out)["steps"] == 2);
  CHECK(r.err.find("0 pre-norm, 0 post-norm, 2 not stated, of which 2 pre-norm and 0 post-norm by their layout") !=
        std::string::npos);
  const auto first = r.err.find(no_mask);
  CHECK_MESSAGE(first != std::string::npos, r.err);
  CHECK(r.err.find(no_mask, first + 1) == std::string::npos);  // once
}

// DeepSpec's target cache v2 (tests/data/deepspec_v2/, written by DeepSpec's own writer:
// make_fixture.py), through every command a user runs on a dump: the folder is indexed by its
// manifest.json, its loss mask is used, its last states are post-norm by the row's fact.
TEST_CASE("producers cli: a DeepSpec target cache indexes, validates, converts and trains") {
  test::TempDir dir("producers-deepspec");
  const std::string fx = test::source_dir() + "/tests/data/deepspec_v2";
  const std::string index = dir / "ds.eki";
  auto r = test::eaglekit("synth --out " + test::quote(dir / "unused") + " --conversations 2 --hidden 8 --vocab 32"
                          " --base-out " + test::quote(dir / "base"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  r = test::eaglekit("index " + test::quote(fx + "/cache") + " --out " + test::quote(index) + " --json");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(nlohmann::json::parse(r.out)["files"] == 1);  // manifest.json; samples.idx and shards are not records
  r = test::eaglekit("index --show " + test::quote(index) + " --json");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  {
    const auto j = nlohmann::json::parse(r.out);
    REQUIRE(j["entries"].size() == 4);
    const int tokens[] = {5, 3, 7, 2};
    for (int i = 0; i < 4; ++i) {
      const auto& e = j["entries"][static_cast<std::size_t>(i)];
      CHECK(e["format"] == "deepspec");
      CHECK(e["conversation_id"] == std::to_string(i));
      CHECK(e["tokens"] == tokens[i]);
      CHECK(e["aux_width"] == 24);
      CHECK(e["layout_prenorm"] == false);
      CHECK(e["has_loss_mask"] == true);
    }
  }
  const std::string data = " --data " + test::quote(fx + "/conversations.jsonl") + " --index " + test::quote(index);
  r = test::eaglekit("validate" + data + " --deep");
  CHECK_MESSAGE(r.exit_code == 0, std::string(r.out + r.err));
  r = test::eaglekit("stats --index " + test::quote(index) + " --json");
  CHECK_MESSAGE(r.exit_code == 0, r.err);
  {
    // 17 tokens of 6 + 2*4*8 bytes in the shards, 56 a sample in samples.idx, the manifest.
    const auto j = nlohmann::json::parse(r.out);
    CHECK(j["total_tokens"] == 17);
    CHECK(j["bytes_on_disk"] == 17 * 70 + 4 * 56 + fs::file_size(fx + "/cache/manifest.json"));
  }
  r = test::eaglekit("inspect " + test::quote(fx + "/cache/manifest.json#2"));
  CHECK_MESSAGE(r.exit_code == 0, r.err);
  CHECK(r.out.find("format:          deepspec") != std::string::npos);
  CHECK(r.out.find("norm form:       post-norm (not stated; implied by its layout)") != std::string::npos);
  // convert: the whole cache to one .eks shard; a sample to .pt. Every value as stored.
  r = test::eaglekit("convert " + test::quote(fx + "/cache/manifest.json") + " " + test::quote(dir / "ds.eks"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(r.out.find("facts: aux layer ids [2, 3, 4] kept") != std::string::npos);
  r = test::eaglekit("convert " + test::quote(fx + "/cache/manifest.json#1") + " " + test::quote(dir / "s1.pt"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  // .pt has no field for the aux layer ids the cache states (target_layer_ids + 1): said, not kept.
  CHECK_MESSAGE(r.out.find("note: the .pt format has no field for the aux layer ids [2, 3, 4] " + fx +
                           "/cache/manifest.json states; pass --aux-layer-ids 2,3,4 when training") != std::string::npos,
                r.out);
  // One shard whose samples fall in both splits is one file stating the layers, not two.
  r = test::eaglekit("index " + test::quote(dir / "ds.eks") + " --out " + test::quote(dir / "eks.eki"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  r = test::eaglekit("train --data " + test::quote(fx + "/conversations.jsonl") + " --index " +
                     test::quote(dir / "eks.eki") + " --base " + test::quote(dir / "base") + " --out " +
                     test::quote(dir / "eksrun") + " --max-steps 2 --batch-size 2 --max-length 16 --eval-fraction 0.5"
                     " --dry-run --json");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  {
    const auto j = nlohmann::json::parse(r.out);
    REQUIRE(j["train_samples"] > 0);
    REQUIRE(j["eval_samples"] > 0);
    CHECK(j["aux_layer_ids_source"] == "the data: the .eks shard " + dir / "ds.eks");
  }
  const auto src = open_reader(fx + "/cache/manifest.json");
  const auto eks = open_reader(dir / "ds.eks");
  REQUIRE(eks->size() == 4);
  CHECK(eks->facts().aux_layer_ids == std::vector<std::int64_t>{2, 3, 4});
  CHECK(eks->facts().aux_layer_ids == src->facts().aux_layer_ids);
  for (std::size_t i = 0; i < 4; ++i) {
    CAPTURE(i);
    const Record want = src->read(i);
    const Record got = i == 1 ? open_reader(dir / "s1.pt")->read(0) : eks->read(*eks->find(std::to_string(i)));
    CHECK(got.conversation_id == std::to_string(i));
    CHECK(got.hidden_states_prenorm == std::optional<bool>(false));
    REQUIRE(got.tokens() == want.tokens());
    CHECK(got.hidden_states.equal(want.hidden_states));  // bf16 as stored, every bit
    CHECK(got.aux_hidden_states.equal(want.aux_hidden_states));
    REQUIRE(got.loss_mask.has_value());
    for (std::int64_t t = 0; t < want.tokens(); ++t) {
      CHECK(got.input_ids.get(t) == want.input_ids.get(t));
      CHECK(got.loss_mask->get(t) == want.loss_mask->get(t));
    }
  }
  // pack keeps the facts too: one set of facts a shard, so a folder of the cache and a .pt
  // that states none packs into two shards, the cache's stating its aux layer ids.
  fs::create_directories(dir / "mixed");
  fs::copy(fx + "/cache", dir / "mixed/cache", fs::copy_options::recursive);
  fs::copy_file(dir / "s1.pt", dir / "mixed/s1.pt");
  r = test::eaglekit("pack " + test::quote(dir / "mixed") + " --out " + test::quote(dir / "packed") + " --json");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(nlohmann::json::parse(r.out)["shards_written"] == 2);
  {
    const auto cache_shard = open_reader(dir / "packed/shard-000000.eks");
    CHECK(cache_shard->size() == 4);
    CHECK(cache_shard->facts().aux_layer_ids == std::vector<std::int64_t>{2, 3, 4});
    const auto pt_shard = open_reader(dir / "packed/shard-000001.eks");
    CHECK(pt_shard->size() == 1);
    CHECK(pt_shard->facts().empty());
  }
  // The aux layers are the manifest's target_layer_ids 1,2,3, HF hidden_states 2,3,4: another
  // --aux-layer-ids is refused, and without it the draft takes the data's.
  const std::string train = "train" + data + " --base " + test::quote(dir / "base") + " --out " +
                            test::quote(dir / "run") + " --max-steps 2 --batch-size 2 --max-length 16 "
                            "--eval-fraction 0 --eval-every -1 --jobs 2 --threads 2";
  r = test::eaglekit(train + " --aux-layer-ids 1,2,3 --dry-run");
  CHECK(r.exit_code == 2);
  CHECK_MESSAGE(r.err.find("--aux-layer-ids 1,2,3 differs from the layers the data holds, 2,3,4, as the DeepSpec "
                           "manifest.json") != std::string::npos, r.err);
  r = test::eaglekit(train + " --dry-run --json");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  {
    const auto j = nlohmann::json::parse(r.out);
    CHECK(j["aux_layer_ids"] == std::vector<int>{2, 3, 4});
    CHECK_MESSAGE(j["aux_layer_ids_source"].get<std::string>().find("the data: the DeepSpec manifest.json") == 0,
                  j.dump());
  }
  // train: matched by id, post-norm by the row's fact, the stored loss mask used, the aux
  // layers the export names the data's.
  r = test::eaglekit(train + " --json");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(nlohmann::json::parse(r.out)["steps"] == 2);
  {
    std::ifstream f(dir / "run/final/config.json");
    const auto c = nlohmann::json::parse(f);
    CHECK(c["eagle_aux_hidden_state_layer_ids"] == std::vector<int>{2, 3, 4});
  }
  CHECK(r.err.find("0 pre-norm, 0 post-norm, 4 not stated, of which 0 pre-norm and 4 post-norm by their layout") !=
        std::string::npos);
  CHECK(r.err.find("no loss mask found") == std::string::npos);
  CHECK((r.out + r.err).find("no aux layers; the run takes") == std::string::npos);

  // A cache of the embeddings (DeepSpec's target layer -1, HF index 0) is refused by name:
  // the engines' drafts read decoder layers' outputs.
  fs::copy(fx + "/cache", dir / "embeddings", fs::copy_options::recursive);
  {
    std::ifstream in(dir / "embeddings/manifest.json");
    auto m = nlohmann::json::parse(in);
    m["target_layer_ids"] = std::vector<int>{-1, 1, 2};
    std::ofstream(dir / "embeddings/manifest.json") << m.dump(2);
  }
  r = test::eaglekit("index " + test::quote(dir / "embeddings") + " --out " + test::quote(dir / "emb.eki"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  r = test::eaglekit("train --data " + test::quote(fx + "/conversations.jsonl") + " --index " +
                     test::quote(dir / "emb.eki") + " --base " + test::quote(dir / "base") + " --out " +
                     test::quote(dir / "embrun") + " --max-steps 1 --batch-size 2 --max-length 16 --eval-fraction 0 "
                     "--eval-every -1 --dry-run");
  CHECK(r.exit_code == 2);
  CHECK_MESSAGE(r.err.find("holds the base's embeddings (HF hidden_states index 0) among its aux layers 0,2,3") !=
                    std::string::npos,
                r.err);

  // The cache beside records that state no layers (synth's .pt): the run takes the cache's
  // layers for them too, and says so once.
  fs::create_directories(dir / "mix");
  fs::copy(fx + "/cache", dir / "mix/cache", fs::copy_options::recursive);
  fs::copy(dir / "unused/records", dir / "mix/pt", fs::copy_options::recursive);
  {
    std::ofstream both(dir / "mix.jsonl");
    for (const std::string& f : {fx + "/conversations.jsonl", std::string(dir / "unused/conversations.jsonl")})
      both << std::ifstream(f).rdbuf();
  }
  r = test::eaglekit("index " + test::quote(dir / "mix") + " --out " + test::quote(dir / "mix.eki"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  r = test::eaglekit("train --data " + test::quote(dir / "mix.jsonl") + " --index " + test::quote(dir / "mix.eki") +
                     " --base " + test::quote(dir / "base") + " --out " + test::quote(dir / "mixrun") +
                     " --max-steps 1 --batch-size 2 --max-length 16 --eval-fraction 0 --eval-every -1 --dry-run");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK_MESSAGE(r.out.find("note: 2 record files (" + dir / "mix/pt/") != std::string::npos, r.out);
  CHECK_MESSAGE(r.out.find(") state no aux layers; the run takes theirs to be 2,3,4, as the DeepSpec manifest.json " +
                           dir / "mix/cache/manifest.json") != std::string::npos,
                r.out);
}

// speculators keeps the loss mask in its prepared dataset folder, not in hs_{i}
// (tests/data/speculators_masks/, written by speculators 0.9's own preprocessing):
// convert --loss-masks joins it by row, and the converted records then train on it.
TEST_CASE("producers cli: convert --loss-masks joins speculators' prepared-dataset masks by row") {
  test::TempDir dir("producers-masks");
  const std::string fx = test::source_dir() + "/tests/data/speculators_masks";
  const std::string masks = fx + "/loss_masks.safetensors";
  auto r = test::eaglekit("synth --out " + test::quote(dir / "unused") + " --conversations 2 --hidden 8 --vocab 32"
                          " --base-out " + test::quote(dir / "base"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const std::string dump = fx + "/prepared/hidden_states";
  const std::string conversations = test::source_dir() + "/tests/data/speculators_fp8/conversations.jsonl";
  const std::string flags = " --base " + test::quote(dir / "base") + " --aux-layer-ids 1,2 --batch-size 2"
                            " --max-length 16 --eval-fraction 0 --eval-every -1 --dry-run";
  // The dump alone: no mask anywhere, said by validate and the plan.
  r = test::eaglekit("index " + test::quote(dump) + " --out " + test::quote(dir / "dump.eki"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const std::string dump_data = " --data " + test::quote(conversations) + " --index " + test::quote(dir / "dump.eki");
  r = test::eaglekit("validate" + dump_data);
  CHECK_MESSAGE(r.out.find("no loss mask found") != std::string::npos, r.out);
  r = test::eaglekit("train" + dump_data + flags + " --out " + test::quote(dir / "run0"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK_MESSAGE((r.out + r.err).find("no loss mask found") != std::string::npos, std::string(r.out + r.err));

  // Joined: each hs_{i} takes row i's mask, as speculators' ArrowDataset pairs them.
  r = test::eaglekit("convert " + test::quote(dump) + " " + test::quote(dir / "masked.eks") + " --loss-masks " +
                     test::quote(masks) + " --json");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(nlohmann::json::parse(r.out)["loss_masks_joined"] == 2);
  r = test::eaglekit("convert " + test::quote(dump) + " " + test::quote(dir / "masked2.eks") + " --loss-masks " +
                     test::quote(masks));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK_MESSAGE(r.out.find("loss masks: 2 records took their mask from " + masks) != std::string::npos, r.out);
  const auto eks = open_reader(dir / "masked.eks");
  REQUIRE(eks->size() == 2);
  for (std::size_t k = 0; k < 2; ++k) {
    const Record got = eks->read(k);
    CAPTURE(got.conversation_id);
    // The mask speculators' ArrowDataset gives with this hs_{i} (make_fixture.py).
    const auto want = SafetensorsFile::open(fx + "/expected/" + got.conversation_id + ".safetensors");
    REQUIRE(got.loss_mask.has_value());
    CHECK(got.loss_mask->equal(*want->get("loss_mask")));
  }
  r = test::eaglekit("index " + test::quote(dir / "masked.eks") + " --out " + test::quote(dir / "masked.eki"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const std::string data = " --data " + test::quote(conversations) + " --index " + test::quote(dir / "masked.eki");
  r = test::eaglekit("validate" + data);
  CHECK_MESSAGE(r.exit_code == 0, std::string(r.out + r.err));
  CHECK_MESSAGE(r.out.find("no loss mask found") == std::string::npos, r.out);
  r = test::eaglekit("train" + data + flags + " --out " + test::quote(dir / "run1"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK_MESSAGE((r.out + r.err).find("no loss mask found") == std::string::npos, std::string(r.out + r.err));

  // A dump that is not the dataset's: refused, naming the row and the file; nothing written.
  fs::create_directories(dir / "shifted");
  fs::copy_file(dump + "/hs_0.safetensors", dir / "shifted/hs_1.safetensors");
  r = test::eaglekit("convert " + test::quote(dir / "shifted") + " " + test::quote(dir / "shifted.eks") +
                     " --loss-masks " + test::quote(masks));
  CHECK(r.exit_code == 1);
  CHECK_MESSAGE(r.err.find(masks + ": row 1 at byte ") != std::string::npos, r.err);
  CHECK_MESSAGE(r.err.find("holds 4 tokens, but " + (dir / "shifted/hs_1.safetensors") + " holds 6") != std::string::npos,
                r.err);
  CHECK_FALSE(fs::exists(dir / "shifted.eks"));
  // A file name that names no row: bad usage.
  fs::create_directories(dir / "renamed");
  fs::copy_file(dump + "/hs_0.safetensors", dir / "renamed/x.safetensors");
  r = test::eaglekit("convert " + test::quote(dir / "renamed") + " " + test::quote(dir / "renamed.eks") +
                     " --loss-masks " + test::quote(masks));
  CHECK(r.exit_code == 2);
  CHECK_MESSAGE(r.err.find((dir / "renamed/x.safetensors") + ": --loss-masks pairs a record with its dataset row") !=
                    std::string::npos, r.err);
}

// The same dump trained straight from the producer's files: `index --loss-masks` joins the
// masks without converting, and validate, stats, inspect and the plan say where they come
// from; a loss-mask file changed after indexing stops validate and train, naming both files.
TEST_CASE("producers cli: index --loss-masks trains speculators' dump on its prepared-dataset masks, unconverted") {
  test::TempDir dir("producers-index-masks");
  const std::string fx = test::source_dir() + "/tests/data/speculators_masks";
  const std::string masks = dir / "loss_masks.safetensors";
  fs::copy_file(fx + "/loss_masks.safetensors", masks);
  auto r = test::eaglekit("synth --out " + test::quote(dir / "unused") + " --conversations 2 --hidden 8 --vocab 32"
                          " --base-out " + test::quote(dir / "base"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const std::string dump = fx + "/prepared/hidden_states";
  const std::string conversations = test::source_dir() + "/tests/data/speculators_fp8/conversations.jsonl";
  const std::string index = dir / "joined.eki";
  const std::string flags = " --base " + test::quote(dir / "base") + " --aux-layer-ids 1,2 --batch-size 2"
                            " --max-length 16 --eval-fraction 0 --eval-every -1 --dry-run";
  r = test::eaglekit("index " + test::quote(dump) + " --out " + test::quote(index) + " --loss-masks " +
                     test::quote(masks) + " --json");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(nlohmann::json::parse(r.out)["loss_masks"]["joined"] == 2);
  const std::string said = "loss masks: 2 of the 2 records take theirs from " + masks + ", joined by `eaglekit index --loss-masks`";
  const std::string data = " --data " + test::quote(conversations) + " --index " + test::quote(index);
  for (const char* deep : {"", " --deep"}) {
    r = test::eaglekit(std::string("validate") + data + deep);
    CHECK_MESSAGE(r.exit_code == 0, std::string(r.out + r.err));
    CHECK_MESSAGE(r.out.find(said) != std::string::npos, r.out);
    CHECK_MESSAGE(r.out.find("no loss mask found") == std::string::npos, r.out);
  }
  r = test::eaglekit("stats --index " + test::quote(index) + " --json");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(nlohmann::json::parse(r.out)["loss_masks"]["joined"] == 2);
  r = test::eaglekit("inspect " + test::quote(dump + "/hs_1.safetensors") + " --loss-masks " + test::quote(masks));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK_MESSAGE(r.out.find("loss mask:       row 1 of " + masks) != std::string::npos, r.out);
  r = test::eaglekit("train" + data + flags + " --out " + test::quote(dir / "run"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK_MESSAGE((r.out + r.err).find(said) != std::string::npos, std::string(r.out + r.err));
  CHECK_MESSAGE((r.out + r.err).find("no loss mask found") == std::string::npos, std::string(r.out + r.err));

  // One mask value changed after indexing.
  {
    auto bytes = test::read_bytes(masks);
    const auto f = SafetensorsFile::open(masks);
    bytes[f->data_start() + f->find("loss_mask")->begin + 3] ^= 1;
    test::write_bytes(masks, bytes);
  }
  const std::string refused = index + " joins the loss masks of " + masks + ", which holds other bytes than when indexed";
  r = test::eaglekit("validate" + data);
  CHECK(r.exit_code == 1);
  CHECK_MESSAGE(r.out.find(refused) != std::string::npos, r.out);
  CHECK_MESSAGE(r.out.find("--quarantine") == std::string::npos, r.out);  // no quarantine leaves it out
  r = test::eaglekit("train" + data + flags + " --out " + test::quote(dir / "run2"));
  CHECK(r.exit_code == 1);
  CHECK_MESSAGE(r.err.find("eaglekit train: error: " + refused) != std::string::npos, r.err);
}

// NeMo AutoModel's EAGLE-3 cache (tests/data/nemo_cache/, written by NeMo 0.7.0's own producer
// code: make_fixture.py): indexed by its manifest.json (its shards are not records of their own),
// counted, validated (--deep checks the stored distributions) and trained on; converted to .eks
// only, the one format that keeps its stored distributions and their draft vocabulary.
TEST_CASE("producers cli: a NeMo cache indexes, counts, validates --deep and trains on its stored distributions") {
  test::TempDir dir("producers-nemo");
  const std::string fx = test::source_dir() + "/tests/data/nemo_cache";
  const std::string index = dir / "nemo.eki";
  auto r = test::eaglekit("index " + test::quote(fx + "/topk") + " --out " + test::quote(index) + " --json");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(nlohmann::json::parse(r.out)["files"] == 1);
  CHECK(nlohmann::json::parse(r.out)["bad_records"] == 0);
  r = test::eaglekit("index --show " + test::quote(index) + " --json");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  {
    const auto j = nlohmann::json::parse(r.out);
    REQUIRE(j["entries"].size() == 5);
    const int tokens[] = {5, 8, 6, 7, 5};
    for (int i = 0; i < 5; ++i) {
      const auto& e = j["entries"][static_cast<std::size_t>(i)];
      CHECK(e["format"] == "nemo");
      CHECK(e["conversation_id"] == std::to_string(i));
      CHECK(e["tokens"] == tokens[i]);
      CHECK(e["aux_width"] == 24);
      CHECK(e["hidden_size"] == 8);
    }
  }
  r = test::eaglekit("stats --index " + test::quote(index) + " --json");
  CHECK_MESSAGE(r.exit_code == 0, r.err);
  CHECK(nlohmann::json::parse(r.out)["total_tokens"] == 31);
  // Raw bytes count the 16-wide stored distribution in H's place: an int64 id + (16 + 24) fp32.
  CHECK(nlohmann::json::parse(r.out)["target_probs_width"] == 16);
  CHECK(nlohmann::json::parse(r.out)["raw_bytes_per_token"] == doctest::Approx(8.0 + 40 * 4));
  const std::string data = " --data " + test::quote(fx + "/conversations.jsonl") + " --index " + test::quote(index);
  // --deep checks what a cache without hidden states holds: every stored distribution.
  r = test::eaglekit("validate" + data + " --deep");
  CHECK_MESSAGE(r.exit_code == 0, std::string(r.out + r.err));
  // convert: to .eks, keeping the facts; to .pt, refused saying to convert to .eks.
  r = test::eaglekit("convert " + test::quote(fx + "/topk/manifest.json") + " " + test::quote(dir / "n.eks"));
  CHECK_MESSAGE(r.exit_code == 0, r.err);
  CHECK(r.out.find("facts: aux layer ids [1, 2, 3] kept\nfacts: target vocabulary of 16 draft tokens of 32, top 4 kept") !=
        std::string::npos);
  r = test::eaglekit("convert " + test::quote(fx + "/topk/manifest.json") + " " + test::quote(dir / "n.pt"));
  CHECK(r.exit_code == 1);
  CHECK_MESSAGE(r.err.find("the .pt format has no field for the distribution or its vocabulary; convert to .eks") !=
                    std::string::npos,
                r.err);
  CHECK_FALSE(std::filesystem::exists(dir / "n.pt"));
  // pack gives its shards the cache's facts, so its records of stored distributions pack too.
  r = test::eaglekit("pack " + test::quote(fx + "/topk") + " --out " + test::quote(dir / "packed") + " --json");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(nlohmann::json::parse(r.out)["records"] == 5);
  {
    const auto cache = open_reader(fx + "/topk/manifest.json");
    const auto packed = open_reader(dir / "packed/shard-000000.eks");
    CHECK(packed->facts() == cache->facts());
    REQUIRE(packed->facts().target_vocabulary.has_value());
    REQUIRE(packed->size() == 5);
    for (std::size_t i = 0; i < 5; ++i) {
      const Record want = cache->read(i);
      const Record got = packed->read(*packed->find(want.conversation_id));
      REQUIRE(got.target_probs.has_value());
      CHECK(got.target_probs->equal(*want.target_probs));
      CHECK(got.aux_hidden_states.equal(want.aux_hidden_states));
    }
  }

  // A base of the cache's shape (H 8, V 32): synth's tiny base folder.
  r = test::eaglekit("synth --out " + test::quote(dir / "synth") + " --conversations 2 --hidden 8 --vocab 32 "
                     "--min-tokens 4 --max-tokens 6 --dtype fp32 --seed 3 --base-out " + test::quote(dir / "base"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const std::string train = "train" + data + " --base " + test::quote(dir / "base") +
                            " --max-length 8 --batch-size 2 --eval-every -1 --threads 1";
  r = test::eaglekit(train + " --max-steps 1 --out " + test::quote(dir / "run") + " --dry-run");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  // NeMo's aux_layer_ids 0,1,2 hook layers[i]: HF hidden_states 1,2,3, taken without being told.
  CHECK_MESSAGE(r.out.find("aux ids:     1,2,3 (the data: the NeMo cache manifest.json") != std::string::npos, r.out);
  CHECK_MESSAGE(r.out.find("targets: the cache's stored distribution over its 16 draft tokens") != std::string::npos,
                r.out);
  CHECK_MESSAGE(r.out.find("top 4 of them per position") != std::string::npos, r.out);
  CHECK_MESSAGE(r.out.find("the tail) is lost for good") != std::string::npos, r.out);
  CHECK_MESSAGE(r.out.find("draft vocab: 16 of 32") != std::string::npos, r.out);
  CHECK_MESSAGE(r.out.find("selected_token_ids of") != std::string::npos, r.out);
  // Losses that need the base's logits, DFlash, and another draft vocabulary: refused by name.
  r = test::eaglekit(train + " --max-steps 1 --out " + test::quote(dir / "run") + " --dry-run --loss rkl");
  CHECK(r.exit_code == 2);
  CHECK_MESSAGE(r.err.find("--loss rkl is computed from the base's logits") != std::string::npos, r.err);
  r = test::eaglekit(train + " --max-steps 1 --out " + test::quote(dir / "run") + " --dry-run --draft-vocab-size 8");
  CHECK(r.exit_code == 2);
  CHECK_MESSAGE(r.err.find("--draft-vocab-size 8 differs from the 16 draft tokens") != std::string::npos, r.err);
  r = test::eaglekit(train + " --max-steps 1 --out " + test::quote(dir / "run") +
                     " --dry-run --draft-arch dflash --mask-token-id 31");
  CHECK(r.exit_code == 2);
  CHECK_MESSAGE(r.err.find("DFlash") != std::string::npos, r.err);
  // Two real steps, exported; the draft's d2t is the cache's selected_token_ids - i.
  r = test::eaglekit(train + " --max-steps 2 --out " + test::quote(dir / "run"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK_MESSAGE(r.err.find("draft vocabulary: the 16 tokens of selected_token_ids") != std::string::npos, r.err);
  CHECK(std::filesystem::exists(dir / "run/final/config.json"));
  // A draft of other aux layers: evaluate refuses it on this data, and an --init-draft from it
  // trains on the data's layers and says so.
  std::filesystem::copy(dir / "run/final", dir / "other");
  {
    std::ifstream in(dir / "other/config.json");
    auto c = nlohmann::json::parse(in);
    REQUIRE(c["eagle_aux_hidden_state_layer_ids"] == std::vector<int>{1, 2, 3});
    c["eagle_aux_hidden_state_layer_ids"] = {4, 8, 12};
    std::ofstream(dir / "other/config.json") << c.dump(2);
  }
  const std::string evaluate = "evaluate" + data + " --base " + test::quote(dir / "base") +
                               " --max-length 8 --split all --threads 1 --draft ";
  r = test::eaglekit(evaluate + test::quote(dir / "other"));
  CHECK(r.exit_code == 2);
  CHECK_MESSAGE(r.err.find("reads aux layers 4,8,12 but the data holds 1,2,3") != std::string::npos, r.err);
  r = test::eaglekit(evaluate + test::quote(dir / "run/final"));
  CHECK_MESSAGE(r.exit_code == 0, r.err);
  r = test::eaglekit(train + " --max-steps 1 --out " + test::quote(dir / "run2") + " --dry-run --init-draft " +
                     test::quote(dir / "other"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK_MESSAGE(r.out.find("was trained on aux layers 4,8,12; the data holds 1,2,3") != std::string::npos, r.out);
  CHECK_MESSAGE(r.out.find("aux ids:     1,2,3 (the data: the NeMo cache manifest.json") != std::string::npos, r.out);

  // A stored distribution that does not sum to 1 fails validate --deep, named.
  const std::string cache = dir / "damaged";
  std::filesystem::copy(fx + "/topk", cache);
  {
    const auto shard = SafetensorsFile::open(cache + "/shard-000000.safetensors");
    const std::uint64_t at = shard->data_start() + shard->find("target_probs_values")->begin;
    std::fstream f(cache + "/shard-000000.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    const float two = 2.0f;
    f.seekp(static_cast<std::streamoff>(at));  // sample 0, position 0, the largest kept value
    f.write(reinterpret_cast<const char*>(&two), 4);
  }
  r = test::eaglekit("index " + test::quote(cache) + " --out " + test::quote(dir / "damaged.eki"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  r = test::eaglekit("validate --data " + test::quote(fx + "/conversations.jsonl") + " --index " +
                     test::quote(dir / "damaged.eki") + " --deep");
  CHECK(r.exit_code == 1);
  CHECK_MESSAGE((r.out + r.err).find("target_probs at token 0 sums to") != std::string::npos, std::string(r.out + r.err));
}

// The .eks conversion of a NeMo cache is what the cache is to every command: index, validate
// --deep, stats, inspect (which shows the facts) and train, whose losses and weights are the
// cache's, bit for bit.
TEST_CASE("producers cli: a NeMo cache converted to .eks indexes, validates, inspects and trains as the cache") {
  test::TempDir dir("producers-nemo-eks");
  const std::string fx = test::source_dir() + "/tests/data/nemo_cache";
  auto r = test::eaglekit("synth --out " + test::quote(dir / "synth") + " --conversations 2 --hidden 8 --vocab 32 "
                          "--min-tokens 4 --max-tokens 6 --dtype fp32 --seed 3 --base-out " + test::quote(dir / "base"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  for (const std::string name : {"lossless", "topk"}) {
    CAPTURE(name);
    const std::string eks = dir / (name + ".eks");
    r = test::eaglekit("convert " + test::quote(fx + "/" + name + "/manifest.json") + " " + test::quote(eks) + " --json");
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    {
      const auto j = nlohmann::json::parse(r.out);
      CHECK(j["records"] == 5);
      CHECK(j["facts"]["aux_layer_ids"] == nlohmann::json::array({1, 2, 3}));
      CHECK(j["facts"]["target_vocabulary"]["draft_vocab_size"] == 16);
      CHECK(j["facts"]["target_vocabulary"]["target_vocab_size"] == 32);
      CHECK(j["facts"]["target_vocabulary"]["topk"] == (name == "topk" ? 4 : 0));
      CHECK(j["notes"].empty());
    }
    const std::string cache_index = dir / (name + "-cache.eki"), eks_index = dir / (name + "-eks.eki");
    for (const auto& [root, index] : {std::pair{fx + "/" + name, cache_index}, std::pair{eks, eks_index}}) {
      r = test::eaglekit("index " + test::quote(root) + " --out " + test::quote(index) + " --json");
      REQUIRE_MESSAGE(r.exit_code == 0, r.err);
      CHECK(nlohmann::json::parse(r.out)["bad_records"] == 0);
    }
    r = test::eaglekit("index --show " + test::quote(eks_index) + " --json");
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    {
      const auto j = nlohmann::json::parse(r.out);
      REQUIRE(j["entries"].size() == 5);
      const int tokens[] = {5, 8, 6, 7, 5};
      for (int i = 0; i < 5; ++i) {
        const auto& e = j["entries"][static_cast<std::size_t>(i)];
        CHECK(e["format"] == "eks");
        CHECK(e["conversation_id"] == std::to_string(i));
        CHECK(e["tokens"] == tokens[i]);
        CHECK(e["hidden_size"] == 8);
        CHECK(e["aux_width"] == 24);
        CHECK(e["has_loss_mask"] == true);
      }
    }
    const std::string conv = " --data " + test::quote(fx + "/conversations.jsonl");
    r = test::eaglekit("validate" + conv + " --index " + test::quote(eks_index) + " --deep");
    CHECK_MESSAGE(r.exit_code == 0, std::string(r.out + r.err));
    CHECK(r.out.find("deep: read 5 matched records in full") != std::string::npos);
    r = test::eaglekit("stats --index " + test::quote(eks_index) + " --json");
    CHECK_MESSAGE(r.exit_code == 0, r.err);
    CHECK(nlohmann::json::parse(r.out)["total_tokens"] == 31);
    {
      const auto j = nlohmann::json::parse(r.out);
      CHECK(j["target_probs_width"] == 16);
      const double elem = j["dtype"] == "float32" ? 4 : 2;
      CHECK(j["raw_bytes_per_token"] == doctest::Approx(8.0 + 40 * elem));
    }
    r = test::eaglekit("inspect " + test::quote(eks + "#3"));
    CHECK_MESSAGE(r.exit_code == 0, r.err);
    CHECK(r.out.find("aux layer ids:   [1, 2, 3] (stated by the file; HF hidden_states indices)") != std::string::npos);
    CHECK(r.out.find(name == "topk" ? "target vocab:    16 draft tokens of 32, top 4 kept per position"
                                    : "target vocab:    16 draft tokens of 32, full distribution") != std::string::npos);
    CHECK(r.out.find("target_probs       ") != std::string::npos);
    r = test::eaglekit("inspect --json " + test::quote(fx + "/" + name + "/manifest.json"));
    CHECK_MESSAGE(r.exit_code == 0, r.err);
    CHECK(nlohmann::json::parse(r.out)["facts"]["target_vocabulary"]["draft_vocab_size"] == 16);

    // A short run on each: the same losses at every TTT step and the same weights, bit for bit;
    // the aux layers come from each one's facts, and the shard's name them as the cache's do.
    const std::string train = "train" + conv + " --base " + test::quote(dir / "base") +
                              " --max-length 8 --batch-size 2 --eval-every -1 --threads 1"
                              " --max-steps 3 --seed 5 --json";
    r = test::eaglekit(train + " --index " + test::quote(eks_index) + " --out " + test::quote(dir / "unused") +
                       " --dry-run");
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    CHECK(nlohmann::json::parse(r.out)["aux_layer_ids"] == std::vector<int>{1, 2, 3});
    CHECK_MESSAGE(nlohmann::json::parse(r.out)["aux_layer_ids_source"].get<std::string>().find(
                      "the data: the .eks shard " + eks) == 0,
                  r.out);
    r = test::eaglekit(train + " --index " + test::quote(cache_index) + " --out " + test::quote(dir / (name + "-run-cache")));
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    const auto from_cache = nlohmann::json::parse(r.out);
    r = test::eaglekit(train + " --index " + test::quote(eks_index) + " --out " + test::quote(dir / (name + "-run-eks")));
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    CHECK_MESSAGE(r.err.find("draft vocabulary: the 16 tokens of selected_token_ids in " + eks) != std::string::npos, r.err);
    const auto from_eks = nlohmann::json::parse(r.out);
    CHECK(from_eks["steps"] == 3);
    CHECK(from_eks["train"]["loss_per_step"].size() == 3);
    CHECK(from_eks["train"]["loss_per_step"] == from_cache["train"]["loss_per_step"]);
    CHECK(from_eks["train"]["loss"] == from_cache["train"]["loss"]);
    CHECK(from_eks["train"]["tokens"] == from_cache["train"]["tokens"]);
    CHECK(test::read_bytes(dir / (name + "-run-eks/final/model.safetensors")) ==
          test::read_bytes(dir / (name + "-run-cache/final/model.safetensors")));
  }
}
