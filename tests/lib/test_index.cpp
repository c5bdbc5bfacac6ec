#include <doctest/doctest.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include <xxhash.h>

#include "formats/byte_source.h"
#include "formats/bytes.h"
#include "formats/error.h"
#include "formats/format.h"
#include "formats/record.h"
#include "lib/index.h"
#include "tests/support.h"

using namespace eaglekit;
namespace fs = std::filesystem;

namespace {

template <class E, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  FAIL("expected an exception");
  return {};
}

Record make_record(const std::string& id, std::int64_t t, std::int64_t h, int k = 3,
                   DType dtype = DType::kBFloat16) {
  Record r;
  r.conversation_id = id;
  r.input_ids = HostTensor::zeros(DType::kInt64, {t});
  r.hidden_states = HostTensor::zeros(dtype, {t, h});
  r.aux_hidden_states = HostTensor::zeros(dtype, {t, k * h});
  return r;
}

void write_records(const std::string& path, const std::vector<Record>& records,
                   Format format = Format::kPt) {
  fs::create_directories(fs::path(path).parent_path());
  WriterOptions opts;
  opts.format = format;
  auto w = create_writer(path, opts);
  for (const auto& r : records) w->add(r);
  w->finish();
}

std::string abs(const std::string& p) { return fs::absolute(p).lexically_normal().string(); }

IndexReport build(const std::string& root, const std::string& out, bool incremental = true) {
  IndexOptions o;
  o.roots = {root};
  o.out = out;
  o.jobs = 2;
  o.progress = 0;
  o.incremental = incremental;
  return build_index(o);
}

std::vector<std::uint8_t> sample_index_bytes(const std::string& path) {
  IndexedFile f;
  f.path = "/d/a.pt";
  f.size = 100;
  f.mtime_ns = 5;
  f.format = Format::kPt;
  IndexedRecord r;
  r.info.conversation_id = "a";
  r.info.tokens = 3;
  r.info.hidden_size = 4;
  r.info.aux_width = 12;
  f.records.push_back(r);
  write_index(path, {"/d"}, {f});
  return test::read_bytes(path);
}

}  // namespace

