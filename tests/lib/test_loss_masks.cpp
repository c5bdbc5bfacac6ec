#include <doctest/doctest.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "formats/error.h"
#include "formats/index_format.h"
#include "formats/pt_format.h"
#include "formats/registry.h"
#include "formats/safetensors_format.h"
#include "lib/convert.h"
#include "lib/index.h"
#include "lib/loss_masks.h"
#include "tests/support.h"

using namespace eaglekit;
namespace fs = std::filesystem;

// tests/data/speculators_masks/make_fixture.py: a prepared dataset folder written by
// speculators 0.9's own preprocessing, the loss masks its ArrowDataset pairs with each
// hs_{i}.safetensors (expected/), and scripts/speculators/loss_masks.py's file of them.
namespace {

std::string fixture(const std::string& name) {
  return test::source_dir() + "/tests/data/speculators_masks/" + name;
}

template <class E>
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "<no error>";
}

HostTensor i64(std::vector<std::int64_t> v) {
  std::vector<std::uint8_t> b(v.size() * 8);
  std::memcpy(b.data(), v.data(), b.size());
  return HostTensor::from_bytes(DType::kInt64, {static_cast<std::int64_t>(v.size())}, std::move(b));
}

HostTensor u8(std::vector<std::uint8_t> v) {
  const auto n = static_cast<std::int64_t>(v.size());
  return HostTensor::from_bytes(DType::kUInt8, {n}, std::move(v));
}

void write_masks(const std::string& path, HostTensor offsets, HostTensor ids, HostTensor mask,
                 std::string kind = "speculators loss masks") {
  write_safetensors(path, {{"row_offsets", offsets}, {"input_ids", ids}, {"loss_mask", mask}},
                    {{"eaglekit", kind}, {"version", "1"}});
}

}  // namespace

TEST_CASE("loss_masks: speculators' masks join each hs_{i} as its ArrowDataset pairs them") {
  const LossMasks masks = LossMasks::open(fixture("loss_masks.safetensors"));
  CHECK(masks.rows() == 3);
  for (int i : {0, 1}) {
    CAPTURE(i);
    const std::string src = fixture("prepared/hidden_states/hs_" + std::to_string(i) + ".safetensors");
    Record r = open_reader(src)->read(0);
    REQUIRE_FALSE(r.loss_mask.has_value());
    masks.apply(r, src);
    const auto want = SafetensorsFile::open(fixture("expected/hs_" + std::to_string(i) + ".safetensors"));
    REQUIRE(r.loss_mask.has_value());
    CHECK(r.loss_mask->equal(*want->get("loss_mask")));
    CHECK(r.input_ids.equal(*want->get("input_ids")));
  }
  // convert --loss-masks: the output holds them.
  test::TempDir dir("masks");
  ConvertOptions o;
  o.loss_masks = fixture("loss_masks.safetensors");
  o.jobs = 1;
  const std::string out = dir.path() + "/out.eks";
  const ConvertResult res = convert_records(fixture("prepared/hidden_states"), out, o);
  CHECK(res.records == 2);
  CHECK(res.loss_masks_joined == 2);
  const auto reader = open_reader(out);
  for (std::size_t k = 0; k < 2; ++k) {
    const Record r = reader->read(k);
    const auto want = SafetensorsFile::open(fixture("expected/" + r.conversation_id + ".safetensors"));
    REQUIRE(r.loss_mask.has_value());
    CHECK(r.loss_mask->equal(*want->get("loss_mask")));
  }
}

