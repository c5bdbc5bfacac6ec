// The eaglekit binary: inspect, convert and synth as a user runs them (exit codes, --help,
// JSON shape, error lines), and conversions between every pair of writable formats.
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "formats/format.h"
#include "tests/support.h"

using namespace eaglekit;
namespace fs = std::filesystem;
using test::quote;

namespace {

// A small synthetic dataset (6 conversations, H = 16) made by the binary itself.
std::string make_dataset(const test::TempDir& dir, const std::string& name = "data",
                         const std::string& extra = "") {
  const std::string out = dir / name;
  const auto r = test::eaglekit("synth --out " + quote(out) +
                                " --conversations 6 --hidden 16 --vocab 64 --min-tokens 4 "
                                "--max-tokens 12 --seed 3 " + extra);
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  return out;
}

// The default dataset, made once for the whole binary. Tests that modify files work on a
// copy.
const std::string& shared_dataset() {
  static test::TempDir dir("cli-shared");
  static const std::string data = make_dataset(dir);
  return data;
}

std::string record_path(const std::string& data, int i) {
  char name[64];
  std::snprintf(name, sizeof name, "synth-%06d.pt", i);
  return data + (i % 5 == 4 ? "/records/000/more/" : "/records/000/") + name;
}

bool same_record(const Record& a, const Record& b) {
  return a.conversation_id == b.conversation_id && a.input_ids.equal(b.input_ids) &&
         a.hidden_states.equal(b.hidden_states) &&
         a.aux_hidden_states.equal(b.aux_hidden_states) &&
         a.loss_mask.has_value() == b.loss_mask.has_value() &&
         (!a.loss_mask || a.loss_mask->equal(*b.loss_mask));
}

std::map<std::string, Record> all_records(const std::string& root) {
  std::map<std::string, Record> out;
  for (const auto& f : find_record_files(root)) {
    const auto reader = open_reader(f);
    for (std::size_t i = 0; i < reader->size(); ++i) {
      Record r = reader->read(i);
      out[r.conversation_id] = r;
    }
  }
  return out;
}

bool any_file_below(const std::string& dir) {
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) return true;
  return false;
}

}  // namespace

