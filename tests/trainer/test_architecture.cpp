// The draft-architecture seam (trainer/model/architecture.h, trainer/model/draft_net.h):
// EAGLE-3's row lists exactly the parameters its network holds and the plan counts them from
// it; names are checked; and EAGLE 3.1's fc-norm (an RMSNorm per aux layer before fc, the
// speculators/SpecForge key fc_norm: true) is added the way the seam promises, as one file
// (this one: its network and its row) and one row (registered here as a tree adds it to
// kBuiltIn), then trained, exported in both layouts, checkpointed and loaded back with no
// other file knowing it.
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

// ---- EAGLE 3.1's fc-norm: the one new file an architecture is ----------------------------

// EAGLE-3's network with a learned RMSNorm on each aux layer's slice of the fc input.
class FcNormNet final : public DraftNet {
 public:
  explicit FcNormNet(const DraftConfig& c) : c_(c), inner_(make_eagle3_net(c)) {
    for (std::int64_t i = 0; i < c.num_aux_layers; ++i)
      norms_.push_back(at::ones({c.target_hidden_size}).requires_grad_());
  }
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const override {
    auto out = inner_->named_parameters();
    for (std::size_t i = 0; i < norms_.size(); ++i) out.emplace_back("fc_norm." + std::to_string(i) + ".weight", norms_[i]);
    return out;
  }
  void to(c10::Device device, c10::ScalarType dtype) override {
    inner_->to(device, dtype);
    c10::NoGradGuard no_grad;
    for (auto& w : norms_) w = w.to(device, dtype).detach().requires_grad_();
  }
  void train(bool on) override { inner_->train(on); }
  std::int64_t num_layers() const override { return inner_->num_layers(); }
  at::Tensor fc(const at::Tensor& aux) const override {
    std::vector<at::Tensor> parts;
    for (std::int64_t i = 0; i < c_.num_aux_layers; ++i) {
      const at::Tensor x = aux.narrow(-1, i * c_.target_hidden_size, c_.target_hidden_size).to(at::kFloat);
      const at::Tensor normed = x * at::rsqrt(x.pow(2).mean(-1, true) + c_.rms_norm_eps);
      parts.push_back(norms_[static_cast<std::size_t>(i)] * normed.to(aux.scalar_type()));
    }
    return inner_->fc(at::cat(parts, -1));
  }
  at::Tensor norm_embeddings(const at::Tensor& emb) const override { return inner_->norm_embeddings(emb); }
  Qkv qkv(const at::Tensor& e, const at::Tensor& h, const RotaryTable& rope, std::int64_t layer) const override {
    return inner_->qkv(e, h, rope, layer);
  }
  at::Tensor finish_layer(const at::Tensor& h, const at::Tensor& attn, std::int64_t layer) const override {
    return inner_->finish_layer(h, attn, layer);
  }
  at::Tensor final_norm(const at::Tensor& x) const override { return inner_->final_norm(x); }
  const at::Tensor& lm_head_weight() const override { return inner_->lm_head_weight(); }

 private:
  DraftConfig c_;
  std::shared_ptr<DraftNet> inner_;
  std::vector<at::Tensor> norms_;
};

class FcNormArchitecture final : public Eagle3Architecture {
 public:
  std::string_view name() const override { return "eagle3-fc-norm"; }
  std::string_view title() const override { return "EAGLE 3.1 (fc-norm)"; }
  bool claims(const nlohmann::json& j) const override {
    return j.contains("fc_norm") && j["fc_norm"] == true && !(j.contains("norm_output") && j["norm_output"] == false);
  }
  std::vector<ParameterShape> parameters(const DraftConfig& c) const override {
    auto out = Eagle3Architecture::parameters(c);
    for (std::int64_t i = 0; i < c.num_aux_layers; ++i)
      out.push_back({"fc_norm." + std::to_string(i) + ".weight", {c.target_hidden_size}});
    return out;
  }
  nlohmann::ordered_json served_config(const DraftConfig& c, const std::string& weights_dtype) const override {
    nlohmann::ordered_json j = Eagle3Architecture::served_config(c, weights_dtype);
    j["fc_norm"] = true;
    return j;
  }
  std::shared_ptr<DraftNet> make_net(const DraftConfig& c) const override { return std::make_shared<FcNormNet>(c); }
};