TEST_CASE("loss_masks: a dump and a dataset that differ are refused, naming the file and the row") {
  test::TempDir dir("masks");
  const std::string d = dir.path();
  const std::string hs0 = fixture("prepared/hidden_states/hs_0.safetensors");  // 6 tokens
  const auto record = [&] { return open_reader(hs0)->read(0); };
  const LossMasks good = LossMasks::open(fixture("loss_masks.safetensors"));
  SUBCASE("a file name without a row") {
    Record r = record();
    CHECK(error_of<UsageError>([&] { good.apply(r, d + "/x.safetensors"); }) ==
          d + "/x.safetensors: --loss-masks pairs a record with its dataset row by the file name "
              "hs_{row}.safetensors, as speculators does; this name has no row");
    CHECK(error_of<UsageError>([&] { good.apply(r, d + "/hs_01.safetensors"); }).find("this name has no row") !=
          std::string::npos);
  }
  SUBCASE("a row past the end") {
    Record r = record();
    CHECK(error_of<UsageError>([&] { good.apply(r, d + "/hs_3.safetensors"); }) ==
          d + "/hs_3.safetensors: row 3 is past the end of " + fixture("loss_masks.safetensors") +
              " (3 rows): the dump and the dataset differ");
  }
  SUBCASE("a row of another length") {
    Record r = record();
    const std::string e = error_of<FormatError>([&] { good.apply(r, d + "/hs_1.safetensors"); });
    CHECK(e.find(fixture("loss_masks.safetensors") + ": row 1 at byte ") == 0);
    CHECK(e.find(": holds 4 tokens, but " + d + "/hs_1.safetensors holds 6: the dump and the dataset differ") !=
          std::string::npos);
  }
  SUBCASE("other token ids") {
    const std::string p = d + "/ids.safetensors";
    write_masks(p, i64({0, 6}), i64({10, 29, 19, 4, 26, 20}), u8({0, 0, 1, 1, 1, 0}));
    Record r = record();
    const std::string e = error_of<FormatError>([&] { LossMasks::open(p).apply(r, hs0); });
    CHECK(e.find(p + ": row 0 input_ids[4] at byte ") == 0);
    CHECK(e.find("is 26, but " + hs0 + " holds token 25: the dump and the dataset differ") != std::string::npos);
  }
  SUBCASE("a record that holds another mask") {
    Record r = record();
    r.loss_mask = u8({0, 0, 1, 1, 1, 0});  // row 0's own: kept
    good.apply(r, hs0);
    CHECK(r.loss_mask->get(2) == 1);
    r.loss_mask = u8({0, 0, 1, 1, 1, 1});
    const std::string e = error_of<FormatError>([&] { good.apply(r, hs0); });
    CHECK(e.find(fixture("loss_masks.safetensors") + ": row 0 loss_mask[5] at byte ") == 0);
    CHECK(e.find("is 0, but the loss_mask " + hs0 + " holds is 1: the dump and the dataset differ") != std::string::npos);
  }
  SUBCASE("a mask that is not 0/1, offsets that do not add up, another file") {
    const std::string p = d + "/bad.safetensors";
    write_masks(p, i64({0, 6}), i64({10, 29, 19, 4, 25, 20}), u8({0, 0, 2, 1, 1, 0}));
    CHECK(error_of<FormatError>([&] { LossMasks::open(p); }).find(p + ": loss_mask[2] at byte ") == 0);
    write_masks(p, i64({0, 7}), i64({10, 29, 19, 4, 25, 20}), u8({0, 0, 1, 1, 1, 0}));
    CHECK(error_of<FormatError>([&] { LossMasks::open(p); }).find(p + ": row_offsets[1] at byte ") == 0);
    write_masks(p, i64({0, 6}), i64({10, 29, 19, 4, 25, 20}), u8({0, 0, 1, 1, 1, 0}), "other");
    CHECK(error_of<FormatError>([&] { LossMasks::open(p); }).find(p + ": __metadata__ at byte 8: not a loss-mask file") == 0);
  }
}

// tools/python/eaglekit_masks.py's file, keyed by conversation id, joined to .pt records as
// NVIDIA ModelOpt's HF dumper writes them without --answer-only-loss (input_ids, hidden_states,
// aux_hidden_states, conversation_id; no loss_mask), named by id as that dumper names them.
namespace {

HostTensor bytes_of(const std::vector<std::string>& ids, std::vector<std::int64_t>& offsets) {
  std::vector<std::uint8_t> b;
  offsets = {0};
  for (const std::string& id : ids) {
    b.insert(b.end(), id.begin(), id.end());
    offsets.push_back(static_cast<std::int64_t>(b.size()));
  }
  return u8(std::move(b));
}

void write_masks_by_id(const std::string& path, const std::vector<std::string>& ids, HostTensor offsets,
                       HostTensor tokens, HostTensor mask) {
  std::vector<std::int64_t> io;
  HostTensor names = bytes_of(ids, io);
  write_safetensors(path,
                    {{"row_offsets", offsets}, {"input_ids", tokens}, {"loss_mask", mask},
                     {"id_offsets", i64(io)}, {"conversation_ids", names}},
                    {{"eaglekit", "loss masks by conversation id"}, {"version", "1"},
                     {"rows", std::to_string(ids.size())}, {"rule", "modelopt"}});
}

// A ModelOpt HF dump record of `tokens` tokens (H = 2, one aux layer).
void write_modelopt_pt(const std::string& path, const std::string& id, std::vector<std::int64_t> tokens) {
  const auto t = static_cast<std::int64_t>(tokens.size());
  write_pt(path, {{"input_ids", i64(std::move(tokens))},
                  {"hidden_states", HostTensor::zeros(DType::kFloat32, {t, 2})},
                  {"aux_hidden_states", HostTensor::zeros(DType::kFloat32, {t, 2})},
                  {"conversation_id", id}});
}

}  // namespace

