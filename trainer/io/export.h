// The draft on disk as vLLM and SGLang load it (docs/export.md), and back: a Hugging
// Face style folder with config.json and model.safetensors.
//
//   model.safetensors ({"format": "pt"} metadata; no "model." prefix; Linear weights [out, in]):
//     fc.weight                                  [H, k*Ht]   aux layers low to high
//     midlayer.input_layernorm.weight            [H]         applied to the embeddings
//     midlayer.hidden_norm.weight                [H]         applied to the fc output
//     midlayer.self_attn.{q,k,v}_proj.weight     [heads*D | kv_heads*D, 2H]
//                                                            embedding columns, then hidden
//     midlayer.self_attn.o_proj.weight           [H, heads*D]
//     midlayer.post_attention_layernorm.weight   [H]
//     midlayer.mlp.{gate,up}_proj.weight         [I, H]
//     midlayer.mlp.down_proj.weight              [H, I]
//     (a draft of N > 1 layers: layers.0.* for midlayer.*, then layers.1..N-1.*, plain
//     layers on H without hidden_norm)
//     norm.weight                                [H]
//     lm_head.weight                             [Vd, H]
//     d2t                                        [Vd] int64  target id = i + d2t[i]
//     t2d                                        [V] bool
//   No embed_tokens (servers use the target's).
//   config.json: draft_config_json() (trainer/model/config.h).
//
// Errors: IoError (cannot write/read), FormatError (a tensor missing, of the wrong shape or
// unknown; t2d inconsistent with d2t), UsageError (aux layer ids unknown at export).
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "trainer/io/speculators_format.h"
#include "trainer/model/draft_model.h"

namespace eaglekit::trainer {

struct ExportOptions {
  // Float dtype of the weights written (config.json torch_dtype follows); nullopt: the
  // draft's parameter dtype, so that a float32 export loads back bit-exactly.
  std::optional<c10::ScalarType> dtype;
  // A folder for a server (export, final/), not a checkpoint: a draft no engine computes
  // (modelopt_norm) is refused with the reason unless allow_unservable.
  bool serving = false;
  bool allow_unservable = false;
  // kSpeculators: vLLM's speculators layout instead (trainer/io/speculators_format.h): layers.0.*
  // for midlayer.*, d2t and t2d only when Vd < V, config.json from speculators_config_json
  // with `speculators` (the speculative token count and the verifier).
  ExportFormat format = ExportFormat::kEaglekit;
  SpeculatorsInfo speculators;
  // The TrainOptions JSON of the run that trained the draft, written beside the weights as
  // train_options.json ("" when unknown: nothing is written), so that a copy of the folder
  // still says how it was trained (evaluate takes --ttt-steps and --max-length from it).
  std::string run_options_json;
};

// UsageError naming why no serving engine runs `config` as trained, as its architecture says
// (EAGLE-3: ModelOpt's norm form), unless allowed. `what` names the action ("export", "train").
void check_servable(const DraftConfig& config, bool allow_unservable, const std::string& what);

// What a user should know before serving `config` (docs/export.md), as its architecture says
// (EAGLE-3: for more than one decoder layer, that vLLM runs it as trained and SGLang does not).
std::vector<std::string> serving_warnings(const DraftConfig& config);

// Writes DIR/model.safetensors, then DIR/config.json (each atomically; DIR is created). For
// a folder being filled before it is renamed into place (a checkpoint's temp folder).
void export_draft(const DraftModel& draft, const std::string& dir, const ExportOptions& options = {});

// The export as a whole folder that appears complete or not at all (`eaglekit export --out
// DIR`): written into the temp folder ".NAME.tmp-PID" beside DIR, fsynced, then renamed over
// DIR or atomically exchanged with the old one (replace_folder_atomic), so a server never
// finds a half-written DIR and a failed or killed export leaves an existing DIR as it was.
// Because the old folder is replaced as a whole, DIR must be absent, empty or hold only an
// exported draft's files (config.json, model.safetensors, our ".tmp." files); else
// UsageError before anything is written. Temp folders of killed exports to DIR are removed;
// a failed export removes its own. Throws as export_draft, IoError when the rename fails.
void export_draft_folder(const DraftModel& draft, const std::string& dir,
                         const ExportOptions& options = {});

// What load_draft recognised.
struct DraftSource {
  std::string layout;  // e.g. "ModelOpt / vLLM names (model.safetensors, layers.0.*)"
  std::string path;    // the weights file read
  // A speculators draft's proposal and verifier (speculative_tokens 0 for other layouts).
  SpeculatorsInfo speculators;
};

// Reads a draft folder written by eaglekit or by another trainer: config.json (ours, or a
// published config: aux ids top-level or under eagle_config, absent keys at the Hugging Face
// defaults), and the weights from model.safetensors (or its shards) or a torch.save state
// dict pytorch_model.bin (the EAGLE authors' drafts; read by formats/pickle.h's whitelist
// unpickler, never by Python code). Names are taken as eaglekit's (midlayer.*), ModelOpt's
// and vLLM's (layers.0.*, an optional model. prefix) or SpecForge's; an embed_tokens in the
// file is ignored (the draft uses the target's). A config.json with speculators_model_type
// is read as vLLM reads the speculators layout (speculators_to_draft_config). A
// vocab_mapping.pt beside the weights (SpecForge's {"d2t", "t2d"}) supplies d2t and t2d
// when the weights have none and must agree with them when they have. d2t is used as stored
// (identity when absent and Vd == V); a stored t2d must agree with it. The draft is float32
// on the CPU.
// `source` (optional) gets what was recognised.
DraftModel load_draft(const std::string& dir, DraftSource* source = nullptr);

}  // namespace eaglekit::trainer