TEST_CASE("index: written entries read back field by field") {
  test::TempDir dir("idx");
  const std::string path = dir / "x.ekidx";
  IndexedFile shard;
  shard.path = "/data/s.eks";
  shard.size = 123456789012ull;
  shard.mtime_ns = 1700000000123456789LL;
  shard.format = Format::kEks;
  for (int i = 0; i < 3; ++i) {
    IndexedRecord r;
    r.record = static_cast<std::uint32_t>(i);
    r.info.conversation_id = i == 1 ? "dup" : "s" + std::to_string(i);
    r.info.key = r.info.conversation_id;
    r.info.tokens = 100 + i;
    r.info.hidden_size = 4096;
    r.info.aux_width = 3 * 4096;
    r.info.ids_dtype = DType::kInt32;
    r.info.hidden_dtype = DType::kFloat16;
    r.info.has_loss_mask = i == 2;
    r.info.codec = "zstd";
    r.info.byte_offset = 16 + 1000 * i;
    r.info.byte_size = 1000;
    shard.records.push_back(r);
  }
  IndexedFile bad;
  bad.path = "/data/sub/7.pt";
  bad.format = Format::kPt;
  bad.error = "/data/sub/7.pt: zip: truncated";
  IndexedRecord br;
  br.info.conversation_id = "7";
  br.id_from_file_name = true;
  br.error = bad.error;
  br.error_kind = EntryError::kFormat;
  bad.records.push_back(br);
  IndexedFile one;
  one.path = "/data/dup.pt";
  one.format = Format::kPt;
  IndexedRecord r1;
  r1.info.conversation_id = "dup";
  r1.info.tokens = 9;
  r1.info.hidden_size = 4096;
  r1.info.aux_width = 3 * 4096;
  one.records.push_back(r1);
  IndexedFile empty_shard;
  empty_shard.path = "/data/empty.h5";
  empty_shard.format = Format::kHdf5;

  write_index(path, {"/data", "/more"}, {shard, bad, one, empty_shard});
  const DatasetIndex index = DatasetIndex::load(path);
  CHECK(index.path() == path);
  CHECK(index.size() == 5);
  CHECK(index.file_count() == 4);
  CHECK(index.bad_count() == 1);
  CHECK(index.roots() == std::vector<std::string>{"/data", "/more"});

  const IndexFile f0 = index.file(0);
  CHECK(f0.path == "/data/s.eks");
  CHECK(f0.size == 123456789012ull);
  CHECK(f0.mtime_ns == 1700000000123456789LL);
  CHECK(f0.format == Format::kEks);
  CHECK(f0.first_entry == 0);
  CHECK(f0.entry_count == 3);
  CHECK(f0.error.empty());
  CHECK(index.file(1).error == "/data/sub/7.pt: zip: truncated");
  CHECK(index.file(3).entry_count == 0);
  CHECK(index.file(3).first_entry == 5);

  const IndexEntry e2 = index.entry(2);
  CHECK(e2.conversation_id == "s2");
  CHECK(e2.key == "s2");
  CHECK(e2.codec == "zstd");
  CHECK(e2.file == 0);
  CHECK(e2.record == 2);
  CHECK(e2.tokens == 102);
  CHECK(e2.hidden_size == 4096);
  CHECK(e2.aux_width == 12288);
  CHECK(e2.ids_dtype == DType::kInt32);
  CHECK(e2.hidden_dtype == DType::kFloat16);
  CHECK(e2.has_loss_mask);
  CHECK_FALSE(index.entry(1).has_loss_mask);
  CHECK(e2.byte_offset == 2016);
  CHECK(e2.byte_size == 1000);
  CHECK(e2.format == Format::kEks);
  CHECK(e2.ok);
  CHECK(e2.error_kind == EntryError::kNone);

  const IndexEntry e3 = index.entry(3);
  CHECK_FALSE(e3.ok);
  CHECK(e3.error == "/data/sub/7.pt: zip: truncated");
  CHECK(e3.error_kind == EntryError::kFormat);
  CHECK(e3.id_from_file_name);
  CHECK(e3.conversation_id == "7");
  CHECK(index.file_path(3) == "/data/sub/7.pt");
  CHECK(index.conversation_id(4) == "dup");

  CHECK(index.find("s0") == std::vector<std::size_t>{0});
  CHECK(index.find("dup") == std::vector<std::size_t>{1, 4});
  CHECK(index.find("7") == std::vector<std::size_t>{3});
  CHECK(index.find("nope").empty());
  CHECK(index.find("").empty());
  CHECK(index.duplicate_ids() == std::vector<std::string>{"dup"});
  std::vector<std::string> sorted;
  for (std::size_t r = 0; r < index.size(); ++r)
    sorted.emplace_back(index.conversation_id(index.sorted_entry(r)));
  CHECK(sorted == std::vector<std::string>{"7", "dup", "dup", "s0", "s2"});
  CHECK_THROWS_AS(index.entry(5), std::out_of_range);
  CHECK_THROWS_AS(index.file(4), std::out_of_range);

  // Moving keeps the views valid (the mapping moves with the object).
  DatasetIndex moved = std::move(const_cast<DatasetIndex&>(index));
  CHECK(moved.entry(0).conversation_id == "s0");
}