TEST_CASE("loss_masks: a file by conversation id joins ModelOpt's .pt records by their id") {
  test::TempDir dir("masks-id");
  const std::string d = dir.path();
  fs::create_directories(d + "/dump");
  write_modelopt_pt(d + "/dump/conv-b.pt", "conv-b", {1, 5, 6, 7});
  write_modelopt_pt(d + "/dump/conv-a.pt", "conv-a", {1, 3, 4, 2, 9});
  // Rows in another order than the files, and one conversation the dumper skipped.
  const std::string masks = d + "/masks.safetensors";
  write_masks_by_id(masks, {"conv-a", "skipped", "conv-b"}, i64({0, 5, 7, 11}),
                    i64({1, 3, 4, 2, 9, 1, 8, 1, 5, 6, 7}), u8({0, 0, 1, 1, 0, 0, 1, 0, 0, 1, 1}));
  const LossMasks m = LossMasks::open(masks);
  CHECK(m.rows() == 3);
  CHECK(m.by_conversation_id());
  Record a = open_reader(d + "/dump/conv-a.pt")->read(0);
  REQUIRE(a.conversation_id == "conv-a");
  REQUIRE_FALSE(a.loss_mask.has_value());
  m.apply(a, d + "/dump/conv-a.pt");
  REQUIRE(a.loss_mask.has_value());
  CHECK(a.loss_mask->equal(u8({0, 0, 1, 1, 0})));
  ConvertOptions o;
  o.loss_masks = masks;
  o.jobs = 1;
  const ConvertResult res = convert_records(d + "/dump", d + "/out.eks", o);
  CHECK(res.loss_masks_joined == 2);
  const auto reader = open_reader(d + "/out.eks");
  REQUIRE(reader->size() == 2);
  for (std::size_t k = 0; k < 2; ++k) {
    const Record r = reader->read(k);
    CAPTURE(r.conversation_id);
    REQUIRE(r.loss_mask.has_value());
    CHECK(r.loss_mask->equal(r.conversation_id == "conv-a" ? u8({0, 0, 1, 1, 0}) : u8({0, 0, 1, 1})));
  }
}

TEST_CASE("loss_masks: a file by conversation id is refused with the id when it and the dump differ") {
  test::TempDir dir("masks-id");
  const std::string d = dir.path();
  const std::string pt = d + "/conv-a.pt";
  write_modelopt_pt(pt, "conv-a", {1, 3, 4, 2, 9});
  const std::string p = d + "/masks.safetensors";
  const auto record = [&] { return open_reader(pt)->read(0); };
  SUBCASE("an id without a row") {
    write_masks_by_id(p, {"conv-b"}, i64({0, 5}), i64({1, 3, 4, 2, 9}), u8({0, 0, 1, 1, 0}));
    Record r = record();
    CHECK(error_of<FormatError>([&] { LossMasks::open(p).apply(r, pt); }) ==
          p + ": conversation 'conv-a': has no row, but " + pt +
              " holds it: the dump and the conversations the masks were computed from differ");
  }
  SUBCASE("other token ids") {
    write_masks_by_id(p, {"conv-a"}, i64({0, 5}), i64({1, 3, 4, 2, 8}), u8({0, 0, 1, 1, 0}));
    Record r = record();
    const std::string e = error_of<FormatError>([&] { LossMasks::open(p).apply(r, pt); });
    CHECK(e.find(p + ": conversation 'conv-a' (row 0) input_ids[4] at byte ") == 0);
    CHECK(e.find("is 8, but " + pt + " holds token 9: the dump and the dataset differ") != std::string::npos);
    CHECK_FALSE(r.loss_mask.has_value());
  }
  SUBCASE("another length") {
    write_masks_by_id(p, {"conv-a"}, i64({0, 4}), i64({1, 3, 4, 2}), u8({0, 0, 1, 1}));
    Record r = record();
    const std::string e = error_of<FormatError>([&] { LossMasks::open(p).apply(r, pt); });
    CHECK(e.find(p + ": conversation 'conv-a' (row 0) at byte ") == 0);
    CHECK(e.find("holds 4 tokens, but " + pt + " holds 5") != std::string::npos);
  }
  SUBCASE("an id twice, id offsets that do not add up") {
    write_masks_by_id(p, {"x", "x"}, i64({0, 1, 2}), i64({1, 2}), u8({0, 1}));
    CHECK(error_of<FormatError>([&] { LossMasks::open(p); })
              .find(p + ": conversation_ids[1] at byte ") == 0);
    CHECK(error_of<FormatError>([&] { LossMasks::open(p); }).find("is 'x' again (row 0)") != std::string::npos);
    write_safetensors(p, {{"row_offsets", i64({0, 1})}, {"input_ids", i64({1})}, {"loss_mask", u8({1})},
                          {"id_offsets", i64({0, 3})}, {"conversation_ids", u8({'a', 'b'})}},
                      {{"eaglekit", "loss masks by conversation id"}, {"version", "1"}});
    CHECK(error_of<FormatError>([&] { LossMasks::open(p); }).find(p + ": id_offsets[1] at byte ") == 0);
  }
}

