// The SpecForge .ckpt.gz record format (Format::kPtGzip): a .ckpt.gz is the gzip
// (formats/gzip_source.h) of a torch.save zip, so it is decompressed whole into memory,
// within gunzip_limit(), and handed to the .pt reader (formats/pt_format.h) as a ByteSource.
// The bytes inside are exactly a .pt file; docs/formats.md ("SpecForge .ckpt.gz") says more.
//
// Errors: those of the gzip stream (formats/gzip_source.h) and of the .pt reader, naming
// the .ckpt.gz. Thread safety: a reader is immutable after open; a writer is one thread's.
#pragma once

#include <memory>
#include <string>

#include "formats/format.h"

namespace eaglekit {

// Format::kPtGzip. The record and its conversation id are what the .pt reader gives for
// the decompressed bytes (the id falls back to the file name without ".gz" and one more
// extension: "12.ckpt.gz" -> "12"); info() reports codec "gzip" and the compressed size.
std::unique_ptr<RecordReader> open_pt_gzip_reader(const std::string& path);
// Writes the .pt form of one record (formats/pt_format.h), gzip'd: level 6, or
// WriterOptions::level when WriterOptions::codec is "gzip".
std::unique_ptr<RecordWriter> create_pt_gzip_writer(const std::string& path,
                                                    const WriterOptions& opts);

}  // namespace eaglekit
