#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include <xxhash.h>

#include "formats/byte_source.h"
#include "formats/error.h"
#include "formats/format.h"
#include "formats/record.h"
#include "lib/index.h"
#include "tests/support.h"

using namespace eaglekit;
namespace fs = std::filesystem;

namespace {

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

}  // namespace

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

  // The exact fuzz input (its version field since raised from 1 to 2: the entry layout is
  // the same); like the harness, fix its trailing checksum first.
  std::vector<std::uint8_t> bytes = test::read_bytes(
      test::source_dir() + "/tests/fuzz/regressions/index-invalid-utf8-path.ekindex");
  const std::uint64_t h = XXH3_64bits(bytes.data(), bytes.size() - 8);
  std::memcpy(bytes.data() + bytes.size() - 8, &h, 8);
  const DatasetIndex fuzzed =
      DatasetIndex::from_source(ByteSource::from_bytes(bytes, "fuzzed.ekidx"));
  const auto k = nlohmann::json::parse(index_to_json(fuzzed));
  CHECK(k["files"][1]["path"].get<std::string>().find("synth\xef\xbf\xbd") != std::string::npos);
}

TEST_CASE("index: vLLM's .lock companions are skipped and counted; one still locked is named") {
  // vLLM 0.32's ExampleHiddenStatesConnector: FILE.lock (empty) beside FILE.safetensors, held
  // with an exclusive flock while FILE is written.
  test::TempDir dir("idx");
  const std::string root = dir / "data";
  write_records(root + "/req-a.safetensors", {make_record("a", 3, 8)}, Format::kSafetensors);
  write_records(root + "/req-b.safetensors", {make_record("b", 3, 8)}, Format::kSafetensors);
  test::write_text(root + "/req-a.safetensors.lock", "");
  test::write_text(root + "/req-b.safetensors.lock", "");
  test::write_text(root + "/req-c.safetensors.lock", "");  // created before its record is written
  const int fd = ::open((root + "/req-c.safetensors.lock").c_str(), O_RDONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  REQUIRE(::flock(fd, LOCK_EX) == 0);  // the writer's lock (another open file: flock sees two)
  const std::string out = dir / "i.ekidx";
  const IndexReport rep = build(root, out);
  ::close(fd);
  CHECK(rep.files == 2);
  CHECK(rep.records == 2);
  CHECK(rep.bad_records == 0);
  CHECK(rep.lock_files == 3);
  CHECK(rep.held_locks == std::vector<std::string>{abs(root + "/req-c.safetensors.lock")});
  const std::string text = index_report_to_text(rep, out);
  CHECK(text.find("skipped 3 .lock companion files") != std::string::npos);
  CHECK(text.find("warning: 1 of them locked by a running writer") != std::string::npos);
  const auto j = nlohmann::json::parse(index_report_to_json(rep, out));
  CHECK(j["lock_files"] == 3);
  CHECK(j["held_locks"].size() == 1);
  // Released: counted, not named.
  const IndexReport again = build(root, out);
  CHECK(again.lock_files == 3);
  CHECK(again.held_locks.empty());
  CHECK(index_report_to_text(again, out).find("warning") == std::string::npos);
}