TEST_CASE("index: corrupt index files fail with a clear error") {
  test::TempDir dir("idx");
  const std::string good_path = dir / "good.ekidx";
  const std::vector<std::uint8_t> good = sample_index_bytes(good_path);
  REQUIRE(good.size() > 136);
  REQUIRE(DatasetIndex::load(good_path).size() == 1);
  const std::string p = dir / "bad.ekidx";
  auto load_error = [&](std::vector<std::uint8_t> bytes) {
    test::write_bytes(p, bytes);
    return error_of<FormatError>([&] { DatasetIndex::load(p); });
  };

  auto bytes = good;
  bytes[0] = 'X';
  CHECK(load_error(bytes) == p + ": magic at byte 0: not an eaglekit dataset index (expected "
                                 "\"EKINDEX\"); build one with `eaglekit index DIR --out FILE`");
  CHECK(load_error({}) == p + ": magic at byte 0: file is 0 bytes, too short to be an eaglekit "
                              "dataset index (truncated?)");
  CHECK(load_error(std::vector<std::uint8_t>(good.begin(), good.begin() + 100)) ==
        p + ": header at byte 0: file is 100 bytes, shorter than the 136 of an empty index "
            "(truncated)");
  CHECK(load_error(std::vector<std::uint8_t>(good.begin(), good.end() - 9)) ==
        p + ": total size at byte 96: header says " + std::to_string(good.size()) +
            " bytes but the file has " + std::to_string(good.size() - 9) + " (truncated)");
  bytes = good;
  bytes[8] = 9;
  test::write_bytes(p, bytes);
  CHECK(error_of<UnsupportedError>([&] { DatasetIndex::load(p); }) ==
        p + ": version at byte 8: index version 9; this build reads 1: rebuild it with "
            "`eaglekit index`");
  bytes = good;
  bytes[16] = 81;
  CHECK(load_error(bytes) == p + ": header at byte 12: record sizes 128/81/48 differ from "
                                 "version 1's 128/80/48");
  bytes = good;
  bytes[good.size() - 20] ^= 0x40;  // a string byte
  test::write_bytes(p, bytes);
  const std::string sum = error_of<ChecksumError>([&] { DatasetIndex::load(p); });
  CHECK(sum.rfind(p + ": checksum at byte " + std::to_string(good.size() - 8) + ": stored ", 0) == 0);
  CHECK(sum.find(": the index is corrupt; rebuild it with `eaglekit index`") != std::string::npos);

  // A section pointing outside the file, with a checksum that matches (a buggy writer).
  bytes = good;
  bytes[64] = 0xf0;  // entries offset
  bytes[65] = 0xff;
  auto fix_checksum = [](std::vector<std::uint8_t>& b) {
    const std::uint64_t h = XXH3_64bits(b.data(), b.size() - 8);
    for (int i = 0; i < 8; ++i) b[b.size() - 8 + i] = static_cast<std::uint8_t>(h >> (8 * i));
  };
  fix_checksum(bytes);
  CHECK(load_error(bytes) == p + ": entries at byte 64: section at byte 65520 of 80 bytes lies "
                                 "outside the file's " + std::to_string(good.size() - 8) + " bytes");
  // An entry whose string reference points past the strings section.
  bytes = good;
  const std::uint64_t entries_off = load_le64(good.data() + 64);
  bytes[entries_off + 4] = 0x7f;  // conversation id offset high bits
  fix_checksum(bytes);
  test::write_bytes(p, bytes);
  const DatasetIndex damaged = DatasetIndex::load(p);  // nothing per entry is parsed at load
  CHECK(error_of<FormatError>([&] { damaged.entry(0); })
            .rfind(p + ": entry conversation_id at byte " + std::to_string(entries_off) +
                       ": string reference (offset ", 0) == 0);
  CHECK_THROWS_AS(DatasetIndex::load(dir / "absent.ekidx"), IoError);
}

TEST_CASE("index: file names give conversation ids") {
  CHECK(file_stem_id("/a/b/123.pt") == "123");
  CHECK(file_stem_id("x/abc.def.pt") == "abc.def");
  CHECK(file_stem_id("7.ckpt.gz") == "7");
  CHECK(file_stem_id("7.ckpt") == "7");
  CHECK(file_stem_id("conv-9.safetensors") == "conv-9");
  CHECK(file_stem_id("m.pth") == "m");
  CHECK(file_stem_id("noext") == "noext");
  CHECK(file_stem_id(".hidden") == ".hidden");
  CHECK(file_stem_id("s.h5") == "s");
}

TEST_CASE("index: reader exceptions are classified") {
  CHECK(classify_error(IoError("x")) == EntryError::kIo);
  CHECK(classify_error(FormatError("p", 10, "zip", "bad")) == EntryError::kFormat);
  CHECK(classify_error(FormatError("p", 10, "hidden_states", "needs 8 bytes")) == EntryError::kFormat);
  CHECK(classify_error(FormatError("p", std::nullopt, "hidden_states", "3 rows but")) == EntryError::kShape);
  CHECK(classify_error(ChecksumError("p", 1, "block", "x")) == EntryError::kChecksum);
  CHECK(classify_error(UnsupportedError("p", 0, "magic", "legacy")) == EntryError::kUnsupported);
  CHECK(classify_error(std::runtime_error("?")) == EntryError::kOther);
  CHECK(entry_error_name(EntryError::kShape) == "shape");
}

