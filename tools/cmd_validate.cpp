// eaglekit validate: check an index's records against the conversations before training.
#include <iostream>
#include <string>

#include "formats/error.h"
#include "lib/validate.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace eaglekit::tools {

int run_validate(int argc, char** argv) {
  DataSelection data;
  ValidateOptions o;
  bool json = false;
  using opt::field;
  const opt::Groups groups{
      data_options(data).only({"data", "index"}),
      opt::Group{"Validate",
                 {field("deep", "", o.deep, "Read every value of every matched record: NaN/Inf, checksums, shapes"),
                  field("max_length", "L", o.max_length,
                        "Report how many records and tokens truncation to L drops (0: no report)"),
                  field("quarantine", "FILE", o.quarantine,
                        "Write the ids of every problem record to FILE (the loader's --quarantine)"),
                  opt::short_named(field("jobs", "N", o.jobs, "Threads for --deep (0: all cores)"), 'j'),
                  field("json", "", json, "Machine-readable output")}}};
  const CommandLine cl = parse_command_line(argc, argv, groups);
  if (cl.help) {
    std::cout << help_text(std::string(argv[0]) + " --data PATH --index FILE [OPTIONS]",
                           "Check records against the conversations and against each other. Exit 0: trainable as "
                           "is (warnings listed); 1: not trainable.",
                           groups);
    return 0;
  }
  if (!cl.given("data")) throw UsageError("--data CONVERSATIONS is required");
  if (!cl.given("index")) throw UsageError("--index INDEX is required (build one with eaglekit index)");
  cl.apply();
  o.data = data.data;
  o.index = data.index;
  o.progress = stderr_is_tty() ? 1 : 0;
  const ValidateReport report = validate_dataset(o);
  std::cout << (json ? validate_report_to_json(report) : validate_report_to_text(report));
  return report.exit_code();
}

}  // namespace eaglekit::tools