TEST_CASE("cli: --help exits 0 and bad usage exits 2 with one clear line") {
  for (const char* cmd : {"inspect", "convert", "synth"}) {
    CAPTURE(cmd);
    const auto h = test::eaglekit(std::string(cmd) + " --help");
    CHECK(h.exit_code == 0);
    CHECK(h.out.find("Usage:") != std::string::npos);
  }
  const auto top = test::eaglekit("--help");
  CHECK(top.exit_code == 0);
  for (const char* cmd : {"inspect", "convert", "synth"}) CHECK(top.out.find(cmd) != std::string::npos);

  struct Case {
    std::string args, err;
  };
  const std::vector<Case> cases = {
      {"inspect", "eaglekit inspect: FILE is required (see --help)\n"},
      {"inspect a b", "eaglekit inspect: unexpected argument 'b' (see --help)\n"},
      {"convert onlyone", "eaglekit convert: SRC and DST are required (see --help)\n"},
      {"convert a b --format zip", "eaglekit convert: --format: unknown format 'zip' (pt, safetensors, hdf5, eks)\n"},
      {"convert a b --format pt.gz", "eaglekit convert: --format: unknown format 'pt.gz' (pt, safetensors, hdf5, eks)\n"},
      {"synth --conversations 3", "eaglekit synth: --out DIR is required (see --help)\n"},
      {"synth --out x --dtype int8", "eaglekit synth: --dtype must be bf16, fp16 or fp32, not int8\n"},
      // The loader commands and vocab judge their options by the rows' bounds, as train does,
      // before they read anything (no.eki does not exist).
      {"collate --index no.eki --out x --batch-size 0", "eaglekit collate: --batch-size must be at least 1\n"},
      {"collate --index no.eki --out x --pad-multiple 0", "eaglekit collate: --pad-multiple must be at least 1\n"},
      {"collate --index no.eki --out x --max-length 0", "eaglekit collate: --max-length must be at least 1\n"},
      {"collate --index no.eki --out x --rank -1", "eaglekit collate: --rank must not be negative\n"},
      {"collate --index no.eki --out x --last-token -2", "eaglekit collate: --last-token must be at least -1\n"},
      {"collate --index no.eki --out x --eval-fraction 1.5", "eaglekit collate: --eval-fraction must be in [0, 1]\n"},
      {"loader-bench --index no.eki --prefetch 0", "eaglekit loader-bench: --prefetch must be at least 1\n"},
      {"loader-bench --index no.eki --cp-size 0", "eaglekit loader-bench: --cp-size must be at least 1\n"},
      {"vocab --index no.eki --out x --draft-vocab-size 0", "eaglekit vocab: --draft-vocab-size is required and must be positive\n"},
      {"vocab --index no.eki --out x --draft-vocab-size 8 --jobs -1", "eaglekit vocab: --jobs must not be negative\n"},
      {"vocab --index no.eki --out x --draft-vocab-size 8 --vocab-size -1", "eaglekit vocab: --vocab-size must not be negative\n"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.args);
    const auto r = test::eaglekit(c.args);
    CHECK(r.exit_code == 2);
    CHECK(r.err == c.err);
    CHECK(r.out.empty());
  }
  CHECK_FALSE(fs::exists("x"));

  // A mistyped flag: the command's nearest flag, when one is near (a typo, a swap, '_').
  const std::vector<Case> typos = {
      {"synth --out x --conversation 3", "eaglekit synth: unknown option '--conversation' (did you mean --conversations?) (see --help)\n"},
      {"synth --out x --cnoversations 3", "eaglekit synth: unknown option '--cnoversations' (did you mean --conversations?) (see --help)\n"},
      {"synth --out x --min_tokens 3", "eaglekit synth: unknown option '--min_tokens' (did you mean --min-tokens?) (see --help)\n"},
      {"inspect --hlep", "eaglekit inspect: unknown option '--hlep' (did you mean --help?) (see --help)\n"},
      {"synth --out x --frobnicate 3", "eaglekit synth: unknown option '--frobnicate' (see --help)\n"},
      {"synth --out x --ab", "eaglekit synth: unknown option '--ab' (see --help)\n"},
  };
  for (const auto& c : typos) {
    CAPTURE(c.args);
    const auto r = test::eaglekit(c.args);
    CHECK(r.exit_code == 2);
    CHECK(r.err == c.err);
  }
  CHECK_FALSE(fs::exists("x"));
}

