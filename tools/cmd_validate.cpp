// eaglekit validate: check an index's records against the conversations before training.
// With --base the same command also runs the semantic check; `eaglekit` hands such a call
// to eaglekit-torch (tools/main.cpp), where tools/cmd_validate_base.cpp runs it.
#include <iostream>
#include <optional>
#include <string>

#include "formats/error.h"
#include "lib/validate.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace eaglekit::tools {

opt::Groups ValidateCli::groups() {
  using opt::field;
  return {data_options(data).only({"data", "index", "match_by"}),
          opt::Group{"Validate",
                     {field("deep", "", options.deep, "Read every value of every matched record: NaN/Inf, checksums, shapes; stored target "
                                 "distributions (NeMo's cache) sum to 1"),
                      field("max_length", "L", options.max_length,
                            "Report how many records and tokens truncation to L drops (0: no report)"),
                      field("quarantine", "FILE", options.quarantine,
                            "Write the ids of every problem record to FILE (the loader's --quarantine)"),
                      opt::short_named(field("jobs", "N", options.jobs, "Threads (0: all cores)"), 'j'),
                      field("json", "", json, "Machine-readable output")}},
          opt::Group{"Semantic check (needs LibTorch)",
                     {field("base", "DIR", base,
                            "Base model folder: run its lm_head over sampled hidden states of every record and "
                            "measure how often argmax equals the next token, as post- and pre-norm states; report "
                            "the dump's norm form and the records that agree far less than the rest"),
                      field("positions", "N", positions, "Positions sampled per record for --base"),
                      opt::choice_of("hidden_states_norm", hidden_states_norm, trainer::kHiddenStatesNormNames,
                                     "The form --base reads records that state none in (a record's stored "
                                     "hidden_states_prenorm wins): post, pre, or auto: the form the record's "
                                     "layout implies, else the form the dataset measures as"),
                      field("device", "NAME", device, "Where --base's head runs: cpu, cuda or cuda:N")}}};
}

int run_validate(int argc, char** argv) {
  ValidateCli v;
  const opt::Groups groups = v.groups();
  const std::optional<CommandLine> cl = parse_or_help(
      argc, argv, groups, std::string(argv[0]) + " [--data PATH] --index FILE [--base DIR] [OPTIONS]",
      "Check records against the conversations (without --data: every usable record of the index) and "
      "against each other. Exit 0: trainable as is (warnings listed); 1: not trainable.");
  if (!cl) return 0;
  if (!cl->given("index")) throw UsageError("--index INDEX is required (build one with eaglekit index)");
  cl->apply();
  if (!v.base.empty()) throw UsageError("--base runs in eaglekit-torch: call it through eaglekit");
  ValidateOptions& o = v.options;
  o.data = v.data.data;
  o.index = v.data.index;
  o.match_by = v.data.match_by;
  const ValidateReport report = validate_dataset(o);
  std::cout << (v.json ? validate_report_to_json(report) : validate_report_to_text(report));
  return report.exit_code();
}

}  // namespace eaglekit::tools
