// Checkpoints: exact resume (2N steps == N + resume + N), atomic folders and the choice of
// the newest complete one, state parsing errors, export with aux ids/dtype, and
// --init-draft from a checkpoint.
#include <ATen/ATen.h>
#include <doctest/doctest.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/support.h"
#include "tests/trainer/train_data.h"
#include "trainer/io/checkpoint.h"
#include "trainer/io/export.h"
#include "trainer/model/config.h"
#include "trainer/run/train.h"

namespace fs = std::filesystem;
using namespace eaglekit;
using namespace eaglekit::trainer;

using test::read_jsonl;

namespace {

// A small draft (hidden 16, vocab 20) for the tests that save and load checkpoints.
DraftModel small_draft() {
  BaseConfig b;
  b.hidden_size = 16;
  b.intermediate_size = 32;
  b.num_attention_heads = 2;
  b.num_key_value_heads = 1;
  b.head_dim = 8;
  b.num_hidden_layers = 8;
  b.vocab_size = 20;
  return DraftModel(draft_config_from_base(b, DraftOptions{}), at::zeros({20}, at::kLong), at::Tensor(), 4);
}

// A checkpoint with only what save_checkpoint needs: the RNG state and empty options.
Checkpoint bare_checkpoint() {
  Checkpoint ck;
  ck.rng = capture_rng_state();
  ck.options_json = "{}";
  return ck;
}

}  // namespace

TEST_CASE("checkpoint: a run of 2N steps equals N steps + resume + N steps (fp32, 1e-6)") {
  auto job = test::make_synth_job(30);
  test::TempDir dir("resume");
  auto options = [&](const std::string& out) {
    TrainOptions o = test::small_options(*job, out);
    o.max_steps = 8;  // 2N with N = 4; 24 train samples / (2 x 2 rows) = 6 steps per epoch: crosses an epoch
    o.batch_size = 2;
    o.grad_accum = 2;
    o.warmup_steps = 2;
    o.schedule = Schedule::kCosine;
    o.weight_decay = 0.05;
    o.shuffle = true;
    o.save_every = 3;
    return o;
  };
  const TrainResult whole = run_training(options(dir / "whole"));
  CHECK(whole.steps == 8);
  CHECK(whole.epoch >= 1);

  TrainHooks stop_at_4;
  stop_at_4.after_step = [](std::int64_t step, DraftModel&) { return step < 4; };
  const TrainResult first = run_training(options(dir / "split"), nullptr, stop_at_4);
  CHECK(first.interrupted);
  CHECK(first.steps == 4);
  CHECK(first.final_dir.empty());
  CHECK(first.last_checkpoint == dir / "split/checkpoint-4");
  CHECK(is_complete_checkpoint(dir / "split/checkpoint-3"));

  TrainOptions again = options(dir / "split");
  again.resume = true;
  const TrainResult second = run_training(again);
  CHECK(second.start_step == 4);
  CHECK(second.resumed_from == dir / "split/checkpoint-4");
  CHECK(second.steps == 8);

  const auto a = test::read_weights(dir / "whole/checkpoint-8/model.safetensors");
  const auto b = test::read_weights(dir / "split/checkpoint-8/model.safetensors");
  CHECK(test::max_rel_diff(b, a) < 1e-6);
  const auto ma = test::read_weights(dir / "whole/checkpoint-8/optimizer.safetensors");
  const auto mb = test::read_weights(dir / "split/checkpoint-8/optimizer.safetensors");
  CHECK(test::max_rel_diff(mb, ma) < 1e-6);
  // The weights moved: the equality is not vacuous.
  const auto mid = test::read_weights(dir / "split/checkpoint-4/model.safetensors");
  CHECK(test::max_rel_diff(mid, a) > 1e-4);

  // One metrics line per step, steps 1..8 once each, the same losses.
  const auto la = read_jsonl(dir / "whole/metrics.jsonl"), lb = read_jsonl(dir / "split/metrics.jsonl");
  REQUIRE(la.size() == 8);
  REQUIRE(lb.size() == 8);
  for (std::size_t i = 0; i < 8; ++i) {
    CHECK(lb[i]["step"] == i + 1);
    CHECK(lb[i]["loss"].get<double>() == doctest::Approx(la[i]["loss"].get<double>()).epsilon(1e-6));
    CHECK(lb[i]["lr"].get<double>() == doctest::Approx(la[i]["lr"].get<double>()).epsilon(1e-12));
  }
  CHECK(test::metric_rel_diff(dir / "split/metrics.jsonl", dir / "whole/metrics.jsonl", "grad_norm") < 1e-6);
  const LoadedCheckpoint ck = load_checkpoint(dir / "split/checkpoint-8");
  CHECK(ck.checkpoint.state.step == 8);
  CHECK(ck.checkpoint.state.optimizer_steps == 8);
  CHECK(ck.checkpoint.state.schedule_total_steps == 8);
  CHECK(ck.checkpoint.state.world_size == 1);
  CHECK(ck.checkpoint.options_json.find("\"max_steps\": 8") != std::string::npos);
}

