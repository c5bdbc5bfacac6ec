// The draft-architecture seam (trainer/model/architecture.h, trainer/model/draft_net.h):
// EAGLE-3's and EAGLE 3.1's rows list exactly the parameters their network holds and the plan
// counts them from it; names are checked; EAGLE 3.1's norms (fc_norm, norm_before_fc,
// norm_output, as vLLM 0.32 reads them) and norm_before_residual train, change the function,
// export in both layouts, checkpoint and load back; and a row registered at run time (one
// file, one row) trains, exports and loads as itself with no other file knowing it.
#include "tests/torch_doctest.h"
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>  // c10::NoGradGuard: LibTorch 2.x ATen.h no longer declares c10::NoGradGuard

#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "formats/error.h"
#include "tests/support.h"
#include "trainer/io/checkpoint.h"
#include "trainer/io/export.h"
#include "trainer/model/architecture_rows.h"
#include "trainer/model/draft_model.h"
#include "trainer/model/eagle3.h"
#include "trainer/unroll/ttt.h"
#include "tests/trainer/trainer_fixtures.h"

using namespace eaglekit;
using namespace eaglekit::trainer;

namespace {

// ---- a registered row: what a tree adds as one file and one row -----------------------------

// EAGLE-3 under another name, registered at run time as a tree would add it to kBuiltIn.
class TwinArchitecture final : public Eagle3Architecture {
 public:
  std::string_view name() const override { return "eagle3-twin"; }
  std::string_view title() const override { return "EAGLE-3 (twin)"; }
  bool claims(const nlohmann::json& j) const override { return j.contains("eaglekit_twin"); }
  nlohmann::ordered_json served_config(const DraftConfig& c, const std::string& weights_dtype) const override {
    nlohmann::ordered_json j = Eagle3Architecture::served_config(c, weights_dtype);
    j["eaglekit_twin"] = true;
    return j;
  }
};

const TwinArchitecture kTwin;

struct Registered {
  Registered() { register_draft_architecture(kTwin); }
  ~Registered() { unregister_draft_architecture(kTwin.name()); }
};

// ---- helpers --------------------------------------------------------------------------------

void check_list_matches_net(const DraftConfig& c) {
  const DraftModel d(c, fixtures::spread_d2t(c), at::Tensor(), 3);
  const auto listed = draft_architecture(c.architecture).parameters(c);
  const auto held = d.named_parameters();
  REQUIRE(listed.size() == held.size());
  for (std::size_t i = 0; i < listed.size(); ++i) {
    CHECK(listed[i].name == held[i].first);
    CHECK(at::IntArrayRef(listed[i].shape) == held[i].second.sizes());
  }
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  return nlohmann::json::parse(f);
}

float loss_of(const BaseModel& base, const DraftModel& d, const TttBatch& batch) {
  c10::NoGradGuard no_grad;
  TttUnroll u(base, d, TttOptions{3, 0.8, std::nullopt});
  return u.forward(batch).loss.item<float>();
}

}  // namespace

TEST_CASE("architecture: EAGLE-3's row lists the parameters its network holds, in the export order") {
  DraftConfig c = fixtures::tiny_config();
  CHECK(c.architecture == "eagle3");
  check_list_matches_net(c);
  c.num_hidden_layers = 3;
  check_list_matches_net(c);
  // A list that left out a norm or misnamed a layer would fail above; the row is the one
  // the name finds, and names are unique.
  CHECK(&draft_architecture("eagle3") == draft_architectures().back());
  CHECK(draft_architecture("eagle3").title() == "EAGLE-3");
}

TEST_CASE("architecture: an unknown name is refused with the known ones; a taken name cannot be registered") {
  DraftConfig c = fixtures::tiny_config();
  c.architecture = "medusa";
  try {
    DraftModel d(c, fixtures::spread_d2t(c), at::Tensor());
    FAIL("accepted an unknown architecture");
  } catch (const UsageError& e) {
    CHECK(std::string(e.what()).find("unknown draft architecture 'medusa' (known: dflash, eagle3.1, eagle3)") !=
          std::string::npos);
  }
  CHECK_THROWS_AS(draft_config_json(c), UsageError);
  const Eagle3Architecture twin;
  CHECK_THROWS_AS(register_draft_architecture(twin), UsageError);
}

