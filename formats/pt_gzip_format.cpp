#include "formats/pt_gzip_format.h"

#include <unistd.h>

#include <atomic>
#include <filesystem>

#include "formats/byte_source.h"
#include "formats/error.h"
#include "formats/gzip_source.h"
#include "formats/pt_format.h"

namespace eaglekit {

namespace {

class PtGzipReader final : public RecordReader {
 public:
  explicit PtGzipReader(const std::string& path)
      : PtGzipReader(path, ByteSource::open_file(path)) {}
  PtGzipReader(const std::string& path, const std::shared_ptr<const ByteSource>& gz)
      : path_(path), compressed_size_(gz->size()), inner_(gunzip(*gz, gunzip_limit()), path) {}

  Format format() const override { return Format::kPtGzip; }
  const std::string& path() const override { return path_; }
  std::size_t size() const override { return inner_.size(); }
  RecordInfo info(std::size_t i) const override {
    RecordInfo info = inner_.info(i);
    info.codec = "gzip";
    info.byte_offset = 0;
    info.byte_size = compressed_size_;
    return info;
  }
  Record read_prefix(std::size_t i, std::int64_t max_rows) const override {
    return inner_.read_prefix(i, max_rows);
  }

 private:
  std::string path_;
  std::uint64_t compressed_size_;
  PtReader inner_;
};

std::atomic<unsigned> g_temp_counter{0};

// Keeps the .pt in a hidden temp file beside the output, gzips it into place at finish().
class PtGzipWriter final : public RecordWriter {
 public:
  PtGzipWriter(std::string path, int level)
      : path_(std::move(path)), level_(level), temp_pt_(temp_name(path_)), pt_(temp_pt_) {}
  ~PtGzipWriter() override { ::unlink(temp_pt_.c_str()); }

  void add(const Record& r) override { pt_.add(r); }
  void finish() override {
    pt_.finish();
    gzip_file(temp_pt_, path_, level_);
    ::unlink(temp_pt_.c_str());
  }

 private:
  static std::string temp_name(const std::string& path) {
    const std::filesystem::path p(path);
    const std::string dir = p.parent_path().empty() ? "." : p.parent_path().string();
    return dir + "/." + p.filename().string() + ".pt.tmp." + std::to_string(::getpid()) + "." +
           std::to_string(g_temp_counter++);
  }

  std::string path_;
  int level_;
  std::string temp_pt_;
  PtWriter pt_;
};

}  // namespace

std::unique_ptr<RecordReader> open_pt_gzip_reader(const std::string& path) {
  return std::make_unique<PtGzipReader>(path);
}

std::unique_ptr<RecordWriter> create_pt_gzip_writer(const std::string& path,
                                                    const WriterOptions& opts) {
  const int level = opts.codec == "gzip" ? opts.level : 6;
  if (level < 0 || level > 9)
    throw UsageError("gzip level must be 0 to 9, got " + std::to_string(level));
  if (!opts.overwrite && std::filesystem::exists(path))
    throw UsageError(path + ": exists (pass overwrite to replace it)");
  return std::make_unique<PtGzipWriter>(path, level);
}

}  // namespace eaglekit