TEST_CASE("checkpoint: with --optimizer muon, 2N steps equal N + resume + N (fp32, 1e-6); the other optimizer is refused") {
  auto job = test::make_synth_job(30);
  test::TempDir dir("resume_muon");
  auto options = [&](const std::string& out) {
    TrainOptions o = test::small_options(*job, out);
    o.max_steps = 6;
    o.batch_size = 2;
    o.warmup_steps = 1;
    o.optimizer = OptimizerKind::kMuon;
    o.muon_lr = 1e-3;  // its own rate on the shared schedule
    o.weight_decay = 0.05;
    o.shuffle = true;
    return o;
  };
  run_training(options(dir / "whole"));
  TrainHooks stop_at_3;
  stop_at_3.after_step = [](std::int64_t step, DraftModel&) { return step < 3; };
  CHECK(run_training(options(dir / "split"), nullptr, stop_at_3).steps == 3);

  TrainOptions other = options(dir / "split");
  other.resume = true;
  other.optimizer = OptimizerKind::kAdamW;
  CHECK_THROWS_WITH_AS(run_training(other),
                       doctest::Contains("was trained with --optimizer muon; resume with it (now adamw)"), UsageError);

  TrainOptions again = options(dir / "split");
  again.resume = true;
  const TrainResult second = run_training(again);
  CHECK(second.start_step == 3);
  CHECK(second.steps == 6);

  const auto a = test::read_weights(dir / "whole/checkpoint-6/model.safetensors");
  const auto b = test::read_weights(dir / "split/checkpoint-6/model.safetensors");
  CHECK(test::max_rel_diff(b, a) < 1e-6);
  const auto ma = test::read_weights(dir / "whole/checkpoint-6/optimizer.safetensors");
  const auto mb = test::read_weights(dir / "split/checkpoint-6/optimizer.safetensors");
  CHECK(test::max_rel_diff(mb, ma) < 1e-6);
  // Muon's buffers are saved in place of AdamW's moments for the matrices; lm_head keeps AdamW.
  auto has = [&](const std::string& name) {
    return std::any_of(ma.begin(), ma.end(), [&](const auto& np) { return np.first == name; });
  };
  CHECK(has("momentum_buffer.fc.weight"));
  CHECK_FALSE(has("exp_avg.fc.weight"));
  CHECK(has("exp_avg.lm_head.weight"));
  CHECK_FALSE(has("momentum_buffer.lm_head.weight"));
  const auto mid = test::read_weights(dir / "split/checkpoint-3/model.safetensors");
  CHECK(test::max_rel_diff(mid, a) > 1e-4);
  CHECK(test::metric_rel_diff(dir / "split/metrics.jsonl", dir / "whole/metrics.jsonl", "grad_norm") < 1e-6);
  CHECK(test::metric_rel_diff(dir / "split/metrics.jsonl", dir / "whole/metrics.jsonl", "loss") < 1e-6);
}

