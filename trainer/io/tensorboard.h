// TensorBoard event files written natively (docs/tensorboard.md): TFRecord framing around
// `Event` protocol buffers, encoded by hand for the few fields a scalar needs. No LibTorch,
// no protobuf library.
//
// File layout: a sequence of records, each
//   uint64 length (little-endian) | uint32 masked_crc32c(length bytes) |
//   `length` bytes of a serialized Event | uint32 masked_crc32c(those bytes)
// with masked_crc32c(x) = rotate_right(crc32c(x), 15) + 0xa282ead8. The first Event carries
// file_version "brain.Event:2"; each later one a step and a Summary of simple_value scalars.
//
// Thread safety: none; one writer per file. Errors: IoError naming the file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace eaglekit {
class ByteWriter;
}

namespace eaglekit::trainer {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), continuing from `crc`.
std::uint32_t crc32c(const void* data, std::size_t size, std::uint32_t crc = 0);
std::uint32_t masked_crc32c(const void* data, std::size_t size);

class EventFileWriter {
 public:
  // Creates `dir` (and parents) and a new file events.out.tfevents.SECONDS.HOST.PID.N in it
  // (never an existing one: a resumed run appends a file, older ones stay as they were),
  // and writes the file_version record.
  explicit EventFileWriter(const std::string& dir);
  ~EventFileWriter();  // closes; never throws
  EventFileWriter(const EventFileWriter&) = delete;
  EventFileWriter& operator=(const EventFileWriter&) = delete;

  // One Event at `step` holding every (tag, value) as a float scalar, written whole and
  // flushed: a killed run leaves every earlier record intact. wall_time < 0: now.
  void add_scalars(std::int64_t step, const std::vector<std::pair<std::string, double>>& values,
                   double wall_time = -1);
  const std::string& path() const { return path_; }

 private:
  void write_record(const ByteWriter& event);

  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace eaglekit::trainer
