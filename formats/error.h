// The one exception hierarchy of eaglekit. Every layer throws these (LibTorch's
// c10::Error aside); main() maps them to exit codes: UsageError -> 2, anything else -> 1.
// Expected outcomes (a missing key, an absent record) are std::optional, not exceptions.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace eaglekit {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The command line or a config file asked for something that cannot be done.
class UsageError : public Error {
 public:
  using Error::Error;
};

// The operating system refused: open, read, write, rename, mmap...
class IoError : public Error {
 public:
  using Error::Error;
  // "PATH: WHAT: strerror(errno)" with the errno of the failed call.
  static IoError from_errno(const std::string& path, const std::string& what, int err);
};

// Bytes that do not follow the format. The message always names the file, the byte
// offset (when known) and the field, e.g.
//   "data/7.pt: zip central directory at byte 812: entry count 9 exceeds file size".
class FormatError : public Error {
 public:
  FormatError(std::string path, std::optional<std::uint64_t> offset, std::string field,
              const std::string& detail);
  const std::string& path() const { return path_; }
  std::optional<std::uint64_t> offset() const { return offset_; }
  const std::string& field() const { return field_; }

 private:
  std::string path_;
  std::optional<std::uint64_t> offset_;
  std::string field_;
};

// 'name': how messages quote a key, entry or field name.
inline std::string squote(std::string_view s) { return "'" + std::string(s) + "'"; }

// Stored checksum and decoded bytes disagree.
class ChecksumError : public FormatError {
 public:
  using FormatError::FormatError;
};

// A valid file of a kind we deliberately do not read (legacy torch pickles, big-endian).
class UnsupportedError : public FormatError {
 public:
  using FormatError::FormatError;
};

}  // namespace eaglekit
