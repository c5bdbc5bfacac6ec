#include "tests/torch_doctest.h"
#include <c10/core/GradMode.h>  // c10::NoGradGuard: LibTorch 2.x ATen.h no longer declares at::NoGradGuard

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "formats/error.h"
#include "formats/safetensors_format.h"
#include "tests/support.h"
#include "tests/trainer/trainer_fixtures.h"
#include "trainer/io/export.h"
#include "trainer/model/base_model.h"
#include "trainer/unroll/ttt.h"

using namespace eaglekit;
using namespace eaglekit::trainer;

namespace {

DraftModel trained_looking_draft(const DraftConfig& c, const BaseModel& base) {
  DraftModel d(c, fixtures::spread_d2t(c), base.lm_head, 91);
  // Norm weights away from 1 (every 1-D parameter, in export order).
  for (const auto& [n, p] : d.named_parameters())
    if (p.dim() == 1) d.load_parameter(n, 1.0 + 0.3 * at::randn({c.hidden_size}));
  return d;
}

// The tensors of an exported file, to rewrite broken variants of it.
std::vector<std::pair<std::string, at::Tensor>> read_all(const std::string& path) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  const auto file = SafetensorsFile::open(path);
  for (const auto& e : file->entries()) out.emplace_back(e.name, tensor_from_host(file->tensor(e)));
  return out;
}

template <typename E>
std::string load_error(const std::string& dir) {
  try {
    load_draft(dir);
  } catch (const E& e) {
    return e.what();
  }
  return "(no exception)";
}

}  // namespace

TEST_CASE("export: export then load is bit-exact and computes the same loss") {
  test::TempDir dir("export-rt");
  DraftConfig c = fixtures::tiny_config();
  c.modelopt_norm = true;
  const BaseModel base = fixtures::random_base(c, 90);
  const DraftModel d = trained_looking_draft(c, base);
  export_draft(d, dir / "draft");
  CHECK(std::filesystem::exists(dir / "draft/config.json"));
  CHECK(std::filesystem::exists(dir / "draft/model.safetensors"));
  const DraftModel back = load_draft(dir / "draft");
  const auto a = d.named_parameters(), b = back.named_parameters();
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].first == b[i].first);
    CHECK(at::equal(a[i].second, b[i].second));
  }
  CHECK(at::equal(d.d2t(), back.d2t()));
  const DraftConfig& bc = back.config();
  CHECK(bc.modelopt_norm);
  CHECK(bc.rope_scaling == c.rope_scaling);
  CHECK(bc.aux_layer_ids == c.aux_layer_ids);
  CHECK(bc.draft_vocab_size == c.draft_vocab_size);
  CHECK(bc.torch_dtype == "float32");

  const TttBatch batch = fixtures::random_batch(c, 2, 10, {10, 7}, 92);
  c10::NoGradGuard no_grad;
  TttUnroll u1(base, d), u2(base, back);
  CHECK(u1.forward(batch).loss.item<float>() == u2.forward(batch).loss.item<float>());
}

