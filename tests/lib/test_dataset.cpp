#include <doctest/doctest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "formats/error.h"
#include "lib/dataset.h"
#include "lib/index.h"
#include "tests/support.h"

using namespace eaglekit;
namespace fs = std::filesystem;

namespace {

std::vector<std::string> ids_of(const std::vector<Conversation>& cs) {
  std::vector<std::string> out;
  for (const auto& c : cs) out.push_back(c.id);
  return out;
}

// The message of what `f` throws as exception type E (fails the test when it throws
// nothing or something else).
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

IndexedRecord rec(const std::string& id, std::int64_t tokens, std::uint32_t record = 0) {
  IndexedRecord r;
  r.info.conversation_id = id;
  r.info.tokens = tokens;
  r.info.hidden_size = 8;
  r.info.aux_width = 24;
  r.record = record;
  return r;
}

IndexedRecord bad_rec(const std::string& id, const std::string& error) {
  IndexedRecord r;
  r.info.conversation_id = id;
  r.error = error;
  r.error_kind = EntryError::kFormat;
  return r;
}

IndexedFile file(const std::string& path, std::vector<IndexedRecord> records,
                 Format f = Format::kPt) {
  IndexedFile out;
  out.path = path;
  out.format = f;
  out.records = std::move(records);
  return out;
}

std::vector<Conversation> convs(const std::vector<std::string>& ids) {
  std::vector<Conversation> out;
  for (std::size_t i = 0; i < ids.size(); ++i)
    out.push_back({ids[i], "c.jsonl:" + std::to_string(i + 1)});
  return out;
}

}  // namespace

TEST_CASE("dataset: JSONL ids from conversation_id, uuid or id, in order") {
  test::TempDir dir("ds");
  const std::string path = dir / "c.jsonl";
  test::write_text(path,
                   "\xef\xbb\xbf{\"conversation_id\": \"a\", \"uuid\": \"x\", \"id\": 1, "
                   "\"conversations\": [{\"from\": \"human\", \"value\": \"hi\"}]}\n"
                   "{\"uuid\": \"u-2\", \"messages\": [{\"role\": \"user\", \"content\": "
                   "\"{\\\"id\\\": 5}\"}]}\r\n"
                   "\n"
                   "   \n"
                   "{\"id\": 42, \"meta\": {\"conversation_id\": \"nested, ignored\"}}\n"
                   "{\"conversation_id\": null, \"id\": -7}\n"
                   "{\"id\": 18446744073709551615}\n"
                   "{\"conversation_id\": \"\xc3\xa9t\xc3\xa9\"}");  // no final newline
  const auto cs = load_conversations(path);
  CHECK(ids_of(cs) ==
        std::vector<std::string>{"a", "u-2", "42", "-7", "18446744073709551615", "\xc3\xa9t\xc3\xa9"});
  CHECK(cs[0].source == path + ":1");
  CHECK(cs[1].source == path + ":2");
  CHECK(cs[2].source == path + ":5");  // blank lines 3 and 4 are skipped but counted
  CHECK(cs[5].source == path + ":8");
}

TEST_CASE("dataset: JSONL errors name the file and line") {
  test::TempDir dir("ds");
  const std::string path = dir / "c.jsonl";
  struct Case {
    const char* third_line;
    const char* message_tail;
  };
  const Case cases[] = {
      {"{\"messages\": []}", "no conversation id (expected a \"conversation_id\", \"uuid\" or \"id\" key)"},
      {"{\"id\": null}", "no conversation id (expected a \"conversation_id\", \"uuid\" or \"id\" key)"},
      {"{\"id\": 1.5}", "\"id\" must be a string or an integer, got the non-integer number 1.5"},
      {"{\"uuid\": true, \"id\": 3}", "\"uuid\" must be a string or an integer, got a boolean"},
      {"{\"conversation_id\": [1]}", "\"conversation_id\" must be a string or an integer, got an array"},
      {"{\"conversation_id\": {\"a\": 1}}", "\"conversation_id\" must be a string or an integer, got an object"},
      {"{\"conversation_id\": \"\"}", "\"conversation_id\" is an empty string"},
      {"[{\"id\": 1}]", "expected a JSON object (one conversation), got an array"},
      {"\"just text\"", "expected a JSON object (one conversation), got a string"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.third_line);
    test::write_text(path, std::string("{\"id\": 1}\n\n") + c.third_line + "\n{\"id\": 4}\n");
    const std::string msg = error_of<FormatError>([&] { load_conversations(path); });
    CHECK(msg == path + ": line 3 at byte 11: " + c.message_tail);
  }
  test::write_text(path, "{\"id\": 1}\n{\"id\": 2\n");
  const std::string msg = error_of<FormatError>([&] { load_conversations(path); });
  CHECK(msg.rfind(path + ": line 2 at byte 10: invalid JSON at column 9: syntax error", 0) == 0);
  CHECK_THROWS_AS(load_conversations(dir / "absent.jsonl"), IoError);
}

