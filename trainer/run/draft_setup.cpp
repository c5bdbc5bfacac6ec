#include "trainer/run/draft_setup.h"

#include <ATen/ATen.h>

#include "formats/error.h"
#include "lib/collate.h"
#include "trainer/io/export.h"
#include "trainer/model/config.h"
#include "trainer/model/draft_model.h"
#include "trainer/model/vocab.h"
#include "trainer/run/options.h"

namespace eaglekit::trainer {

namespace {

// The draft vocabulary of a fresh run: --d2t's size (which --draft-vocab-size, when given,
// must equal), else --draft-vocab-size, else the base's whole vocabulary.
std::int64_t fresh_draft_vocab_size(const TrainOptions& o, const BaseConfig& base) {
  if (!o.d2t.empty()) {
    const std::int64_t n = load_d2t(o.d2t).size(0);
    if (o.draft_vocab_size > 0 && n != o.draft_vocab_size) {
      throw UsageError("--d2t " + o.d2t + " holds " + std::to_string(n) + " entries but --draft-vocab-size is " +
                       std::to_string(o.draft_vocab_size));
    }
    return n;
  }
  const std::int64_t vd = o.draft_vocab_size > 0 ? o.draft_vocab_size : base.vocab_size;
  if (vd > base.vocab_size) {
    throw UsageError("--draft-vocab-size " + std::to_string(vd) + " exceeds the base vocabulary (" +
                     std::to_string(base.vocab_size) + ")");
  }
  return vd;
}

bool same_d2t(const at::Tensor& a, const at::Tensor& b) {
  return a.numel() == b.numel() && at::equal(a.to(at::kCPU).to(at::kLong), b.to(at::kCPU).to(at::kLong));
}

std::string ids_text(const std::vector<std::int64_t>& ids) {
  std::string s;
  for (auto id : ids) s += (s.empty() ? "" : ",") + std::to_string(id);
  return s;
}

}  // namespace

std::int64_t aux_layers_of(const RecordShape& shape, const BaseConfig& bc, const std::string& base_dir) {
  if (shape.hidden != bc.hidden_size) {
    throw UsageError("the data's hidden states are " + std::to_string(shape.hidden) + " wide but the base in " +
                     base_dir + " has hidden_size " + std::to_string(bc.hidden_size));
  }
  if (shape.hidden <= 0 || shape.aux_width % shape.hidden != 0) {
    throw UsageError("the data's aux width " + std::to_string(shape.aux_width) + " is not a multiple of hidden " +
                     std::to_string(shape.hidden));
  }
  return shape.aux_width / shape.hidden;
}

void check_draft_fits_data(const DraftConfig& c, const RecordShape& shape, bool allow_unservable) {
  const std::int64_t aux_layers = shape.hidden > 0 ? shape.aux_width / shape.hidden : 0;
  if (c.aux_width() != shape.aux_width || c.target_hidden_size != shape.hidden) {
    throw UsageError("the draft's fc reads " + std::to_string(c.num_aux_layers) + " x " +
                     std::to_string(c.target_hidden_size) + " aux features, the data has " +
                     std::to_string(aux_layers) + " x " + std::to_string(shape.hidden));
  }
  // Before any step: final/ is for a server, and no server computes some drafts.
  check_servable(c, allow_unservable, "train");
  if (c.aux_layer_ids.empty()) {
    throw UsageError("--aux-layer-ids is required: the data has " + std::to_string(aux_layers) +
                     " aux layers and the export must name them (the ids the dump used; EAGLE-3's default "
                     "2,N/2,N-3 applies only to 3 layers of a base with at least 6)");
  }
}

void check_draft_layers(const TrainOptions& o, const DraftConfig& c, const std::string& source) {
  if (o.draft_layers > 0 && o.draft_layers != c.num_hidden_layers) {
    throw UsageError("--draft-layers " + std::to_string(o.draft_layers) + " differs from the " +
                     std::to_string(c.num_hidden_layers) + " decoder layer(s) of the draft in " + source +
                     " (a draft keeps its depth; drop --draft-layers, or start a fresh draft)");
  }
}

namespace {

// A fresh draft's architecture and norms from --draft-arch, --fc-norm, --norm-output and
// --norm-before-residual (options.h): the arch's defaults where auto; a combination that is
// not the arch asked for is refused with what to pass.
void fresh_architecture(const TrainOptions& o, DraftOptions& d) {
  if (o.draft_arch == DraftArch::kDFlash) {
    // DFlash (trainer/model/dflash.h) has none of EAGLE's norms; its own two keys.
    if (o.fc_norm != FcNorm::kAuto || o.norm_output != Switch::kAuto || o.norm_before_residual || o.modelopt_norm)
      throw UsageError("--fc-norm, --norm-output, --norm-before-residual and --modelopt-norm are EAGLE's; a DFlash "
                       "draft has none of them: drop them");
    if (o.mask_token_id < 0)
      throw UsageError("a fresh DFlash draft needs --mask-token-id: the token fed at a block's unknown positions, a "
                       "reserved or otherwise unused token of the base's vocabulary (ModelOpt takes the tokenizer's "
                       "mask token)");
    d.architecture = "dflash";
    d.block_size = o.block_size > 0 ? o.block_size : 8;
    d.mask_token_id = o.mask_token_id;
    return;
  }
  if (o.block_size > 0 || o.mask_token_id >= 0)
    throw UsageError("--block-size and --mask-token-id are DFlash's: pass --draft-arch dflash, or drop them");
  bool v31 = o.draft_arch == DraftArch::kEagle31;
  const bool auto_arch = o.draft_arch == DraftArch::kAuto;
  const FcNorm fc = o.fc_norm != FcNorm::kAuto ? o.fc_norm : (v31 ? FcNorm::kPerLayer : FcNorm::kNone);
  const bool out = o.norm_output != Switch::kAuto ? o.norm_output == Switch::kOn : v31;
  d.fc_norm = fc == FcNorm::kPerLayer;
  d.norm_before_fc = fc == FcNorm::kConcat;
  d.norm_output = out;
  d.norm_before_residual = o.norm_before_residual;
  const bool has31 = d.fc_norm || d.norm_before_fc || d.norm_output;
  if (o.draft_arch == DraftArch::kEagle3 && has31)
    throw UsageError("--fc-norm " + std::string(name_in(kFcNormNames, fc)) + ", --norm-output " +
                     (out ? "on" : "off") + ": those norms are EAGLE 3.1's; pass --draft-arch eagle3.1, or drop them");
  if (v31 && !has31)
    throw UsageError("--draft-arch eagle3.1 with --fc-norm none and --norm-output off is EAGLE-3: pass --draft-arch "
                     "eagle3, or keep one of EAGLE 3.1's norms");
  if (auto_arch && has31) v31 = true;  // --fc-norm or --norm-output alone asked for EAGLE 3.1's norms
  d.architecture = v31 ? "eagle3.1" : "eagle3";
}

// A draft read from a folder keeps its architecture and norms (they are in its weights): an
// option that asks for other ones is refused, naming the draft's.
void check_draft_architecture(const TrainOptions& o, const DraftConfig& c, const std::string& source) {
  const std::string is =
      c.architecture == "dflash"
          ? "dflash (block_size " + std::to_string(c.block_size) + ", mask_token_id " + std::to_string(c.mask_token_id) + ")"
          : c.architecture + " (fc_norm " + (c.fc_norm ? "true" : "false") + ", norm_before_fc " +
                         (c.norm_before_fc ? "true" : "false") + ", norm_output " + (c.norm_output ? "true" : "false") +
                         ", norm_before_residual " + (c.norm_before_residual ? "true" : "false") + ")";
  auto refuse = [&](const std::string& flag) {
    throw UsageError(flag + " differs from the draft in " + source + ", which is " + is +
                     " (a draft keeps its architecture; drop " + flag + ", or start a fresh draft)");
  };
  if (o.draft_arch != DraftArch::kAuto && name_in(kDraftArchNames, o.draft_arch) != c.architecture)
    refuse("--draft-arch " + std::string(name_in(kDraftArchNames, o.draft_arch)));
  if (o.fc_norm != FcNorm::kAuto) {
    const FcNorm has = c.fc_norm ? FcNorm::kPerLayer : c.norm_before_fc ? FcNorm::kConcat : FcNorm::kNone;
    if (has != o.fc_norm) refuse("--fc-norm " + std::string(name_in(kFcNormNames, o.fc_norm)));
  }
  if (o.norm_output != Switch::kAuto && (o.norm_output == Switch::kOn) != c.norm_output)
    refuse("--norm-output " + std::string(name_in(kSwitchNames, o.norm_output)));
  if (o.norm_before_residual && !c.norm_before_residual) refuse("--norm-before-residual");
  if (o.block_size > 0 && o.block_size != c.block_size) refuse("--block-size " + std::to_string(o.block_size));
  if (o.mask_token_id >= 0 && o.mask_token_id != c.mask_token_id)
    refuse("--mask-token-id " + std::to_string(o.mask_token_id));
}

}  // namespace

DraftOrigin init_draft_origin(const std::string& dir, std::optional<DraftModel>& init) {
  DraftSource source;
  init.emplace(load_draft(dir, &source));
  DraftOrigin origin;
  origin.kind = DraftOrigin::Kind::kInit;
  origin.dir = dir;
  origin.layout = source.layout;
  origin.config = &init->config();
  origin.d2t = [&init] { return init->d2t(); };
  return origin;
}

DraftDecision decide_draft(const TrainOptions& o, const BaseConfig& bc, const RecordShape& shape,
                           const DraftOrigin& origin, const DataFacts& data) {
  const std::int64_t aux_layers = aux_layers_of(shape, bc, o.base);
  const at::Tensor& data_d2t = data.d2t;
  const std::string& data_source = data.d2t_source;
  const std::vector<std::int64_t>& stated = data.aux_layer_ids;
  const std::string stated_text =
      stated.empty() ? std::string() : ids_text(stated) + ", as " + data.aux_source + " states them";
  if (!stated.empty()) {
    if (static_cast<std::int64_t>(stated.size()) != aux_layers)
      throw UsageError(data.aux_source + " states " + std::to_string(stated.size()) + " aux layers (" +
                       ids_text(stated) + ") but its records hold " + std::to_string(aux_layers) +
                       " side by side (aux width " + std::to_string(shape.aux_width) + ", hidden " +
                       std::to_string(shape.hidden) + ")");
    if (std::any_of(stated.begin(), stated.end(), [](std::int64_t id) { return id < 1; }))
      throw UsageError(data.aux_source + " holds the base's embeddings (HF hidden_states index 0) among its aux "
                       "layers " + ids_text(stated) + "; an EAGLE-3 draft as vLLM and SGLang serve it reads decoder "
                       "layers' outputs (indices from 1): dump without the embeddings");
    if (!o.aux_layer_ids.empty() && o.aux_layer_ids != stated)
      throw UsageError("--aux-layer-ids " + ids_text(o.aux_layer_ids) + " differs from the layers the data holds, " +
                       stated_text + " (HF hidden_states indices): drop it, the run takes the data's");
  }
  DraftDecision d;
  if (origin.kind == DraftOrigin::Kind::kResume) {
    d.config = *origin.config;
    check_draft_layers(o, d.config, origin.dir);
    check_draft_architecture(o, d.config, origin.dir);
    d.source = "resume " + origin.dir;
    d.aux_layer_ids_source = "the resumed checkpoint's draft";
    if (!stated.empty() && d.config.aux_layer_ids != stated)
      throw UsageError("the checkpoint " + origin.dir + " trains a draft of aux layers " +
                       ids_text(d.config.aux_layer_ids) + " but the data holds " + stated_text +
                       ": resume on the data it was trained on");
  } else if (origin.kind == DraftOrigin::Kind::kInit) {
    DraftConfig c = *origin.config;
    d.aux_layer_ids_source = "the --init-draft's config";
    if (!stated.empty() && stated != c.aux_layer_ids) {
      // The data decides which layers the trained draft reads; the export must name them.
      if (!c.aux_layer_ids.empty())
        d.said.push_back("--init-draft " + origin.dir + " was trained on aux layers " + ids_text(c.aux_layer_ids) +
                         "; the data holds " + stated_text + ", so the draft trains on those and its config "
                         "names them");
      c.aux_layer_ids = stated;
      d.config_changed = true;
      d.aux_layer_ids_source = "the data: " + data.aux_source;
    } else if (!stated.empty()) {
      d.aux_layer_ids_source = "the --init-draft's config, as " + data.aux_source + " states them";
    } else if (!o.aux_layer_ids.empty() && o.aux_layer_ids != c.aux_layer_ids) {
      c.aux_layer_ids = o.aux_layer_ids;
      d.config_changed = true;
      d.aux_layer_ids_source = "--aux-layer-ids";
    } else if (c.aux_layer_ids.empty() && c.num_aux_layers == 3 && bc.num_hidden_layers >= 6) {
      // Published configs often name no aux layers; the engines then use EAGLE-3's default.
      c.aux_layer_ids = default_aux_layer_ids(bc.num_hidden_layers);
      d.config_changed = true;
      d.aux_layer_ids_source = "EAGLE-3's default for a " + std::to_string(bc.num_hidden_layers) +
                               "-layer base (2, N/2, N-3); the --init-draft's config names none";
      d.said.push_back("--init-draft names no aux layer ids: " + ids_text(c.aux_layer_ids) +
                       ", EAGLE-3's default for a " + std::to_string(bc.num_hidden_layers) +
                       "-layer base; pass --aux-layer-ids if the dump used others");
    }
    if (o.modelopt_norm && !c.modelopt_norm) {
      c.modelopt_norm = true;
      d.config_changed = true;
    }
    check_draft_layers(o, c, origin.dir);
    check_draft_architecture(o, c, origin.dir);
    if (o.draft_vocab_size > 0 && o.draft_vocab_size != c.draft_vocab_size) {
      throw UsageError("--draft-vocab-size " + std::to_string(o.draft_vocab_size) + " differs from --init-draft's (" +
                       std::to_string(c.draft_vocab_size) + ")");
    }
    if (!o.d2t.empty() && !at::equal(load_d2t(o.d2t).to(at::kLong), origin.d2t().to(at::kCPU).to(at::kLong))) {
      throw UsageError("--d2t " + o.d2t + " differs from the d2t of --init-draft " + origin.dir +
                       " (its lm_head rows belong to its own d2t)");
    }
    if (data_d2t.defined() && !same_d2t(origin.d2t(), data_d2t))
      throw UsageError("the draft vocabulary of --init-draft " + origin.dir + " (" +
                       std::to_string(origin.d2t().size(0)) + " tokens) is not the one the data's target "
                       "distributions are over (" + data_source + ", " + std::to_string(data_d2t.size(0)) +
                       " tokens): its lm_head rows would be trained against other tokens' probabilities");
    c.check();
    d.config = c;
    d.source = "--init-draft " + origin.dir + (origin.layout.empty() ? "" : " (" + origin.layout + ")");
  } else {
    DraftOptions dopts;
    dopts.num_aux_layers = aux_layers;
    dopts.aux_layer_ids = stated.empty() ? o.aux_layer_ids : stated;
    dopts.modelopt_norm = o.modelopt_norm;
    fresh_architecture(o, dopts);
    const bool dflash = dopts.architecture == "dflash";
    if (dflash && ((o.draft_vocab_size > 0 && o.draft_vocab_size != bc.vocab_size) || !o.d2t.empty()))
      throw UsageError("a DFlash draft predicts over the base's whole vocabulary with the base's lm_head: drop "
                       "--draft-vocab-size and --d2t");
    if (data_d2t.defined()) {
      // The stored distributions are over the data's own draft vocabulary: the draft takes it.
      const std::int64_t vd = data_d2t.size(0);
      if (dflash)
        throw UsageError("a DFlash draft trains against the base's whole vocabulary; the data stores the target's "
                         "distribution over a draft vocabulary of " + std::to_string(vd) + " tokens (" + data_source +
                         "): train an EAGLE draft on it (drop --draft-arch dflash)");
      if (o.draft_vocab_size > 0 && o.draft_vocab_size != vd)
        throw UsageError("--draft-vocab-size " + std::to_string(o.draft_vocab_size) + " differs from the " +
                         std::to_string(vd) + " draft tokens the data's target distributions are over (" +
                         data_source + "): drop it");
      if (!o.d2t.empty() && !same_d2t(load_d2t(o.d2t), data_d2t))
        throw UsageError("--d2t " + o.d2t + " differs from the draft vocabulary the data's target distributions are "
                         "over (" + data_source + "): drop it, the run takes the data's");
      dopts.draft_vocab_size = vd;
      d.d2t = data_d2t;
    } else {
      dopts.draft_vocab_size = dflash ? bc.vocab_size : fresh_draft_vocab_size(o, bc);
    }
    // DFlash pairs one draft layer with each target layer (ModelOpt's default).
    dopts.num_hidden_layers = o.draft_layers > 0 ? o.draft_layers : dflash ? aux_layers : 1;
    d.config = draft_config_from_base(bc, dopts);
    if (dflash && o.draft_layers <= 0)
      d.said.push_back("DFlash draft of " + std::to_string(d.config.num_hidden_layers) +
                       " decoder layers, one per target layer of the dump as ModelOpt pairs them; pass "
                       "--draft-layers to choose");
    d.count_d2t = !dflash && !data_d2t.defined() && o.d2t.empty() && d.config.draft_vocab_size < bc.vocab_size;
    d.source = "fresh from the base";
    d.aux_layer_ids_source = "--aux-layer-ids";
    if (!stated.empty()) {
      d.aux_layer_ids_source = "the data: " + data.aux_source;
    } else if (o.aux_layer_ids.empty() && !d.config.aux_layer_ids.empty()) {
      d.aux_layer_ids_source = "EAGLE-3's default for a " + std::to_string(bc.num_hidden_layers) +
                               "-layer base (2, N/2, N-3); no --aux-layer-ids given";
      d.said.push_back("aux layer ids " + ids_text(d.config.aux_layer_ids) + ": EAGLE-3's default for a " +
                       std::to_string(bc.num_hidden_layers) +
                       "-layer base (HF hidden_states indices 2, N/2, N-3); pass --aux-layer-ids if the dump used "
                       "others");
    }
  }
  const DraftConfig& c = d.config;
  if (c.hidden_size != bc.hidden_size || c.vocab_size != bc.vocab_size) {
    throw UsageError("the draft (hidden " + std::to_string(c.hidden_size) + ", vocab " + std::to_string(c.vocab_size) +
                     ") does not fit the base (hidden " + std::to_string(bc.hidden_size) + ", vocab " +
                     std::to_string(bc.vocab_size) + ")");
  }
  check_draft_fits_data(c, shape, o.allow_unservable);
  return d;
}

}  // namespace eaglekit::trainer
