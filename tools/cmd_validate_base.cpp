// eaglekit validate in eaglekit-torch: the checks of tools/cmd_validate.cpp, then with
// --base the semantic check of trainer/run/semantic_check.h over every matched record. Its
// suspects join the quarantine file (category semantic_suspects) and make the dataset
// "not trainable as is" (exit 1), as the structural problems do.
#include <nlohmann/json.hpp>

#include <iostream>
#include <string>

#include "formats/error.h"
#include "lib/loader.h"
#include "lib/validate.h"
#include "tools/cli.h"
#include "tools/commands.h"
#include "trainer/model/base_model.h"
#include "trainer/model/config.h"
#include "trainer/run/semantic_check.h"

namespace eaglekit::tools {

int run_validate_base(int argc, char** argv) {
  ValidateCli v;
  const opt::Groups groups = v.groups();
  const CommandLine cl = parse_command_line(argc, argv, groups);
  if (cl.help || !cl.given("base")) return run_validate(argc, argv);
  if (!cl.given("index")) throw UsageError("--index INDEX is required (build one with eaglekit index)");
  cl.apply();
  ValidateOptions o = v.options;
  o.data = v.data.data;
  o.index = v.data.index;
  o.match_by = v.data.match_by;
  o.quarantine.clear();  // written below, with the semantic suspects
  ValidateReport report = validate_dataset(o);

  std::string semantic_text;
  nlohmann::ordered_json semantic_json = nullptr;
  if (report.matched > 0) {
    DataSelection sel = v.data;
    sel.split = "all";
    const SelectedData data = select_data(sel);
    // Said before the base is read: on a large base and the CPU this is the long part.
    const trainer::BaseConfig bc = trainer::load_base_config(v.base);
    std::cerr << "validate: " << trainer::semantic_check_notice(static_cast<std::int64_t>(data.samples.size()),
                                                              v.positions, bc.vocab_size, bc.hidden_size, v.device)
              << "\n";
    trainer::BaseLoadOptions bo;
    bo.final_norm = true;  // both forms are measured
    const trainer::BaseModel base = trainer::load_base_model(v.base, bo);
    if (report.hidden_size != base.config.hidden_size)
      throw UsageError("the data's hidden states are " + std::to_string(report.hidden_size) + " wide but the base in " +
                       v.base + " has hidden_size " + std::to_string(base.config.hidden_size));
    trainer::SemanticOptions so;
    so.positions = v.positions;
    so.jobs = o.jobs;
    so.device = v.device;
    so.unstated_form = v.hidden_states_norm == trainer::HiddenStatesNorm::kAuto  ? -1
                       : v.hidden_states_norm == trainer::HiddenStatesNorm::kPre ? 1
                                                                                 : 0;
    const trainer::SemanticReport s = trainer::semantic_check(data.dataset, data.samples, base, so);
    std::vector<std::string> suspects;
    for (const auto& r : s.suspects) suspects.push_back(r.id);
    if (!suspects.empty())
      report.fatal.push_back(std::to_string(suspects.size()) +
                             " records' hidden states do not predict their own next tokens through the base's head "
                             "(semantic check): exclude them with --quarantine FILE");
    for (const auto& p : s.problems) report.fatal.push_back(p);
    report.ok = report.fatal.empty();
    report.quarantine_groups.emplace_back("semantic_suspects", suspects);
    semantic_text = s.to_text();
    semantic_json = nlohmann::ordered_json::parse(s.to_json());
  }
  if (!v.options.quarantine.empty()) write_validate_quarantine(report, v.options.quarantine);
  if (v.json) {
    auto j = nlohmann::ordered_json::parse(validate_report_to_json(report));
    j["semantic"] = semantic_json;
    std::cout << j.dump() << "\n";
  } else {
    std::cout << validate_report_to_text(report) << semantic_text;
  }
  return report.exit_code();
}

}  // namespace eaglekit::tools
