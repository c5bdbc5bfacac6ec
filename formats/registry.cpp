#include "formats/registry.h"

namespace eaglekit {

const std::vector<FormatEntry>& format_registry() {
  static const std::vector<FormatEntry> kEntries = {
      // {Format::kPt, open_pt_reader, create_pt_writer},  (one row per format)
  };
  return kEntries;
}

}  // namespace eaglekit
