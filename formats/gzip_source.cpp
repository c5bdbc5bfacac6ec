#include "formats/gzip_source.h"

#include <zlib.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <optional>

#include "formats/atomic_file.h"
#include "formats/byte_source.h"
#include "formats/bytes.h"
#include "formats/error.h"

namespace eaglekit {

namespace {

constexpr std::uint64_t kInputSlice = 1u << 20;  // zlib counts in 32-bit uInt
constexpr std::uint64_t kMinGrowth = 1u << 20;
// Deflate cannot expand data by more than about 1032:1; a trailer's size hint beyond that
// is garbage (a truncated or corrupt file) and must not drive a huge allocation.
constexpr std::uint64_t kMaxDeflateRatio = 1032;

class Inflater {
 public:
  Inflater() {
    std::memset(&zs_, 0, sizeof(zs_));
    if (inflateInit2(&zs_, 16 + MAX_WBITS) != Z_OK) throw std::bad_alloc();
  }
  ~Inflater() { inflateEnd(&zs_); }
  Inflater(const Inflater&) = delete;
  Inflater& operator=(const Inflater&) = delete;
  z_stream* get() { return &zs_; }

 private:
  z_stream zs_;
};

std::string human_bytes(std::uint64_t n) {
  if (n >= (1ull << 30) && n % (1ull << 30) == 0) return std::to_string(n >> 30) + " GiB";
  if (n >= (1ull << 20) && n % (1ull << 20) == 0) return std::to_string(n >> 20) + " MiB";
  return std::to_string(n) + " bytes";
}

bool all_zero(const std::uint8_t* p, std::uint64_t n) {
  for (std::uint64_t i = 0; i < n; ++i)
    if (p[i] != 0) return false;
  return true;
}

}  // namespace

std::uint64_t gunzip_limit() {
  const char* env = std::getenv("EAGLEKIT_GUNZIP_MAX_BYTES");
  if (env == nullptr || *env == '\0') return kDefaultGunzipLimit;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(env, &end, 10);
  if (end == env || *end != '\0' || v == 0)
    throw UsageError(
        std::string("EAGLEKIT_GUNZIP_MAX_BYTES must be a positive byte count, got \"") + env +
        "\"");
  return v;
}

std::shared_ptr<const ByteSource> gunzip(const ByteSource& in, std::uint64_t max_bytes) {
  const std::string& name = in.name();
  const std::uint64_t size = in.size();
  const std::uint8_t* data = in.data();
  if (size < 2 || data[0] != 0x1f || data[1] != 0x8b)
    throw FormatError(name, 0, "gzip header", "not a gzip file (no 1f 8b magic)");

  std::vector<std::uint8_t> out;
  if (size >= 18) {
    // ISIZE of the last member: the whole output for the usual single member.
    const std::uint64_t hint =
        std::min<std::uint64_t>(load_le32(data + size - 4), size * kMaxDeflateRatio);
    out.reserve(static_cast<std::size_t>(std::min(hint, max_bytes) + 1));
  }
  Inflater inflater;
  z_stream* zs = inflater.get();
  std::uint64_t fed = 0;           // input bytes handed to zlib
  std::uint64_t produced = 0;      // output bytes written
  std::uint64_t member_start = 0;  // compressed offset of the current member
  auto consumed = [&] { return fed - zs->avail_in; };
  for (;;) {
    if (zs->avail_in == 0 && fed < size) {
      const std::uint64_t n = std::min(kInputSlice, size - fed);
      zs->next_in = const_cast<Bytef*>(data + fed);
      zs->avail_in = static_cast<uInt>(n);
      fed += n;
    }
    if (produced == out.size()) {
      // Up to one byte past the cap, so that reaching it is distinguishable from exceeding it.
      const std::uint64_t want = std::max<std::uint64_t>(
          out.capacity() > out.size() ? out.capacity() : 2 * out.size(), out.size() + kMinGrowth);
      out.resize(static_cast<std::size_t>(std::min(want, max_bytes + 1)));
    }
    const std::uint64_t room = std::min<std::uint64_t>(out.size() - produced, UINT_MAX);
    zs->next_out = out.data() + produced;
    zs->avail_out = static_cast<uInt>(room);
    const int ret = inflate(zs, Z_NO_FLUSH);
    produced += room - zs->avail_out;
    if (produced > max_bytes)
      throw UnsupportedError(name, consumed(), "gzip stream",
                             "decompresses to more than " + human_bytes(max_bytes) +
                                 ", the in-memory limit (EAGLEKIT_GUNZIP_MAX_BYTES raises it)");
    if (ret == Z_STREAM_END) {
      const std::uint64_t at = consumed();
      const std::uint64_t rest = size - at;
      if (rest == 0 || all_zero(data + at, rest)) break;
      if (rest < 2 || data[at] != 0x1f || data[at + 1] != 0x8b)
        throw FormatError(name, at, "gzip stream",
                          std::to_string(rest) +
                              " bytes after the gzip member that started at "
                              "byte " +
                              std::to_string(member_start) + " are not another gzip member");
      member_start = at;
      if (inflateReset(zs) != Z_OK) throw FormatError(name, at, "gzip stream", "cannot restart");
      continue;
    }
    if (ret == Z_DATA_ERROR) {
      const std::string msg = zs->msg != nullptr ? zs->msg : "invalid data";
      if (msg == "incorrect data check" || msg == "incorrect length check")
        throw ChecksumError(name, consumed(), "gzip trailer",
                            (msg == "incorrect data check" ? "CRC-32" : "length") +
                                std::string(" of the member that started at byte ") +
                                std::to_string(member_start) +
                                " does not match its decompressed bytes (" + msg + ")");
      throw FormatError(
          name, consumed(), "gzip stream",
          msg + " (in the member that started at byte " + std::to_string(member_start) + ")");
    }
    if (ret == Z_MEM_ERROR) throw std::bad_alloc();
    if (ret != Z_OK && ret != Z_BUF_ERROR)
      throw FormatError(name, consumed(), "gzip stream", "zlib error " + std::to_string(ret));
    // With room left for output and no input left, inflate can make no more progress.
    if (fed == size && zs->avail_in == 0 && zs->avail_out > 0)
      throw FormatError(name, size, "gzip stream",
                        "truncated: the input ends inside the gzip member that started at byte " +
                            std::to_string(member_start) + " (" + std::to_string(produced) +
                            " bytes decompressed)");
  }
  out.resize(static_cast<std::size_t>(produced));
  if (out.capacity() > 2 * out.size() + kMinGrowth) out.shrink_to_fit();
  return ByteSource::from_bytes(std::move(out), name + " (decompressed)");
}

std::shared_ptr<const ByteSource> gunzip_file(const std::string& path, std::uint64_t max_bytes) {
  const auto src = ByteSource::open_file(path);
  return gunzip(*src, max_bytes);
}

namespace {

class Deflater {
 public:
  explicit Deflater(int level) {
    std::memset(&zs_, 0, sizeof(zs_));
    if (level < 0 || level > 9)
      throw UsageError("gzip level must be 0 to 9, got " + std::to_string(level));
    if (deflateInit2(&zs_, level, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY) != Z_OK)
      throw std::bad_alloc();
  }
  ~Deflater() { deflateEnd(&zs_); }
  Deflater(const Deflater&) = delete;
  Deflater& operator=(const Deflater&) = delete;

