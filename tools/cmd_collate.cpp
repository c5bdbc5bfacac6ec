// eaglekit collate: stream batches through the loader and write them as torch.save dicts,
// for inspection and interop. The data/loader options are shared with loader-bench.
#include <cxxopts.hpp>

#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>

#include "formats/error.h"
#include "lib/loader.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace eaglekit::tools {

// Options every loader-driven command takes (collate, loader-bench).
void add_loader_options(cxxopts::Options& options) {
  options.add_options("Data")
      ("data", "Conversations: a .jsonl file, a folder of them, or a JSON array file", cxxopts::value<std::string>())
      ("index", "Dataset index (eaglekit index)", cxxopts::value<std::string>())
      ("quarantine", "File of conversation ids to leave out", cxxopts::value<std::string>()->default_value(""))
      ("split", "train, eval or all", cxxopts::value<std::string>()->default_value("train"))
      ("eval-fraction", "Share of matched samples (at the end) that evaluate", cxxopts::value<double>()->default_value("0.05"));
  options.add_options("Batches")
      ("batch-size", "Rows per batch (per data-parallel rank)", cxxopts::value<std::int64_t>()->default_value("8"))
      ("max-length", "Tokens per sample (and row length in pad and pack mode)", cxxopts::value<std::int64_t>()->default_value("2048"))
      ("mode", "pad (the reference), longest or pack", cxxopts::value<std::string>()->default_value("pad"))
      ("pad-multiple", "longest: round the batch length up to this", cxxopts::value<std::int64_t>()->default_value("8"))
      ("batches", "Stop after N batches, continuing into later epochs (default: one epoch)", cxxopts::value<std::int64_t>()->default_value("-1"))
      ("shuffle", "Seeded per-epoch permutation instead of reference order")
      ("seed", "Shuffle seed", cxxopts::value<std::uint64_t>()->default_value("0"))
      ("drop-last", "Drop the last, partial global batch of an epoch")
      ("rank", "Data-parallel rank", cxxopts::value<int>()->default_value("0"))
      ("world-size", "Data-parallel size", cxxopts::value<int>()->default_value("1"))
      ("first-token", "Token window of each row: first column", cxxopts::value<std::int64_t>()->default_value("0"))
      ("last-token", "Token window of each row: end column (exclusive; -1: row end)", cxxopts::value<std::int64_t>()->default_value("-1"))
      ("cp-rank", "Context-parallel rank: holds its chunk of every row", cxxopts::value<int>()->default_value("0"))
      ("cp-size", "Context-parallel size", cxxopts::value<int>()->default_value("1"))
      ("resume", "Sampler state to continue from (JSON, or a file holding it)", cxxopts::value<std::string>()->default_value(""))
      ("strict", "Fail on the first bad record instead of skipping it");
  options.add_options("Engine")
      ("jobs", "Threads (0: all cores)", cxxopts::value<int>()->default_value("0"))
      ("prefetch", "Batches in flight and ready ahead of the consumer", cxxopts::value<int>()->default_value("4"));
}

namespace {

struct LoaderSetup {
  SelectedData data;
  LoaderOptions options;
  std::int64_t batches = -1;
  std::string resume;  // JSON of a SamplerState, or ""
};

LoaderSetup loader_setup(const cxxopts::ParseResult& a) {
  LoaderSetup s;
  if (!a.count("data")) throw UsageError("--data is required");
  if (!a.count("index")) throw UsageError("--index is required (build one with eaglekit index)");
  auto& o = s.options;
  const std::string mode = a["mode"].as<std::string>();
  const auto m = parse_collate_mode(mode);
  if (!m) throw UsageError("--mode must be pad, longest or pack, not '" + mode + "'");
  o.collate.mode = *m;
  o.collate.max_length = a["max-length"].as<std::int64_t>();
  o.collate.pad_multiple = a["pad-multiple"].as<std::int64_t>();
  o.collate.first_token = a["first-token"].as<std::int64_t>();
  o.collate.last_token = a["last-token"].as<std::int64_t>();
  o.collate.cp_rank = a["cp-rank"].as<int>();
  o.collate.cp_size = a["cp-size"].as<int>();
  o.collate.check();
  o.sampler.batch_size = a["batch-size"].as<std::int64_t>();
  o.sampler.shuffle = a.count("shuffle") > 0;
  o.sampler.seed = a["seed"].as<std::uint64_t>();
  o.sampler.drop_last = a.count("drop-last") > 0;
  o.sampler.rank = a["rank"].as<int>();
  o.sampler.world_size = a["world-size"].as<int>();
  o.sampler.epochs = 0;
  o.jobs = a["jobs"].as<int>();
  o.prefetch = a["prefetch"].as<int>();
  o.strict = a.count("strict") > 0;
  s.batches = a["batches"].as<std::int64_t>();
  s.resume = a["resume"].as<std::string>();
  if (!s.resume.empty() && s.resume.front() != '{') {
    std::ifstream f(s.resume);
    if (!f) throw UsageError("--resume: '" + s.resume + "' is neither JSON nor a readable file");
    s.resume.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  DataSelection sel;
  sel.data = a["data"].as<std::string>();
  sel.index = a["index"].as<std::string>();
  sel.quarantine = a["quarantine"].as<std::string>();
  sel.split = a["split"].as<std::string>();
  sel.eval_fraction = a["eval-fraction"].as<double>();
  s.data = select_data(sel);
  return s;
}

}  // namespace

// The loader the options describe; `batches` and `summary` (what matched) come with it.
std::unique_ptr<Loader> open_loader(const cxxopts::ParseResult& args, std::int64_t& batches,
                                    std::string& summary) {
  LoaderSetup s = loader_setup(args);
  auto loader = std::make_unique<Loader>(s.data.dataset, s.data.samples, s.options);
  if (!s.resume.empty()) loader->restore(SamplerState::from_json(s.resume));
  batches = s.batches;
  summary = s.data.summary;
  return loader;
}

int run_collate(int argc, char** argv) {
  cxxopts::Options options(argv[0],
                           "Stream batches through the loader and write them as torch.save dicts "
                           "DIR/batch_00000.pt, ... (keys input_ids, attention_mask, loss_mask, "
                           "labels, hidden_states, aux_hidden_states; pack mode adds document_ids, "
                           "position_ids) plus DIR/batches.jsonl (ids and sampler state per batch)");
  add_loader_options(options);
  options.add_options()("out", "Output folder", cxxopts::value<std::string>())
      ("json", "Print the summary as JSON");
  auto args = parse_args(options, argc, argv);
  if (!args) return 0;
  if (!args->count("out")) throw UsageError("--out is required");
  std::int64_t batches = -1;
  std::string summary;
  auto loader = open_loader(*args, batches, summary);
  const bool json = args->count("json") > 0;
  if (!json) std::cerr << summary << "\n";
  const CollateReport report = write_batches(*loader, (*args)["out"].as<std::string>(), batches);
  if (json) {
    std::cout << report.to_json() << "\n";
  } else {
    std::cout << "wrote " << report.batches << " batches (" << report.stats.samples << " samples, "
              << report.stats.skipped << " skipped) to " << (*args)["out"].as<std::string>()
              << "\n";
  }
  return 0;
}

}  // namespace eaglekit::tools
