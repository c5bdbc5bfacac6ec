#include "formats/byte_source.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "formats/error.h"

namespace eaglekit {

namespace {

class MappedFile final : public ByteSource {
 public:
  MappedFile(void* map, std::uint64_t size, std::string name)
      : ByteSource(static_cast<const std::uint8_t*>(map), size, std::move(name)), map_(map) {}
  ~MappedFile() override {
    if (map_ != nullptr) ::munmap(map_, size());
  }

 private:
  void* map_;
};

class Window final : public ByteSource {
 public:
  Window(std::shared_ptr<const ByteSource> parent, std::uint64_t offset, std::uint64_t len,
         std::string name)
      : ByteSource(parent->data() + offset, len, std::move(name)), parent_(std::move(parent)) {}

 private:
  std::shared_ptr<const ByteSource> parent_;
};

// Builds a source whose data pointer is the vector's buffer.
class OwnedBytes final : public ByteSource {
 public:
  OwnedBytes(std::shared_ptr<std::vector<std::uint8_t>> buf, std::string name)
      : ByteSource(buf->data(), buf->size(), std::move(name)), buf_(std::move(buf)) {}

 private:
  std::shared_ptr<std::vector<std::uint8_t>> buf_;
};

}  // namespace

const std::uint8_t* ByteSource::at(std::uint64_t offset, std::uint64_t len,
                                   const char* field) const {
  if (!contains(offset, len)) {
    throw FormatError(name_, offset, field,
                      "needs " + std::to_string(len) + " bytes but the file has " +
                          std::to_string(size_) + " (truncated or corrupt)");
  }
  return data_ + offset;
}

std::shared_ptr<const ByteSource> ByteSource::open_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError::from_errno(path, "cannot open", errno);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw IoError::from_errno(path, "cannot stat", err);
  }
  if (S_ISDIR(st.st_mode)) {
    ::close(fd);
    throw IoError(path + ": is a directory, expected a file");
  }
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size == 0) {
    ::close(fd);
    return std::make_shared<OwnedBytes>(std::make_shared<std::vector<std::uint8_t>>(), path);
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int err = errno;
  ::close(fd);
  if (map == MAP_FAILED) throw IoError::from_errno(path, "cannot mmap", err);
  return std::make_shared<MappedFile>(map, size, path);
}

std::shared_ptr<const ByteSource> ByteSource::from_bytes(std::vector<std::uint8_t> bytes,
                                                         std::string name) {
  return std::make_shared<OwnedBytes>(
      std::make_shared<std::vector<std::uint8_t>>(std::move(bytes)), std::move(name));
}

std::shared_ptr<const ByteSource> ByteSource::slice(std::shared_ptr<const ByteSource> parent,
                                                    std::uint64_t offset, std::uint64_t len,
                                                    std::string name) {
  parent->at(offset, len, "slice");
  return std::make_shared<Window>(std::move(parent), offset, len, std::move(name));
}

std::vector<std::uint8_t> read_file_head(const std::string& path, std::size_t max_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError::from_errno(path, "cannot open", errno);
  std::vector<std::uint8_t> out(max_bytes);
  std::size_t got = 0;
  while (got < max_bytes) {
    const ssize_t n = ::read(fd, out.data() + got, max_bytes - got);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      throw IoError::from_errno(path, "cannot read", err);
    }
    if (n == 0) break;
    got += static_cast<std::size_t>(n);
  }
  ::close(fd);
  out.resize(got);
  return out;
}

}  // namespace eaglekit