TEST_CASE("index: builds from nested folders; bad files become bad entries") {
  test::TempDir dir("idx");
  const std::string root = dir / "data";
  write_records(root + "/a.pt", {make_record("a", 5, 8)});
  write_records(root + "/x/y/b.pt", {make_record("b", 7, 8)});
  write_records(root + "/x/s.eks", {make_record("s1", 3, 8), make_record("s2", 4, 8)}, Format::kEks);
  write_records(root + "/x/named-by-stem.safetensors", {make_record("", 6, 8)}, Format::kSafetensors);
  // A truncated .pt: the zip's central directory is gone.
  write_records(root + "/t/trunc.pt", {make_record("trunc", 5, 8)});
  {
    auto bytes = test::read_bytes(root + "/t/trunc.pt");
    bytes.resize(bytes.size() / 2);
    test::write_bytes(root + "/t/trunc.pt", bytes);
  }
  test::write_text(root + "/notes.txt", "not a record");
  // Not indexed: a writer's temp file and a symlinked folder (no cycles, no double counts).
  fs::copy_file(root + "/a.pt", root + "/x/.c.pt.tmp.123.0");
  fs::create_directory_symlink(root + "/x", root + "/link");
  test::write_text(root + "/conversations.jsonl", "{\"id\": 1}\n");

  const std::string out = dir / "data.ekidx";
  const IndexReport rep = build(root, out);
  CHECK(rep.files == 5);
  CHECK(rep.records == 6);
  CHECK(rep.bad_records == 1);
  CHECK(rep.new_files == 5);
  CHECK_FALSE(rep.had_previous);
  CHECK(rep.duplicate_ids.empty());
  REQUIRE(rep.bad.size() == 1);
  CHECK(rep.bad[0].rfind(abs(root + "/t/trunc.pt") + ": ", 0) == 0);

  const DatasetIndex index = DatasetIndex::load(out);
  CHECK(index.roots() == std::vector<std::string>{abs(root)});
  REQUIRE(index.size() == 6);
  // The same files formats/ finds.
  std::vector<std::string> found, indexed;
  for (const auto& f : find_record_files(root)) found.push_back(abs(f));
  for (std::size_t i = 0; i < index.file_count(); ++i) indexed.emplace_back(index.file(i).path);
  CHECK(indexed == found);
  // Files sorted by path; entries grouped by file.
  CHECK(index.file(0).path == abs(root + "/a.pt"));
  const auto a = index.entry(index.find("a").at(0));
  CHECK(a.tokens == 5);
  CHECK(a.hidden_size == 8);
  CHECK(a.aux_width == 24);
  CHECK(a.hidden_dtype == DType::kBFloat16);
  CHECK(a.ids_dtype == DType::kInt64);
  CHECK(a.format == Format::kPt);
  CHECK(a.ok);
  CHECK(index.file(a.file).size == fs::file_size(root + "/a.pt"));
  const auto s2 = index.entry(index.find("s2").at(0));
  CHECK(s2.format == Format::kEks);
  CHECK(s2.record == 1);
  CHECK(s2.key == "s2");
  CHECK(s2.tokens == 4);
  CHECK(index.file_path(index.find("s2").at(0)) == abs(root + "/x/s.eks"));
  const auto stem = index.entry(index.find("named-by-stem").at(0));
  CHECK(stem.format == Format::kSafetensors);
  CHECK(stem.tokens == 6);
  const auto t = index.entry(index.find("trunc").at(0));
  CHECK_FALSE(t.ok);
  CHECK(t.id_from_file_name);
  CHECK(t.format == Format::kPt);
  CHECK(t.error_kind == EntryError::kFormat);
  CHECK(t.error.rfind(abs(root + "/t/trunc.pt"), 0) == 0);

  // --show forms.
  const std::string text = index_to_text(index);
  CHECK(text.find("6 records (1 bad) in 5 files") != std::string::npos);
  CHECK(text.find("s2\t4\t8\t24\tbfloat16\teks\t") != std::string::npos);
  const auto j = nlohmann::json::parse(index_to_json(index));
  CHECK(j["records"] == 6);
  CHECK(j["entries"].size() == 6);
  CHECK(j["files"].size() == 5);
}

