#include "trainer/io/tensorboard.h"

#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <string_view>

#include "formats/bytes.h"
#include "formats/error.h"

namespace eaglekit::trainer {

namespace {

std::array<std::uint32_t, 256> make_table() {
  std::array<std::uint32_t, 256> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}

// --- the protobuf wire format, for the fields used here ---
// A field key is (number << 3) | wire type: 0 varint, 1 fixed64, 2 length-delimited, 5 fixed32.

void put_varint(ByteWriter& out, std::uint64_t v) {
  while (v >= 0x80) {
    out.u8(static_cast<std::uint8_t>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.u8(static_cast<std::uint8_t>(v));
}

void put_key(ByteWriter& out, int field, int wire) { put_varint(out, static_cast<std::uint64_t>(field) << 3 | wire); }

void put_bytes(ByteWriter& out, int field, std::string_view bytes) {
  put_key(out, field, 2);
  put_varint(out, bytes.size());
  out.bytes(bytes);
}

void put_message(ByteWriter& out, int field, const ByteWriter& message) {
  put_bytes(out, field, {reinterpret_cast<const char*>(message.data()), message.size()});
}

// Event { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
// Summary { repeated Value value = 1; }  Value { string tag = 1; float simple_value = 2; }
ByteWriter event_header(double wall_time, std::int64_t step) {
  ByteWriter e;
  put_key(e, 1, 1);
  e.f64(wall_time);
  put_key(e, 2, 0);
  put_varint(e, static_cast<std::uint64_t>(step));  // int64: two's complement in 10 bytes when negative
  return e;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::atomic<unsigned> g_file_counter{0};

}  // namespace

std::uint32_t crc32c(const void* data, std::size_t size, std::uint32_t crc) {
  static const std::array<std::uint32_t, 256> table = make_table();
  const auto* p = static_cast<const std::uint8_t*>(data);
  crc = ~crc;
  for (std::size_t i = 0; i < size; ++i) crc = table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

std::uint32_t masked_crc32c(const void* data, std::size_t size) {
  const std::uint32_t c = crc32c(data, size);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

EventFileWriter::EventFileWriter(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw IoError(dir + ": cannot create folder: " + ec.message());
  char host[256] = "localhost";
  if (::gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "localhost");
  const auto seconds = static_cast<long long>(now_seconds());
  // TensorBoard orders a run's files by name: the time first, then what keeps names unique.
  for (int attempt = 0;; ++attempt) {
    path_ = (fs::path(dir) / ("events.out.tfevents." + std::to_string(seconds) + "." + host + "." +
                              std::to_string(::getpid()) + "." + std::to_string(g_file_counter++)))
                .string();
    file_ = std::fopen(path_.c_str(), "wbx");  // never an existing file
    if (file_ != nullptr) break;
    if (errno != EEXIST || attempt > 1000) throw IoError::from_errno(path_, "create", errno);
  }
  ByteWriter e = event_header(now_seconds(), 0);
  put_bytes(e, 3, "brain.Event:2");
  write_record(e);
}

EventFileWriter::~EventFileWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

void EventFileWriter::add_scalars(std::int64_t step, const std::vector<std::pair<std::string, double>>& values,
                                  double wall_time) {
  ByteWriter summary;
  for (const auto& [tag, value] : values) {
    ByteWriter v;
    put_bytes(v, 1, tag);
    put_key(v, 2, 5);
    v.f32(static_cast<float>(value));
    put_message(summary, 1, v);
  }
  ByteWriter e = event_header(wall_time < 0 ? now_seconds() : wall_time, step);
  put_message(e, 5, summary);
  write_record(e);
}

void EventFileWriter::write_record(const ByteWriter& event) {
  // TFRecord framing: u64 length, masked CRC-32C of the length, data, masked CRC of the data.
  ByteWriter rec;
  rec.u64(event.size());
  rec.u32(masked_crc32c(rec.data(), 8));
  rec.bytes(event);
  rec.u32(masked_crc32c(event.data(), event.size()));
  // One write of the whole record, then a flush: readers see whole records or a torn last one.
  if (std::fwrite(rec.data(), 1, rec.size(), file_) != rec.size() || std::fflush(file_) != 0)
    throw IoError::from_errno(path_, "write", errno);
}

}  // namespace eaglekit::trainer
