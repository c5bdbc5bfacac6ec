// eaglekit vocab: token frequencies over the dataset's input_ids -> d2t.pt (ModelOpt's
// calibration: draft id i is the i-th most frequent token, ties by smaller id).
#include <cxxopts.hpp>

#include <iostream>
#include <string>

#include "formats/error.h"
#include "tools/cli.h"
#include "tools/commands.h"
#include "trainer/train.h"

namespace eaglekit::tools {

int run_vocab(int argc, char** argv) {
  cxxopts::Options options(argv[0],
                           "Count token frequencies over the dataset's input_ids and write d2t "
                           "(torch.save of an int64 tensor [Vd]: target id = i + d2t[i]) for train --d2t");
  options.add_options()
      ("data", "Conversations", cxxopts::value<std::string>())
      ("index", "Dataset index", cxxopts::value<std::string>())
      ("quarantine", "File of conversation ids to leave out", cxxopts::value<std::string>()->default_value(""))
      ("split", "train, eval or all", cxxopts::value<std::string>()->default_value("train"))
      ("eval-fraction", "Share of matched samples that evaluate", cxxopts::value<double>()->default_value("0.05"))
      ("base", "Base model folder (for vocab_size)", cxxopts::value<std::string>()->default_value(""))
      ("vocab-size", "Target vocabulary size (instead of --base)", cxxopts::value<std::int64_t>()->default_value("0"))
      ("draft-vocab-size", "Draft vocabulary size Vd", cxxopts::value<std::int64_t>())
      ("out", "d2t file to write (e.g. d2t.pt)", cxxopts::value<std::string>())
      ("jobs", "Threads (0: all cores)", cxxopts::value<int>()->default_value("0"))
      ("json", "Print {\"vocab_size\", \"draft_vocab_size\", \"tokens\", \"distinct\", \"coverage\", ...}");
  auto args = parse_args(options, argc, argv);
  if (!args) return 0;
  const auto& a = *args;
  trainer::VocabOptions o;
  if (a.count("data")) o.data = a["data"].as<std::string>();
  if (a.count("index")) o.index = a["index"].as<std::string>();
  o.quarantine = a["quarantine"].as<std::string>();
  o.split = a["split"].as<std::string>();
  o.eval_fraction = a["eval-fraction"].as<double>();
  o.base = a["base"].as<std::string>();
  o.vocab_size = a["vocab-size"].as<std::int64_t>();
  if (a.count("draft-vocab-size")) o.draft_vocab_size = a["draft-vocab-size"].as<std::int64_t>();
  if (a.count("out")) o.out = a["out"].as<std::string>();
  o.jobs = a["jobs"].as<int>();
  const trainer::VocabReport r = trainer::build_vocab(o);
  if (a.count("json")) {
    std::cout << r.to_json() << "\n";
  } else {
    std::cerr << r.summary << "\n";
    std::cout << "wrote " << o.out << ": " << r.draft_vocab_size << " of " << r.vocab_size << " tokens ("
              << r.distinct << " seen) cover " << 100.0 * r.coverage << "% of " << r.tokens
              << " token occurrences\n";
  }
  return 0;
}

}  // namespace eaglekit::tools