TEST_CASE("index: incremental re-index after touching, adding and deleting files") {
  test::TempDir dir("idx");
  const std::string root = dir / "data";
  for (int i = 0; i < 6; ++i)
    write_records(root + "/d" + std::to_string(i % 2) + "/" + std::to_string(i) + ".pt",
                  {make_record(std::to_string(i), 3 + i, 8)});
  write_records(root + "/bad.pt", {make_record("bad", 3, 8)});
  test::write_text(root + "/bad.pt", "PK\x03\x04 broken");
  const std::string out = dir / "i.ekidx";
  IndexReport r1 = build(root, out);
  CHECK(r1.files == 7);
  CHECK(r1.new_files == 7);
  CHECK(r1.bad_records == 1);

  // Unchanged: everything reused except the bad file, which is read again.
  IndexReport r2 = build(root, out);
  CHECK(r2.had_previous);
  CHECK(r2.unchanged_files == 6);
  CHECK(r2.changed_files == 1);
  CHECK(r2.new_files == 0);
  CHECK(r2.gone_files == 0);

  // Touch one (same bytes, new mtime), rewrite one with more tokens, add one, delete one,
  // fix the bad one.
  const std::string touched = root + "/d0/2.pt";
  fs::last_write_time(touched, fs::last_write_time(touched) + std::chrono::seconds(5));
  write_records(root + "/d1/3.pt", {make_record("3", 30, 8)});
  fs::last_write_time(root + "/d1/3.pt",
                      fs::last_write_time(root + "/d1/3.pt") + std::chrono::seconds(7));
  write_records(root + "/d2/new.pt", {make_record("new", 4, 8)});
  fs::remove(root + "/d0/4.pt");
  write_records(root + "/bad.pt", {make_record("bad", 3, 8)});
  IndexReport r3 = build(root, out);
  CHECK(r3.files == 7);
  CHECK(r3.new_files == 1);
  CHECK(r3.changed_files == 3);  // touched, rewritten, the formerly bad one
  CHECK(r3.unchanged_files == 3);
  CHECK(r3.gone_files == 1);
  CHECK(r3.bad_records == 0);
  const DatasetIndex index = DatasetIndex::load(out);
  CHECK(index.size() == 7);
  CHECK(index.find("4").empty());
  CHECK(index.entry(index.find("3").at(0)).tokens == 30);
  CHECK(index.entry(index.find("new").at(0)).tokens == 4);
  CHECK(index.entry(index.find("5").at(0)).tokens == 8);  // reused entry intact
  CHECK(index.entry(index.find("bad").at(0)).ok);
  CHECK(index.bad_count() == 0);

  // --full ignores the previous index.
  IndexReport r4 = build(root, out, false);
  CHECK_FALSE(r4.had_previous);
  CHECK(r4.new_files == 7);

  // A corrupt previous index is reported and everything is read again.
  auto bytes = test::read_bytes(out);
  bytes[bytes.size() - 1] ^= 1;
  test::write_bytes(out, bytes);
  IndexReport r5 = build(root, out);
  CHECK_FALSE(r5.had_previous);
  CHECK(r5.previous_error.find("checksum") != std::string::npos);
  CHECK(r5.new_files == 7);
  CHECK(DatasetIndex::load(out).size() == 7);
}

TEST_CASE("index: duplicate conversation ids across files are reported, not resolved") {
  test::TempDir dir("idx");
  const std::string root = dir / "data";
  write_records(root + "/a/one.pt", {make_record("same", 3, 8)});
  write_records(root + "/b/two.pt", {make_record("same", 4, 8)});
  write_records(root + "/c/s.eks", {make_record("same", 5, 8), make_record("other", 5, 8)},
                Format::kEks);
  const std::string out = dir / "i.ekidx";
  const IndexReport rep = build(root, out);
  CHECK(rep.duplicate_ids == std::vector<std::string>{"same"});
  const DatasetIndex index = DatasetIndex::load(out);
  CHECK(index.find("same").size() == 3);
  CHECK(index.duplicate_ids() == std::vector<std::string>{"same"});
  const std::string text = index_report_to_text(rep, out);
  CHECK(text.find("duplicate conversation ids: 1") != std::string::npos);
}

TEST_CASE("index: missing root and bad options") {
  test::TempDir dir("idx");
  CHECK_THROWS_AS(build(dir / "absent", dir / "i.ekidx"), IoError);
  IndexOptions o;
  o.out = dir / "i.ekidx";
  CHECK_THROWS_AS(build_index(o), UsageError);
}

