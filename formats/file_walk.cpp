#include "formats/file_walk.h"

#include <filesystem>
#include <system_error>

#include "formats/error.h"
#include "formats/nemo_cache_format.h"

namespace eaglekit {

namespace fs = std::filesystem;

std::vector<std::string> list_files_below(const std::string& root) {
  std::vector<std::string> out;
  std::error_code ec;
  if (fs::is_regular_file(root, ec)) {
    out.push_back(root);
    return out;
  }
  if (!fs::is_directory(root, ec)) throw IoError(root + ": no such file or directory");
  fs::recursive_directory_iterator it(root, fs::directory_options::skip_permission_denied, ec), end;
  if (ec) throw IoError::from_errno(root, "cannot list", ec.value());
  for (; it != end; it.increment(ec)) {
    if (ec) throw IoError::from_errno(it->path().string(), "cannot list", ec.value());
    if (!it->is_regular_file(ec)) continue;
    if (it->path().filename().string().find(".tmp.") != std::string::npos) continue;
    out.push_back(it->path().string());
  }
  return out;
}

std::optional<Format> record_file_format(const std::string& path) {
  try {
    // NeMo's shards are safetensors files that belong to the manifest beside them.
    if (is_nemo_cache_member(path)) return std::nullopt;
    const Format f = detect_file_format(path);
    if (f == Format::kUnknown) return std::nullopt;
    return f;
  } catch (const IoError&) {
    return Format::kUnknown;
  }
}

}  // namespace eaglekit