TEST_CASE("checkpoint: folders appear whole; the newest complete one is chosen; bad state files are named") {
  test::TempDir dir("ckpt");
  const DraftModel draft = small_draft();
  Checkpoint ck = bare_checkpoint();
  ck.state.sampler.samples = 10;
  ck.optimizer = {{"exp_avg.fc.weight", at::ones({16, 48})}};
  const std::string out = dir / "out";
  CHECK(!find_latest_checkpoint(out));
  for (std::int64_t step : {2, 5, 9}) {
    ck.state.step = step;
    CHECK(save_checkpoint(out, draft, ck) == out + "/" + checkpoint_name(step));
  }
  // Nothing but the checkpoints is left behind.
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(out)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"checkpoint-2", "checkpoint-5", "checkpoint-9"});
  CHECK(find_latest_checkpoint(out) == out + "/checkpoint-9");
  // A folder missing a file, a torn state, a leftover temp folder and a bigger non-checkpoint
  // name are all passed over.
  fs::remove(out + "/checkpoint-9/optimizer.safetensors");
  fs::create_directories(out + "/checkpoint-12");
  fs::copy(out + "/checkpoint-5", out + "/checkpoint-11", fs::copy_options::recursive);
  test::write_text(out + "/checkpoint-11/trainer_state.json", "{\"format\": \"eaglekit-checkpoint\", \"vers");
  fs::create_directories(out + "/.checkpoint-20.tmp-1");
  fs::create_directories(out + "/checkpoint-x");
  CHECK(!is_complete_checkpoint(out + "/checkpoint-9"));
  CHECK(find_latest_checkpoint(out) == out + "/checkpoint-5");
  CHECK(resolve_resume(out) == out + "/checkpoint-5");
  CHECK(resolve_resume(out + "/checkpoint-2") == out + "/checkpoint-2");
  CHECK_THROWS_WITH_AS(resolve_resume(dir / "nothing"),
                       ("--resume: no complete checkpoint in " + (dir / "nothing") +
                        " (looked for the folder itself and checkpoint-STEP folders below it)")
                           .c_str(),
                       UsageError);
  CHECK_THROWS_WITH_AS(load_checkpoint(out + "/checkpoint-9"),
                       (out + "/checkpoint-9: not a complete checkpoint (optimizer.safetensors is missing)").c_str(),
                       IoError);

  // Saving a step again replaces the older folder of that name.
  ck.state.step = 5;
  ck.state.tokens = 123;
  save_checkpoint(out, draft, ck);
  CHECK(load_checkpoint(out + "/checkpoint-5").checkpoint.state.tokens == 123);

  // State files: wrong format, newer version, missing field.
  CHECK_THROWS_WITH_AS(TrainerState::from_json(R"({"format": "other"})", "s.json"),
                       "s.json: format: not an eaglekit checkpoint state", FormatError);
  CHECK_THROWS_WITH_AS(TrainerState::from_json(R"({"format": "eaglekit-checkpoint", "version": 2})", "s.json"),
                       "s.json: version: checkpoint version 2 (this build reads 1)", UnsupportedError);
  CHECK_THROWS_WITH_AS(TrainerState::from_json(R"({"format": "eaglekit-checkpoint", "version": 1, "step": 3})", "s.json"),
                       "s.json: epoch: missing", FormatError);
  TrainerState s;
  s.step = 7;
  s.epoch = 2;
  s.sampler.epoch = 2;
  s.sampler.position = 8;
  s.sampler.samples = 40;
  s.schedule_total_steps = 30;
  const TrainerState back = TrainerState::from_json(s.to_json(), "s.json");
  CHECK(back.step == 7);
  CHECK(back.sampler == s.sampler);
  CHECK(back.schedule_total_steps == 30);

  // RNG state round trip.
  const auto rng = capture_rng_state();
  const at::Tensor x = at::rand({4});
  restore_rng_state(rng);
  CHECK(at::equal(at::rand({4}), x));
}

TEST_CASE("checkpoint: generator states round-trip through rng.safetensors, one per visible CUDA device") {
  // A CPU build only exercises "cpu" and the skipping of devices it does not have; the
  // per-device CUDA states are checked where a GPU is visible.
  test::TempDir dir("rng");
  const std::size_t devices = at::hasCUDA() ? torch::cuda::device_count() : 0;
  const auto states = capture_rng_state();
  std::vector<std::string> names, want{"cpu"};
  for (const auto& [name, state] : states) names.push_back(name);
  for (std::size_t i = 0; i < devices; ++i) want.push_back(i == 0 ? "cuda" : "cuda:" + std::to_string(i));
  CHECK(names == want);

  auto draws = [&] {
    std::vector<at::Tensor> out{at::rand({4})};
    for (std::size_t i = 0; i < devices; ++i)
      out.push_back(at::rand({4}, at::TensorOptions().device(c10::kCUDA, static_cast<c10::DeviceIndex>(i))).cpu());
    return out;
  };
  const auto first = draws();
  Checkpoint ck;
  ck.rng = states;
  ck.options_json = "{}";
  ck.state.step = 1;
  const std::string saved = save_checkpoint(dir / "out", small_draft(), ck);
  const auto again = draws();  // the generators moved on
  CHECK_FALSE(at::equal(again[0], first[0]));
  // States of devices not visible here (and names that are no device) are skipped.
  auto loaded = load_checkpoint(saved).checkpoint.rng;
  loaded.emplace_back("cuda:" + std::to_string(devices + 3), at::zeros({16}, at::kByte));
  loaded.emplace_back("cuda:x", at::zeros({16}, at::kByte));
  restore_rng_state(loaded);
  const auto replay = draws();
  REQUIRE(replay.size() == first.size());
  for (std::size_t i = 0; i < first.size(); ++i) {
    CAPTURE(i);
    CHECK(at::equal(replay[i], first[i]));
  }
}

