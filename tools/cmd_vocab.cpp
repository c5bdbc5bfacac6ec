// eaglekit vocab: token frequencies over the dataset's input_ids -> d2t.pt (ModelOpt's
// calibration: draft id i is the i-th most frequent token, ties by smaller id). Options:
// trainer::VocabOptions's tables.
#include <iostream>
#include <optional>
#include <string>

#include "formats/error.h"
#include "tools/cli.h"
#include "tools/commands.h"
#include "trainer/model/vocab.h"

namespace eaglekit::tools {

int run_vocab(int argc, char** argv) {
  trainer::VocabOptions o;
  bool json = false;
  opt::Groups groups = o.groups();
  groups.push_back(opt::Group{
      "Output",
      {opt::cli_only(opt::field(
          "json", "", json, "Print {\"vocab_size\", \"draft_vocab_size\", \"tokens\", \"distinct\", \"coverage\", ...}"))}});
  const std::optional<CommandLine> cl = parse_or_help(
      argc, argv, groups, std::string(argv[0]) + " --data PATH --index FILE --base DIR --draft-vocab-size N --out FILE",
      "Count token frequencies over the dataset's input_ids and write d2t (torch.save of an "
      "int64 tensor [Vd]: target id = i + d2t[i]) for train --d2t.");
  if (!cl) return 0;
  cl->apply();
  const trainer::VocabReport r = trainer::build_vocab(o);
  if (json) {
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