TEST_CASE("dataset: a folder reads every *.jsonl sorted by name") {
  test::TempDir dir("ds");
  test::write_text(dir / "b.jsonl", "{\"id\": \"b1\"}\n{\"id\": \"b2\"}\n");
  test::write_text(dir / "a.jsonl", "{\"id\": \"a1\"}\n");
  test::write_text(dir / "c.json", "[{\"id\": \"not read\"}]");
  test::write_text(dir / "notes.txt", "hello");
  fs::create_directories(dir / "sub");
  test::write_text(dir / "sub/z.jsonl", "{\"id\": \"not recursive\"}\n");
  const auto cs = load_conversations(dir.path());
  CHECK(ids_of(cs) == std::vector<std::string>{"a1", "b1", "b2"});
  CHECK(cs[2].source == dir / "b.jsonl:2");

  test::TempDir empty("ds");
  const std::string msg = error_of<Error>([&] { load_conversations(empty.path()); });
  CHECK(msg == empty.path() + ": no *.jsonl files in this folder (--data takes a .jsonl file, a "
                              "folder of them, or a JSON array file)");
}

TEST_CASE("dataset: a JSON array file, with lines for messages") {
  test::TempDir dir("ds");
  const std::string path = dir / "c.json";
  test::write_text(path,
                   "[\n"
                   "  {\"id\": \"x\", \"conversations\": [{\"from\": \"gpt\", \"value\": \"a ] , }\"}]},\n"
                   "  {\n"
                   "    \"uuid\": 9\n"
                   "  }\n"
                   "]\n");
  const auto cs = load_conversations(path);
  CHECK(ids_of(cs) == std::vector<std::string>{"x", "9"});
  CHECK(cs[0].source == path + ":2");
  CHECK(cs[1].source == path + ":3");

  test::write_text(path, "[]");
  CHECK(load_conversations(path).empty());

  struct Case {
    const char* text;
    const char* message;
  };
  const Case cases[] = {
      {"{\"id\": 1}", ": line 1 at byte 0: expected a JSON array of conversations (a file named "
                      "*.jsonl is read as one JSON object a line)"},
      {"[{\"id\": 1},\n {\"id\": 2},\n]", ": line 3 at byte 24: empty element in the JSON array"},
      {"[{\"id\": 1},\n {\"name\": 2}]", ": line 2 at byte 13: no conversation id (expected a "
                                         "\"conversation_id\", \"uuid\" or \"id\" key)"},
      {"[{\"id\": 1},\n {\"id\": 2}", ": line 2 at byte 22: unterminated JSON array (the file "
                                      "ends inside it)"},
      {"[{\"id\": 1}] x", ": line 1 at byte 12: unexpected text after the JSON array"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.text);
    test::write_text(path, c.text);
    CHECK(error_of<FormatError>([&] { load_conversations(path); }) == path + c.message);
  }
}

