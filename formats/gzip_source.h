// Gzip (RFC 1952) in and out of memory, and the SpecForge .ckpt.gz record format built on
// it: a .ckpt.gz is the gzip of a torch.save zip, so it is decompressed whole into memory
// and handed to the .pt reader (formats/pt_format.h) as a ByteSource.
//
// Decoding is streaming zlib inflate with the gzip wrapper; several concatenated members
// (what `cat a.gz b.gz` or pigz give) decode to the concatenation of their contents, and
// zero bytes after the last member are ignored (as gzip(1) and Python do). Memory is
// capped: output past the cap is refused before it is allocated.
//
// Errors: FormatError naming the file and the compressed byte offset where decoding
// stopped ("x.ckpt.gz: gzip stream at byte 8123: truncated: ..."); ChecksumError for a
// CRC-32 or length mismatch in a member's trailer; UnsupportedError when the output would
// exceed the cap; IoError from the file system. Thread safety: free functions, no state.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "formats/format.h"

namespace eaglekit {

class ByteSource;

// 16 GiB: far above one conversation's hidden states, far below "decompress a disk".
// The environment variable EAGLEKIT_GUNZIP_MAX_BYTES overrides it for gunzip_limit().
constexpr std::uint64_t kDefaultGunzipLimit = 16ull << 30;
std::uint64_t gunzip_limit();

// Decompresses every member of `compressed` into one owning ByteSource named
// "NAME (decompressed)".
std::shared_ptr<const ByteSource> gunzip(const ByteSource& compressed, std::uint64_t max_bytes);
std::shared_ptr<const ByteSource> gunzip_file(const std::string& path, std::uint64_t max_bytes);

// One gzip member holding `n` bytes (level 0-9; 6 is gzip's default).
std::vector<std::uint8_t> gzip_bytes(const void* data, std::size_t n, int level = 6);
// Streams the file at `src` into a gzip file at `dst`, written atomically (temp + rename).
void gzip_file(const std::string& src, const std::string& dst, int level = 6);

// Format::kPtGzip. The record and its conversation id are what the .pt reader gives for
// the decompressed bytes (the id falls back to the file name without ".gz" and one more
// extension: "12.ckpt.gz" -> "12"); info() reports codec "gzip" and the compressed size.
std::unique_ptr<RecordReader> open_pt_gzip_reader(const std::string& path);
// Writes the .pt form of one record (formats/pt_format.h), gzip'd: level 6, or
// WriterOptions::level when WriterOptions::codec is "gzip".
std::unique_ptr<RecordWriter> create_pt_gzip_writer(const std::string& path,
                                                    const WriterOptions& opts);

}  // namespace eaglekit
