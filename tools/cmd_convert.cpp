// eaglekit convert: records of any format to any format, values preserved exactly.
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "formats/eks_format.h"
#include "formats/error.h"
#include "formats/registry.h"
#include "lib/convert.h"
#include "lib/progress.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace eaglekit::tools {

namespace {

// The --format spellings of the formats convert writes (lib/convert.h convert_writes):
// format_spellings offers every format with a writer, pt.gz's among them, which convert
// refused after offering it.
std::vector<std::pair<Format, std::string_view>> convert_spellings() {
  std::vector<std::pair<Format, std::string_view>> out;
  for (const auto& spelling : format_spellings())
    if (convert_writes(*format_row(spelling.first))) out.push_back(spelling);
  return out;
}

}  // namespace

int run_convert(int argc, char** argv) {
  ConvertOptions o;
  Format format = Format::kUnknown;  // kUnknown: from DST's extension, else pt
  EksCodec codec = EksCodec::kZstd;
  bool json = false;
  const opt::Groups groups{opt::Group{
      "Convert",
      {opt::note(opt::choice_of("format", format, convert_spellings(), "Output format"),
                 "DST's extension, else pt"),
       opt::choice_of("codec", codec, kEksCodecNames, "eks codec"),
       opt::field("level", "N", o.writer.level, "eks zstd level"),
       opt::field("jobs", "N", o.jobs, "Threads (0: all cores)"),
       opt::field("loss-masks", "FILE", o.loss_masks,
                  "speculators' loss masks (scripts/speculators/loss_masks.py wrote FILE from its "
                  "prepared dataset): each hs_{i}.safetensors takes row i's mask"),
       opt::field("json", "", json, "Print the result as JSON")}}};
  const auto shard = [](const FormatRow& r) { return convert_writes(r) && !r.one_record; };
  const auto one_record = [](const FormatRow& r) { return convert_writes(r) && r.one_record; };
  const std::optional<CommandLine> cl = parse_or_help(
      argc, argv, groups, std::string(argv[0]) + " SRC DST [OPTIONS]",
      "Convert records between formats, values preserved exactly. SRC: a record file, "
      "FILE#conversation_id, or a folder of records. DST: a file (one record, or a shard for " +
          format_list(&FormatRow::name, shard, "/", "/") +
          "), or a folder that receives one file per record (" +
          format_list(&FormatRow::name, one_record, ", ", ", ") +
          "). The format comes from --format, else DST's extension, else pt. Outputs are written "
          "atomically. What a source states for all its records (the aux layer ids of a DeepSpec or NeMo "
          "cache, a NeMo cache's draft vocabulary) goes along: .eks keeps both, and the sources of one "
          "shard must state the same; the other formats keep neither, so a NeMo AutoModel EAGLE-3 cache "
          "(its records store the target's distribution over that vocabulary) converts to .eks only, and "
          "dropped aux layer ids are said, to pass with train's --aux-layer-ids.",
      2);
  if (!cl) return 0;
  if (cl->positionals.size() < 2) throw UsageError("SRC and DST are required (see --help)");
  cl->check_choice("format", [](const std::string& v) {
    return "--format: unknown format '" + v + "' (" +
           format_list(&FormatRow::name, convert_writes, ", ", ", ") + ")";
  });
  cl->apply();
  if (format != Format::kUnknown) o.format = format;
  o.writer.codec = std::string(eks_codec_name(codec));
  o.progress = true;  // redrawn on a terminal, plain lines in a log (lib/progress.h)
  const std::string& dst = cl->positionals[1];
  const ConvertResult r = convert_records(cl->positionals[0], dst, o);
  if (json) {
    nlohmann::json j;
    j["format"] = std::string(format_name(r.format));
    j["output"] = r.output;
    j["folder"] = r.folder_output;
    j["records"] = r.records;
    j["files"] = r.files_written;
    j["bytes"] = r.bytes_written;
    j["seconds"] = r.seconds;
    if (!o.loss_masks.empty()) j["loss_masks_joined"] = r.loss_masks_joined;
    nlohmann::json facts = nullptr;
    if (!r.facts.empty()) {
      facts = nlohmann::json::object();
      facts["aux_layer_ids"] = r.facts.aux_layer_ids;
      facts["target_vocabulary"] = nullptr;
      if (const auto& v = r.facts.target_vocabulary)
        facts["target_vocabulary"] = {{"draft_vocab_size", v->selected.size()},
                                      {"target_vocab_size", v->target_vocab_size},
                                      {"topk", v->topk}};
    }
    j["facts"] = facts;
    j["dropped_aux_layer_ids"] = r.dropped_aux_layer_ids;
    j["notes"] = r.notes;
    std::cout << j.dump(2) << "\n";
  } else {
    char line[512];
    std::snprintf(line, sizeof line, "converted %lld records to %s%s (%s, %lld files, %s) in %.2f s\n",
                  static_cast<long long>(r.records), r.output.c_str(), r.folder_output ? "/" : "",
                  std::string(format_name(r.format)).c_str(),
                  static_cast<long long>(r.files_written),
                  human_bytes(static_cast<double>(r.bytes_written)).c_str(), r.seconds);
    std::cout << line;
    if (!o.loss_masks.empty())
      std::cout << "loss masks: " << r.loss_masks_joined << " records took their mask from "
                << o.loss_masks << "\n";
    if (!r.facts.aux_layer_ids.empty()) {
      std::string ids;
      for (const std::int64_t id : r.facts.aux_layer_ids) ids += (ids.empty() ? "" : ", ") + std::to_string(id);
      std::cout << "facts: aux layer ids [" << ids << "] kept\n";
    }
    if (const auto& v = r.facts.target_vocabulary)
      std::cout << "facts: target vocabulary of " << v->selected.size() << " draft tokens of " << v->target_vocab_size
                << (v->topk ? ", top " + std::to_string(v->topk) : std::string()) << " kept\n";
    for (const std::string& note : r.notes) std::cout << "note: " << note << "\n";
  }
  return 0;
}

}  // namespace eaglekit::tools