TEST_CASE("cli: in a log the data commands print plain progress lines every EAGLEKIT_PROGRESS_EVERY seconds") {
  test::TempDir dir("cli-progress");
  // The tests' stderr is a pipe, as a batch job's log. Before: nothing until the end.
  auto r = test::run("EAGLEKIT_PROGRESS_EVERY=0.000000001 " + test::quote(test::eaglekit_path()) + " synth --out " +
                     test::quote(dir / "d") + " --conversations 6 --hidden 16 --vocab 32 --min-tokens 8 "
                     "--max-tokens 12 --jobs 1");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK_MESSAGE(r.err.find("synth: 6/6 (100%)") != std::string::npos, r.err);
  CHECK(r.err.find('\r') == std::string::npos);
  // The default interval (60 s) leaves a short run's log empty.
  r = test::run(test::quote(test::eaglekit_path()) + " index " + test::quote(dir / "d") + " --out " +
                test::quote(dir / "i.eki"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(r.err.find("indexing files") == std::string::npos);
  r = test::run("EAGLEKIT_PROGRESS_EVERY=soon " + test::quote(test::eaglekit_path()) + " index " +
                test::quote(dir / "d") + " --out " + test::quote(dir / "j.eki"));
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("EAGLEKIT_PROGRESS_EVERY must be a number of seconds") != std::string::npos);
}

TEST_CASE("cli: every command's --help comes from its option table") {
  // The commands, as `eaglekit --help` lists them.
  const auto top = test::eaglekit("--help");
  REQUIRE(top.exit_code == 0);
  std::vector<std::string> commands;
  const auto listed = top.out.find("commands:\n");
  REQUIRE(listed != std::string::npos);
  std::istringstream lines(top.out.substr(listed + 10));
  for (std::string line; std::getline(lines, line) && line.rfind("  ", 0) == 0;)
    commands.push_back(line.substr(2, line.find(' ', 2) - 2));
  CHECK(commands.size() == 16);
  std::map<std::string, std::string> index_line;  // command -> its "--index FILE" help line
  for (const auto& cmd : commands) {
    CAPTURE(cmd);
    const auto r = test::eaglekit(cmd + " --help");
    CHECK(r.exit_code == 0);
    CHECK(r.err.empty());
    CHECK(r.out.rfind("Usage: eaglekit " + cmd + " ", 0) == 0);
    std::istringstream text(r.out);
    for (std::string line; std::getline(text, line);) {
      CAPTURE(line);
      const auto first = line.find("default");
      CHECK((first == std::string::npos || line.find("default", first + 1) == std::string::npos));
      // cxxopts' placeholders: "--out arg", "--resume [=arg(=...)]".
      CHECK(line.find("[=arg") == std::string::npos);
      CHECK(line.find(" arg ") == std::string::npos);
      CHECK(line.find("=arg") == std::string::npos);
      CHECK((line.size() < 4 || line.compare(line.size() - 4, 4, " arg") != 0));
      if (line.rfind("  --index FILE ", 0) == 0) index_line[cmd] = line;
    }
  }
  // launch shows where its command goes.
  const auto launch = test::eaglekit("launch --help");
  CHECK(launch.out.substr(0, launch.out.find('\n')).find(" -- COMMAND [ARGS...]") != std::string::npos);
  // The shared data options read the same everywhere.
  for (const char* cmd : {"validate", "stats", "report", "collate", "loader-bench", "evaluate", "vocab"}) {
    CAPTURE(cmd);
    REQUIRE(index_line.count(cmd));
    CHECK(index_line[cmd] == index_line["train"]);
  }
  // Index and validate keep their one-letter flags.
  CHECK(test::eaglekit("index --help").out.find("  -o, --out INDEX") != std::string::npos);
  CHECK(test::eaglekit("validate --help").out.find("  -j, --jobs N") != std::string::npos);
  CHECK(test::eaglekit("launch --help").out.find("(required)") != std::string::npos);
  test::TempDir dir("cli-short");
  const std::string index = dir / "data.ekidx";
  const auto built = test::eaglekit("index " + quote(shared_dataset() + "/records") + " -o " + quote(index) + " -j1 --json");
  CHECK_MESSAGE(built.exit_code == 0, built.err);
  CHECK(fs::exists(index));
  const auto checked = test::eaglekit("validate --data " + quote(shared_dataset() + "/conversations.jsonl") +
                                      " --index " + quote(index) + " -j 1 --deep --json");
  CHECK_MESSAGE(checked.exit_code == 0, checked.err);
  CHECK(test::eaglekit("index -x").err == "eaglekit index: unknown option '-x' (see --help)\n");
}

TEST_CASE("cli: eaglekit loads no LibTorch and runs the LibTorch commands through eaglekit-torch") {
  const std::string bin = test::eaglekit_path();
  // The data commands' binary must not pull LibTorch in (that is its point: ~0.8 CPU-s a run).
  const auto deps = test::run("ldd " + quote(bin));
  REQUIRE(deps.exit_code == 0);
  CHECK(deps.out.find("libc.so") != std::string::npos);
  CHECK(deps.out.find("libtorch") == std::string::npos);
  CHECK(deps.out.find("libc10") == std::string::npos);
  // A LibTorch command is exec'd: same arguments (the global --verbose included), same
  // output and exit codes as if it ran here.
  const auto help = test::eaglekit("--verbose train --help");
  CHECK(help.exit_code == 0);
  CHECK(help.out.find("Usage:") != std::string::npos);
  CHECK(help.out.find("eaglekit train") != std::string::npos);
  const auto bad = test::eaglekit("export --no-such-flag");
  CHECK(bad.exit_code == 2);
  CHECK(bad.err.rfind("eaglekit export: ", 0) == 0);
  // Without eaglekit-torch beside it, the error says what is missing.
  test::TempDir dir("front-alone");
  const std::string alone = dir / "eaglekit";
  fs::copy_file(bin, alone);
  fs::permissions(alone, fs::perms::owner_all);
  const auto lost = test::run(quote(alone) + " train --help");
  CHECK(lost.exit_code == 1);
  CHECK(lost.err == "eaglekit: cannot run " + fs::canonical(dir.path()).string() +
                        "/eaglekit-torch: No such file or directory (the commands that need "
                        "LibTorch live in eaglekit-torch, which must sit next to eaglekit; build "
                        "it with the eaglekit target)\n");
  CHECK(test::run(quote(alone) + " inspect --help").exit_code == 0);  // data commands need nothing
}

TEST_CASE("cli: synth then inspect --json gives the documented shape") {
  const std::string& data = shared_dataset();
  const std::string file = record_path(data, 2);
  REQUIRE(fs::exists(file));
  const auto r = test::eaglekit("inspect --json " + quote(file));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const auto j = nlohmann::json::parse(r.out);
  const auto rec = open_reader(file)->read(0);
  const std::int64_t t = rec.tokens();
  const nlohmann::json expected = {
      {"format", "pt"},
      {"path", file},
      {"conversation_id", "synth-000002"},
      {"tensors",
       {{"input_ids", {{"dtype", "int64"}, {"shape", {t}}}},
        {"hidden_states", {{"dtype", "bfloat16"}, {"shape", {t, 16}}}},
        {"aux_hidden_states", {{"dtype", "bfloat16"}, {"shape", {t, 48}}}}}},
      {"codec", "raw"},
      {"hidden_states_prenorm", false}};  // synth states the form it wrote
  CHECK(j == expected);

  const auto text = test::eaglekit("inspect " + quote(file));
  CHECK(text.exit_code == 0);
  CHECK(text.out.find("conversation_id: synth-000002") != std::string::npos);
  CHECK(text.out.find("hidden_states      bfloat16  [" + std::to_string(t) + ", 16]") !=
        std::string::npos);
}

TEST_CASE("cli: inspect --stats reports min/max/mean/std and NaN/Inf counts") {
  test::TempDir dir("cli");
  const std::string data = make_dataset(dir, "data", "--dtype fp32");
  const std::string file = record_path(data, 0);
  const auto r = test::eaglekit("inspect --stats --json " + quote(file));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const auto j = nlohmann::json::parse(r.out);
  const auto rec = open_reader(file)->read(0);
  const HostTensor& h = rec.hidden_states;
  double lo = 1e300, hi = -1e300, sum = 0, sum2 = 0;
  for (std::int64_t i = 0; i < h.numel(); ++i) {
    const double x = h.get(i);
    lo = std::min(lo, x);
    hi = std::max(hi, x);
    sum += x;
  }
  const double mean = sum / static_cast<double>(h.numel());
  for (std::int64_t i = 0; i < h.numel(); ++i) sum2 += (h.get(i) - mean) * (h.get(i) - mean);
  const auto& hs = j["tensors"]["hidden_states"];
  CHECK(hs["dtype"] == "float32");
  CHECK(hs["min"].get<double>() == lo);
  CHECK(hs["max"].get<double>() == hi);
  CHECK(hs["mean"].get<double>() == doctest::Approx(mean).epsilon(1e-12));
  CHECK(hs["std"].get<double>() == doctest::Approx(std::sqrt(sum2 / h.numel())).epsilon(1e-12));
  CHECK(hs["nan"] == 0);
  CHECK(hs["inf"] == 0);
  CHECK(j["tensors"]["input_ids"]["min"].get<double>() >= 0);
}

TEST_CASE("cli: missing, corrupt and truncated files exit 1 with the path and the reason") {
  test::TempDir dir("cli");
  const std::string missing = dir / "nope.pt";
  auto r = test::eaglekit("inspect " + quote(missing));
  CHECK(r.exit_code == 1);
  CHECK(r.err == "eaglekit inspect: error: " + missing + ": cannot open: No such file or directory\n");
  CHECK(r.out.empty());

  const std::string junk = dir / "junk.pt";
  test::write_text(junk, "this is not a tensor file at all");
  r = test::eaglekit("inspect " + quote(junk));
  CHECK(r.exit_code == 1);
  CHECK(r.err == "eaglekit inspect: error: " + junk +
                     ": magic at byte 0: not a record file (expected a torch.save zip, .ckpt.gz, "
                     "safetensors, HDF5, .eks shard, DeepSpec manifest.json or NeMo cache manifest.json)\n");

  // A safetensors record cut short: the header promises more than the file holds.
  const std::string st = dir / "whole.safetensors";
  auto w = create_writer(st, WriterOptions{Format::kSafetensors});
  w->add(open_reader(record_path(shared_dataset(), 1))->read(0));
  w->finish();
  auto bytes = test::read_bytes(st);
  bytes.resize(bytes.size() - 10);
  const std::string cut = dir / "cut.safetensors";
  test::write_bytes(cut, bytes);
  r = test::eaglekit("inspect " + quote(cut));
  CHECK(r.exit_code == 1);
  CHECK(r.err.rfind("eaglekit inspect: error: " + cut + ": ", 0) == 0);
  CHECK(r.err.find("runs past the end of the data buffer") != std::string::npos);

  r = test::eaglekit("convert " + quote(missing) + " " + quote(dir / "out.pt"));
  CHECK(r.exit_code == 1);
  CHECK(r.err == "eaglekit convert: error: " + missing + ": cannot open: No such file or directory\n");
  CHECK_FALSE(fs::exists(dir / "out.pt"));
}

TEST_CASE("cli: convert between pt, safetensors, hdf5 and eks preserves every value") {
  test::TempDir dir("cli");
  const std::string& data = shared_dataset();
  const auto original = all_records(data + "/records");
  REQUIRE(original.size() == 6);

  // One record: pt -> safetensors -> pt.
  auto r = test::eaglekit("convert " + quote(record_path(data, 1)) + " " + quote(dir / "one.safetensors"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(detect_file_format(dir / "one.safetensors") == Format::kSafetensors);
  r = test::eaglekit("convert " + quote(dir / "one.safetensors") + " " + quote(dir / "one.pt"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(same_record(open_reader(dir / "one.pt")->read(0), original.at("synth-000001")));

  // A folder -> one shard -> a folder of .pt, for each shard format.
  for (const std::string fmt : {"hdf5", "eks"}) {
    CAPTURE(fmt);
    const std::string shard = dir / ("all." + fmt);
    r = test::eaglekit("convert --json --jobs 2 " + quote(data + "/records") + " " + quote(shard));
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    const auto j = nlohmann::json::parse(r.out);
    CHECK(j["format"] == fmt);
    CHECK(j["records"] == 6);
    CHECK(j["files"] == 1);
    CHECK(j["folder"] == false);
    const auto reader = open_reader(shard);
    CHECK(format_name(reader->format()) == fmt);
    CHECK(reader->size() == 6);
    const auto back = all_records(shard);
    for (const auto& [id, rec] : original) {
      CAPTURE(id);
      REQUIRE(back.count(id));
      CHECK(same_record(back.at(id), rec));
    }

    const std::string out = dir / ("from-" + fmt);
    r = test::eaglekit("convert --jobs 2 " + quote(shard) + " " + quote(out));
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    const auto again = all_records(out);
    CHECK(again.size() == 6);
    for (const auto& [id, rec] : original) {
      CAPTURE(id);
      CHECK(fs::exists(out + "/" + id + ".pt"));
      CHECK(same_record(again.at(id), rec));
    }
    if (fmt != "hdf5") continue;  // the rest is format-independent: once is enough

    // inspect lists a shard's records, and FILE#id shows one.
    r = test::eaglekit("inspect --json " + quote(shard));
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    const auto listing = nlohmann::json::parse(r.out);
    CHECK(listing["record_count"] == 6);
    CHECK(listing["records"].size() == 6);
    CHECK(listing["records"][0]["hidden_size"] == 16);
    r = test::eaglekit("inspect --json " + quote(shard + "#synth-000004"));
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    const auto one = nlohmann::json::parse(r.out);
    CHECK(one["conversation_id"] == "synth-000004");
    CHECK(one["tensors"]["aux_hidden_states"]["shape"][1] == 48);
    r = test::eaglekit("inspect " + quote(shard + "#nobody"));
    CHECK(r.exit_code == 1);
    CHECK(r.err == "eaglekit inspect: error: " + shard +
                       ": no record with conversation id 'nobody' (6 records in the file)\n");
    // One record out of a shard into a single file.
    r = test::eaglekit("convert " + quote(shard + "#synth-000003") + " " + quote(dir / ("3-" + fmt + ".safetensors")));
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    CHECK(same_record(open_reader(dir / ("3-" + fmt + ".safetensors"))->read(0), original.at("synth-000003")));
  }

  // A folder of records into a folder of safetensors, chosen by --format.
  r = test::eaglekit("convert --format safetensors " + quote(data + "/records") + " " + quote(dir / "st/"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(fs::exists(dir / "st/synth-000005.safetensors"));
  CHECK(same_record(open_reader(dir / "st/synth-000005.safetensors")->read(0), original.at("synth-000005")));

  r = test::eaglekit("convert " + quote(record_path(data, 0)) + " " + quote(record_path(data, 0)));
  CHECK(r.exit_code == 2);
  CHECK(r.err == "eaglekit convert: DST " + record_path(data, 0) + " is the source file; write elsewhere\n");
  r = test::eaglekit("convert --format hdf5 " + quote(data + "/records") + " " + quote(dir / "st/"));
  CHECK(r.exit_code == 2);
}

TEST_CASE("cli: convert reads a hand-written h5py dump whose hidden and aux dtypes differ") {
  test::TempDir dir("climix");
  test::require_python("h5py");
  const auto py = test::python(R"PY(
import sys, h5py, numpy as np
with h5py.File(sys.argv[1], "w") as f:
    for i in range(3):
        g = f.create_group("conv-%d" % i)
        g["input_ids"] = np.arange(5 + i, dtype=np.int64)
        g["hidden_states"] = (np.arange((5 + i) * 8).reshape(5 + i, 8) / 7).astype(np.float16)
        g["aux_hidden_states"] = (np.arange((5 + i) * 24).reshape(5 + i, 24) / 3).astype(np.float32)
)PY",
                               {dir / "dump.h5"});
  REQUIRE_MESSAGE(py.exit_code == 0, py.err);
  auto r = test::eaglekit("convert --json " + quote(dir / "dump.h5") + " " + quote(dir / "out.eks"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const auto in = open_reader(dir / "dump.h5"), out = open_reader(dir / "out.eks");
  REQUIRE(out->size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    const Record a = in->read(i), b = out->read(*out->find(a.conversation_id));
    CHECK(out->info(i).hidden_dtype == DType::kFloat32);
    CHECK(same_record(a, b));  // the fp16 values widened exactly, the fp32 ones as they were
  }
}

TEST_CASE("cli: convert removes the temp files a killed earlier run left beside its outputs") {
  test::TempDir dir("cli");
  const std::string data = shared_dataset();
  const std::string dead = test::dead_pid();
  // Folder output: stale temps of this format's files go; another format's, a live
  // process's and finished files stay.
  fs::create_directories(dir / "st");
  const std::string stale = ".synth-000001.safetensors.tmp." + dead + ".3";
  const std::string other = ".notes.h5.tmp." + dead + ".0";
  const std::string live = ".x.safetensors.tmp." + std::to_string(::getpid()) + ".0";
  for (const auto& f : {stale, other, live}) test::write_text(dir / ("st/" + f), "half");
  auto r = test::eaglekit("convert --format safetensors " + quote(data + "/records") + " " + quote(dir / "st/"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK_FALSE(fs::exists(dir / ("st/" + stale)));
  CHECK(fs::exists(dir / ("st/" + other)));
  CHECK(fs::exists(dir / ("st/" + live)));
  CHECK(fs::exists(dir / "st/synth-000001.safetensors"));
  // Shard output: the shard's own stale temp goes, a sibling shard's stays.
  const std::string shard_stale = ".all.eks.tmp." + dead + ".0";
  const std::string sibling = ".other.eks.tmp." + dead + ".0";
  for (const auto& f : {shard_stale, sibling}) test::write_text(dir / f, "half");
  r = test::eaglekit("convert " + quote(data + "/records") + " " + quote(dir / "all.eks"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK_FALSE(fs::exists(dir / shard_stale));
  CHECK(fs::exists(dir / sibling));
  CHECK(fs::exists(dir / "all.eks"));
}

TEST_CASE("cli: a conversion that fails part-way leaves no output that looks complete") {
  test::TempDir dir("cli");
  const std::string data = dir / "data";
  fs::copy(shared_dataset(), data, fs::copy_options::recursive);
  // Corrupt the last record of the folder (sorted order puts more/ after the others).
  const std::string victim = record_path(data, 5);
  auto bytes = test::read_bytes(victim);
  bytes.resize(bytes.size() / 2);
  test::write_bytes(victim, bytes);
  for (const std::string ext : {"h5", "eks"}) {
    CAPTURE(ext);
    const std::string out_dir = dir / ("out-" + ext);
    fs::create_directories(out_dir);
    const auto r = test::eaglekit("convert " + quote(data + "/records") + " " + quote(out_dir + "/all." + ext));
    CHECK(r.exit_code == 1);
    CHECK(r.err.find(victim) != std::string::npos);
    CHECK_FALSE(any_file_below(out_dir));  // neither the shard nor its temp file
  }
  // Folder output: the records before the bad one are complete files, nothing else.
  const auto r = test::eaglekit("convert --jobs 1 " + quote(data + "/records") + " " + quote(dir / "pts"));
  CHECK(r.exit_code == 1);
  for (const auto& e : fs::directory_iterator(dir / "pts")) {
    CAPTURE(e.path().string());
    CHECK(e.path().filename().string().rfind('.', 0) != 0);  // no temp files
    CHECK_NOTHROW(open_reader(e.path().string())->read(0));
  }
}

TEST_CASE("cli: duplicate conversation ids cannot share a folder output") {
  test::TempDir dir("cli");
  const std::string& a = shared_dataset();
  fs::create_directories(dir / "both");
  fs::copy_file(record_path(a, 0), dir / "both/x.pt");
  fs::copy_file(record_path(a, 0), dir / "both/y.pt");
  const auto r = test::eaglekit("convert --jobs 1 " + quote(dir / "both") + " " + quote(dir / "out"));
  CHECK(r.exit_code == 1);
  CHECK(r.err == "eaglekit convert: error: two records have conversation id 'synth-000000' (the "
                 "second in " + dir / "both/y.pt" + "); a folder output names files by id, so ids "
                 "must be unique\n");
}

TEST_CASE("cli: stats --json and validate --deep --json describe the dataset; a planted NaN is quarantined for collate") {
  test::require_python("torch");
  test::TempDir dir("cli-stats");
  const std::string data = dir / "data";
  auto made = test::eaglekit("synth --out " + quote(data) + " --conversations 10 --hidden 16 --vocab 64 --min-tokens 4"
                             " --max-tokens 12 --seed 3 --dtype fp16");
  REQUIRE_MESSAGE(made.exit_code == 0, made.err);
  const std::string index = dir / "data.eki";
  auto r = test::eaglekit("index " + quote(data + "/records") + " --out " + quote(index) + " --jobs 2");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  // What Python's torch reads from the record files: tokens per record, dtype and widths.
  const auto py = test::python(
      "import glob, json, sys, torch\n"
      "t = []\n"
      "for p in sorted(glob.glob(sys.argv[1] + '/**/*.pt', recursive=True)):\n"
      "    r = torch.load(p)\n"
      "    t.append(r['input_ids'].numel())\n"
      "    assert r['hidden_states'].dtype == torch.float16, p\n"
      "    h, a = r['hidden_states'].shape[-1], r['aux_hidden_states'].shape[-1]\n"
      "print(json.dumps({'tokens': t, 'hidden': h, 'aux': a}))\n",
      {data + "/records"});
  REQUIRE_MESSAGE(py.exit_code == 0, py.err);
  const auto truth = nlohmann::json::parse(py.out);
  std::vector<std::int64_t> tokens = truth["tokens"];
  REQUIRE(tokens.size() == 10);
  std::sort(tokens.begin(), tokens.end());
  std::int64_t total = 0;
  for (auto t : tokens) total += t;
  std::uintmax_t bytes = 0;
  for (const auto& f : find_record_files(data + "/records")) bytes += fs::file_size(f);

  r = test::eaglekit("stats --index " + quote(index) + " --json");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const auto s = nlohmann::json::parse(r.out);
  CHECK(s["records"] == 10);
  CHECK(s["files"] == 10);
  CHECK(s["bad_records"] == 0);
  CHECK(s["total_tokens"] == total);
  CHECK(s["tokens"]["min"] == tokens.front());
  CHECK(s["tokens"]["max"] == tokens.back());
  CHECK(s["tokens"]["median"] == tokens[4]);  // nearest rank: ceil(0.5 * 10) = 5th
  CHECK(s["tokens"]["mean"].get<double>() == doctest::Approx(total / 10.0).epsilon(1e-12));
  CHECK(s["bytes_on_disk"] == bytes);
  CHECK(s["hidden_size"] == truth["hidden"]);
  CHECK(s["aux_width"] == truth["aux"]);
  CHECK(s["dtype"] == "float16");
  CHECK(s["per_dtype"] == nlohmann::json({{"float16", 10}}));
  CHECK(s["per_format"] == nlohmann::json({{"pt", 10}}));
  std::int64_t binned = 0;
  for (const auto& b : s["histogram"]) binned += b["count"].get<std::int64_t>();
  CHECK(binned == 10);

  const std::string convs = " --data " + quote(data + "/conversations.jsonl") + " --index " + quote(index);
  r = test::eaglekit("validate" + convs + " --deep --json -j 2");
  CHECK_MESSAGE(r.exit_code == 0, r.err);
  auto v = nlohmann::json::parse(r.out);
  CHECK(v["ok"] == true);
  CHECK(v["conversations"] == 10);
  CHECK(v["records"] == 10);
  CHECK(v["matched"] == 10);
  CHECK(v["nonfinite"].empty());
  CHECK(v["unreadable"].empty());

  // A NaN planted by torch in one record (then re-indexed): --deep finds it, names it, exits
  // 1, and its quarantine file keeps it out of collate.
  const std::string victim = record_path(data, 3);
  const auto plant = test::python(
      "import sys, torch\n"
      "r = torch.load(sys.argv[1]); h = r['hidden_states']\n"
      "h.view(-1, h.shape[-1])[2, 5] = float('nan'); torch.save(r, sys.argv[1])\n",
      {victim});
  REQUIRE_MESSAGE(plant.exit_code == 0, plant.err);
  r = test::eaglekit("index " + quote(data + "/records") + " --out " + quote(index) + " --jobs 2");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const std::string q = dir / "quarantine.txt";
  r = test::eaglekit("validate" + convs + " --deep --json -j 2 --quarantine " + quote(q));
  CHECK(r.exit_code == 1);
  v = nlohmann::json::parse(r.out);
  CHECK(v["ok"] == false);
  CHECK(v["nonfinite"] == nlohmann::json({"synth-000003"}));
  CHECK(v["quarantine"]["ids"] == 1);
  // Without --deep the NaN is not looked for: the check above is what found it.
  r = test::eaglekit("validate" + convs + " --json -j 2");
  CHECK(nlohmann::json::parse(r.out)["nonfinite"].empty());
  r = test::eaglekit("collate" + convs + " --quarantine " + quote(q) + " --split all --batch-size 3 --max-length 16"
                     " --json --out " + quote(dir / "batches"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(nlohmann::json::parse(r.out)["samples"] == 9);
  std::ifstream manifest(dir / "batches/batches.jsonl");
  std::string line;
  std::set<std::string> seen;
  while (std::getline(manifest, line)) {
    const auto batch = nlohmann::json::parse(line);
    for (const auto& id : batch["conversation_ids"]) seen.insert(id.get<std::string>());
  }
  CHECK(seen.size() == 9);
  CHECK(seen.count("synth-000003") == 0);
}