// `eaglekit index --loss-masks` records the file (formats/index_format.h IndexLossMasks); the
// loader opens it again only while it is that file, and applies a row to the prefix of a
// record it reads.
TEST_CASE("loss_masks: a joined file opens only while it is the file indexed; a prefix takes its row's first values") {
  test::TempDir dir("masks-joined");
  const std::string masks = dir / "loss_masks.safetensors";
  fs::copy_file(fixture("loss_masks.safetensors"), masks);
  const std::string index = dir / "dump.eki";
  const IndexLossMasks recorded = index_loss_masks_of(masks);
  CHECK(recorded.path == masks);
  CHECK(recorded.size == fs::file_size(masks));
  CHECK(LossMasks::joined_problem(recorded, index).empty());
  const LossMasks m = LossMasks::open_joined(recorded, index);

  // hs_0 holds 6 tokens; the loader reads 4 of them (max_length 4).
  const std::string hs0 = fixture("prepared/hidden_states/hs_0.safetensors");
  const auto want = SafetensorsFile::open(fixture("expected/hs_0.safetensors"))->get("loss_mask")->slice_rows(0, 4);
  Record r = open_reader(hs0)->read_prefix(0, 4);
  REQUIRE(r.tokens() == 4);
  m.apply_prefix(r, hs0, 6);
  REQUIRE(r.loss_mask.has_value());
  CHECK(r.loss_mask->equal(want));
  Record r2 = open_reader(hs0)->read_prefix(0, 4);
  CHECK(error_of<FormatError>([&] { m.apply_prefix(r2, hs0, 5); }).find("holds 6 tokens, but " + hs0 + " holds 5") !=
        std::string::npos);
  CHECK(m.check_length("hs_0", hs0, 6) == 0);
  CHECK(error_of<FormatError>([&] { m.check_length("hs_0", dir / "hs_1.safetensors", 6); })
            .find(masks + ": row 1 at byte ") == 0);

  const std::string head = index + " joins the loss masks of " + masks + ", which ";
  // New times, the same bytes (a copy without -p): the same file.
  fs::last_write_time(masks, fs::last_write_time(masks) + std::chrono::hours(1));
  CHECK(LossMasks::joined_problem(recorded, index).empty());
  // The same size, another mask value.
  {
    auto bytes = test::read_bytes(masks);
    const auto f = SafetensorsFile::open(masks);
    const std::uint64_t at = f->data_start() + f->find("loss_mask")->begin;
    bytes[at] ^= 1;
    test::write_bytes(masks, bytes);
  }
  std::string e = LossMasks::joined_problem(recorded, index);
  CHECK_MESSAGE(e.find(head + "holds other bytes than when indexed (same size; XXH3-64 ") == 0, e);
  CHECK(e.find("index again, naming the file as it is now (`eaglekit index DIR... --out " + index +
               " --loss-masks FILE`), which checks its rows against the records") != std::string::npos);
  CHECK(error_of<Error>([&] { LossMasks::open_joined(recorded, index); }) == e);
  // Another size; gone.
  {
    auto bytes = test::read_bytes(masks);
    bytes.push_back(0);
    test::write_bytes(masks, bytes);
  }
  CHECK(LossMasks::joined_problem(recorded, index).find(head + "has " + std::to_string(recorded.size + 1) + " bytes, " +
                                                        std::to_string(recorded.size) + " when indexed: ") == 0);
  fs::rename(masks, dir / "moved.safetensors");
  CHECK(LossMasks::joined_problem(recorded, index).find(head + "is not there (moved or deleted since indexing?): ") == 0);
}