TEST_CASE("export: a folder export appears whole; a failed one leaves the old folder and no temp folder") {
  namespace fs = std::filesystem;
  test::TempDir dir("export-atomic");
  const DraftConfig c = fixtures::tiny_config();
  const BaseModel base = fixtures::random_base(c, 93);
  const DraftModel d = trained_looking_draft(c, base);
  const std::string out = dir / "served";
  auto entries = [](const std::string& folder) {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(folder)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  };
  const std::vector<std::string> kDraftFiles = {"config.json", "model.safetensors"};

  export_draft_folder(d, out);
  CHECK(entries(dir.path()) == std::vector<std::string>{"served"});
  CHECK(entries(out) == kDraftFiles);
  const auto old_model = test::read_bytes(out + "/model.safetensors");
  const auto old_config = test::read_bytes(out + "/config.json");
  REQUIRE(old_model.size() > 16 * 1024);

  // A failure in the middle of writing model.safetensors: with a 4 KiB file size limit (and
  // SIGXFSZ ignored) the first 4 KiB are written, then write() fails with EFBIG. The bf16
  // export would differ in every byte, so an in-place write would show.
  ExportOptions bf16;
  bf16.dtype = at::kBFloat16;
  {
    rlimit saved{};
    REQUIRE(::getrlimit(RLIMIT_FSIZE, &saved) == 0);
    rlimit small = saved;
    small.rlim_cur = 4096;
    const auto previous = std::signal(SIGXFSZ, SIG_IGN);
    REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
    std::string err = "(no error)";
    try {
      export_draft_folder(d, out, bf16);
    } catch (const IoError& e) {
      err = e.what();
    }
    ::setrlimit(RLIMIT_FSIZE, &saved);
    std::signal(SIGXFSZ, previous);
    CHECK(err.find("File too large") != std::string::npos);
  }
  CHECK(test::read_bytes(out + "/model.safetensors") == old_model);
  CHECK(test::read_bytes(out + "/config.json") == old_config);
  CHECK(entries(dir.path()) == std::vector<std::string>{"served"});
  CHECK(entries(out) == kDraftFiles);

  // A complete export replaces the old folder.
  export_draft_folder(d, out, bf16);
  CHECK(entries(dir.path()) == std::vector<std::string>{"served"});
  CHECK(entries(out) == kDraftFiles);
  CHECK(load_draft(out).config().torch_dtype == "bfloat16");

  // Refused before anything is written: a file in the way, a folder holding other files
  // (it would be replaced as a whole).
  test::write_text(dir / "file", "keep");
  CHECK_THROWS_WITH_AS(export_draft_folder(d, dir / "file"),
                       (dir / "file" + ": exists and is not a folder (export writes a folder)").c_str(),
                       UsageError);
  fs::create_directories(dir / "hf");
  test::write_text(dir / "hf/tokenizer.json", "{}");
  CHECK_THROWS_WITH_AS(export_draft_folder(d, dir / "hf"),
                       (dir / "hf" + ": holds tokenizer.json, which is not part of an exported draft; "
                                     "export replaces the folder as a whole, so give a new or empty folder")
                           .c_str(),
                       UsageError);
  CHECK(entries(dir / "hf") == std::vector<std::string>{"tokenizer.json"});
  CHECK(entries(dir.path()) == std::vector<std::string>{"file", "hf", "served"});
  // A folder named config.json in an old export: written in place, model.safetensors would
  // be replaced before config.json failed, leaving a new model beside no config.
  const auto bf16_model = test::read_bytes(out + "/model.safetensors");
  fs::remove(out + "/config.json");
  fs::create_directories(out + "/config.json/x");
  CHECK_THROWS_WITH_AS(export_draft_folder(d, out),
                       (out + ": holds config.json (not a file), which is not part of an exported draft; "
                              "export replaces the folder as a whole, so give a new or empty folder")
                           .c_str(),
                       UsageError);
  CHECK(test::read_bytes(out + "/model.safetensors") == bf16_model);
  CHECK(entries(dir.path()) == std::vector<std::string>{"file", "hf", "served"});
  fs::remove_all(out + "/config.json");

  // Temp folders of a killed export to the same folder are removed; a live process's and
  // those of other folders stay.
  const std::string dead = test::dead_pid();
  fs::create_directories(dir / (".served.tmp-" + dead));
  test::write_text(dir / (".served.tmp-" + dead + "/model.safetensors"), "half");
  fs::create_directories(dir / (".served.tmp-" + dead + ".old"));
  fs::create_directories(dir / ".served.tmp-1");  // pid 1 is alive
  fs::create_directories(dir / (".other.tmp-" + dead));
  export_draft_folder(d, out + "/");
  CHECK(entries(dir.path()) ==
        std::vector<std::string>{".other.tmp-" + dead, ".served.tmp-1", "file", "hf", "served"});
  CHECK(load_draft(out).config().torch_dtype == "float32");
}

