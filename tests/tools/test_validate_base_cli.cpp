// `eaglekit validate --base`: the base's head over every record's hidden states. Defects
// are planted in a synthetic dump with Python (torch.load / torch.save of the records):
// hidden states swapped between two conversations, ids shifted by one, another layer's
// states; a pre-norm dump, and a base of another model. Each is found, and no clean record
// is flagged. docs/data.md, semantic validation.
#include <doctest/doctest.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "tests/support.h"

using namespace eaglekit;

namespace {

const char* kPlant = R"PY(
import glob, sys, torch
recs = {i: glob.glob(sys.argv[1] + "/records/*/synth-%06d.pt" % i)[0] for i in (3, 7, 11, 15)}
d = {i: torch.load(recs[i]) for i in recs}
d[3]["hidden_states"], d[7]["hidden_states"] = d[7]["hidden_states"].clone(), d[3]["hidden_states"].clone()
ids = d[11]["input_ids"]
d[11]["input_ids"] = torch.cat([ids[:1], ids[:-1]])          # shifted right by one
d[15]["hidden_states"] = d[15]["aux_hidden_states"][:, :32].clone()  # an earlier layer's states
for i, rec in d.items():
    torch.save(rec, recs[i])
)PY";

struct Dump {
  test::TempDir dir{"validate-base"};
  std::string data(const std::string& name) const { return dir / (name + "/conversations.jsonl"); }
  std::string index(const std::string& name) const { return dir / (name + ".eki"); }
};

void synth(const Dump& d, const std::string& name, const std::string& extra) {
  auto r = test::eaglekit("synth --out " + test::quote(d.dir / name) +
                          " --conversations 40 --hidden 32 --vocab 48 --min-tokens 30 --max-tokens 30 --seed 4 " + extra);
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
}

void index(const Dump& d, const std::string& name) {
  const auto r = test::eaglekit("index " + test::quote(d.dir / name) + " --out " + test::quote(d.index(name)));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
}

nlohmann::json semantic(const Dump& d, const std::string& name, const std::string& base, const std::string& extra,
                        int expected_exit) {
  const auto r = test::eaglekit("validate --data " + test::quote(d.data(name)) + " --index " +
                                test::quote(d.index(name)) + " --base " + test::quote(d.dir / base) + " --json" + extra);
  CHECK_MESSAGE(r.exit_code == expected_exit, r.err);
  return nlohmann::json::parse(r.out)["semantic"];
}

}  // namespace

TEST_CASE("validate --base: finds planted defects and flags no clean record; tells the norm form; another model") {
  test::require_python("torch");
  Dump d;
  synth(d, "clean", "--base-out " + test::quote(d.dir / "base"));
  index(d, "clean");
  // The clean dump: post-norm, nothing suspect, exit 0.
  const auto clean = semantic(d, "clean", "base", "", 0);
  CHECK(clean["norm_form"] == "post");
  CHECK(clean["suspects"].empty());
  CHECK(clean["agreement_post"].get<double>() > 10 * clean["chance"].get<double>());

  // The same dump with four planted defects.
  synth(d, "planted", "");
  const auto py = test::python(kPlant, {d.dir / "planted"});
  REQUIRE_MESSAGE(py.exit_code == 0, py.err);
  index(d, "planted");
  const auto planted = semantic(d, "planted", "base", " --quarantine " + test::quote(d.dir / "q.txt"), 1);
  std::set<std::string> flagged;
  std::string shifted_reason;
  for (const auto& s : planted["suspects"]) {
    flagged.insert(s["id"].get<std::string>());
    if (s["id"] == "synth-000011") shifted_reason = s["reason"].get<std::string>();
  }
  CHECK(flagged == std::set<std::string>{"synth-000003", "synth-000007", "synth-000011", "synth-000015"});
  CHECK(shifted_reason.find("input_ids look shifted by one") != std::string::npos);
  // The quarantine file holds them, and training leaves them out.
  std::ifstream q(d.dir / "q.txt");
  const std::string qtext((std::istreambuf_iterator<char>(q)), std::istreambuf_iterator<char>());
  CHECK(qtext.find("# semantic_suspects") != std::string::npos);
  for (const auto& id : flagged) CHECK(qtext.find(id) != std::string::npos);
  const auto col = test::eaglekit("collate --data " + test::quote(d.data("planted")) + " --index " +
                                  test::quote(d.index("planted")) + " --quarantine " + test::quote(d.dir / "q.txt") +
                                  " --split all --max-length 32 --out " + test::quote(d.dir / "batches"));
  REQUIRE_MESSAGE(col.exit_code == 0, col.err);
  CHECK(col.err.find("36 of 40 conversations matched a record, 4 quarantined") != std::string::npos);

  // A pre-norm dump of the same data: named so, and nothing suspect in that form.
  synth(d, "prenorm", "--hidden-states-norm pre");
  index(d, "prenorm");
  const auto pre = semantic(d, "prenorm", "base", "", 0);
  CHECK(pre["norm_form"] == "pre");
  CHECK(pre["suspects"].empty());

  // The base of another model (another seed): the whole dump disagrees, said once.
  synth(d, "other", "--seed 99 --base-out " + test::quote(d.dir / "other-base"));
  const auto other = semantic(d, "clean", "other-base", "", 1);
  REQUIRE(other["problems"].size() == 1);
  CHECK(other["problems"][0].get<std::string>().find("another model") != std::string::npos);
  CHECK(other["suspects"].empty());
}

