#include "formats/atomic_file.h"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <filesystem>
#include <vector>

#include "formats/error.h"

namespace eaglekit {

namespace {
std::atomic<unsigned> g_temp_counter{0};

std::string parent_dir(const std::string& path) {
  auto p = std::filesystem::path(path).parent_path().string();
  return p.empty() ? std::string(".") : p;
}
}  // namespace

AtomicFile::AtomicFile(std::string final_path) : final_path_(std::move(final_path)) {
  std::filesystem::path fp(final_path_);
  const std::string dir = parent_dir(final_path_);
  temp_path_ = dir + "/." + fp.filename().string() + ".tmp." + std::to_string(::getpid()) + "." +
               std::to_string(g_temp_counter++);
  fd_ = ::open(temp_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) throw IoError::from_errno(temp_path_, "cannot create", errno);
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(temp_path_.c_str());
}

void AtomicFile::write(const void* data, std::size_t n) {
  const auto* p = static_cast<const std::uint8_t*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd_, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw IoError::from_errno(temp_path_, "cannot write", errno);
    }
    p += w;
    n -= static_cast<std::size_t>(w);
    written_ += static_cast<std::uint64_t>(w);
  }
}

void AtomicFile::write_zeros(std::size_t n) {
  static const std::vector<std::uint8_t> kZeros(4096, 0);
  while (n > 0) {
    const std::size_t k = std::min(n, kZeros.size());
    write(kZeros.data(), k);
    n -= k;
  }
}

void AtomicFile::pwrite(const void* data, std::size_t n, std::uint64_t offset) {
  const auto* p = static_cast<const std::uint8_t*>(data);
  while (n > 0) {
    const ssize_t w = ::pwrite(fd_, p, n, static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      throw IoError::from_errno(temp_path_, "cannot write", errno);
    }
    p += w;
    n -= static_cast<std::size_t>(w);
    offset += static_cast<std::uint64_t>(w);
  }
}

void AtomicFile::commit() {
  if (::fsync(fd_) != 0) throw IoError::from_errno(temp_path_, "cannot fsync", errno);
  if (::close(fd_) != 0) {
    fd_ = -1;
    throw IoError::from_errno(temp_path_, "cannot close", errno);
  }
  fd_ = -1;
  if (::rename(temp_path_.c_str(), final_path_.c_str()) != 0)
    throw IoError::from_errno(final_path_, "cannot rename temp file into place", errno);
  committed_ = true;
  const int dfd = ::open(parent_dir(final_path_).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

void write_file_atomic(const std::string& path, const void* data, std::size_t n) {
  AtomicFile f(path);
  f.write(data, n);
  f.commit();
}

void replace_folder_atomic(const std::string& from, const std::string& to) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (::rename(from.c_str(), to.c_str()) != 0) {
    // rename(2) only replaces an empty folder; a full one fails with ENOTEMPTY or EEXIST.
    if (errno != ENOTEMPTY && errno != EEXIST)
      throw IoError::from_errno(to, "cannot rename " + from + " into place", errno);
    if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE) != 0) {
      if (errno != EINVAL && errno != ENOSYS)
        throw IoError::from_errno(to, "cannot exchange with " + from, errno);
      const std::string aside = from + ".old";
      fs::remove_all(aside, ec);
      if (::rename(to.c_str(), aside.c_str()) != 0)
        throw IoError::from_errno(to, "cannot move the old folder aside", errno);
      if (::rename(from.c_str(), to.c_str()) != 0)
        throw IoError::from_errno(to, "cannot rename " + from + " into place", errno);
      fs::remove_all(aside, ec);
    } else {
      fs::remove_all(from, ec);  // now the old folder
    }
  }
  const int dfd = ::open(parent_dir(to).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

bool process_gone(long pid) {
  return pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

std::size_t remove_stale_temp_files(const std::string& dir,
                                    const std::function<bool(const std::string&)>& ours) {
  std::size_t removed = 0;
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    // ".NAME.tmp.PID.N", as AtomicFile names them.
    const auto tmp = name.rfind(".tmp.");
    if (name.size() < 2 || name[0] != '.' || tmp == std::string::npos || tmp < 2) continue;
    const std::string tail = name.substr(tmp + 5);
    const auto dot = tail.find('.');
    const auto digits = [](const std::string& t) {
      return !t.empty() && t.size() <= 18 && t.find_first_not_of("0123456789") == std::string::npos;
    };
    if (dot == std::string::npos || !digits(tail.substr(0, dot)) || !digits(tail.substr(dot + 1)))
      continue;
    const long pid = std::stol(tail.substr(0, dot));
    if (pid == static_cast<long>(::getpid()) || !process_gone(pid)) continue;
    if (!ours(name.substr(1, tmp - 1))) continue;
    std::error_code rm;
    if (std::filesystem::remove(it->path(), rm)) ++removed;
  }
  return removed;
}

}  // namespace eaglekit