TEST_CASE("dataset: match in conversation order; duplicates, missing, bad and short left out") {
  test::TempDir dir("ds");
  const std::string index_path = dir / "i.ekidx";
  const auto cs = convs({"d", "a", "missing", "dup", "bad", "e", "c", "b", "twice", "twice"});
  // "twice" has a record but appears twice in the conversations.
  write_index(index_path, {"/data"},
              {
                  file("/data/a.pt", {rec("a", 10)}),
                  file("/data/b.pt", {rec("b", 20)}),
                  file("/data/shard.eks", {rec("c", 30, 0), rec("d", 40, 1), rec("e", 1, 2)},
                       Format::kEks),
                  file("/data/dup1.pt", {rec("dup", 5)}),
                  file("/data/x/dup.pt", {rec("dup", 5)}),
                  file("/data/bad.pt", {bad_rec("bad", "/data/bad.pt: zip: truncated")}),
                  file("/data/orphan.pt", {rec("orphan", 7)}),
                  file("/data/twice.pt", {rec("twice", 9)}),
              });
  const DatasetIndex index = DatasetIndex::load(index_path);
  CHECK(index.size() == 10);
  const Dataset d = match_dataset(cs, index);
  CHECK(d.conversations == 10);
  REQUIRE(d.samples.size() == 4);
  CHECK(d.samples[0].conversation_id == "d");
  CHECK(d.samples[1].conversation_id == "a");
  CHECK(d.samples[2].conversation_id == "c");
  CHECK(d.samples[3].conversation_id == "b");
  CHECK(d.files == std::vector<std::string>{"/data/shard.eks", "/data/a.pt", "/data/b.pt"});
  CHECK(d.samples[0].file == 0);
  CHECK(d.samples[0].record == 1);
  CHECK(d.samples[0].tokens == 40);
  CHECK(d.samples[1].file == 1);
  CHECK(d.samples[2].file == 0);
  CHECK(d.samples[2].record == 0);
  CHECK(d.samples[3].file == 2);
  CHECK(d.missing == 1);
  CHECK(d.duplicates == 3);  // "dup" once (two records), "twice" twice (two conversations)
  CHECK(d.duplicate_ids == std::vector<std::string>{"dup", "twice"});
  CHECK(d.unreadable == 1);
  CHECK(d.too_short == 1);
  CHECK(d.quarantined == 0);

  const Dataset q = match_dataset(cs, index, {"a", "dup", "nothing"});
  CHECK(q.samples.size() == 3);
  CHECK(q.quarantined == 2);
  CHECK(q.duplicates == 2);
  CHECK(q.duplicate_ids == std::vector<std::string>{"twice"});
}

TEST_CASE("dataset: nothing matched says what was expected") {
  test::TempDir dir("ds");
  const std::string index_path = dir / "i.ekidx";
  write_index(index_path, {"/data"}, {file("/data/7.pt", {rec("7", 10)})});
  const DatasetIndex index = DatasetIndex::load(index_path);
  const std::string msg =
      error_of<Error>([&] { match_dataset(convs({"abc", "def"}), index); });
  CHECK(msg == "none of the 2 conversations matched a usable record in the index " + index_path +
                   " (1 records from /data): 2 have no record, 0 are quarantined, 0 have "
                   "duplicate ids, 0 have an unreadable record, 0 have fewer than 2 tokens. "
                   "Records match conversations by id: the conversation_id stored in the "
                   "record, else the file name without extension (conversation \"abc\" <- "
                   "abc.pt); conversations take their id from \"conversation_id\", else "
                   "\"uuid\", else \"id\". For example, the first conversation's id is \"abc\" "
                   "(c.jsonl:1) and the first record's id is \"7\" (/data/7.pt).");
  CHECK(match_records(convs({"abc"}), index).samples.empty());
  const std::string q = error_of<Error>([&] { match_dataset(convs({"7"}), index, {"7"}); });
  CHECK(q.find("1 are quarantined") != std::string::npos);
  CHECK(q.find("Run `eaglekit validate` for the details.") != std::string::npos);

  write_index(index_path, {"/empty"}, {});
  const DatasetIndex none = DatasetIndex::load(index_path);
  CHECK(error_of<Error>([&] { match_dataset(convs({"7"}), none); }) ==
        "no records to train on: the index " + index_path +
            " (built from /empty) holds none; expected record files there (pt, pt.gz, safetensors, hdf5, "
            "eks, deepspec or nemo)");
  CHECK(error_of<Error>([&] { match_dataset({}, index); }) ==
        "no conversations to train on: the data holds none");
}

TEST_CASE("dataset: split is the reference's int(n * 0.95)") {
  for (std::size_t n = 0; n <= 300; ++n) {
    std::vector<SampleRef> s(n);
    for (std::size_t i = 0; i < n; ++i) s[i].conversation_id = std::to_string(i);
    const Split sp = split_dataset(s);
    // Python: int(n * 0.95)
    const std::size_t expect = static_cast<std::size_t>(static_cast<double>(n) * 0.95);
    CAPTURE(n);
    CHECK(sp.train.size() == expect);
    CHECK(sp.eval.size() == n - expect);
    if (!sp.eval.empty()) CHECK(sp.eval.front().conversation_id == std::to_string(expect));
  }
  std::vector<SampleRef> s(10);
  CHECK(split_dataset(s, 0.0).train.size() == 10);
  CHECK(split_dataset(s, 1.0).eval.size() == 10);
  CHECK(split_dataset(s, 0.25).train.size() == 7);
  CHECK_THROWS_AS(split_dataset(s, -0.1), UsageError);
  CHECK_THROWS_AS(split_dataset(s, 1.5), UsageError);
}

