// The table that ties each Format to its reader and writer. Adding a format = one
// header of its own plus one row in registry.cpp. Internal to formats/.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "formats/format.h"

namespace eaglekit {

struct FormatEntry {
  Format format;
  std::function<std::unique_ptr<RecordReader>(const std::string& path)> open;
  std::function<std::unique_ptr<RecordWriter>(const std::string& path, const WriterOptions&)>
      create;  // empty when the format is read-only
};

const std::vector<FormatEntry>& format_registry();

}  // namespace eaglekit
