#include "trainer/run/open_run.h"

#include <ATen/ATen.h>

#include <chrono>

#include "formats/error.h"
#include "lib/clock.h"
#include "trainer/io/checkpoint.h"
#include "trainer/io/export.h"
#include "trainer/model/vocab.h"
#include "trainer/parallel/distributed.h"
#include "trainer/run/plan.h"
#include "trainer/run/run_setup.h"

namespace eaglekit::trainer {

namespace {

using Clock = std::chrono::steady_clock;

// The d2t of a fresh draft: --d2t, else counted over the train split when the plan said so,
// else the identity.
at::Tensor fresh_d2t(const RunPlan& plan, const Say& say) {
  const TrainOptions& o = plan.options;
  const BaseConfig& base = plan.base;
  const std::int64_t vd = plan.draft.config.draft_vocab_size;
  if (plan.draft.d2t.defined()) {  // the data's own (records of stored target distributions)
    say("draft vocabulary: the " + std::to_string(vd) + " tokens of selected_token_ids in " +
        plan.stored_targets->source);
    return plan.draft.d2t;
  }
  if (!o.d2t.empty()) return load_d2t(o.d2t);
  if (!plan.draft.count_d2t) return identity_d2t(base.vocab_size);
  const auto t0 = Clock::now();
  const auto counts = count_tokens(plan.train_data->dataset, plan.train_data->samples, base.vocab_size, o.jobs);
  const double seconds = seconds_since(t0);
  say("draft vocabulary: the " + std::to_string(vd) + " most frequent of " + std::to_string(base.vocab_size) +
      " tokens, counted over the train split in " + std::to_string(seconds).substr(0, 4) + " s");
  return d2t_from_counts(counts, vd);
}

// A copy of `draft` whose config differs only in `config` (aux ids, norm form).
DraftModel with_config(const DraftModel& draft, const DraftConfig& config) {
  DraftModel out(config, draft.d2t().to(at::kCPU), at::Tensor());
  for (const auto& [name, value] : draft.named_parameters()) out.load_parameter(name, value);
  return out;
}

// The draft the plan decided, on the CPU in float32 (a resumed one comes with its checkpoint).
DraftModel build_draft(const RunPlan& plan, const BaseModel& base, const Say& say) {
  if (plan.loaded_draft) return *plan.loaded_draft;  // evaluate's
  if (plan.draft_kind == DraftOrigin::Kind::kInit) {
    const DraftModel init = load_draft(plan.draft_dir);
    say("starting from the draft in " + plan.draft_dir + " (" + plan.loaded_layout + ")");
    return plan.draft.config_changed ? with_config(init, plan.draft.config) : init;
  }
  return DraftModel(plan.draft.config, fresh_d2t(plan, say), base.lm_head.to(at::kCPU), plan.options.seed);
}

}  // namespace

std::unique_ptr<OpenRun> open_run(const RunPlan& plan, const dist::Mesh& mesh, const Say& say) {
  const TrainOptions& o = plan.options;
  const bool training = plan.purpose == RunPlan::Purpose::kTrain;
  auto run = std::make_unique<OpenRun>();
  OpenRun& r = *run;
  r.device = parse_device(o.device);
  if (r.device.is_cuda() && mesh.world_size() > 1) r.device = c10::Device(c10::kCUDA, mesh.local_rank());
  std::optional<LoadedCheckpoint> resumed;
  if (plan.draft_kind == DraftOrigin::Kind::kResume) resumed.emplace(load_checkpoint(plan.draft_dir));
  if (training) at::manual_seed(o.seed);

  r.loader_options = loader_options(o, mesh.dp_rank(), mesh.dp_size(), mesh.cp_rank(), mesh.cp_size());
  r.loader_options.sampler.epochs = plan.epochs;
  r.loader_options.collate.layout_norm = plan.norm.layout_norm;
  r.loader = std::make_unique<Loader>(plan.train_data->dataset, plan.train_data->samples, r.loader_options);

  BaseLoadOptions bo;
  bo.device = r.device;
  bo.final_norm = plan.norm.any_pre;
  r.base = load_base_model(o.base, bo);
  r.draft.emplace(resumed ? resumed->draft : build_draft(plan, r.base, say));
  if (plan.stored_targets) {
    // The resumed (or evaluated) draft's lm_head rows must be the tokens the stored
    // distributions are over.
    const at::Tensor want = plan.stored_targets->d2t();
    const at::Tensor has = r.draft->d2t().to(at::kCPU).to(at::kLong);
    if (has.numel() != want.numel() || !at::equal(has, want))
      throw UsageError("the draft of " + (plan.draft_dir.empty() ? std::string("this run") : plan.draft_dir) +
                       " has another draft vocabulary (" + std::to_string(has.numel()) + " tokens) than the one " +
                       plan.stored_targets->source + "'s stored target distributions are over (" +
                       std::to_string(want.numel()) + " tokens, its selected_token_ids)");
  }
  r.draft->to(r.device, at::kFloat);
  if (training) r.draft->train(true);
  if (plan.block())
    r.block_unroll.emplace(r.base, *r.draft, plan.dflash);
  else
    r.unroll.emplace(r.base, *r.draft, plan.ttt);
  if (!training) return run;  // evaluate_loader makes its own sequence context

  r.named_parameters = r.draft->named_parameters();
  for (const auto& np : r.named_parameters) r.parameters.push_back(np.second);
  for (const auto& p : r.parameters) r.parameter_count += p.numel();
  if (mesh.world_size() > 1 && !resumed) broadcast_parameters(mesh.world(), r.parameters, 0);
  r.optimizer.emplace(r.named_parameters, draft_optimizer_options(o));
  if (resumed) {
    const TrainerState& st = resumed->checkpoint.state;
    r.optimizer->load_state(resumed->checkpoint.optimizer, st.optimizer_steps, resumed->dir + "/optimizer.safetensors");
    restore_rng_state(resumed->checkpoint.rng);
    r.loader->restore(st.sampler);
    r.step = st.step;
    r.tokens = st.tokens;
  }
  if (mesh.world_size() > 1) r.sync = std::make_unique<GradientSync>(mesh.world(), r.parameters);
  r.context = make_sequence_context(mesh, o.ttt_attention);
  return run;
}

}  // namespace eaglekit::trainer
