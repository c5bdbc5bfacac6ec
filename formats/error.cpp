#include "formats/error.h"

#include <cstring>

namespace eaglekit {

namespace {
std::string format_message(const std::string& path, std::optional<std::uint64_t> offset,
                           const std::string& field, const std::string& detail) {
  std::string msg = path.empty() ? std::string("<memory>") : path;
  msg += ": ";
  msg += field;
  if (offset) {
    msg += " at byte ";
    msg += std::to_string(*offset);
  }
  msg += ": ";
  msg += detail;
  return msg;
}
}  // namespace

IoError IoError::from_errno(const std::string& path, const std::string& what, int err) {
  return IoError(path + ": " + what + ": " + std::strerror(err));
}

FormatError::FormatError(std::string path, std::optional<std::uint64_t> offset, std::string field,
                         const std::string& detail)
    : Error(format_message(path, offset, field, detail)),
      path_(std::move(path)),
      offset_(offset),
      field_(std::move(field)) {}

}  // namespace eaglekit