// `eaglekit index --loss-masks`: speculators' dump indexed as it is, its masks joined from
// the file loss_masks.py wrote (a copy of the fixture, so that the index sits beside it).
namespace {

struct SpeculatorsCopy {
  test::TempDir dir{"index-masks"};
  std::string dump = dir / "hidden_states";
  std::string masks = dir / "loss_masks.safetensors";
  std::string index = dir / "dump.eki";
  SpeculatorsCopy() {
    fs::create_directories(dump);
    for (const char* f : {"hs_0.safetensors", "hs_1.safetensors"})
      fs::copy_file(fixture(std::string("prepared/hidden_states/") + f), dump + "/" + f);
    fs::copy_file(fixture("loss_masks.safetensors"), masks);
  }
  IndexOptions options(const std::string& loss_masks) const {
    IndexOptions o;
    o.roots = {dump};
    o.out = index;
    o.jobs = 1;
    o.progress = 0;
    o.loss_masks = loss_masks;
    return o;
  }
};

}  // namespace

TEST_CASE("loss_masks: index --loss-masks flags every record and names the file; an incremental run keeps it") {
  const SpeculatorsCopy c;
  const IndexReport rep = build_index(c.options(c.masks));
  CHECK(rep.loss_masks == c.masks);
  CHECK_FALSE(rep.loss_masks_kept);
  CHECK(rep.loss_masks_joined == 2);
  CHECK(rep.loss_masks_rows == 3);
  CHECK(rep.loss_masks_unused_rows == 1);  // row 2 has no dump (make_fixture.py)
  CHECK_FALSE(rep.loss_masks_by_id);
  const std::string text = index_report_to_text(rep, c.index);
  CHECK_MESSAGE(text.find("loss masks: 2 records take theirs from " + c.masks + " (by row") != std::string::npos, text);
  CHECK(text.find("1 of its 3 rows are no record's") != std::string::npos);
  const auto json = nlohmann::json::parse(index_report_to_json(rep, c.index));
  CHECK(json["loss_masks"]["joined"] == 2);
  CHECK(json["loss_masks"]["path"] == c.masks);
  {
    const DatasetIndex idx = DatasetIndex::load(c.index);
    CHECK(idx.version() == 4);
    REQUIRE(idx.loss_masks().has_value());
    const IndexLossMasks now = index_loss_masks_of(c.masks);
    CHECK(idx.loss_masks()->path == now.path);
    CHECK(idx.loss_masks()->size == now.size);
    CHECK(idx.loss_masks()->mtime_ns == now.mtime_ns);
    CHECK(idx.loss_masks()->xxh3 == now.xxh3);
    for (std::size_t i = 0; i < idx.size(); ++i) {
      CHECK(idx.entry(i).joined_loss_mask);
      CHECK_FALSE(idx.entry(i).has_loss_mask);
    }
    CHECK(index_to_text(idx).find("loss masks: 2 records take theirs from " + c.masks) != std::string::npos);
    CHECK(nlohmann::json::parse(index_to_json(idx))["entries"][0]["joined_loss_mask"] == true);
  }

  // Again without --loss-masks: the unchanged files are reused, and joined again to the same file.
  const IndexReport again = build_index(c.options(""));
  CHECK(again.unchanged_files == 2);
  CHECK(again.loss_masks_kept);
  CHECK(again.loss_masks_joined == 2);
  CHECK(index_report_to_text(again, c.index).find("kept from the previous index (--full indexes without it)") !=
        std::string::npos);
  CHECK(DatasetIndex::load(c.index).entry(1).joined_loss_mask);
  // A new dump file: read, and joined with the rest.
  fs::copy_file(c.dump + "/hs_0.safetensors", c.dump + "/hs_9.safetensors");
  CHECK_THROWS_WITH_AS(build_index(c.options("")),
                       (c.dump + "/hs_9.safetensors: row 9 is past the end of " + c.masks +
                        " (3 rows): the dump and the dataset differ (1 of the 3 readable records do not fit " + c.masks +
                        ", so the index was not written: a record without its mask would train every token)")
                           .c_str(),
                       UsageError);
  CHECK(DatasetIndex::load(c.index).size() == 2);  // the previous index stays
  fs::remove(c.dump + "/hs_9.safetensors");

  // Moved away: the incremental run says where it was.
  fs::rename(c.masks, c.dir / "elsewhere.safetensors");
  CHECK(error_of<Error>([&] { build_index(c.options("")); }) ==
        c.index + " joins the loss masks of " + c.masks +
            ", which is not there (moved or deleted since indexing?): pass --loss-masks FILE with its new place, "
            "or --full to index without it");
  // --full starts over: no file, version 3.
  IndexOptions full = c.options("");
  full.incremental = false;
  CHECK(build_index(full).loss_masks.empty());
  const DatasetIndex plain = DatasetIndex::load(c.index);
  CHECK(plain.version() == 3);
  CHECK_FALSE(plain.loss_masks().has_value());
  CHECK_FALSE(plain.entry(0).joined_loss_mask);
}