TEST_CASE("export: the folder opens in Python with the exact names, shapes, dtypes and config") {
  test::TempDir dir("export-py");
  const DraftConfig c = fixtures::tiny_config();
  const BaseModel base = fixtures::random_base(c, 93);
  const DraftModel d = trained_looking_draft(c, base);
  export_draft(d, dir / "fp32");
  ExportOptions as_bf16;
  as_bf16.dtype = at::kBFloat16;
  export_draft(d, dir / "bf16", as_bf16);
  const auto r = test::python(R"(
import json, struct, sys, torch
out = {}
for name in sys.argv[1:]:
    raw = open(name + "/model.safetensors", "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", None)
    order = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    ends = [0] + [v["data_offsets"][1] for _, v in order]
    tiles = all(v["data_offsets"][0] == ends[i] for i, (_, v) in enumerate(order))
    T = {"F32": torch.float32, "BF16": torch.bfloat16, "I64": torch.int64, "BOOL": torch.bool}
    data = raw[8 + n:]
    def tensor(k):
        v = header[k]; b, e = v["data_offsets"]
        return torch.frombuffer(bytearray(data[b:e]), dtype=T[v["dtype"]]).reshape(v["shape"])
    d2t, t2d = tensor("d2t"), tensor("t2d")
    target = torch.arange(d2t.shape[0]) + d2t
    out[name.rsplit("/", 1)[1]] = {
        "meta": meta, "header_len_mod8": n % 8, "tiles": tiles and ends[-1] == len(data),
        "order": [k for k, _ in order],
        "tensors": {k: [v["dtype"], v["shape"]] for k, v in header.items()},
        "t2d_matches": bool(t2d.sum() == d2t.shape[0] and t2d[target].all()),
        "d2t": d2t.tolist(),
        "lm_head_row0": tensor("lm_head.weight")[0, :3].float().tolist(),
        "config": json.load(open(name + "/config.json")),
    }
print(json.dumps(out))
)", {dir / "fp32", dir / "bf16"});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const auto j = nlohmann::json::parse(r.out);
  const auto& f = j["fp32"];
  CHECK((f["meta"] == nlohmann::json{{"format", "pt"}}));
  CHECK(f["header_len_mod8"] == 0);
  CHECK(f["tiles"] == true);
  CHECK(f["t2d_matches"] == true);
  const nlohmann::json expected = {
      {"fc.weight", {"F32", {32, 96}}},
      {"midlayer.input_layernorm.weight", {"F32", {32}}},
      {"midlayer.hidden_norm.weight", {"F32", {32}}},
      {"midlayer.self_attn.q_proj.weight", {"F32", {32, 64}}},
      {"midlayer.self_attn.k_proj.weight", {"F32", {16, 64}}},
      {"midlayer.self_attn.v_proj.weight", {"F32", {16, 64}}},
      {"midlayer.self_attn.o_proj.weight", {"F32", {32, 32}}},
      {"midlayer.post_attention_layernorm.weight", {"F32", {32}}},
      {"midlayer.mlp.gate_proj.weight", {"F32", {48, 32}}},
      {"midlayer.mlp.up_proj.weight", {"F32", {48, 32}}},
      {"midlayer.mlp.down_proj.weight", {"F32", {32, 48}}},
      {"norm.weight", {"F32", {32}}},
      {"lm_head.weight", {"F32", {24, 32}}},
      {"d2t", {"I64", {24}}},
      {"t2d", {"BOOL", {40}}},
  };
  CHECK(f["tensors"] == expected);
  // Sorted by alignment (8-byte d2t first, then 4-byte floats by name, then bool).
  CHECK(f["order"].front() == "d2t");
  CHECK(f["order"][1] == "fc.weight");
  CHECK(f["order"][2] == "lm_head.weight");
  CHECK(f["order"].back() == "t2d");
  std::vector<std::int64_t> d2t;
  for (std::int64_t i = 0; i < c.draft_vocab_size; ++i) d2t.push_back(d.d2t()[i].item<std::int64_t>());
  CHECK(f["d2t"].get<std::vector<std::int64_t>>() == d2t);

  const auto& cfg = f["config"];
  CHECK(cfg["architectures"] == nlohmann::json::array({"LlamaForCausalLMEagle3"}));
  CHECK(cfg["model_type"] == "llama");
  CHECK(cfg["hidden_size"] == 32);
  CHECK(cfg["intermediate_size"] == 48);
  CHECK(cfg["num_hidden_layers"] == 1);
  CHECK(cfg["num_attention_heads"] == 4);
  CHECK(cfg["num_key_value_heads"] == 2);
  CHECK(cfg["head_dim"] == 8);
  CHECK(cfg["hidden_act"] == "silu");
  CHECK(cfg["rms_norm_eps"] == 1e-5);
  CHECK(cfg["vocab_size"] == 40);
  CHECK(cfg["draft_vocab_size"] == 24);
  CHECK(cfg["target_hidden_size"] == 32);
  CHECK(cfg["max_position_embeddings"] == 256);
  CHECK(cfg["rope_theta"] == 10000.0);
  CHECK((cfg["rope_scaling"] == nlohmann::json{{"rope_type", "llama3"},
                                               {"factor", 4.0},
                                               {"low_freq_factor", 1.0},
                                               {"high_freq_factor", 4.0},
                                               {"original_max_position_embeddings", 64}}));
  CHECK(cfg["tie_word_embeddings"] == false);
  CHECK(cfg["torch_dtype"] == "float32");
  CHECK(cfg["eagle_aux_hidden_state_layer_ids"] == nlohmann::json::array({2, 4, 5}));
  CHECK(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == nlohmann::json::array({1, 3, 4}));
  CHECK_FALSE(f["tensors"].contains("embed_tokens.weight"));

  const auto& h = j["bf16"];
  CHECK(h["config"]["torch_dtype"] == "bfloat16");
  CHECK((h["tensors"]["fc.weight"] == nlohmann::json{"BF16", {32, 96}}));
  CHECK((h["tensors"]["d2t"] == nlohmann::json{"I64", {24}}));
  CHECK((h["tensors"]["t2d"] == nlohmann::json{"BOOL", {40}}));
  const at::Tensor row0 = d.named_parameters().back().second[0].narrow(0, 0, 3).to(at::kBFloat16).to(at::kFloat);
  for (int i = 0; i < 3; ++i) CHECK(h["lm_head_row0"][i].get<double>() == row0[i].item<double>());
  // A bf16 export loads (into float32) as the bf16-rounded weights, every parameter exactly:
  // round-to-nearest-even of each float32 is one known value. At least one element of each
  // moved (not stored as float32 and read back).
  const DraftModel back = load_draft(dir / "bf16");
  const auto got = back.named_parameters(), want = d.named_parameters();
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    CAPTURE(want[i].first);
    CHECK(got[i].first == want[i].first);
    CHECK(at::equal(got[i].second, want[i].second.to(at::kBFloat16).to(at::kFloat)));
    CHECK_FALSE(at::equal(got[i].second, want[i].second));
  }
}

