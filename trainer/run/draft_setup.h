// Which draft a training run trains, decided before its first step (trainer/run/plan.h resolve):
// the one of the checkpoint it resumes, an exported draft it starts from (--init-draft), or a
// fresh one built from the base's config (docs/draft.md) with the dump's aux layers and a
// draft vocabulary (--d2t, counted over the train split, or the base's whole vocabulary).
// Each is checked against the base and the data before anything is trained; trainer/
// open_run.h builds the draft decided.
//
// Thread safety: free functions. Errors: UsageError naming the option that does not fit
// (and what would), FormatError/IoError from reading checkpoints and drafts.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "trainer/model/config.h"

namespace eaglekit {
struct RecordShape;
}  // namespace eaglekit

namespace eaglekit::trainer {

struct BaseConfig;
struct DraftConfig;
class DraftModel;
struct TrainOptions;

using Say = std::function<void(const std::string&)>;

// k, the dump's aux layers: aux width over hidden. UsageError when the data's hidden size is
// not the base's (`base_dir` names it) or the aux width is not a multiple of it.
std::int64_t aux_layers_of(const RecordShape& shape, const BaseConfig& base, const std::string& base_dir);

// A draft config against the data it will train on: the fc's input width, servability
// (check_servable, unless allowed) and known aux layer ids. UsageError naming what to pass.
void check_draft_fits_data(const DraftConfig& config, const RecordShape& shape, bool allow_unservable);
// UsageError when --draft-layers was given and differs from the layers of the draft read
// from `source` (an --init-draft folder or a checkpoint): a draft keeps its depth.
void check_draft_layers(const TrainOptions& options, const DraftConfig& config, const std::string& source);

// Where the draft of a run comes from, as far as the decision needs it: nothing (fresh),
// or the config (and, for --init-draft, the d2t) of the checkpoint or folder it starts from.
struct DraftOrigin {
  enum class Kind { kFresh, kInit, kResume };
  Kind kind = Kind::kFresh;
  std::string dir;                       // the checkpoint or --init-draft folder
  std::string layout;                    // --init-draft: the layout load_draft recognised
  const DraftConfig* config = nullptr;   // its config (kInit, kResume); outlives the call
  std::function<at::Tensor()> d2t;       // kInit: its d2t, asked for only to compare --d2t
};

// What a run decides about its draft before it builds any weights (called by resolve, for
// `train` and `train --dry-run` alike): the config, where it comes from, the lines train says
// about defaults it applied, and every check against the options, the base and the data.
// UsageError naming what to pass.
struct DraftDecision {
  DraftConfig config;
  std::string source;                // "fresh from the base", "--init-draft DIR (layout)", "resume DIR"
  std::string aux_layer_ids_source;  // "--aux-layer-ids", "the draft", "EAGLE-3's default ..."
  std::vector<std::string> said;     // what train prints about it
  bool config_changed = false;       // kInit: differs from the folder's (aux ids, norm form)
  // kFresh with a smaller vocabulary and no --d2t: the d2t is counted over the train split
  // when the run opens (trainer/run/open_run.h).
  bool count_d2t = false;
  // kFresh on records of stored target distributions: the data's d2t (data_d2t below), which
  // the fresh draft takes. Undefined otherwise.
  at::Tensor d2t;
};
// What the data states beside its records, which the draft must agree with.
struct DataFacts {
  // Records of stored target distributions: the d2t of the draft vocabulary they are over
  // (NeMo's selected_token_ids, d2t[i] = selected[i] - i), `d2t_source` naming it. A fresh
  // draft takes it (--d2t and --draft-vocab-size, when given, must agree; DFlash is refused),
  // an --init-draft's must equal it. A resumed draft's is compared when the run opens.
  // Undefined otherwise.
  at::Tensor d2t;
  std::string d2t_source;
  // The base layers the aux hidden states were taken from, HF hidden_states indices, as the
  // record files state them (FileFacts::aux_layer_ids: NeMo's and DeepSpec's manifests, an
  // .eks converted from them), `aux_source` naming the files. A fresh draft takes them; an
  // --init-draft's config takes them (said); --aux-layer-ids and a resumed draft must equal
  // them. Empty: not stated (the options, the draft or EAGLE-3's default decide).
  std::vector<std::int64_t> aux_layer_ids;
  std::string aux_source;
};
DraftDecision decide_draft(const TrainOptions& options, const BaseConfig& base, const RecordShape& shape,
                           const DraftOrigin& origin, const DataFacts& data = {});
// The origin of an --init-draft folder: loads it into `init` (which the origin's config and
// d2t then point into, so it must outlive the origin). FormatError/IoError from load_draft.
DraftOrigin init_draft_origin(const std::string& dir, std::optional<DraftModel>& init);

}  // namespace eaglekit::trainer