TEST_CASE("checkpoint: temp folders of a killed save are removed by the next save; a live writer's stay") {
  test::TempDir dir("stale");
  const DraftModel draft = small_draft();
  Checkpoint ck = bare_checkpoint();
  const std::string out = dir / "out";
  const std::string dead = test::dead_pid();  // as a SIGKILLed run's
  fs::create_directories(out + "/.checkpoint-3.tmp-" + dead);
  test::write_text(out + "/.checkpoint-3.tmp-" + dead + "/model.safetensors", "half");
  fs::create_directories(out + "/.final.tmp-" + dead);
  fs::create_directories(out + "/.checkpoint-2.tmp-" + dead + ".old");
  fs::create_directories(out + "/.checkpoint-7.tmp-1");  // pid 1 is alive
  ck.state.step = 2;
  save_checkpoint(out, draft, ck);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(out)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{".checkpoint-7.tmp-1", "checkpoint-2"});
  CHECK(is_complete_checkpoint(out + "/checkpoint-2"));
}

TEST_CASE("checkpoint: prune_checkpoints keeps the newest N and the one just written; best/ is a whole checkpoint") {
  test::TempDir dir("prune");
  const DraftModel draft = small_draft();
  Checkpoint ck = bare_checkpoint();
  const std::string out = dir / "out";
  auto names = [&] {
    std::vector<std::string> v;
    for (const auto& e : fs::directory_iterator(out)) v.push_back(e.path().filename().string());
    std::sort(v.begin(), v.end());
    return v;
  };
  for (std::int64_t step : {2, 5, 9, 12}) {
    ck.state.step = step;
    save_checkpoint(out, draft, ck);
  }
  // best/ of step 9: hard links to checkpoint-9's files, plus best.json.
  ck.state.step = 9;
  BestCheckpoint b;
  b.step = 9;
  b.est_ar = 1.75;
  CHECK(save_best_checkpoint(out, draft, ck, b, out + "/checkpoint-9") == out + "/best");
  CHECK(fs::hard_link_count(out + "/best/model.safetensors") == 2);
  CHECK(is_complete_checkpoint(out + "/best"));
  // keep <= 0 keeps all.
  CHECK(prune_checkpoints(out, 0, out + "/checkpoint-12").empty());
  CHECK(names() == std::vector<std::string>{"best", "checkpoint-12", "checkpoint-2", "checkpoint-5", "checkpoint-9"});
  CHECK(prune_checkpoints(out, 2, out + "/checkpoint-12") ==
        std::vector<std::string>{out + "/checkpoint-5", out + "/checkpoint-2"});
  CHECK(names() == std::vector<std::string>{"best", "checkpoint-12", "checkpoint-9"});
  CHECK(find_latest_checkpoint(out) == out + "/checkpoint-12");
  // A run resumed from an earlier step writes checkpoint-10 beside the newer 12: the one just
  // written always stays.
  ck.state.step = 10;
  const std::string ten = save_checkpoint(out, draft, ck);
  CHECK(prune_checkpoints(out, 1, ten) == std::vector<std::string>{out + "/checkpoint-12", out + "/checkpoint-9"});
  CHECK(names() == std::vector<std::string>{"best", "checkpoint-10"});
  // best/ outlived its step's folder, whole.
  CHECK(is_complete_checkpoint(out + "/best"));
  CHECK(load_checkpoint(out + "/best").checkpoint.state.step == 9);
  const auto read = read_best(out);
  REQUIRE(read);
  CHECK(read->step == 9);
  CHECK(read->est_ar == 1.75);
  CHECK(read->metric == "est_ar");
  CHECK(!read_best(dir / "nothing"));
  // Without a checkpoint of its step, best/ is written in full; a newer best replaces it.
  b.step = 10;
  b.est_ar = 2.0;
  save_best_checkpoint(out, draft, ck, b);
  CHECK(fs::hard_link_count(out + "/best/model.safetensors") == 1);
  CHECK(read_best(out)->step == 10);
  CHECK(load_checkpoint(out + "/best").checkpoint.state.step == 10);
  CHECK(names() == std::vector<std::string>{"best", "checkpoint-10"});
  test::write_text(out + "/best/best.json", "{\"metric\": \"est_ar\"");
  CHECK_THROWS_AS(read_best(out), FormatError);
}

