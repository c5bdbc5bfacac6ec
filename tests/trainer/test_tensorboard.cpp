// trainer/io/tensorboard.h: event files read by an independent Python reader
// (tests/trainer/tfevents_reader.py: framing, CRC-32C, protobuf fields by number); a torn or
// corrupted tail is detected as such; `train` logs every metrics.jsonl number at its step,
// and a resumed run adds a file without touching the old one.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/support.h"
#include "tests/trainer/train_data.h"
#include "trainer/io/metrics_log.h"
#include "trainer/io/tensorboard.h"
#include "trainer/run/train.h"

namespace fs = std::filesystem;
using namespace eaglekit;
using namespace eaglekit::trainer;
using nlohmann::json;

namespace {

json read_events(const std::string& path) {
  test::require_python("json");
  const auto r = test::run(test::python_bin() + " " +
                           test::quote(test::source_dir() + "/tests/trainer/tfevents_reader.py") + " " +
                           test::quote(path));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  return json::parse(r.out);
}

std::vector<std::string> event_files(const std::string& dir) {
  std::vector<std::string> out;
  if (!fs::exists(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

TEST_CASE("tensorboard: CRC-32C and the masked form of TFRecord") {
  const std::string check = "123456789";
  CHECK(crc32c(check.data(), check.size()) == 0xE3069283u);  // the standard check value
  CHECK(crc32c("", 0) == 0u);
  // Continuing a CRC over a split input gives the CRC of the whole.
  CHECK(crc32c(check.data() + 4, 5, crc32c(check.data(), 4)) == 0xE3069283u);
  const std::uint32_t c = 0xE3069283u;
  CHECK(masked_crc32c(check.data(), check.size()) == ((c >> 15) | (c << 17)) + 0xa282ead8u);
}

TEST_CASE("tensorboard: event files read back in an independent reader; torn and corrupt tails detected") {
  test::TempDir d("tb");
  std::string path;
  {
    EventFileWriter w(d / "run");
    path = w.path();
    w.add_scalars(1, {{"train/loss", 1.5}, {"train/acc/step0", -2.25}}, 1000.5);
    w.add_scalars(7, {{"train/loss", 0.1}}, 1001.25);
    w.add_scalars(123456789012, {}, 1002);
  }
  CHECK(fs::path(path).filename().string().rfind("events.out.tfevents.", 0) == 0);
  const json e = read_events(path);
  CHECK(e["version"] == "brain.Event:2");
  CHECK(e["tail"] == "ok");
  REQUIRE(e["events"].size() == 3);
  CHECK(e["events"][0]["step"] == 1);
  CHECK(e["events"][0]["wall_time"] == 1000.5);
  CHECK(e["events"][0]["values"]["train/loss"] == 1.5);
  CHECK(e["events"][0]["values"]["train/acc/step0"] == -2.25);
  CHECK(e["events"][1]["values"]["train/loss"] == static_cast<double>(0.1f));  // float scalars
  CHECK(e["events"][2]["step"] == 123456789012);
  CHECK(e["events"][2]["values"].empty());
  // A second writer never reuses a file.
  { EventFileWriter again(d / "run"); CHECK(again.path() != path); }
  CHECK(event_files(d / "run").size() == 2);

  // A run killed mid-write leaves a torn last record: the ones before it read.
  const auto bytes = test::read_bytes(path);
  test::write_bytes(d / "torn", std::vector<std::uint8_t>(bytes.begin(), bytes.end() - 5));
  const json torn = read_events(d / "torn");
  CHECK(torn["tail"] == "truncated");
  CHECK(torn["events"].size() == 2);
  // A flipped byte in the last record's data fails its CRC.
  auto flipped = bytes;
  flipped[flipped.size() - 6] ^= 0x40;
  test::write_bytes(d / "flipped", flipped);
  const json bad = read_events(d / "flipped");
  CHECK(bad["tail"] == "bad crc at record 3");
  CHECK(bad["events"].size() == 2);

  CHECK_THROWS_AS(EventFileWriter(d / "run/" + fs::path(path).filename().string() + "/x"), IoError);
}

TEST_CASE("tensorboard: train logs every metrics number at its step; resume adds a file, the old one unchanged") {
  auto job = test::make_synth_job(24);
  test::TempDir dir("tbtrain");
  TrainOptions o = test::small_options(*job, dir / "out");
  o.max_steps = 3;
  o.schedule = Schedule::kConstant;
  o.eval_every = 2;
  run_training(o);
  const auto files = event_files(dir / "out/tensorboard");
  REQUIRE(files.size() == 1);
  const json e = read_events(files[0]);
  CHECK(e["tail"] == "ok");
  std::size_t checked = 0;
  for (const auto& line : test::read_jsonl(dir / "out/metrics.jsonl")) {
    const std::string prefix = line.value("split", "train") + "/";
    const std::int64_t step = line["step"];
    json values;
    for (const auto& ev : e["events"])
      if (ev["step"] == step && ev["values"].contains(prefix + "loss")) values = ev["values"];
    REQUIRE_MESSAGE(values.is_object(), "no event for " << prefix << " step " << step);
    for (const auto& [k, v] : line.items()) {
      if (k == "step" || k == "split") continue;
      if (v.is_number()) {
        CHECK_MESSAGE(values[prefix + k] == static_cast<double>(static_cast<float>(v.get<double>())), prefix << k);
        ++checked;
      }
      if (v.is_array())
        for (std::size_t s = 0; s < v.size(); ++s) {
          const std::string tag = prefix + k + "/step" + std::to_string(s);
          CHECK_MESSAGE(values[tag] == static_cast<double>(static_cast<float>(v[s].get<double>())), tag);
          ++checked;
        }
    }
  }
  CHECK(checked > 60);  // 3 train lines and 2 eval lines of a dozen numbers and lists each
  CHECK(e["events"][0]["values"].contains("train/peak_rss_mb"));

  const auto before = test::read_bytes(files[0]);
  TrainOptions more = o;
  more.max_steps = 4;
  more.resume = true;
  run_training(more);
  const auto after = event_files(dir / "out/tensorboard");
  REQUIRE(after.size() == 2);
  CHECK(test::read_bytes(files[0]) == before);
  const json resumed = read_events(after[0] == files[0] ? after[1] : after[0]);
  CHECK(resumed["events"][0]["step"] == 4);

  TrainOptions none = test::small_options(*job, dir / "none");
  none.max_steps = 1;
  none.no_tensorboard = true;
  run_training(none);
  CHECK_FALSE(fs::exists(dir / "none/tensorboard"));
  TrainOptions elsewhere = none;
  elsewhere.out = dir / "elsewhere";
  elsewhere.no_tensorboard = false;
  elsewhere.tensorboard = dir / "tb-here";
  run_training(elsewhere);
  CHECK(event_files(dir / "tb-here").size() == 1);
}

TEST_CASE("tensorboard: a fresh run into a folder without checkpoints deletes the earlier run's event files, saying so") {
  test::TempDir dir("tbstale");
  const std::string tb = dir / "out/tensorboard";
  fs::create_directories(tb);
  test::write_text(tb + "/events.out.tfevents.1.host.1.0", "an earlier run's");
  test::write_text(tb + "/notes.txt", "not an event file");
  std::vector<std::string> said;
  auto events = [&] {
    std::vector<std::string> v;
    for (const auto& f : event_files(tb))
      if (fs::path(f).filename().string().rfind("events.out.tfevents.", 0) == 0) v.push_back(f);
    return v;
  };
  {
    MetricsLog::Options mo;
    mo.out = dir / "out";
    mo.say = [&](const std::string& m) { said.push_back(m); };
    MetricsLog log(mo);
    log.write(R"({"step": 1, "loss": 2.5})");
  }
  const auto files = events();
  REQUIRE(files.size() == 1);
  CHECK(files[0] != tb + "/events.out.tfevents.1.host.1.0");
  CHECK(fs::exists(tb + "/notes.txt"));
  REQUIRE(said.size() == 1);
  CHECK(said[0].rfind("removed " + tb + "/events.out.tfevents.1.host.1.0, an event file of an earlier run", 0) == 0);
  // A resumed run keeps them: it continues the same log.
  said.clear();
  {
    MetricsLog::Options mo;
    mo.out = dir / "out";
    mo.resume_step = 1;
    mo.say = [&](const std::string& m) { said.push_back(m); };
    MetricsLog log(mo);
  }
  CHECK(events().size() == 2);
  CHECK(said.empty());
}

// A DFlash run's list-valued figures are per block position 1..block-1 (entry s is position
// s + 1), and TensorBoard names them so; a TTT run's per step from 0.
TEST_CASE("tensorboard: a block drafter's per-position figures are named by block position") {
  test::TempDir dir("tb-block");
  for (const bool block : {false, true}) {
    const std::string out = dir / (block ? "dflash" : "ttt");
    {
      MetricsLog::Options mo;
      mo.out = out;
      mo.block_positions = block;
      MetricsLog log(mo);
      log.write(R"({"step": 3, "loss": 2.5, "acc": [0.5, 0.25, 0.125]})");
      log.write(R"({"split": "eval", "step": 3, "acc": [0.75, 0.5, 0.25]})");
    }
    const auto files = event_files(out + "/tensorboard");
    REQUIRE(files.size() == 1);
    const json e = read_events(files[0]);
    REQUIRE(e["events"].size() == 2);
    const json& train = e["events"][0]["values"];
    const json& eval = e["events"][1]["values"];
    CAPTURE(train.dump());
    if (block) {
      CHECK(train["train/acc/position1"] == 0.5);
      CHECK(train["train/acc/position3"] == 0.125);
      CHECK(eval["eval/acc/position2"] == 0.5);
      CHECK_FALSE(train.contains("train/acc/step0"));
    } else {
      CHECK(train["train/acc/step0"] == 0.5);
      CHECK(eval["eval/acc/step2"] == 0.25);
      CHECK_FALSE(train.contains("train/acc/position1"));
    }
    CHECK(train["train/loss"] == 2.5);
  }
}