// Records that state their norm form (hidden_states_prenorm) are measured in it; one whose
// states contradict its flag is a suspect; the others take --hidden-states-norm. Without
// --data: every record of the index.
TEST_CASE("validate --base: stated norm forms are checked; a wrong flag is a suspect; no --data needed") {
  test::require_python("torch");
  Dump d;
  // Long records, many positions each: the per-record test of a named form needs them.
  const auto sr = test::eaglekit("synth --out " + test::quote(d.dir / "pre") +
                                 " --conversations 40 --hidden 32 --vocab 48 --min-tokens 210 --max-tokens 210 --seed 4"
                                 " --hidden-states-norm pre --base-out " + test::quote(d.dir / "base"));
  REQUIRE_MESSAGE(sr.exit_code == 0, sr.err);
  const char* flag = R"PY(
import glob, sys, torch
for path in glob.glob(sys.argv[1] + "/records/**/*.pt", recursive=True):
    i = int(path.rsplit("synth-", 1)[1][:-3])
    rec = torch.load(path)
    if i == 9:
        rec.pop("hidden_states_prenorm", None)  # says nothing (synth states its form)
        torch.save(rec, path)
        continue
    rec["hidden_states_prenorm"] = not (i == 5 and sys.argv[2] == "wrong")  # record 5: a wrong flag
    torch.save(rec, path)
)PY";
  auto py = test::python(flag, {d.dir / "pre", "wrong"});
  REQUIRE_MESSAGE(py.exit_code == 0, py.err);
  index(d, "pre");
  auto run = [&](const std::string& extra, int expected_exit) {
    const auto r = test::eaglekit("validate --index " + test::quote(d.index("pre")) + " --base " +
                                  test::quote(d.dir / "base") + " --positions 200 --json" + extra);
    CHECK_MESSAGE(r.exit_code == expected_exit, r.err);
    return nlohmann::json::parse(r.out);
  };
  auto j = run("", 1);
  CHECK(j["matched_by"] == "index");
  CHECK(j["matched"] == 40);
  auto s = j["semantic"];
  CHECK(s["norm_form"] == "pre");
  CHECK(s["stated_pre"] == 38);
  CHECK(s["stated_post"] == 1);
  REQUIRE(s["suspects"].size() == 1);
  CHECK(s["suspects"][0]["id"] == "synth-000005");
  CHECK(s["suspects"][0]["stated"] == "post");
  CHECK(s["suspects"][0]["reason"].get<std::string>().find("its hidden_states_prenorm flag is wrong") != std::string::npos);
  // Record 9 states nothing: read as post when told so, its states then predict nothing.
  s = run(" --hidden-states-norm post", 1)["semantic"];
  std::set<std::string> ids;
  for (const auto& x : s["suspects"]) ids.insert(x["id"].get<std::string>());
  CHECK(ids == std::set<std::string>{"synth-000005", "synth-000009"});
  // Must fail twin: the flag of record 5 set right, nothing is suspect.
  py = test::python(flag, {d.dir / "pre", "right"});
  REQUIRE_MESSAGE(py.exit_code == 0, py.err);
  index(d, "pre");
  s = run("", 0)["semantic"];
  CHECK(s["suspects"].empty());
  CHECK(s["stated_pre"] == 39);
}

TEST_CASE("validate --base: says up front how much work the check is, and on the CPU a lower bound of its time") {
  Dump d;
  synth(d, "clean", "--base-out " + test::quote(d.dir / "base"));
  index(d, "clean");
  const auto r = test::eaglekit("validate --data " + test::quote(d.data("clean")) + " --index " +
                                test::quote(d.index("clean")) + " --base " + test::quote(d.dir / "base") +
                                " --positions 8 --json");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  // Before: nothing on stderr while a large base's head ran over every record on the CPU.
  CHECK_MESSAGE(r.err.find("validate: the semantic check runs ") != std::string::npos, r.err);
  CHECK(r.err.find(" records x 8 positions through the base's head (") != std::string::npos);
  CHECK(r.err.find(" parameters, read first) on cpu: ") != std::string::npos);
  CHECK(r.err.find("GFLOP/s a float32 matmul reached here") != std::string::npos);
}