// EAGLE 3.1 as vLLM 0.32 and speculators 0.9 define it (docs/draft.md): `variant` names the
// norms set on top of the plain config.
DraftConfig eagle31(bool fc_norm, bool norm_before_fc, bool norm_output, bool norm_before_residual = false) {
  DraftConfig c = fixtures::tiny_config();
  c.architecture = "eagle3.1";
  c.fc_norm = fc_norm;
  c.norm_before_fc = norm_before_fc;
  c.norm_output = norm_output;
  c.norm_before_residual = norm_before_residual;
  c.check();
  return c;
}

TEST_CASE("architecture: EAGLE 3.1 is built in: its norms train, change the function, export both ways and load back") {
  test::TempDir dir("arch");
  const DraftConfig plain = fixtures::tiny_config();
  const BaseModel base = fixtures::random_base(plain, 70);
  const TttBatch batch = fixtures::random_batch(plain, 2, 10, {10, 8}, 71);

  struct Variant {
    const char* name;
    DraftConfig config;
    std::vector<std::string> extra;  // parameters beyond EAGLE-3's
  };
  const std::vector<Variant> variants = {
      {"fc_norm + norm_output", eagle31(true, false, true), {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"}},
      {"norm_before_fc + norm_output + norm_before_residual", eagle31(false, true, true, true), {"input_norm.weight"}},
      {"fc_norm alone", eagle31(true, false, false), {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"}},
      {"norm_output alone", eagle31(false, false, true), {}},
  };
  std::int64_t plain_numel = 0;
  for (const auto& p : draft_architecture("eagle3").parameters(plain)) plain_numel += p.numel();

  for (const Variant& v : variants) {
    CAPTURE(v.name);
    const DraftConfig& c = v.config;
    check_list_matches_net(c);
    DraftModel d(c, fixtures::spread_d2t(c), base.lm_head, 72);
    // The extra parameters lead the list (the fc input's norms come before fc), by vLLM's names.
    const auto params = d.named_parameters();
    for (std::size_t i = 0; i < v.extra.size(); ++i) CHECK(params[i].first == v.extra[i]);
    std::int64_t numel = 0;
    for (const auto& p : draft_architecture("eagle3.1").parameters(c)) numel += p.numel();
    CHECK(numel == plain_numel + (c.fc_norm ? 3 * c.target_hidden_size : 0) +
                       (c.norm_before_fc ? 3 * c.target_hidden_size : 0));

    // The unroll trains it: each norm gets a gradient, and each flag changes the function
    // against EAGLE-3 with the same weights (the shared ones copied over).
    {
      TttUnroll u(base, d, TttOptions{3, 0.8, std::nullopt});
      const TttResult r = u.forward(batch);
      r.loss.backward();
      CHECK(std::isfinite(r.loss.item<float>()));
      for (std::size_t i = 0; i < v.extra.size(); ++i) {
        REQUIRE(params[i].second.grad().defined());
        CHECK(params[i].second.grad().abs().sum().item<float>() > 0);
      }
    }
    DraftModel same_as_eagle3(plain, fixtures::spread_d2t(plain), base.lm_head, 72);
    for (const auto& [name, t] : same_as_eagle3.named_parameters()) d.load_parameter(name, t.detach().clone());
    // With unit norm weights fc_norm/input_norm still normalise, so the function differs from
    // EAGLE-3's wherever a flag is set; norm_output changes steps 1 and later only.
    CHECK(loss_of(base, d, batch) != loss_of(base, same_as_eagle3, batch));

    // Export in both layouts and load back: the architecture, the flags, the weights and the
    // loss return.
    const std::string name = std::string("v") + std::to_string(&v - variants.data());
    export_draft(d, dir / (name + "-ours"));
    const nlohmann::json ours = read_json(dir / (name + "-ours/config.json"));
    CHECK(ours["fc_norm"] == c.fc_norm);
    CHECK(ours["norm_before_fc"] == c.norm_before_fc);
    CHECK(ours["norm_output"] == c.norm_output);
    CHECK(ours["norm_before_residual"] == c.norm_before_residual);
    ExportOptions spec;
    spec.format = ExportFormat::kSpeculators;
    spec.speculators.speculative_tokens = 3;
    spec.speculators.verifier = "base";
    export_draft(d, dir / (name + "-spec"), spec);
    const nlohmann::json sj = read_json(dir / (name + "-spec/config.json"));
    CHECK(sj["fc_norm"] == c.fc_norm);
    CHECK(sj["norm_before_fc"] == c.norm_before_fc);
    CHECK(sj["norm_output"] == c.norm_output);
    CHECK(sj["norm_before_residual"] == c.norm_before_residual);
    for (const std::string layout : {"-ours", "-spec"}) {
      CAPTURE(layout);
      const DraftModel back = load_draft(dir / (name + layout));
      CHECK(back.config().architecture == "eagle3.1");
      CHECK(back.config().fc_norm == c.fc_norm);
      CHECK(back.config().norm_before_fc == c.norm_before_fc);
      CHECK(back.config().norm_output == c.norm_output);
      CHECK(back.config().norm_before_residual == c.norm_before_residual);
      const auto a = d.named_parameters(), b = back.named_parameters();
      REQUIRE(a.size() == b.size());
      for (std::size_t i = 0; i < a.size(); ++i) {
        CHECK(a[i].first == b[i].first);
        CHECK(at::equal(a[i].second, b[i].second));
      }
      CHECK(loss_of(base, back, batch) == loss_of(base, d, batch));
    }

    // A checkpoint resumes it as itself.
    Checkpoint ckpt;
    ckpt.options_json = "{}";
    const std::string saved = save_checkpoint(dir / (name + "-run"), d, ckpt);
    const LoadedCheckpoint loaded = load_checkpoint(saved);
    CHECK(loaded.draft.config().architecture == "eagle3.1");
    CHECK(loss_of(base, loaded.draft, batch) == loss_of(base, d, batch));
  }
}

TEST_CASE("architecture: norm_before_residual changes EAGLE-3's first layer, and EAGLE 3.1's flags are its own") {
  const DraftConfig plain = fixtures::tiny_config();
  const BaseModel base = fixtures::random_base(plain, 80);
  const TttBatch batch = fixtures::random_batch(plain, 2, 10, {10, 8}, 81);
  DraftConfig nbr = plain;
  nbr.norm_before_residual = true;
  CHECK(std::string(architecture_of_config(nlohmann::json::parse(draft_config_json(nbr)), "c.json").name()) ==
        "eagle3");
  const DraftModel a(plain, fixtures::spread_d2t(plain), base.lm_head, 82);
  DraftModel b(nbr, fixtures::spread_d2t(nbr), base.lm_head, 83);
  for (const auto& [name, t] : a.named_parameters()) b.load_parameter(name, t.detach().clone());
  CHECK(loss_of(base, a, batch) != loss_of(base, b, batch));

  // The row names and the flags agree, or check() says which.
  DraftConfig wrong = plain;
  wrong.fc_norm = true;
  CHECK_THROWS_WITH_AS(wrong.check(), doctest::Contains("EAGLE 3.1's (architecture eagle3.1)"), UsageError);
  wrong = plain;
  wrong.architecture = "eagle3.1";
  CHECK_THROWS_WITH_AS(wrong.check(), doctest::Contains("needs fc_norm, norm_before_fc or norm_output"), UsageError);
  wrong.fc_norm = wrong.norm_before_fc = true;
  CHECK_THROWS_WITH_AS(wrong.check(), doctest::Contains("exclusive"), UsageError);

  // The keys vLLM 0.32 reads decide the row; mistyped ones are refused, never read as EAGLE-3.
  auto row = [](const char* text) { return std::string(architecture_of_config(nlohmann::json::parse(text), "c.json").name()); };
  CHECK(row(R"({"fc_norm": true})") == "eagle3.1");
  CHECK(row(R"({"norm_output": true})") == "eagle3.1");
  CHECK(row(R"({"norm_before_fc": true})") == "eagle3.1");
  CHECK(row(R"({"eagle_config": {"norm_before_fc": true}})") == "eagle3.1");
  CHECK(row(R"({"fc_norm": false, "norm_output": false, "norm_before_fc": false})") == "eagle3");
  CHECK_THROWS_AS(architecture_of_config(nlohmann::json::parse(R"({"norm_output": "yes"})"), "c.json"), FormatError);
}

TEST_CASE("architecture: a registered row is one file and one row: trains, exports and loads as itself") {
  test::TempDir dir("arch-twin");
  const Registered row;
  DraftConfig c = fixtures::tiny_config();
  c.architecture = "eagle3-twin";
  check_list_matches_net(c);
  const BaseModel base = fixtures::random_base(c, 90);
  const TttBatch batch = fixtures::random_batch(c, 2, 10, {10, 8}, 91);
  DraftModel d(c, fixtures::spread_d2t(c), base.lm_head, 92);
  export_draft(d, dir / "twin");
  const DraftModel back = load_draft(dir / "twin");
  CHECK(back.config().architecture == "eagle3-twin");
  CHECK(loss_of(base, back, batch) == loss_of(base, d, batch));
}