TEST_CASE("checkpoint: export writes the aux ids both ways and the serving dtype; --init-draft continues from it") {
  auto job = test::make_synth_job(24);
  test::TempDir dir("export");
  TrainOptions o = test::small_options(*job, dir / "out");
  o.max_steps = 3;
  o.schedule = Schedule::kConstant;
  run_training(o);

  ExportCheckpointOptions as_bf16;
  as_bf16.aux_layer_ids = {3, 17, 29};
  as_bf16.dtype = "bf16";
  const ExportReport r = export_checkpoint(dir / "out", dir / "served", as_bf16);
  CHECK(r.source == dir / "out/checkpoint-3");
  CHECK(r.dtype == "bfloat16");
  const auto cfg = nlohmann::json::parse(std::ifstream(dir / "served/config.json"));
  CHECK(cfg["eagle_aux_hidden_state_layer_ids"] == nlohmann::json({3, 17, 29}));
  CHECK(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == nlohmann::json({2, 16, 28}));
  CHECK(cfg["torch_dtype"] == "bfloat16");
  const auto served = test::read_weights(dir / "served/model.safetensors");
  const auto saved = test::read_weights(dir / "out/checkpoint-3/model.safetensors");
  REQUIRE(served.size() == saved.size());
  for (std::size_t i = 0; i < served.size(); ++i) {
    CAPTURE(served[i].first);
    if (served[i].first == "d2t" || served[i].first == "t2d") {
      CHECK(at::equal(served[i].second, saved[i].second));
    } else {
      CHECK((served[i].second.scalar_type() == at::kBFloat16));
      // bf16 rounding (nearest even) of the float32 checkpoint is exact and known: equal bits.
      CHECK(at::equal(served[i].second, saved[i].second.to(at::kBFloat16)));
    }
  }
  CHECK_THROWS_AS(export_checkpoint(dir / "nothing-here", dir / "x"), UsageError);
  ExportCheckpointOptions as_int8;
  as_int8.dtype = "int8";
  CHECK_THROWS_WITH_AS(export_checkpoint(dir / "out/checkpoint-3", dir / "y", as_int8),
                       "dtype must be bfloat16, float16 or float32, not 'int8'", UsageError);

  // --init-draft: a fresh run that starts from the checkpoint's weights. With a vanishing
  // learning rate its first checkpoint holds those weights.
  TrainOptions init = test::small_options(*job, dir / "init");
  init.init_draft = dir / "out/checkpoint-3";
  init.max_steps = 1;
  init.lr = 1e-30;
  run_training(init);
  const auto continued = test::read_weights(dir / "init/checkpoint-1/model.safetensors");
  CHECK(test::max_rel_diff(continued, saved) < 1e-6);
  // ... and a fresh draft is different.
  TrainOptions fresh = init;
  fresh.out = dir / "fresh";
  fresh.init_draft.clear();
  run_training(fresh);
  CHECK(test::max_rel_diff(test::read_weights(dir / "fresh/checkpoint-1/model.safetensors"), saved) > 1e-3);
}

TEST_CASE("checkpoint: a speculators export takes --speculative-tokens 0 as the trained TTT steps and refuses a negative count saying so") {
  auto job = test::make_synth_job(24);
  test::TempDir dir("spec-tokens");
  TrainOptions o = test::small_options(*job, dir / "out");
  o.max_steps = 1;
  o.ttt_steps = 2;
  run_training(o);
  ExportCheckpointOptions spec;
  spec.format = ExportFormat::kSpeculators;
  spec.verifier = "base";
  spec.speculative_tokens = 0;  // what export's --speculative-tokens leaves when not given
  CHECK(export_checkpoint(dir / "out", dir / "zero", spec).speculative_tokens == 2);
  spec.speculative_tokens = 3;
  CHECK(export_checkpoint(dir / "out", dir / "three", spec).speculative_tokens == 3);
  spec.speculative_tokens = -1;
  CHECK_THROWS_WITH_AS(export_checkpoint(dir / "out", dir / "negative", spec),
                       "--speculative-tokens must be at least 1 (0: the --ttt-steps the draft was trained with), not -1",
                       UsageError);
}

