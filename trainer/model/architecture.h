// Draft architectures (docs/architecture.md, "Draft architectures"): each is one row, a
// DraftArchitecture, that says what its config.json looks like, which trainable parameters it
// has (names and shapes, in the export order), what an engine is given to serve it, and which
// network (trainer/model/draft_net.h) computes it. DraftConfig::architecture names the row;
// the draft model, export, checkpoints, the plan and evaluate ask the row, never a fixed
// architecture. EAGLE-3 with 1..N decoder layers (trainer/model/eagle3.h) is the one row
// built in. LibTorch-free: the network is made in the row's own .cpp.
//
// The rows are listed and looked up in trainer/model/architecture_rows.h. Adding an
// architecture is one file (a DraftArchitecture and its DraftNet) and one row in kBuiltIn
// (architecture_rows.cpp); tests/trainer/test_architecture.cpp adds EAGLE 3.1's fc-norm that
// way, through register_draft_architecture, and trains, exports and reloads it. A built-in
// row also builds in the config fuzzer, without LibTorch: its answers go in one file (as
// eagle3.cpp), its network in another (eagle3_net.cpp), and tests/fuzz/no_networks.cpp
// refuses its make_net there.
//
// Thread safety: a row is immutable.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace eaglekit::trainer {

struct DraftConfig;
class DraftNet;

// One trainable parameter: its export name and shape.
struct ParameterShape {
  std::string name;
  std::vector<std::int64_t> shape;
  std::int64_t numel() const;
};

// Which unroll drives a row's network (trainer/model/draft_net.h): the TTT unroll
// (trainer/unroll/ttt.h, EAGLE-3's training-time test) or the block-parallel one
// (trainer/unroll/dflash.h, DFlash).
enum class DraftUnrollKind { kTtt, kBlock };

class DraftArchitecture {
 public:
  virtual ~DraftArchitecture() = default;

  // eaglekit's name for it ("eagle3"): DraftConfig::architecture.
  virtual std::string_view name() const = 0;
  // What users call it in messages ("EAGLE-3").
  virtual std::string_view title() const = 0;
  // The unroll that trains it; its network is a TttNet or a BlockNet accordingly.
  virtual DraftUnrollKind unroll() const { return DraftUnrollKind::kTtt; }

  // Whether a draft's flat config.json (a JSON object) describes this architecture. Rows are
  // asked in turn (registered ones first); the first that claims the config reads it.
  virtual bool claims(const nlohmann::json& config) const = 0;
  // Called when no row claims `config`: throws UnsupportedError naming `where` and the key
  // that no row computes, if this row knows it; returns otherwise.
  virtual void explain_unclaimed(const nlohmann::json& config, const std::string& where) const;

  // The trainable parameters, in the export order (the order DraftNet::named_parameters
  // gives them).
  virtual std::vector<ParameterShape> parameters(const DraftConfig& config) const = 0;
  // The config.json an engine is given (docs/export.md). `weights_dtype`: the dtype of the
  // weights beside it ("" = config.torch_dtype). Throws UsageError for a draft that cannot be
  // described (unknown aux layer ids).
  virtual nlohmann::ordered_json served_config(const DraftConfig& config, const std::string& weights_dtype) const = 0;
  // Why no engine would serve `config` as trained (nullopt: they would); export refuses it
  // unless --allow-unservable. The text follows "export: ".
  virtual std::optional<std::string> unservable(const DraftConfig& config) const;
  // What a user should know before serving it (engine-specific limits).
  virtual std::vector<std::string> serving_warnings(const DraftConfig& config) const;

  // The network, weights not initialised (DraftModel draws them), on the CPU in float32.
  virtual std::shared_ptr<DraftNet> make_net(const DraftConfig& config) const = 0;
};

}  // namespace eaglekit::trainer
