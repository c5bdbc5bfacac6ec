// eaglekit collate: stream batches through the loader and write them as torch.save dicts,
// for inspection and interop. The data/loader options (tools/cli.h LoaderJob) are shared
// with loader-bench.
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>

#include "formats/error.h"
#include "lib/loader.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace eaglekit::tools {

std::unique_ptr<Loader> open_loader(const LoaderJob& job, std::string& summary) {
  if (job.index.empty()) throw UsageError("--index is required (build one with eaglekit index)");
  opt::check_bounds(const_cast<LoaderJob&>(job).groups());  // reads only
  LoaderOptions o = loader_options(job, job.rank, job.world_size, job.cp_rank, job.cp_size);
  o.collate.first_token = job.first_token;
  o.collate.last_token = job.last_token;
  o.collate.check();
  o.strict = job.strict;
  std::string resume = job.resume;
  if (!resume.empty() && resume.front() != '{') {
    std::ifstream f(resume);
    if (!f) throw UsageError("--resume: '" + resume + "' is neither JSON nor a readable file");
    resume.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  SelectedData data = select_data(job);
  auto loader = std::make_unique<Loader>(data.dataset, data.samples, o);
  if (!resume.empty()) loader->restore(SamplerState::from_json(resume));
  summary = data.summary;
  return loader;
}

int run_collate(int argc, char** argv) {
  LoaderJob job;
  std::string out;
  bool json = false;
  opt::Groups groups = job.groups();
  groups.push_back(opt::Group{"Output",
                              {opt::cli_only(opt::field("out", "DIR", out, "Output folder")),
                               opt::cli_only(opt::field("json", "", json, "Print the summary as JSON"))}});
  const std::optional<CommandLine> cl = parse_or_help(
      argc, argv, groups, std::string(argv[0]) + " --data PATH --index FILE --out DIR [OPTIONS]",
      "Stream batches through the loader and write them as torch.save dicts "
      "DIR/batch_00000.pt, ... (keys input_ids, attention_mask, loss_mask, labels, "
      "hidden_states, aux_hidden_states; pack mode adds document_ids, position_ids; a batch whose "
      "records state their norm form adds hidden_states_prenorm, int8 per token: 1 pre-norm, 0 post-norm, "
      "-1 not stated) plus "
      "DIR/batches.jsonl (ids and sampler state per batch).");
  if (!cl) return 0;
  cl->apply();
  if (out.empty()) throw UsageError("--out is required");
  std::string summary;
  auto loader = open_loader(job, summary);
  if (!json) std::cerr << summary << "\n";
  const CollateReport report = write_batches(*loader, out, job.batches);
  if (json) {
    std::cout << report.to_json() << "\n";
  } else {
    std::cout << "wrote " << report.batches << " batches (" << report.stats.samples << " samples, "
              << report.stats.skipped << " skipped) to " << out << "\n";
  }
  return 0;
}

}  // namespace eaglekit::tools