TEST_CASE("dataset: quarantine files round trip") {
  test::TempDir dir("ds");
  const std::string path = dir / "q.txt";
  write_quarantine(path, {{"duplicate_ids", {"a", "b"}}, {"nonfinite", {"b", "c d"}}, {"empty", {}}});
  const auto bytes = test::read_bytes(path);
  const std::string text(bytes.begin(), bytes.end());
  CHECK(text ==
        "# conversation ids to leave out of training (eaglekit validate --quarantine);\n"
        "# one id a line, '#' starts a comment line\n"
        "# duplicate_ids\na\nb\n# nonfinite\nc d\n");
  CHECK(load_quarantine(path) == std::set<std::string>{"a", "b", "c d"});

  test::write_text(path, "  x  \r\n# comment\n\n#y\nz#1\n");
  CHECK(load_quarantine(path) == std::set<std::string>{"x", "z#1"});
  CHECK_THROWS_AS(load_quarantine(dir / "absent"), IoError);
  const std::string msg = error_of<Error>([&] { write_quarantine(path, {{"x", {"#7"}}}); });
  CHECK(msg == path + ": conversation id \"#7\" cannot be written to a quarantine file (empty, "
                      "surrounded by blanks, starting with '#' or holding a newline)");
}

TEST_CASE("dataset: row-named records (data_{i}, hs_{i}) match by row; without conversations, row order") {
  CHECK(row_of("data_12") == 12);
  CHECK(row_of("hs_0") == 0);
  CHECK(row_of("rows_0-2000_data_7") == 7);
  CHECK(!row_of("data_"));
  CHECK(!row_of("data_012"));  // not a row number as producers write them
  CHECK(!row_of("conv-3"));
  CHECK(!row_of("12"));

  test::TempDir dir("ds");
  const std::string index_path = dir / "i.ekidx";
  // Index order is path order: data_10 comes before data_2.
  write_index(index_path, {"/sf"},
              {file("/sf/data_0.ckpt", {rec("data_0", 10)}), file("/sf/data_1.ckpt", {rec("data_1", 11)}),
               file("/sf/data_10.ckpt", {rec("data_10", 20)}), file("/sf/data_2.ckpt", {rec("data_2", 12)}),
               file("/sf/data_3.ckpt", {rec("data_3", 1)})});
  const DatasetIndex index = DatasetIndex::load(index_path);
  const auto cs = convs({"c0", "c1", "c2", "c3", "c4"});
  // auto: no record id is a conversation id, every record is row-named -> by row.
  const Dataset d = match_dataset(cs, index);
  CHECK(d.matched_by == "row");
  REQUIRE(d.samples.size() == 3);  // c3's record is too short, c4 has no row 4
  CHECK(d.samples[0].conversation_id == "c0");
  CHECK(d.samples[0].tokens == 10);
  CHECK(d.samples[2].conversation_id == "c2");
  CHECK(d.samples[2].tokens == 12);
  CHECK(d.missing == 1);
  CHECK(d.too_short == 1);
  // Quarantine names conversations.
  CHECK(match_dataset(cs, index, {"c1"}).samples.size() == 2);
  // By id, nothing matches, and the error says how these records are named.
  const std::string msg = error_of<Error>([&] { match_dataset(cs, index, {}, MatchBy::kId); });
  CHECK(msg.find("The records are named by row (data_{i}, hs_{i}): pass --match-by row") != std::string::npos);

  // Without conversations: every usable record, in row order.
  const Dataset all = index_dataset(index);
  CHECK(all.matched_by == "index");
  CHECK(all.conversations == 5);
  REQUIRE(all.samples.size() == 4);
  CHECK(all.samples[0].conversation_id == "data_0");
  CHECK(all.samples[1].conversation_id == "data_1");
  CHECK(all.samples[2].conversation_id == "data_2");
  CHECK(all.samples[3].conversation_id == "data_10");
  CHECK(all.too_short == 1);
  CHECK(index_dataset(index, {"data_2"}).samples.size() == 3);

  // Ids that are not all row-named keep index order, and match by id under auto.
  write_index(index_path, {"/m"}, {file("/m/b.pt", {rec("b", 10)}), file("/m/a_1.pt", {rec("a_1", 10)})});
  const DatasetIndex mixed = DatasetIndex::load(index_path);
  const Dataset m = index_dataset(mixed);
  REQUIRE(m.samples.size() == 2);
  CHECK(m.samples[0].conversation_id == "b");
  CHECK(match_dataset(convs({"a_1", "b"}), mixed).matched_by == "id");
}
