// Gzip (RFC 1952) in and out of memory: the stream under the SpecForge .ckpt.gz record
// format (formats/pt_gzip_format.h), usable on its own for any gzip'd bytes.
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

}  // namespace eaglekit
