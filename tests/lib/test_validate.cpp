#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "formats/byte_source.h"
#include "formats/error.h"
#include "formats/format.h"
#include "formats/pt_format.h"
#include "formats/record.h"
#include "formats/zip.h"
#include "lib/dataset.h"
#include "lib/index.h"
#include "lib/validate.h"
#include "tests/support.h"

using namespace eaglekit;
namespace fs = std::filesystem;

namespace {

Record make_record(const std::string& id, std::int64_t t, std::int64_t h = 8,
                   DType dtype = DType::kBFloat16) {
  Record r;
  r.conversation_id = id;
  r.input_ids = HostTensor::zeros(DType::kInt64, {t});
  r.hidden_states = HostTensor::zeros(dtype, {t, h});
  r.aux_hidden_states = HostTensor::zeros(dtype, {t, 3 * h});
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

void truncate_file(const std::string& path) {
  auto b = test::read_bytes(path);
  b.resize(b.size() / 2);
  test::write_bytes(path, b);
}

std::string jsonl(const std::vector<std::string>& ids) {
  std::string s;
  for (const auto& id : ids)
    s += "{\"conversation_id\": \"" + id + "\", \"conversations\": [{\"from\": \"human\", \"value\": \"hi\"}]}\n";
  return s;
}

std::vector<std::string> ids_of(const std::vector<Problem>& ps) {
  std::vector<std::string> out;
  for (const auto& p : ps) out.push_back(p.id);
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> sorted(std::vector<std::string> v) {
  std::sort(v.begin(), v.end());
  return v;
}

// A dataset with every problem validate knows planted once, H = 8, k = 3, bf16.
struct Planted {
  test::TempDir dir{"val"};
  std::string root = dir / "records";
  std::string data = dir / "conversations.jsonl";
  std::string index = dir / "records.ekidx";

  explicit Planted(bool with_fatal) {
    std::vector<std::string> convs;
    for (int i = 0; i < 8; ++i) {
      const std::string id = "c" + std::to_string(i);
      write_records(root + "/good/" + id + ".pt", {make_record(id, 5 + 2 * i)});
      convs.push_back(id);
    }
    // Two records for one id, in different folders.
    write_records(root + "/a/crossdup.pt", {make_record("crossdup", 6)});
    write_records(root + "/b/crossdup.pt", {make_record("crossdup", 6)});
    // One record, the conversation listed twice.
    write_records(root + "/dupconv.pt", {make_record("dupconv", 6)});
    // A record without a conversation.
    write_records(root + "/orphan.pt", {make_record("orphan", 6)});
    // Truncated file.
    write_records(root + "/bad/trunc.pt", {make_record("trunc", 6)});
    truncate_file(root + "/bad/trunc.pt");
    // Too short.
    write_records(root + "/short.pt", {make_record("short", 1)});
    // Tensors that disagree on the token count (the reader refuses it at index time).
    {
      const Record r = make_record("tokmis", 5);
      write_pt(root + "/tokmis.pt",
               {{"input_ids", r.input_ids},
                {"hidden_states", r.hidden_states},
                {"aux_hidden_states", HostTensor::zeros(DType::kBFloat16, {4, 24})},
                {"conversation_id", std::string("tokmis")}});
    }
    // A shard: one good record, one more.
    write_records(root + "/shard/s.eks", {make_record("s0", 7), make_record("s1", 9)}, Format::kEks);
    convs.insert(convs.end(), {"crossdup", "dupconv", "dupconv", "missing1", "trunc", "short",
                               "tokmis", "s0", "s1"});
    if (with_fatal) {
      write_records(root + "/mixed.pt", {make_record("mixed", 6, 16)});
      write_records(root + "/fp16.pt", {make_record("fp16", 6, 8, DType::kFloat16)});
      convs.insert(convs.end(), {"mixed", "fp16"});
    }
    test::write_text(data, jsonl(convs));
    IndexOptions o;
    o.roots = {root};
    o.out = index;
    o.progress = 0;
    build_index(o);
  }

  ValidateReport validate(bool deep = false, std::int64_t max_length = 0,
                          const std::string& quarantine = "") const {
    ValidateOptions o;
    o.data = data;
    o.index = index;
    o.deep = deep;
    o.max_length = max_length;
    o.quarantine = quarantine;
    o.jobs = 2;
    o.progress = 0;
    return validate_dataset(o);
  }
};

// Flips one byte in the middle of a zip entry's data (the CRC-32 no longer matches).
void damage_pt_entry(const std::string& path, const std::string& suffix) {
  auto bytes = test::read_bytes(path);
  std::uint64_t at = 0;
  {
    const ZipArchive zip(ByteSource::open_file(path));
    for (const auto& e : zip.entries())
      if (e.name.size() >= suffix.size() &&
          e.name.compare(e.name.size() - suffix.size(), suffix.size(), suffix) == 0)
        at = e.data_offset + e.size / 2;
  }
  REQUIRE(at != 0);
  bytes[at] ^= 0x01;  // a low mantissa bit: still a finite bf16 value
  test::write_bytes(path, bytes);
}

}  // namespace

TEST_CASE("validate: every planted problem lands in its category") {
  Planted p(true);
  const ValidateReport r = p.validate();
  CHECK(r.conversations == 19);
  CHECK(r.records == 19);
  // c0..c7, s0, s1 (mixed and fp16 match too: the loader would train on them)
  CHECK(r.matched == 12);
  CHECK(r.missing == std::vector<std::string>{"missing1"});
  CHECK(r.orphans == std::vector<std::string>{"orphan"});
  CHECK(r.duplicate_ids == std::vector<std::string>{"crossdup", "dupconv"});
  REQUIRE(r.unreadable.size() == 1);
  CHECK(r.unreadable[0].path == fs::absolute(p.root + "/bad/trunc.pt").lexically_normal().string());
  CHECK(r.unreadable[0].conversation_id == "trunc");
  CHECK(r.unreadable[0].error.rfind(r.unreadable[0].path + ": ", 0) == 0);
  CHECK(ids_of(r.shape_mismatch) == std::vector<std::string>{"mixed", "tokmis"});
  for (const auto& s : r.shape_mismatch) {
    if (s.id == "mixed") CHECK(s.detail == "hidden size 16, the dataset's is 8");
    if (s.id == "tokmis") CHECK(s.detail.find("aux_hidden_states") != std::string::npos);
  }
  REQUIRE(r.dtype_mismatch.size() == 1);
  CHECK(r.dtype_mismatch[0].id == "fp16");
  CHECK(r.dtype_mismatch[0].detail == "dtype float16, the dataset's is bfloat16");
  CHECK(r.nonfinite.empty());
  REQUIRE(r.too_short.size() == 1);
  CHECK(r.too_short[0].id == "short");
  CHECK(r.too_short[0].detail == "1 tokens");
  CHECK(r.hidden_size == 8);
  CHECK(r.aux_width == 24);
  CHECK(r.dtype == DType::kBFloat16);
  CHECK_FALSE(r.ok);
  CHECK(r.exit_code() == 1);
  REQUIRE(r.fatal.size() == 2);
  CHECK(r.fatal[0] == "1 matched records do not have the dataset's shape (hidden size 8, aux "
                      "width 24, tensors agreeing on the token count)");
  CHECK(r.fatal[1] == "1 matched records are not bfloat16 like the rest");

  const std::string text = validate_report_to_text(r);
  CHECK(text.find("missing: 1 conversations have no record\n  missing1\n  hint: ") != std::string::npos);
  CHECK(text.find("result: NOT trainable as is:") != std::string::npos);
  CHECK(text.find("mixed: hidden size 16, the dataset's is 8") != std::string::npos);
}

TEST_CASE("validate: problems the loader skips are warnings; exit 0") {
  Planted p(false);
  const ValidateReport r = p.validate();
  CHECK(r.matched == 10);
  CHECK(r.missing.size() == 1);
  CHECK(r.orphans.size() == 1);
  CHECK(r.duplicate_ids.size() == 2);
  CHECK(r.unreadable.size() == 1);
  CHECK(r.shape_mismatch.size() == 1);  // tokmis: bad in the index, so skipped
  CHECK(r.too_short.size() == 1);
  CHECK(r.ok);
  CHECK(r.exit_code() == 0);
  CHECK(r.fatal.empty());
  const std::string text = validate_report_to_text(r);
  CHECK(text.find("result: trainable as is (6 kinds of warnings above") != std::string::npos);

  // The JSON form: exactly the keys (plus "fatal", how samples were matched, the
  // SpecForge padding scan, the unreadable conversations, the quarantine ids read back and
  // the line said when no record stores a loss mask).
  const auto j = nlohmann::json::parse(validate_report_to_json(r));
  std::set<std::string> keys;
  for (auto it = j.begin(); it != j.end(); ++it) keys.insert(it.key());
  CHECK(keys == std::set<std::string>{"ok", "conversations", "records", "matched", "missing",
                                      "orphans", "duplicate_ids", "unreadable", "shape_mismatch",
                                      "dtype_mismatch", "nonfinite", "too_short", "fatal", "matched_by",
                                      "padding", "bad_conversations", "quarantine_read", "no_loss_mask", "joined_loss_masks"});
  CHECK(j["matched_by"] == "id");
  CHECK(j["ok"] == true);
  CHECK(j["matched"] == 10);
  CHECK(j["missing"] == nlohmann::json::array({"missing1"}));
  CHECK(j["unreadable"][0]["path"] == r.unreadable[0].path);
  CHECK(j["unreadable"][0]["error"] == r.unreadable[0].error);
  CHECK(j["too_short"] == nlohmann::json::array({"short"}));
}

TEST_CASE("validate: --deep finds NaN/Inf, checksum damage and stale entries") {
  Planted p(false);
  // NaN in one record's hidden states, Inf in another's aux.
  {
    Record r = make_record("c1", 7);
    const std::uint16_t nan = 0x7fc0, inf = 0x7f80;
    std::memcpy(r.hidden_states.mutable_data() + 2 * (3 * 8 + 5), &nan, 2);
    write_records(p.root + "/good/c1.pt", {r});
    Record q = make_record("c2", 9);
    std::memcpy(q.aux_hidden_states.mutable_data() + 2 * (24 + 2), &inf, 2);
    write_records(p.root + "/good/c2.pt", {q});
  }
  // A flipped bit in stored tensor bytes: the zip CRC-32 catches it.
  damage_pt_entry(p.root + "/good/c3.pt", "data/1");
  // Re-index (c1, c2, c3 changed), then damage a block of s1 behind the index's back.
  IndexOptions o;
  o.roots = {p.root};
  o.out = p.index;
  o.progress = 0;
  build_index(o);
  {
    const auto reader = open_reader(p.root + "/shard/s.eks");
    const RecordInfo info = reader->info(1);
    auto bytes = test::read_bytes(p.root + "/shard/s.eks");
    bytes[info.byte_offset + info.byte_size / 2] ^= 0x10;
    const auto mtime = fs::last_write_time(p.root + "/shard/s.eks");
    test::write_bytes(p.root + "/shard/s.eks", bytes);
    fs::last_write_time(p.root + "/shard/s.eks", mtime);  // the index still calls it ok
  }

  const ValidateReport shallow = p.validate();
  CHECK(shallow.ok);
  CHECK(shallow.nonfinite.empty());

  const ValidateReport r = p.validate(true);
  CHECK(r.deep_records == 10);
  REQUIRE(r.nonfinite.size() == 2);
  CHECK(ids_of(r.nonfinite) == std::vector<std::string>{"c1", "c2"});
  for (const auto& n : r.nonfinite) {
    if (n.id == "c1") CHECK(n.detail == "NaN in hidden_states at token 3, column 5");
    if (n.id == "c2") CHECK(n.detail == "Inf in aux_hidden_states at token 1, column 2");
  }
  std::vector<std::string> unreadable;
  for (const auto& u : r.unreadable) unreadable.push_back(u.conversation_id);
  CHECK(sorted(unreadable) == std::vector<std::string>{"c3", "s1", "trunc"});
  for (const auto& u : r.unreadable)
    if (u.conversation_id == "c3") CHECK(u.error.find("CRC-32 stored") != std::string::npos);
  CHECK_FALSE(r.ok);
  CHECK(r.exit_code() == 1);
  CHECK(std::find(r.fatal.begin(), r.fatal.end(), "2 matched records hold NaN or Inf") != r.fatal.end());
  CHECK(std::find(r.fatal.begin(), r.fatal.end(),
                  "2 matched records could not be read in full (the index lists them as ok)") !=
        r.fatal.end());

  // The quarantine file holds every problem id; the loader's match then leaves them out
  // and what remains is trainable.
  const std::string qpath = p.dir / "quarantine.txt";
  const ValidateReport rq = p.validate(true, 0, qpath);
  CHECK(rq.quarantine_path == qpath);
  const std::set<std::string> q = load_quarantine(qpath);
  CHECK(q == std::set<std::string>{"c1", "c2", "c3", "s1", "trunc", "crossdup", "dupconv",
                                   "short", "tokmis"});
  CHECK(rq.quarantined == q.size());
  const Dataset d = match_dataset(load_conversations(p.data), DatasetIndex::load(p.index), q);
  std::vector<std::string> trained;
  for (const auto& s : d.samples) trained.push_back(s.conversation_id);
  CHECK(trained == std::vector<std::string>{"c0", "c4", "c5", "c6", "c7", "s0"});
}

TEST_CASE("validate: a file rewritten since indexing is named, with 're-run eaglekit index', without --deep") {
  Planted p(false);
  const std::string path = p.root + "/good/c5.pt";
  const auto mtime = fs::last_write_time(path);
  const auto size = fs::file_size(path);
  // Rewritten after indexing and not re-indexed: the index still says 15 tokens.
  write_records(path, {make_record("c5", 40)});
  fs::last_write_time(path, mtime);
  CHECK(fs::file_size(path) != size);
  for (const bool deep : {false, true}) {
    CAPTURE(deep);
    const ValidateReport r = p.validate(deep);
    bool found = false;
    for (const auto& u : r.unreadable)
      if (u.conversation_id == "c5") {
        found = true;
        CHECK(u.error.find(path + ": changed since indexing (") != std::string::npos);
        CHECK(u.error.find("re-run `eaglekit index`") != std::string::npos);
      }
    CHECK(found);
    CHECK_FALSE(r.ok);
    CHECK(std::find(r.fatal.begin(), r.fatal.end(),
                    "1 matched records are in files that moved, vanished or changed since the index was built: "
                    "re-run `eaglekit index` (an index moved together with its dumps still finds them)") !=
          r.fatal.end());
  }
}

TEST_CASE("validate: an index moved with its dumps still finds them; dumps moved alone are named, not 'trainable'") {
  Planted p(false);
  const ValidateReport before = p.validate();
  REQUIRE(before.ok);
  auto validate_at = [&](const std::string& index) {
    ValidateOptions o;
    o.data = p.data;
    o.index = index;
    o.jobs = 2;
    o.progress = 0;
    return validate_dataset(o);
  };
  // `mv records records.ekidx moved/`: the index stores the paths below its folder
  // relative to it, so nothing changes (before, it kept absolute paths and lost them all).
  fs::create_directories(p.dir / "moved");
  fs::rename(p.root, p.dir / "moved/records");
  fs::rename(p.index, p.dir / "moved/records.ekidx");
  const ValidateReport together = validate_at(p.dir / "moved/records.ekidx");
  CHECK(together.ok);
  CHECK(together.unreadable.size() == before.unreadable.size());
  CHECK(together.matched == before.matched);
  CHECK(DatasetIndex::load(p.dir / "moved/records.ekidx").file(0).path.rfind(p.dir / "moved/records/", 0) == 0);

  // The dumps moved again, the index left behind: every matched record is named, with the
  // fix, and the dataset is not trainable as is (before: "trainable as is", then train
  // failed with "none of the first 64 samples could be opened").
  fs::rename(p.dir / "moved/records", p.dir / "moved/records-old");
  const ValidateReport apart = validate_at(p.dir / "moved/records.ekidx");
  CHECK_FALSE(apart.ok);
  CHECK(apart.exit_code() == 1);
  std::size_t named = 0;
  for (const auto& u : apart.unreadable)
    if (u.error.find("No such file or directory (moved or deleted since indexing? re-run `eaglekit index`)") !=
        std::string::npos)
      ++named;
  CHECK(named == apart.matched);
  CHECK(named > 0);
}

TEST_CASE("validate: unreadable conversations are all listed and the quarantine still written; a quarantine file read back") {
  Planted p(false);
  const auto original = test::read_bytes(p.data);
  // Two conversations train cannot read: one without an id, one that is not JSON. Before,
  // validate stopped at the first with an exception: no report, no quarantine, no --json.
  std::string text(original.begin(), original.end());
  const std::size_t lines = static_cast<std::size_t>(std::count(text.begin(), text.end(), '\n'));
  text += "{\"conversations\": [{\"from\": \"human\", \"value\": \"no id\"}]}\n";
  text += "{not json\n";
  test::write_text(p.data, text);
  const std::string qpath = p.dir / "bad.txt";
  const ValidateReport r = p.validate(false, 0, qpath);
  CHECK_FALSE(r.ok);
  REQUIRE(r.bad_conversations.size() == 2);
  CHECK(r.bad_conversations[0].source == p.data + ":" + std::to_string(lines + 1));
  CHECK(r.bad_conversations[0].error.find("no conversation id") != std::string::npos);
  CHECK(r.bad_conversations[1].source == p.data + ":" + std::to_string(lines + 2));
  CHECK(r.matched > 0);  // the other checks ran
  CHECK(fs::exists(qpath));
  CHECK(r.fatal.front().find("2 conversations of --data cannot be read") == 0);
  const auto j = nlohmann::json::parse(validate_report_to_json(r));
  CHECK(j["bad_conversations"].size() == 2);
  CHECK(validate_report_to_text(r).find("bad_conversations: 2 conversations of --data cannot be read") !=
        std::string::npos);

  // Fixed conversations, one record with a NaN: --deep is not trainable and quarantines it;
  // the same command again reads that quarantine, leaves c1 out as train does, and says
  // trainable (before: NOT trainable forever, whatever the quarantine).
  test::write_bytes(p.data, original);
  fs::remove(qpath);
  {
    Record rec = make_record("c1", 7);
    const std::uint16_t nan = 0x7fc0;
    std::memcpy(rec.hidden_states.mutable_data() + 2 * 3, &nan, 2);
    write_records(p.root + "/good/c1.pt", {rec});
    IndexOptions o;
    o.roots = {p.root};
    o.out = p.index;
    o.progress = 0;
    build_index(o);
  }
  const ValidateReport first = p.validate(true, 0, qpath);
  CHECK_FALSE(first.ok);
  CHECK(first.quarantine_read == 0);
  CHECK(load_quarantine(qpath).count("c1") == 1);
  const ValidateReport second = p.validate(true, 0, qpath);
  CHECK(second.ok);
  CHECK(second.quarantine_read == load_quarantine(qpath).size());
  CHECK(second.nonfinite.empty());
  CHECK(second.matched == first.matched - 1);
  CHECK(load_quarantine(qpath).count("c1") == 1);  // written again
  CHECK(validate_report_to_text(second).find("quarantined before: ") != std::string::npos);
}

TEST_CASE("validate: nothing matched is fatal and says why") {
  Planted p(false);
  test::write_text(p.data, jsonl({"x1", "x2"}));
  const ValidateReport r = p.validate();
  CHECK(r.matched == 0);
  CHECK_FALSE(r.ok);
  REQUIRE(r.fatal.size() == 1);
  CHECK(r.fatal[0].rfind("none of the 2 conversations matched a usable record", 0) == 0);
  CHECK(r.missing == std::vector<std::string>{"x1", "x2"});
  CHECK(r.orphans.size() == 15);
}

TEST_CASE("validate: --max-length reports truncation") {
  Planted p(false);
  // Matched token counts: c0..c7 = 5, 7, ..., 19; s0 = 7, s1 = 9.
  const ValidateReport r = p.validate(false, 10);
  CHECK(r.max_length == 10);
  CHECK(r.truncated_records == 5);  // 11, 13, 15, 17, 19
  CHECK(r.truncated_tokens == 1 + 3 + 5 + 7 + 9);
  CHECK(r.matched_tokens == 5 + 7 + 9 + 11 + 13 + 15 + 17 + 19 + 7 + 9);
  const auto j = nlohmann::json::parse(validate_report_to_json(r));
  CHECK(j["truncation"]["records"] == 5);
  CHECK(j["truncation"]["tokens"] == 25);
  CHECK(validate_report_to_text(r).find("--max-length 10 cuts 5 of 10 matched records, dropping 25 of 112 tokens (22.3%)") !=
        std::string::npos);
}

TEST_CASE("validate: bad options and inputs") {
  ValidateOptions o;
  CHECK_THROWS_AS(validate_dataset(o), UsageError);
  test::TempDir dir("val");
  o.data = dir / "c.jsonl";
  o.index = dir / "absent.ekidx";
  test::write_text(o.data, jsonl({"a"}));
  CHECK_THROWS_AS(validate_dataset(o), IoError);
  o.max_length = -1;
  CHECK_THROWS_AS(validate_dataset(o), UsageError);
}

TEST_CASE("validate: the CLI exits 0 when trainable, 1 when not, 2 on usage") {
  if (!test::require_program(test::eaglekit_path(), "build the eaglekit target (cmake --build build --target eaglekit)")) return;
  Planted ok(false);
  auto r = test::eaglekit("validate --data " + test::quote(ok.data) + " --index " +
                          test::quote(ok.index) + " --json");
  CHECK(r.exit_code == 0);
  CHECK(nlohmann::json::parse(r.out)["ok"] == true);
  Planted bad(true);
  r = test::eaglekit("validate --data " + test::quote(bad.data) + " --index " + test::quote(bad.index));
  CHECK(r.exit_code == 1);
  CHECK(r.out.find("result: NOT trainable as is:") != std::string::npos);
  r = test::eaglekit("validate --data " + test::quote(bad.data));
  CHECK(r.exit_code == 2);
  r = test::eaglekit("index " + test::quote(bad.root) + " --out " + test::quote(bad.index) + " --json");
  CHECK(r.exit_code == 0);
  CHECK(nlohmann::json::parse(r.out)["unchanged_files"] == 16);  // the 2 bad files are read again
}

// Without conversations: every usable record of the index is checked, as train takes them.
TEST_CASE("validate: without --data every usable record of the index; nothing is missing or an orphan") {
  Planted p(false);
  ValidateOptions o;
  o.index = p.index;
  o.jobs = 2;
  o.progress = 0;
  const ValidateReport r = validate_dataset(o);
  CHECK(r.matched_by == "index");
  CHECK(r.conversations == 0);
  // c0..c7, dupconv, orphan, s0, s1 (crossdup twice is a duplicate; trunc, tokmis bad; short too short).
  CHECK(r.matched == 12);
  CHECK(r.missing.empty());
  CHECK(r.orphans.empty());
  CHECK(r.duplicate_ids == std::vector<std::string>{"crossdup"});
  CHECK(r.ok);
  CHECK(validate_report_to_text(r).find("records: ") == 0);
}

// SpecForge pads a dump batch to its longest sample: input_ids 0 with loss_mask 0 at the end.
TEST_CASE("validate: records ending in SpecForge padding are counted; a real token 0 in the loss is not padding") {
  test::TempDir dir("valpad");
  auto rec = [](const std::string& id, std::vector<std::int64_t> ids, std::vector<std::int64_t> mask) {
    Record r = make_record(id, static_cast<std::int64_t>(ids.size()));
    std::memcpy(r.input_ids.mutable_data(), ids.data(), 8 * ids.size());
    HostTensor m = HostTensor::zeros(DType::kInt64, {static_cast<std::int64_t>(mask.size())});
    std::memcpy(m.mutable_data(), mask.data(), 8 * mask.size());
    r.loss_mask = m;
    return r;
  };
  write_records(dir / "r/padded.pt", {rec("padded", {5, 6, 0, 7, 0, 0, 0}, {0, 1, 1, 1, 0, 0, 0})});
  write_records(dir / "r/ends-in-zero.pt", {rec("ends-in-zero", {5, 6, 7, 0}, {0, 1, 1, 1})});  // 0 is in the loss
  write_records(dir / "r/clean.pt", {rec("clean", {5, 6, 7, 8}, {0, 1, 1, 0})});
  write_records(dir / "r/shard.eks", {rec("in-eks", {5, 6, 0, 0}, {1, 1, 0, 0})}, Format::kEks);
  IndexOptions io;
  io.roots = {dir / "r"};
  io.out = dir / "i.ekidx";
  io.progress = 0;
  build_index(io);
  ValidateOptions o;
  o.index = dir / "i.ekidx";
  o.jobs = 2;
  o.progress = 0;
  ValidateReport r = validate_dataset(o);
  // The torch.save records are read; the .eks one only with --deep.
  CHECK(r.padding.scanned == 3);
  REQUIRE(r.padding.padded.size() == 1);
  CHECK(r.padding.padded[0].id == "padded");
  CHECK(r.padding.padded[0].padding == 3);
  CHECK(r.padding.padding_tokens == 3);
  CHECK(r.padding.scanned_tokens == 15);
  CHECK(r.ok);  // a warning: they train correctly
  const std::string text = validate_report_to_text(r);
  CHECK(text.find("padded: 1 of 3 records read end in padding") != std::string::npos);
  CHECK(text.find("3 padding tokens, 20.0% of their 15") != std::string::npos);
  const auto j = nlohmann::json::parse(validate_report_to_json(r));
  CHECK(j["padding"]["padded_records"] == 1);
  CHECK(j["padding"]["records"][0]["padding"] == 3);
  o.deep = true;
  r = validate_dataset(o);
  CHECK(r.padding.scanned == 4);
  CHECK(r.padding.padded.size() == 2);
  CHECK(r.padding.padding_tokens == 5);
}