TEST_CASE("export: loading refuses broken folders with the file and tensor named") {
  test::TempDir dir("export-bad");
  const DraftConfig c = fixtures::tiny_config();
  const BaseModel base = fixtures::random_base(c, 95);
  export_draft(trained_looking_draft(c, base), dir / "good");
  const auto tensors = read_all(dir / "good/model.safetensors");
  const std::string config = dir / "good/config.json";

  auto variant = [&](const std::string& name, auto edit) {
    std::filesystem::create_directories(dir / name);
    std::filesystem::copy_file(config, dir / (name + "/config.json"));
    auto t = tensors;
    edit(t);
    fixtures::write_tensors(dir / (name + "/model.safetensors"), t);
    return dir / name;
  };
  auto drop = [](const std::string& which) {
    return [which](std::vector<std::pair<std::string, at::Tensor>>& t) {
      t.erase(std::remove_if(t.begin(), t.end(), [&](const auto& p) { return p.first == which; }), t.end());
    };
  };
  const std::string missing = variant("missing", drop("midlayer.mlp.up_proj.weight"));
  CHECK(load_error<FormatError>(missing) == missing + ": midlayer.mlp.up_proj.weight: missing");

  const std::string shape = variant("shape", [](auto& t) {
    for (auto& [n, v] : t)
      if (n == "fc.weight") v = at::zeros({32, 64});
  });
  CHECK(load_error<FormatError>(shape) ==
        shape + "/model.safetensors: fc.weight: shape [32, 64] does not match config.json (expected [32, 96])");

  const std::string extra = variant("extra", [](auto& t) { t.emplace_back("layers.1.mlp.up_proj.weight", at::zeros({2})); });
  CHECK(load_error<FormatError>(extra) == extra +
        "/model.safetensors: layers.1.mlp.up_proj.weight: mixes decoder layer names (layers.{i}.*, midlayer.*)");
  const std::string unknown = variant("unknown", [](auto& t) { t.emplace_back("midlayer.rotary.inv_freq", at::zeros({2})); });
  CHECK(load_error<FormatError>(unknown) == unknown +
        "/model.safetensors: midlayer.rotary.inv_freq: not part of a 1-layer EAGLE-3 draft (unexpected tensor)");

  const std::string embed = variant("embed", [](auto& t) { t.emplace_back("embed_tokens.weight", at::zeros({40, 32})); });
  CHECK_NOTHROW(load_draft(embed));  // published drafts sometimes carry the embeddings

  const std::string t2d = variant("t2d", [](auto& t) {
    for (auto& [n, v] : t)
      if (n == "t2d") v = at::ones({40}, at::kBool);
  });
  CHECK(load_error<FormatError>(t2d) ==
        t2d + "/model.safetensors: t2d: does not mark exactly the target tokens d2t maps to");

  const std::string no_d2t = variant("no-d2t", drop("d2t"));
  CHECK(load_error<FormatError>(no_d2t) ==
        no_d2t + ": d2t: missing, and draft_vocab_size != vocab_size so it cannot be implied");

  CHECK_THROWS_AS(load_draft(dir / "nothing-here"), IoError);
  DraftConfig unknown_ids = c;
  unknown_ids.aux_layer_ids.clear();
  CHECK_THROWS_AS(export_draft(DraftModel(unknown_ids, fixtures::spread_d2t(c), at::Tensor()), dir / "no-ids"), UsageError);
  CHECK_FALSE(std::filesystem::exists(dir / "no-ids/model.safetensors"));
}