// ---- the one row --------------------------------------------------------------------------

const FcNormArchitecture kFcNorm;

struct Registered {
  Registered() { register_draft_architecture(kFcNorm); }
  ~Registered() { unregister_draft_architecture(kFcNorm.name()); }
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
    CHECK(std::string(e.what()).find("unknown draft architecture 'medusa' (known: eagle3)") != std::string::npos);
  }
  CHECK_THROWS_AS(draft_config_json(c), UsageError);
  const Eagle3Architecture twin;
  CHECK_THROWS_AS(register_draft_architecture(twin), UsageError);
}

TEST_CASE("architecture: EAGLE 3.1's fc-norm, one file and one row, trains, exports, checkpoints and loads") {
  test::TempDir dir("arch");
  const DraftConfig plain = fixtures::tiny_config();
  const BaseModel base = fixtures::random_base(plain, 70);
  const TttBatch batch = fixtures::random_batch(plain, 2, 10, {10, 8}, 71);

  // Before the row exists, a folder that says fc_norm: true is refused, naming the key.
  {
    DraftModel d(plain, fixtures::spread_d2t(plain), base.lm_head, 72);
    export_draft(d, dir / "plain");
    nlohmann::json cfg = read_json(dir / "plain/config.json");
    cfg["fc_norm"] = true;
    std::ofstream(dir / "plain/config.json") << cfg.dump(2);
    try {
      load_draft(dir / "plain");
      FAIL("loaded an fc_norm draft with no architecture for it");
    } catch (const UnsupportedError& e) {
      CHECK(std::string(e.what()).find("fc_norm") != std::string::npos);
    }
  }

  const Registered row;
  DraftConfig c = plain;
  c.architecture = "eagle3-fc-norm";
  check_list_matches_net(c);
  DraftModel d(c, fixtures::spread_d2t(c), base.lm_head, 72);

  // The unroll trains it: the norms get gradients and change the function.
  {
    TttUnroll u(base, d, TttOptions{3, 0.8, std::nullopt});
    const TttResult r = u.forward(batch);
    r.loss.backward();
    CHECK(std::isfinite(r.loss.item<float>()));
    const auto params = d.named_parameters();
    const at::Tensor norm0 = params[params.size() - 3].second;
    REQUIRE(params[params.size() - 3].first == "fc_norm.0.weight");
    REQUIRE(norm0.grad().defined());
    CHECK(norm0.grad().abs().sum().item<float>() > 0);
    const float before = loss_of(base, d, batch);
    d.load_parameter("fc_norm.1.weight", at::full({c.target_hidden_size}, 3.0f));
    CHECK(loss_of(base, d, batch) != before);
  }

  // The plan counts its parameters from the row.
  std::int64_t numel = 0;
  for (const auto& [name, t] : d.named_parameters()) numel += t.numel();
  std::int64_t listed = 0;
  for (const auto& p : kFcNorm.parameters(c)) listed += p.numel();
  CHECK(listed == numel);
  CHECK(listed == [&] {
    std::int64_t n = 0;
    for (const auto& p : draft_architecture("eagle3").parameters(plain)) n += p.numel();
    return n;
  }() + 3 * c.target_hidden_size);

  // Export in both layouts and load back: the architecture, the weights and the loss return.
  export_draft(d, dir / "ours");
  CHECK(read_json(dir / "ours/config.json")["fc_norm"] == true);
  ExportOptions spec;
  spec.format = ExportFormat::kSpeculators;
  spec.speculators.speculative_tokens = 3;
  spec.speculators.verifier = "base";
  export_draft(d, dir / "spec", spec);
  CHECK(read_json(dir / "spec/config.json")["fc_norm"] == true);
  for (const char* layout : {"ours", "spec"}) {
    CAPTURE(layout);
    const DraftModel back = load_draft(dir / layout);
    CHECK(back.config().architecture == "eagle3-fc-norm");
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
  const std::string saved = save_checkpoint(dir / "run", d, ckpt);
  const LoadedCheckpoint loaded = load_checkpoint(saved);
  CHECK(loaded.draft.config().architecture == "eagle3-fc-norm");
  CHECK(loss_of(base, loaded.draft, batch) == loss_of(base, d, batch));
}