TEST_CASE("checkpoint: final/, final/ after resume and export are in the base's dtype; float32 warns; "
          "a draft no engine computes is refused for serving") {
  auto job = test::make_synth_job(24);
  test::TempDir dir("serving");
  // The synthetic base is float32; declare it bf16, as real bases are.
  auto base_cfg = nlohmann::json::parse(std::ifstream(job->base + "/config.json"));
  base_cfg["torch_dtype"] = "bfloat16";
  test::write_text(job->base + "/config.json", base_cfg.dump());
  auto json_of = [](const std::string& path) { return nlohmann::json::parse(std::ifstream(path)); };
  auto weights_dtype = [](const std::string& path) {
    return std::string(dtype_name(SafetensorsFile::open(path)->get("fc.weight")->dtype));
  };
  TrainOptions o = test::small_options(*job, dir / "out");
  o.max_steps = 2;
  o.schedule = Schedule::kConstant;
  run_training(o);
  CHECK(json_of(dir / "out/final/config.json")["torch_dtype"] == "bfloat16");
  CHECK(weights_dtype(dir / "out/final/model.safetensors") == "bfloat16");
  // A checkpoint stores float32 weights and remembers the serving dtype beside them.
  const auto ck = json_of(dir / "out/checkpoint-2/config.json");
  CHECK(ck["torch_dtype"] == "float32");
  CHECK(ck["eaglekit_serving_dtype"] == "bfloat16");
  CHECK(weights_dtype(dir / "out/checkpoint-2/model.safetensors") == "float32");
  // What the engines read besides: the fc's k, and the first-layer form trained here.
  const auto served = json_of(dir / "out/final/config.json");
  CHECK(served["num_aux_hidden_states"] == 3);
  CHECK(served["norm_before_residual"] == false);

  // Resumed: final/ is still in the base's dtype (it was float32, from the checkpoint).
  TrainOptions more = o;
  more.max_steps = 3;
  more.resume = true;
  run_training(more);
  CHECK(json_of(dir / "out/final/config.json")["torch_dtype"] == "bfloat16");
  CHECK(weights_dtype(dir / "out/final/model.safetensors") == "bfloat16");

  // export: the serving dtype by default; float32 when asked, with the SGLang warning.
  ExportReport r = export_checkpoint(dir / "out", dir / "served");
  CHECK(r.dtype == "bfloat16");
  CHECK(r.warnings.empty());
  CHECK(weights_dtype(dir / "served/model.safetensors") == "bfloat16");
  ExportCheckpointOptions fp32;
  fp32.dtype = "fp32";
  r = export_checkpoint(dir / "out", dir / "served32", fp32);
  CHECK(r.dtype == "float32");
  REQUIRE(r.warnings.size() == 1);
  CHECK(r.warnings[0].find("SGLang's --dtype auto serves a float32 config as float16") != std::string::npos);
  CHECK(json_of(dir / "served32/config.json")["torch_dtype"] == "float32");

  // ModelOpt's norm form: refused before any step, and at export, unless allowed.
  TrainOptions mo = test::small_options(*job, dir / "mo");
  mo.max_steps = 1;
  mo.modelopt_norm = true;
  CHECK_THROWS_WITH_AS(run_training(mo), doctest::Contains("train: the draft uses ModelOpt's norm form"), UsageError);
  CHECK_FALSE(fs::exists(dir / "mo/checkpoint-1"));
  mo.allow_unservable = true;
  run_training(mo);
  CHECK(fs::exists(dir / "mo/final/config.json"));
  CHECK_THROWS_WITH_AS(export_checkpoint(dir / "mo", dir / "mo-served"),
                       doctest::Contains("neither vLLM nor SGLang computes"), UsageError);
  CHECK_FALSE(fs::exists(dir / "mo-served"));
  ExportCheckpointOptions allow;
  allow.allow_unservable = true;
  export_checkpoint(dir / "mo", dir / "mo-served", allow);
  CHECK(json_of(dir / "mo-served/config.json")["eaglekit_modelopt_norm"] == true);
}
