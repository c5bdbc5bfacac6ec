// eaglekit convert: records of any format to any format, values preserved exactly.
#include <cxxopts.hpp>

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "formats/error.h"
#include "lib/convert.h"
#include "lib/progress.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace eaglekit::tools {

int run_convert(int argc, char** argv) {
  cxxopts::Options options(
      argv[0],
      "Convert records between formats, values preserved exactly. SRC: a record file, "
      "FILE#conversation_id, or a folder of records. DST: a file (one record, or a shard for "
      "hdf5/eks), or a folder that receives one file per record (pt, safetensors). The format "
      "comes from --format, else DST's extension, else pt. Outputs are written atomically.");
  options.positional_help("SRC DST");
  options.add_options()("src", "Source", cxxopts::value<std::string>())
      ("dst", "Destination", cxxopts::value<std::string>())
      ("format", "Output format: pt, safetensors, hdf5 or eks", cxxopts::value<std::string>())
      ("codec", "eks codec: zstd or fp8", cxxopts::value<std::string>()->default_value("zstd"))
      ("level", "eks zstd level", cxxopts::value<int>()->default_value("3"))
      ("jobs", "Threads (0: all cores)", cxxopts::value<int>()->default_value("0"))
      ("json", "Print the result as JSON");
  options.parse_positional({"src", "dst"});
  const auto args = parse_args(options, argc, argv);
  if (!args) return 0;
  if (!args->count("src") || !args->count("dst"))
    throw UsageError("SRC and DST are required (see --help)");
  ConvertOptions o;
  if (args->count("format")) {
    const std::string f = (*args)["format"].as<std::string>();
    o.format = parse_format(f);
    if (!o.format) throw UsageError("--format: unknown format '" + f + "' (pt, safetensors, hdf5, eks)");
  }
  o.writer.codec = (*args)["codec"].as<std::string>();
  o.writer.level = (*args)["level"].as<int>();
  o.jobs = (*args)["jobs"].as<int>();
  o.progress = stderr_is_tty();
  const std::string dst = (*args)["dst"].as<std::string>();
  const ConvertResult r = convert_records((*args)["src"].as<std::string>(), dst, o);
  if (args->count("json")) {
    nlohmann::json j;
    j["format"] = std::string(format_name(r.format));
    j["output"] = r.output;
    j["folder"] = r.folder_output;
    j["records"] = r.records;
    j["files"] = r.files_written;
    j["bytes"] = r.bytes_written;
    j["seconds"] = r.seconds;
    std::cout << j.dump(2) << "\n";
  } else {
    char line[512];
    std::snprintf(line, sizeof line, "converted %lld records to %s%s (%s, %lld files, %s) in %.2f s\n",
                  static_cast<long long>(r.records), r.output.c_str(), r.folder_output ? "/" : "",
                  std::string(format_name(r.format)).c_str(),
                  static_cast<long long>(r.files_written),
                  human_bytes(static_cast<double>(r.bytes_written)).c_str(), r.seconds);
    std::cout << line;
  }
  return 0;
}

}  // namespace eaglekit::tools
