// Writes a file so that it appears complete or not at all: bytes go to
// "DIR/.NAME.tmp.PID.N", then fsync, rename over NAME, fsync of the folder. A writer
// destroyed before commit() removes its temp file. Nobody ever sees a half-written NAME.
//
// Not thread-safe; one writer per output.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace eaglekit {

class AtomicFile {
 public:
  explicit AtomicFile(std::string final_path);
  ~AtomicFile();  // removes the temp file unless committed; never throws
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, std::size_t n);
  void write_zeros(std::size_t n);
  // Overwrites bytes already written (for headers patched at the end).
  void pwrite(const void* data, std::size_t n, std::uint64_t offset);
  std::uint64_t tell() const { return written_; }
  // fsync + rename + fsync(dir). Throws IoError; the temp file is removed on failure.
  void commit();

  const std::string& path() const { return final_path_; }
  const std::string& temp_path() const { return temp_path_; }

 private:
  std::string final_path_;
  std::string temp_path_;
  int fd_ = -1;
  std::uint64_t written_ = 0;
  bool committed_ = false;
};

// Writes a whole buffer atomically.
void write_file_atomic(const std::string& path, const void* data, std::size_t n);

// Puts the folder `from` (already complete, its files fsynced) in place as `to` so that `to`
// is always either the old folder or the new one: a plain rename when `to` does not exist,
// else an atomic exchange (renameat2 RENAME_EXCHANGE; where the file system lacks it, the old
// folder is first renamed aside, leaving a short window without `to`), after which the old
// contents are removed. Then fsyncs the parent folder so the rename survives a power loss.
// Throws IoError.
void replace_folder_atomic(const std::string& from, const std::string& to);

// True when `pid` names no running process (ESRCH), as for a writer killed before commit.
bool process_gone(long pid);

// Removes the temp files ".NAME.tmp.PID.N" in `dir` (not below it) that writers killed
// before commit() left: those whose PID is gone and whose NAME ours(NAME) accepts (the
// outputs of the calling command). Temp files of live processes, this one included, stay.
// PIDs are per host: two hosts writing one folder of a shared file system must not share
// an output. Returns how many it removed; never throws (a file it cannot remove stays).
std::size_t remove_stale_temp_files(const std::string& dir,
                                    const std::function<bool(const std::string&)>& ours);

}  // namespace eaglekit