  // Feeds all of [p, p + n); `last` finishes the member. Output goes to sink(data, len).
  template <typename Sink>
  void feed(const std::uint8_t* p, std::uint64_t n, bool last, Sink&& sink) {
    std::uint8_t buf[1 << 16];
    do {
      const std::uint64_t take = std::min<std::uint64_t>(n, kInputSlice);
      zs_.next_in = const_cast<Bytef*>(p);
      zs_.avail_in = static_cast<uInt>(take);
      p += take;
      n -= take;
      const int flush = last && n == 0 ? Z_FINISH : Z_NO_FLUSH;
      int ret;
      do {
        zs_.next_out = buf;
        zs_.avail_out = sizeof(buf);
        ret = deflate(&zs_, flush);
        if (ret == Z_STREAM_ERROR) throw Error("zlib deflate failed");
        sink(buf, sizeof(buf) - zs_.avail_out);
      } while (zs_.avail_out == 0);
      if (flush == Z_FINISH && ret != Z_STREAM_END) throw Error("zlib deflate did not finish");
    } while (n > 0);
  }

 private:
  z_stream zs_;
};

}  // namespace

std::vector<std::uint8_t> gzip_bytes(const void* data, std::size_t n, int level) {
  std::vector<std::uint8_t> out;
  Deflater d(level);
  d.feed(static_cast<const std::uint8_t*>(data), n, true,
         [&](const std::uint8_t* p, std::size_t k) { out.insert(out.end(), p, p + k); });
  return out;
}

void gzip_file(const std::string& src, const std::string& dst, int level) {
  const auto in = ByteSource::open_file(src);
  Deflater d(level);
  AtomicFile out(dst);
  d.feed(in->data(), in->size(), true,
         [&](const std::uint8_t* p, std::size_t k) { out.write(p, k); });
  out.commit();
}

}  // namespace eaglekit