TEST_CASE("loss_masks: index --loss-masks refuses a file that does not fit, naming it and the position; nothing is written") {
  const SpeculatorsCopy c;
  SUBCASE("rows of other lengths (the dump's files swapped)") {
    fs::rename(c.dump + "/hs_0.safetensors", c.dump + "/tmp");
    fs::rename(c.dump + "/hs_1.safetensors", c.dump + "/hs_0.safetensors");
    fs::rename(c.dump + "/tmp", c.dump + "/hs_1.safetensors");
    const std::string e = error_of<Error>([&] { build_index(c.options(c.masks)); });
    const auto f = SafetensorsFile::open(c.masks);
    const std::uint64_t row0 = f->data_start() + f->find("input_ids")->begin;  // row 0 starts the ids
    CHECK(e == c.masks + ": row 0 at byte " + std::to_string(row0) + ": holds 6 tokens, but " + c.dump +
                   "/hs_0.safetensors holds 4: the dump and the dataset differ (2 of the 2 readable records do not fit " +
                   c.masks + ", so the index was not written: a record without its mask would train every token)");
  }
  SUBCASE("a file of fewer rows") {
    write_masks(c.masks, i64({0, 6}), i64({10, 29, 19, 4, 25, 20}), u8({0, 0, 1, 1, 1, 0}));
    CHECK(error_of<UsageError>([&] { build_index(c.options(c.masks)); })
              .find(c.dump + "/hs_1.safetensors: row 1 is past the end of " + c.masks + " (1 rows)") == 0);
  }
  SUBCASE("a truncated file") {
    auto bytes = test::read_bytes(c.masks);
    bytes.resize(bytes.size() - 10);
    test::write_bytes(c.masks, bytes);
    CHECK(error_of<FormatError>([&] { build_index(c.options(c.masks)); }).find(c.masks + ": ") == 0);
  }
  CHECK_FALSE(fs::exists(c.index));
}

TEST_CASE("loss_masks: index --loss-masks joins a file by conversation id to ModelOpt's .pt records") {
  test::TempDir dir("index-masks-id");
  const std::string d = dir.path();
  fs::create_directories(d + "/dump");
  write_modelopt_pt(d + "/dump/conv-b.pt", "conv-b", {1, 5, 6, 7});
  write_modelopt_pt(d + "/dump/conv-a.pt", "conv-a", {1, 3, 4, 2, 9});
  const std::string masks = d + "/masks.safetensors";
  write_masks_by_id(masks, {"conv-a", "skipped", "conv-b"}, i64({0, 5, 7, 11}),
                    i64({1, 3, 4, 2, 9, 1, 8, 1, 5, 6, 7}), u8({0, 0, 1, 1, 0, 0, 1, 0, 0, 1, 1}));
  IndexOptions o;
  o.roots = {d + "/dump"};
  o.out = d + "/dump.eki";
  o.progress = 0;
  o.loss_masks = masks;
  const IndexReport rep = build_index(o);
  CHECK(rep.loss_masks_by_id);
  CHECK(rep.loss_masks_joined == 2);
  CHECK(rep.loss_masks_unused_rows == 1);
  // A record whose id has no row.
  write_modelopt_pt(d + "/dump/conv-c.pt", "conv-c", {1, 2});
  CHECK(error_of<Error>([&] { build_index(o); })
            .find(masks + ": conversation 'conv-c': has no row, but " + d + "/dump/conv-c.pt holds it") == 0);
  CHECK(DatasetIndex::load(d + "/dump.eki").size() == 2);
}