TEST_CASE("export: a two-layer draft round-trips under layers.{i}, midlayer.{i} and model. names; its depth is checked") {
  test::TempDir dir("export-deep");
  DraftConfig c = fixtures::tiny_config();
  c.num_hidden_layers = 2;
  const BaseModel base = fixtures::random_base(c, 96);
  const DraftModel d = trained_looking_draft(c, base);
  export_draft(d, dir / "ours");
  const auto tensors = read_all(dir / "ours/model.safetensors");
  std::set<std::string> names;
  for (const auto& [n, t] : tensors) names.insert(n);
  CHECK(names.count("layers.0.hidden_norm.weight"));
  CHECK(names.count("layers.1.input_layernorm.weight"));
  CHECK(!names.count("layers.1.hidden_norm.weight"));
  CHECK(!names.count("midlayer.input_layernorm.weight"));
  const std::string config = [&] {
    std::ifstream f(dir / "ours/config.json");
    return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  }();
  CHECK(nlohmann::json::parse(config)["num_hidden_layers"] == 2);

  auto variant = [&](const std::string& name, const std::string& config_text, auto rename) {
    std::filesystem::create_directories(dir / name);
    test::write_text(dir / (name + "/config.json"), config_text);
    std::vector<std::pair<std::string, at::Tensor>> t;
    for (const auto& [n, v] : tensors)
      if (auto r = rename(n)) t.emplace_back(*r, v);
    fixtures::write_tensors(dir / (name + "/model.safetensors"), t);
    return dir / name;
  };
  auto same = [&](const DraftModel& got) {
    const auto a = got.named_parameters(), b = d.named_parameters();
    REQUIRE(a.size() == b.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      CAPTURE(a[i].first);
      CHECK(a[i].first == b[i].first);
      CHECK(at::equal(a[i].second, b[i].second));
    }
  };
  DraftSource src;
  same(load_draft(dir / "ours", &src));
  CHECK(src.layout == "eaglekit (model.safetensors, layers.{i}.*)");
  // Some deep ModelOpt exports say midlayer.{i}; vLLM checkpoints may carry model.
  const std::string mid = variant("midlayer-i", config, [](const std::string& n) -> std::optional<std::string> {
    return n.rfind("layers.", 0) == 0 ? "midlayer." + n.substr(7) : n;
  });
  same(load_draft(mid, &src));
  CHECK(src.layout == "deep EAGLE-3 names (model.safetensors, midlayer.{i}.*)");
  const std::string prefixed = variant("model-prefix", config, [](const std::string& n) -> std::optional<std::string> {
    return n == "lm_head.weight" || n == "d2t" || n == "t2d" ? n : "model." + n;
  });
  same(load_draft(prefixed));

  const std::string missing = variant("missing", config, [](const std::string& n) -> std::optional<std::string> {
    if (n == "layers.1.mlp.up_proj.weight") return std::nullopt;
    return n;
  });
  CHECK(load_error<FormatError>(missing) == missing + ": layers.1.mlp.up_proj.weight: missing");
  // A config that names no layer count means one layer: the second layer's tensors are refused.
  auto cfg = nlohmann::json::parse(config);
  cfg.erase("num_hidden_layers");
  const std::string shallow = variant("no-count", cfg.dump(), [](const std::string& n) -> std::optional<std::string> {
    return n;
  });
  CHECK(load_error<FormatError>(shallow) ==
        shallow + "/model.safetensors: layers.1.input_layernorm.weight: is decoder layer 1, but config.json says "
                  "num_hidden_layers 1 (or names none: 1)");
}
