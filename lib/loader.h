// The streaming loader: matched samples -> batches of LibTorch tensors, read and collated
// on TBB threads ahead of the trainer, in sampler order whatever the thread timing, with
// bounded memory. The batch layout (struct Batch) and collation rules are in
// lib/collate.h; order, sharding and resume state in lib/sampler.h.
//
// Engine: a tbb::parallel_pipeline (plan -> read+check+copy, one batch at a time over all
// threads -> deliver) runs on its own thread in a task arena of `jobs` threads. Each record
// is copied into its batch row right after it is read and checked, while its bytes are in
// the CPU's cache; at most `prefetch` batches wait ready in the queue, so peak memory is
// about (prefetch + 2 + batches the consumer still holds) batches, whatever the dataset
// size. Only the rows a batch needs are read (read_prefix up to max_length, or up to the
// token window's end); the reader parses only metadata, and the tensor bytes are copied
// once, from the file mapping straight into recycled batch tensors.
//
// Bad records (unreadable, a .pt failing its zip CRC-32, NaN/Inf among the values read, wrong
// shape or dtype, token count not the index's) are skipped with a warning naming them and
// counted, or, with `strict`, end the run: next() rethrows the worker's exception.
// A sample whose mask the index joined from a loss-mask file (`eaglekit index --loss-masks`,
// SampleRef::joined_loss_mask) takes its row as it is read (LossMasks::apply_prefix): token
// ids that differ from the row's make it a bad record. The file is opened when the Loader
// is constructed, which throws Error, naming the index and the file, when it moved or
// changed since indexing.
// Destroying a Loader mid-epoch stops and joins its threads.
// Thread safety: one consumer thread calls next()/restore(); stats() and state() may be
// called from any thread. Throws UsageError for bad options, Error when no sample of the
// dataset can be opened, and whatever a worker threw from next().
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "formats/format.h"
#include "lib/collate.h"
#include "lib/data_options.h"
#include "lib/dataset.h"
#include "lib/sampler.h"

namespace eaglekit {

struct LoaderOptions {
  CollateOptions collate;  // mode, max_length, token window
  SamplerOptions sampler;  // batch size (per DP rank), shuffle, seed, rank, world size, epochs
  int jobs = 0;            // TBB threads; 0: all cores
  int prefetch = 4;        // batches ready ahead of the consumer (and in the pipeline)
  bool strict = false;     // a bad record ends the run instead of being skipped
  int pinned = -1;         // pinned batch memory: 1 / 0 / -1 = when CUDA is available
  // Called once for each skipped record of each batch next() delivers, on the consumer's
  // thread, before next() returns that batch (records only read ahead are never reported);
  // default: the first 20 go to stderr.
  std::function<void(const std::string&)> on_warning;
  // How record files are opened; default formats/format.h open_reader. For tests.
  std::function<std::unique_ptr<RecordReader>(const std::string& path)> open;
};

// The loader a command's batch options describe, for this rank of a dp x cp mesh; the
// sampler runs without an epoch limit (set sampler.epochs after).
LoaderOptions loader_options(const BatchOptions& batches, int dp_rank = 0, int dp_size = 1, int cp_rank = 0,
                             int cp_size = 1);

struct LoaderStats {
  std::uint64_t batches = 0;  // delivered to the consumer
  std::uint64_t samples = 0;
  std::uint64_t skipped = 0;  // bad records left out
  std::uint64_t tokens = 0;
  std::uint64_t bytes = 0;    // record bytes copied into delivered batches
  double wait_s = 0;          // consumer time blocked in next()
  double last_wait_ms = 0;    // of the latest next()
  double elapsed_s = 0;       // since the loader (re)started
  std::size_t queue_depth = 0;      // ready batches now
  double mean_queue_depth = 0;      // ready batches seen by next(), averaged
  std::size_t max_queue_depth = 0;
  // Batch buffers allocated fresh so far (the rest were reused): a fresh one is new memory
  // the kernel zeroes on first touch, the loader's main one-time cost. With pinned memory:
  // every batch (BatchMemory::slabs_allocated).
  std::uint64_t fresh_buffers = 0;

  double samples_per_s() const { return elapsed_s > 0 ? samples / elapsed_s : 0; }
  double bytes_per_s() const { return elapsed_s > 0 ? bytes / elapsed_s : 0; }
  double wait_ms_per_batch() const { return batches ? 1000.0 * wait_s / batches : 0; }
  std::string to_json() const;
};

class Loader {
 public:
  // Copies what it needs from `dataset` (file paths) and `samples`. Samples whose token
  // count is unknown (0) are measured with RecordReader::info in longest and pack mode.
  Loader(const Dataset& dataset, std::vector<SampleRef> samples, LoaderOptions opts);
  ~Loader();  // stops and joins the workers; never throws
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  // The next batch of this rank; nullopt at the end of each epoch (the call after it
  // starts the next epoch), and forever once `epochs` epochs are done. Rethrows a
  // worker's error.
  std::optional<Batch> next();

  // The state right after the last batch next() returned (or the end-of-epoch it reported).
  SamplerState state() const;
  // Continue as if the run had stopped at `s`: the batches that follow are exactly those
  // that followed `s` originally. Throws UsageError for a state of another dataset/order.
  void restore(const SamplerState& s);

  std::int64_t steps_in_epoch() const;  // of the epoch state() is in
  LoaderStats stats() const;
  RecordShape shape() const;           // hidden size, aux width and dtype of this run
  std::size_t samples() const;
  bool pinned() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// ---- What the CLI commands call ------------------------------------------------------

// DataSelection (--data, --index, --quarantine, --split, --eval-fraction) is in
// lib/data_options.h.

struct SelectedData {
  Dataset dataset;
  std::vector<SampleRef> samples;  // the chosen split
  std::string summary;             // "N of M conversations matched, ...", for the user
};

// Loads conversations and index, matches them (lib/dataset.h) and picks the split.
// Throws UsageError for a bad split name, and what load_conversations / DatasetIndex::load
// / match_dataset throw.
SelectedData select_data(const DataSelection& sel);

struct CollateReport {
  std::int64_t batches = 0;
  std::vector<std::string> files;  // DIR/batch_00000.pt, ...
  LoaderStats stats;
  std::string to_json() const;
};

// Writes max_batches batches (continuing into the following epochs while the loader has
// any; < 0: the rest of the current epoch) as
// torch.save dicts DIR/batch_NNNNN.pt (keys as Batch::named_tensors), plus
// DIR/batches.jsonl: one line per batch with its epoch, step, conversation ids, the row of
// each, its token window and the sampler state after it. Creates DIR. Throws IoError.
CollateReport write_batches(Loader& loader, const std::string& out_dir, std::int64_t max_batches);

struct BenchReport {
  std::int64_t batches = 0;
  double seconds = 0;
  double cpu_seconds = 0;  // user + system time of the whole process (all threads) meanwhile
  LoaderStats stats;
  // {"samples_per_s", "bytes_per_s", "wait_ms_per_batch", "batches", "seconds", "cpu_s", ...}
  std::string to_json() const;
  std::string to_text() const;
};

// Streams max_batches batches (across epochs, as write_batches; < 0: the rest of the
// current epoch) without writing them, touching
// every batch the way a consumer would (it reads one value per tensor), and reports speed.
BenchReport bench_loader(Loader& loader, std::int64_t max_batches);

}  // namespace eaglekit
