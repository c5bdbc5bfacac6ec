// HDF5 record files: eaglekit's HDF5 shard (many conversations in one file; read and
// written) and the group-per-conversation layout people write by hand with h5py (read).
// Both read into the normalized Record. The layouts, in full, are in docs/formats.md:
//
//   Shard: root attributes eaglekit_format = "hdf5-shard", version = 1, hidden_size,
//   aux_layers; datasets conversation_ids [N] (variable-length UTF-8), offsets [N+1] int64
//   (offsets[0] = 0, non-decreasing, offsets[N] = total_T), input_ids [total_T] int64,
//   loss_mask [total_T] uint8 (optional), hidden_states [total_T, H],
//   aux_hidden_states [total_T, k*H], hidden_states_prenorm [N] int8 (optional: -1 not
//   stated, 0 post-norm, 1 pre-norm; written when some record states its norm form).
//   Per-token datasets are chunked along tokens; gzip and shuffle filters are read
//   transparently. Record i is rows [offsets[i], offsets[i+1]).
//
//   Groups: any group (the root included, nested to any depth) holding datasets input_ids
//   and hidden_states is one record; it must also hold aux_hidden_states and may hold
//   loss_mask, and an attribute hidden_states_prenorm (a bool, as h5py writes one, or 0 /
//   1). The conversation id is the group's name (the file stem for the root).
//
//   Dtypes in both: bf16 is stored as 16-bit unsigned integers with the dataset attribute
//   dtype = "bfloat16"; fp16, fp32 (and fp64) as IEEE floats. input_ids int64 or int32
//   (other integer types are widened to int64); loss_mask uint8, bool (h5py's enum) or
//   any integer type.
//
// Thread safety: every HDF5 call in eaglekit holds hdf5_mutex() (one process-wide lock).
// libhdf5 builds without the thread-safe option must never be entered from two threads,
// and builds with it (Debian 12's reports H5is_library_threadsafe = 1) take one global lock
// per call anyway, so ours costs no parallelism and keeps us correct on either build.
// Readers are safe to share between threads, but their reads run one at a time; a loader
// that needs parallel reads should convert to .eks shards. Code elsewhere that calls HDF5
// must hold the same lock.
//
// Errors: FormatError naming the file and the dataset or attribute (HDF5's own message as
// detail; HDF5 never prints to stderr), UnsupportedError for a shard version we do not
// know, IoError when a file cannot be created or renamed.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "formats/format.h"

namespace eaglekit {

// The lock around every HDF5 call (recursive: helpers that take it may nest).
std::recursive_mutex& hdf5_mutex();

// Opens an HDF5 file of either layout; the layout is chosen by the root attribute
// eaglekit_format. Reads the index (ids, offsets, shapes) at open, never tensor data.
// find() is a hash lookup. Records returned own their bytes (HDF5 reads copy).
std::unique_ptr<RecordReader> open_hdf5_reader(const std::string& path);

struct Hdf5WriterOptions {
  int gzip_level = 0;                   // 0: no filter; 1-9: shuffle + gzip at that level
  std::uint64_t chunk_bytes = 1 << 20;  // target bytes per chunk of each per-token dataset
  bool overwrite = true;                // false: UsageError when the output exists
};

// Writes an eaglekit HDF5 shard. Records must share hidden size, aux width and hidden
// dtype (UsageError naming the record otherwise) and have distinct conversation ids.
// input_ids are stored as int64 and loss_mask as uint8; records without a loss_mask get
// ones when another record in the shard has one. Rows are buffered only up to one chunk
// per dataset plus the record being added, so memory does not grow with the shard.
// The file is built at a temp path (".NAME.tmp.PID.N" beside it) and renamed into place by
// finish(); a writer destroyed unfinished removes it.
std::unique_ptr<RecordWriter> create_hdf5_shard_writer(const std::string& path,
                                                       const Hdf5WriterOptions& opts);
// The registry's entry: WriterOptions::codec "gzip" selects gzip at WriterOptions::level;
// "raw", "none" and the default "zstd" (an .eks codec) write unfiltered; others are a
// UsageError.
std::unique_ptr<RecordWriter> create_hdf5_writer(const std::string& path,
                                                 const WriterOptions& opts);

}  // namespace eaglekit
