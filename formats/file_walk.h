// The one walk below a dataset root that every folder reader shares (find_record_files in
// formats/format.h, the index in lib/index.h), so that they agree on which files exist:
// regular files only, symlinked folders not followed (no cycles, no double counts),
// unreadable folders skipped, writers' temp files ("*.tmp.*", formats/atomic_file.h) left
// out. Listing reads no file, so callers can detect formats afterwards in parallel.
//
// Thread-safe (no shared state). Throws IoError.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "formats/format.h"

namespace eaglekit {

// `root` itself when it is a regular file, else every regular file below it, in the order
// the walk meets them (not sorted). IoError "ROOT: no such file or directory" when root is
// neither a file nor a folder, "PATH: cannot list: ..." when a folder cannot be read.
std::vector<std::string> list_files_below(const std::string& root);

// What a listed file is, by its magic bytes: its record format; nullopt for a readable file
// that holds no records; Format::kUnknown for one whose head cannot be read, kept so that
// the caller reports it.
std::optional<Format> record_file_format(const std::string& path);

}  // namespace eaglekit