TEST_CASE("index: records written by Python torch.save") {
  test::TempDir dir("idx");
  const std::string root = dir / "data";
  fs::create_directories(root + "/n");
  const auto r = test::python(R"(
import sys, torch
root = sys.argv[1]
# ModelOpt: a dict with conversation_id; file named by it.
torch.save({"input_ids": torch.arange(5), "hidden_states": torch.zeros(5, 16, dtype=torch.bfloat16),
            "aux_hidden_states": torch.zeros(5, 48, dtype=torch.bfloat16), "conversation_id": "m-1"},
           root + "/m-1.pt")
# A list holding one dict, 'hidden_state' spelling, int32 ids, no id: the stem names it.
torch.save([{"input_ids": torch.arange(7, dtype=torch.int32), "hidden_state": torch.zeros(7, 16),
             "aux_hidden_states": torch.zeros(7, 48), "loss_mask": torch.ones(7, dtype=torch.int64)}],
           root + "/n/42.pt")
)", {root});
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const std::string out = dir / "i.ekidx";
  const IndexReport rep = build(root, out);
  CHECK(rep.records == 2);
  CHECK(rep.bad_records == 0);
  const DatasetIndex index = DatasetIndex::load(out);
  const IndexEntry m = index.entry(index.find("m-1").at(0));
  CHECK(m.tokens == 5);
  CHECK(m.hidden_size == 16);
  CHECK(m.aux_width == 48);
  CHECK(m.hidden_dtype == DType::kBFloat16);
  const IndexEntry n = index.entry(index.find("42").at(0));
  CHECK(n.tokens == 7);
  CHECK(n.ids_dtype == DType::kInt32);
  CHECK(n.hidden_dtype == DType::kFloat32);
  CHECK(n.has_loss_mask);
}

// Found by tests/fuzz (fuzz_index): a file name that is not UTF-8 (legal on Linux) made
// index_to_json throw nlohmann's type_error 316 instead of printing.
TEST_CASE("index: --show --json prints a path that is not UTF-8 (fuzz regression)") {
  test::TempDir dir("idx");
  IndexedFile f;
  f.path = "/d/caf\xe9.pt";  // Latin-1 name
  f.format = Format::kPt;
  IndexedRecord r;
  r.info.conversation_id = "caf\xe9";
  r.info.tokens = 3;
  f.records.push_back(r);
  write_index(dir / "x.ekidx", {"/d"}, {f});
  const DatasetIndex index = DatasetIndex::load(dir / "x.ekidx");
  const auto j = nlohmann::json::parse(index_to_json(index));
  CHECK(j["files"][0]["path"] == "/d/caf\xef\xbf\xbd.pt");  // U+FFFD
  CHECK(j["entries"][0]["conversation_id"] == "caf\xef\xbf\xbd");

  // The exact fuzz input; like the harness, fix its trailing checksum first.
  std::vector<std::uint8_t> bytes = test::read_bytes(
      test::source_dir() + "/tests/fuzz/regressions/index-invalid-utf8-path.ekindex");
  const std::uint64_t h = XXH3_64bits(bytes.data(), bytes.size() - 8);
  std::memcpy(bytes.data() + bytes.size() - 8, &h, 8);
  const DatasetIndex fuzzed =
      DatasetIndex::from_source(ByteSource::from_bytes(bytes, "fuzzed.ekidx"));
  const auto k = nlohmann::json::parse(index_to_json(fuzzed));
  CHECK(k["files"][1]["path"].get<std::string>().find("synth\xef\xbf\xbd") != std::string::npos);
}

// What tests/fuzz checks at scale (fuzz_index), pinned here: section counts far past the
// file fail on the header alone (the checksum is made to match, so the counts are what
// the loader judges).
TEST_CASE("index: absurd section counts fail before any allocation") {
  test::TempDir dir("idx");
  const std::vector<std::uint8_t> good = sample_index_bytes(dir / "x.ekidx");
  auto load_with = [&](std::uint64_t at, std::uint64_t value) {
    std::vector<std::uint8_t> b = good;
    std::memcpy(b.data() + at, &value, 8);
    const std::uint64_t h = XXH3_64bits(b.data(), b.size() - 8);
    std::memcpy(b.data() + b.size() - 8, &h, 8);
    return error_of<FormatError>(
        [&] { DatasetIndex::from_source(ByteSource::from_bytes(b, "big.ekidx")); });
  };
  CHECK(load_with(24, 1ull << 60) ==
        "big.ekidx: entries at byte 64: count 1152921504606846976 is too large");
  CHECK(load_with(32, 1ull << 31).find("big.ekidx: files at byte 56: section at byte ") == 0);
  CHECK(load_with(88, 1ull << 41) ==
        "big.ekidx: strings at byte 80: count 2199023255552 is too large");
}
