#include "lib/loader.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>
#include <nlohmann/json.hpp>
#include <tbb/blocked_range.h>
#include <tbb/global_control.h>
#include <tbb/info.h>
#include <tbb/parallel_for.h>
#include <tbb/parallel_pipeline.h>
#include <tbb/task_arena.h>
#include <tbb/task_group.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <exception>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "formats/atomic_file.h"
#include "formats/error.h"
#include "formats/finite.h"
#include "formats/pt_format.h"
#include "lib/clock.h"
#include "lib/index.h"
#include "lib/loss_masks.h"

namespace eaglekit {

namespace {

using Clock = std::chrono::steady_clock;

enum class ItemKind { kBatch, kEndOfEpoch, kFinished };

// A batch on its way through the pipeline.
struct Job {
  ItemKind kind = ItemKind::kBatch;
  std::uint64_t epoch = 0;
  std::uint64_t step = 0;
  SamplerState after;
  std::int64_t rows = 0;
  std::int64_t length = 0;
  std::vector<Placement> placements;
  std::vector<std::size_t> sample_of;  // per placement: index into the loader's samples
  std::vector<std::int64_t> need;      // per placement: rows to read
  // Per placement: why its record was skipped ("" = it was not). Reported when the batch
  // is delivered, not when it is read (see Impl::deliver_warnings).
  std::vector<std::string> skip_reasons;
  Batch batch;
};
using JobPtr = std::shared_ptr<Job>;

// Ready batches, in order, between the pipeline's last stage and the consumer.
class BatchQueue {
 public:
  // Blocks while full. False when the queue was closed (the loader is stopping).
  bool push(JobPtr job) {
    std::unique_lock<std::mutex> lock(mu_);
    not_full_.wait(lock, [&] { return closed_ || items_.size() < capacity_; });
    if (closed_) return false;
    items_.push_back(std::move(job));
    not_empty_.notify_one();
    return true;
  }
  // Blocks until a batch is ready; rethrows a worker's error as soon as there is one.
  JobPtr pop() {
    std::unique_lock<std::mutex> lock(mu_);
    not_empty_.wait(lock, [&] { return error_ || !items_.empty() || producer_done_; });
    if (error_) std::rethrow_exception(error_);
    if (items_.empty()) throw Error("loader: the pipeline stopped without finishing");
    JobPtr job = std::move(items_.front());
    items_.pop_front();
    not_full_.notify_one();
    return job;
  }
  void fail(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_) error_ = std::move(e);
    not_empty_.notify_all();
  }
  void producer_done() {
    std::lock_guard<std::mutex> lock(mu_);
    producer_done_ = true;
    not_empty_.notify_all();
  }
  void close() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    not_full_.notify_all();
    not_empty_.notify_all();
  }
  void reset(std::size_t capacity) {
    std::lock_guard<std::mutex> lock(mu_);
    items_.clear();
    capacity_ = std::max<std::size_t>(capacity, 1);
    closed_ = false;
    producer_done_ = false;
    error_ = nullptr;
  }
  std::size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return items_.size();
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable not_full_, not_empty_;
  std::deque<JobPtr> items_;
  std::size_t capacity_ = 1;
  bool closed_ = false;
  bool producer_done_ = false;
  std::exception_ptr error_;
};

// Multi-record files (shards) stay open for the records that follow; single-record files
// are opened per sample and closed with it, so their mappings never pile up.
class ReaderCache {
 public:
  using Open = std::function<std::unique_ptr<RecordReader>(const std::string&)>;
  ReaderCache(const std::vector<std::string>& files, Open open, std::size_t capacity)
      : files_(files), open_(std::move(open)), capacity_(capacity) {}

  std::shared_ptr<const RecordReader> get(std::uint32_t file) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = cache_.find(file);
      if (it != cache_.end()) {
        it->second.last_use = ++tick_;
        return it->second.reader;
      }
    }
    if (file >= files_.size())
      throw Error("sample refers to file " + std::to_string(file) + " of a dataset with " +
                  std::to_string(files_.size()) + " files");
    std::shared_ptr<const RecordReader> reader(open_(files_[file]));
    if (reader->size() > 1) {
      std::lock_guard<std::mutex> lock(mu_);
      if (cache_.size() >= capacity_) {
        auto oldest = cache_.begin();
        for (auto it = cache_.begin(); it != cache_.end(); ++it)
          if (it->second.last_use < oldest->second.last_use) oldest = it;
        cache_.erase(oldest);
      }
      cache_[file] = Entry{reader, ++tick_};
    }
    return reader;
  }

 private:
  struct Entry {
    std::shared_ptr<const RecordReader> reader;
    std::uint64_t last_use = 0;
  };
  const std::vector<std::string>& files_;
  Open open_;
  std::size_t capacity_;
  std::mutex mu_;
  std::unordered_map<std::uint32_t, Entry> cache_;
  std::uint64_t tick_ = 0;
};

bool same_shape(const Record& r, const RecordShape& s) {
  return r.hidden_size() == s.hidden && r.aux_width() == s.aux_width && r.stored_dtype() == s.dtype &&
         r.aux_hidden_states.dtype == s.dtype && r.target_probs_width() == s.target_probs_width;
}

std::string shape_text(std::int64_t hidden, std::int64_t aux, DType dtype, std::int64_t target_probs_width) {
  return "hidden " + std::to_string(hidden) + ", aux width " + std::to_string(aux) + ", " +
         std::string(dtype_name(dtype)) +
         (target_probs_width > 0 ? ", stored target distribution over " + std::to_string(target_probs_width) +
                                       " draft tokens"
                                 : std::string());
}

}  // namespace

// ---------------------------------------------------------------------------------------

struct Loader::Impl {
  std::vector<std::string> files;
  std::vector<SampleRef> samples;
  std::vector<std::int64_t> lengths;  // per sample: tokens cut to max_length (0 = unknown)
  std::vector<char> sole;             // per file: only one sample refers to it
  LoaderOptions opts;
  RecordShape shape;
  Sampler::Planner planner;
  std::unique_ptr<BatchMemory> memory;
  std::unique_ptr<ReaderCache> readers;
  std::unique_ptr<const LossMasks> masks;  // the index's loss-mask file, when samples join it
  std::unique_ptr<tbb::task_arena> arena;
  std::unique_ptr<tbb::global_control> allow;  // lets `jobs` exceed the core count

  // The pipeline.
  std::thread thread;
  std::atomic<bool> stop{false};
  std::unique_ptr<tbb::task_group_context> ctx;
  BatchQueue queue;

  // The consumer's view.
  mutable std::mutex mu;
  LoaderStats stats;
  SamplerState state;
  bool finished = false;
  Clock::time_point started = Clock::now();
  double depth_sum = 0;
  std::uint64_t pops = 0;

  std::uint64_t warnings = 0;  // consumer thread only

  // Skipped records are reported from next(), on the consumer's thread, for the batch it
  // is handed, and counted there too. Warning from the worker that read the record (as
  // this loader once did) reported reads, not deliveries: a batch read ahead but never
  // delivered (prefetch past the epoch the consumer stops at, or the batches restore() and
  // destruction drop and read again) warned without being counted, so one bad record
  // could warn twice while counting once.
  void deliver_warnings(const Job& job) {
    for (const auto& reason : job.skip_reasons)
      if (!reason.empty()) warn(reason);
  }

  void warn(const std::string& msg) {
    ++warnings;
    if (opts.on_warning) {
      opts.on_warning(msg);
      return;
    }
    constexpr std::uint64_t kShown = 20;
    if (warnings <= kShown) std::cerr << "eaglekit: warning: " << msg << "\n";
    if (warnings == kShown + 1)
      std::cerr << "eaglekit: warning: more records skipped; the count is in the summary\n";
  }

  Sampler make_sampler() const { return Sampler(samples.size(), opts.sampler, planner); }

  JobPtr plan(const Sampler::Step& step) const {
    auto job = std::make_shared<Job>();
    job->epoch = step.epoch;
    job->step = step.step;
    job->after = step.after;
    if (step.finished) {
      job->kind = ItemKind::kFinished;
      return job;
    }
    if (step.end_of_epoch) {
      job->kind = ItemKind::kEndOfEpoch;
      return job;
    }
    const CollateOptions& co = opts.collate;
    std::int64_t longest = 0;
    for (const auto& unit : step.rows)
      for (const auto s : unit) longest = std::max(longest, lengths[s]);
    // The row length comes from the index's token counts, so every context-parallel rank
    // of a group agrees on it whichever records turn out bad.
    job->length = batch_length(co, longest);
    const auto window = token_window(co, job->length);
    const std::int64_t last = window.second;
    job->rows = static_cast<std::int64_t>(step.rows.size());
    for (std::size_t r = 0; r < step.rows.size(); ++r) {
      std::int64_t offset = 0, doc = 0;
      for (const auto s : step.rows[r]) {
        Placement p;
        p.row = static_cast<std::int64_t>(r);
        p.offset = offset;
        p.document = doc++;
        p.conversation_id = samples[s].conversation_id;
        job->placements.push_back(std::move(p));
        job->sample_of.push_back(s);
        job->skip_reasons.emplace_back();
        // Only the rows up to the window's end are read; pad mode reads at most max_length.
        const std::int64_t len = co.mode == CollateMode::kPack ? lengths[s] : co.max_length;
        job->need.push_back(std::clamp<std::int64_t>(last - offset, 0, len));
        if (co.mode == CollateMode::kPack) offset += lengths[s];
      }
    }
    advise(*job);
    return job;
  }

  // The plan stage runs up to `prefetch` - 1 batches ahead of build(): asking the kernel to
  // read the files of this batch's samples now lets the disk work while the batches before
  // it are copied. A file is read ahead only when it is the sample's alone and the sample
  // is read whole (a prefix of a .pt is spread over the file; a shard is much more than
  // one sample). A warm page cache makes it an open, a walk of cached pages and a close.
  void advise(const Job& job) const {
    for (std::size_t i = 0; i < job.sample_of.size(); ++i) {
      const SampleRef& s = samples[job.sample_of[i]];
      if (s.file >= sole.size() || !sole[s.file] || s.tokens <= 0 || job.need[i] < s.tokens) continue;
      const int fd = ::open(files[s.file].c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) continue;  // read_one reports it
      ::posix_fadvise(fd, 0, 0, POSIX_FADV_WILLNEED);
      ::close(fd);
    }
  }

  void read_one(Job& job, std::size_t i) {
    const SampleRef& s = samples[job.sample_of[i]];
    const std::int64_t need = job.need[i];
    const std::string path = s.file < files.size() ? files[s.file] : "?";
    try {
      const auto reader = readers->get(s.file);
      if (s.record >= reader->size())
        throw FormatError(path, std::nullopt, "record",
                          "record " + std::to_string(s.record) + " is past the file's " +
                              std::to_string(reader->size()) + " records (stale index?)");
      Record r = reader->read_prefix(s.record, need);
      r.check(path);
      if (!same_shape(r, shape))
        throw FormatError(path, std::nullopt, "hidden_states",
                          shape_text(r.hidden_size(), r.aux_width(), r.stored_dtype(), r.target_probs_width()) +
                              " differs from the dataset's " +
                              shape_text(shape.hidden, shape.aux_width, shape.dtype, shape.target_probs_width));
      if (s.tokens > 0 && r.tokens() != std::min(s.tokens, need))
        throw FormatError(path, std::nullopt, "input_ids",
                          "record has " + std::to_string(r.tokens()) + " of the " +
                              std::to_string(std::min(s.tokens, need)) +
                              " tokens the index promised (" + std::to_string(s.tokens) +
                              " in all; re-run eaglekit index)");
      // The index found its row and checked its length; the ids are checked here.
      if (s.joined_loss_mask) masks->apply_prefix(r, path, s.tokens);
      // A NaN or Inf in a record would make the loss NaN steps later, with nothing pointing
      // back at the record: the values are checked here, one pass over the rows read (a
      // .pt read whole has had its zip CRC-32s checked by the reader as well).
      if (auto bad = first_nonfinite(r))
        throw FormatError(path, std::nullopt, "values",
                          *bad + " (no model produces that: a damaged or wrongly dumped record)");
      // build() copies the tensor bytes from the mapping into the batch. Populating the
      // mapping first (MADV_POPULATE_READ, MAP_POPULATE) cost more CPU than the checks' own
      // fault-around faults, as did reading them with pread (bench_loader.sh).
      job.placements[i].record = std::move(r);
    } catch (const UsageError&) {
      throw;
    } catch (const Error& e) {
      if (opts.strict) throw;
      job.skip_reasons[i] = "skipping conversation " + s.conversation_id + ": " + e.what();
    }
  }

  // Reads, checks and copies each record of the batch into its row as soon as it has been
  // read, on all threads: its bytes are then still in the CPU's cache (the checks just read
  // them) instead of read again from memory after the rest of the batch, or of the batches
  // read ahead, pushed them out. One batch at a time: the batch memory of every batch in
  // flight is a slab, and each fresh slab is memory the kernel must zero.
  void build(Job& job) {
    BatchBuilder builder(job.placements.size(), job.rows, job.length, opts.collate, shape, memory.get());
    const std::size_t n = job.placements.size();
    tbb::parallel_for(tbb::blocked_range<std::size_t>(0, n, 1),
                      [&](const tbb::blocked_range<std::size_t>& range) {
                        for (auto i = range.begin(); i != range.end(); ++i) {
                          if (stop.load(std::memory_order_relaxed)) return;
                          read_one(job, i);
                          Placement& p = job.placements[i];
                          if (!p.record) continue;
                          builder.place(i, p);
                          p.record.reset();  // drops the record's file mapping
                        }
                      });
    job.batch = builder.finish(job.placements, /*parallel=*/true);
    job.batch.epoch = job.epoch;
    job.batch.step = job.step;
    job.batch.state = job.after;
    job.placements.clear();
    job.placements.shrink_to_fit();
  }

  void run(Sampler sampler) {
    bool done = false;
    const auto tokens = static_cast<std::size_t>(std::max(opts.prefetch, 1));
    tbb::parallel_pipeline(
        tokens,
        tbb::make_filter<void, JobPtr>(
            tbb::filter_mode::serial_in_order,
            [&](tbb::flow_control& fc) -> JobPtr {
              if (done || stop.load()) {
                fc.stop();
                return nullptr;
              }
              const Sampler::Step step = sampler.next();
              done = step.finished;
              return plan(step);
            }) &
            // One batch is read and collated at a time, its records spread over every
            // thread (build()). Reading batches ahead in a parallel stage and collating them
            // in a later one copied each record seconds after its checks had read it, from
            // memory rather than the cache, and held more batch buffers: loader-bench
            // (docs/benchmarks.md) spent 15-20% more CPU that way.
            tbb::make_filter<JobPtr, JobPtr>(tbb::filter_mode::serial_in_order,
                                             [&](JobPtr job) {
                                               if (job->kind == ItemKind::kBatch && !stop.load())
                                                 build(*job);
                                               return job;
                                             }) &
            tbb::make_filter<JobPtr, void>(tbb::filter_mode::serial_in_order,
                                           [&](JobPtr job) {
                                             if (!stop.load()) queue.push(std::move(job));
                                           }),
        *ctx);
  }

  void start(const SamplerState& from) {
    Sampler sampler = make_sampler();
    sampler.restore(from);
    stop = false;
    queue.reset(static_cast<std::size_t>(std::max(opts.prefetch, 1)));
    ctx = std::make_unique<tbb::task_group_context>();
    thread = std::thread([this, sampler = std::move(sampler)]() mutable {
      try {
        arena->execute([&] { run(std::move(sampler)); });
      } catch (...) {
        queue.fail(std::current_exception());
      }
      queue.producer_done();
    });
  }

  void halt() noexcept {
    stop = true;
    queue.close();
    if (ctx) ctx->cancel_group_execution();
    if (thread.joinable()) {
      try {
        thread.join();
      } catch (...) {
      }
    }
  }
};

Loader::Loader(const Dataset& dataset, std::vector<SampleRef> samples, LoaderOptions opts)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  opts.collate.check();
  if (opts.prefetch < 1) throw UsageError("prefetch must be at least 1");
  if (opts.jobs < 0) throw UsageError("jobs must be >= 0");
  if (!opts.open) opts.open = [](const std::string& path) { return open_reader(path); };
  m.files = dataset.files;
  m.samples = std::move(samples);
  m.opts = std::move(opts);
  // Opened (and checked to be the file indexed) before any record is read: a file moved
  // or changed since indexing ends the run here rather than give each record other masks.
  for (const SampleRef& s : m.samples) {
    if (!s.joined_loss_mask) continue;
    if (!dataset.loss_masks)
      throw Error("conversation " + s.conversation_id + " takes its loss mask from the index's loss-mask file, but " +
                  (dataset.index_path.empty() ? std::string("the index") : dataset.index_path) + " names none");
    m.masks = std::make_unique<const LossMasks>(LossMasks::open_joined(*dataset.loss_masks, dataset.index_path));
    break;
  }
  const auto& co = m.opts.collate;
  // Validates the sampler options (and refuses an empty sample list) before any I/O.
  { Sampler probe(m.samples.size(), m.opts.sampler); }
  const int jobs = m.opts.jobs > 0 ? m.opts.jobs : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  // More threads than cores can pay off when reads wait on a disk or a network filesystem;
  // TBB caps its workers at the core count unless asked (process-wide, while we live).
  if (jobs > tbb::info::default_concurrency())
    m.allow = std::make_unique<tbb::global_control>(tbb::global_control::max_allowed_parallelism,
                                                    static_cast<std::size_t>(jobs));
  m.arena = std::make_unique<tbb::task_arena>(jobs);
  m.readers = std::make_unique<ReaderCache>(m.files, m.opts.open, 16);
  m.memory = std::make_unique<BatchMemory>(2 * static_cast<std::size_t>(m.opts.prefetch) + 2,
                                           m.opts.pinned);

  // The run's record layout, from the first sample that opens (metadata only).
  std::string first_error;
  bool found = false;
  const std::size_t probes = std::min<std::size_t>(m.samples.size(), 64);
  for (std::size_t i = 0; i < probes && !found; ++i) {
    const SampleRef& s = m.samples[i];
    try {
      const auto reader = m.readers->get(s.file);
      if (s.record >= reader->size()) throw Error("record " + std::to_string(s.record) + " is past the file's end");
      m.shape = RecordShape::of(reader->info(s.record));
      found = m.shape.hidden > 0;
      if (!found) first_error = m.files[s.file] + ": record has no hidden size";
    } catch (const UsageError&) {
      throw;
    } catch (const Error& e) {
      if (m.opts.strict) throw;
      if (first_error.empty()) first_error = e.what();
    }
  }
  if (!found) {
    std::size_t absent = 0;
    for (std::size_t i = 0; i < probes; ++i) {
      std::error_code ec;
      absent += !std::filesystem::exists(m.files[m.samples[i].file], ec);
    }
    throw Error("none of the first " + std::to_string(probes) +
                " samples could be opened; the first error: " + first_error +
                (absent > 0 ? " (" + std::to_string(absent) + " of their files are not where the index says: " +
                                  "moved or deleted since indexing? Re-run `eaglekit index`)"
                            : std::string()));
  }

  // Longest and pack mode plan rows from token counts; measure the ones the caller lacks.
  m.lengths.resize(m.samples.size());
  if (co.mode != CollateMode::kPad) {
    m.arena->execute([&] {
      tbb::parallel_for(std::size_t{0}, m.samples.size(), [&](std::size_t i) {
        SampleRef& s = m.samples[i];
        if (s.tokens > 0) return;
        try {
          s.tokens = m.readers->get(s.file)->info(s.record).tokens;
        } catch (const Error&) {
          // Left unknown: reading it fails again later and is reported there.
        }
      });
    });
  }
  for (std::size_t i = 0; i < m.samples.size(); ++i)
    m.lengths[i] = std::clamp<std::int64_t>(m.samples[i].tokens, 0, co.max_length);
  {
    std::vector<std::uint32_t> uses(m.files.size(), 0);
    for (const SampleRef& s : m.samples)
      if (s.file < uses.size()) ++uses[s.file];
    m.sole.resize(m.files.size());
    for (std::size_t f = 0; f < uses.size(); ++f) m.sole[f] = uses[f] == 1;
  }
  if (co.mode == CollateMode::kPack) {
    const auto lengths = m.lengths;
    const std::int64_t max_length = co.max_length;
    m.planner = [lengths, max_length](const std::vector<std::size_t>& order) {
      return pack_rows(order, lengths, max_length);
    };
  }
  m.state = m.make_sampler().state();
  m.started = Clock::now();
  m.start(m.state);
}

Loader::~Loader() { impl_->halt(); }

std::optional<Batch> Loader::next() {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    if (m.finished) return std::nullopt;
  }
  const auto t0 = Clock::now();
  const std::size_t depth = m.queue.size();
  JobPtr job = m.queue.pop();
  const double waited = seconds_since(t0);
  {
    std::lock_guard<std::mutex> lock(m.mu);
    m.stats.wait_s += waited;
    m.stats.last_wait_ms = 1000.0 * waited;
    m.depth_sum += static_cast<double>(depth);
    ++m.pops;
    m.stats.max_queue_depth = std::max(m.stats.max_queue_depth, depth);
    m.state = job->after;
    if (job->kind == ItemKind::kFinished) {
      m.finished = true;
      return std::nullopt;
    }
    if (job->kind == ItemKind::kEndOfEpoch) return std::nullopt;
    const Batch& b = job->batch;
    ++m.stats.batches;
    m.stats.samples += b.conversation_ids.size();
    m.stats.skipped += static_cast<std::uint64_t>(b.skipped);
    m.stats.tokens += static_cast<std::uint64_t>(b.tokens);
    m.stats.bytes += b.bytes;
  }
  // Outside the lock: the callback may call stats() or state().
  m.deliver_warnings(*job);
  return std::move(job->batch);
}

SamplerState Loader::state() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->state;
}

void Loader::restore(const SamplerState& s) {
  Impl& m = *impl_;
  {
    Sampler check = m.make_sampler();
    check.restore(s);  // throws UsageError, leaving this loader as it was
  }
  m.halt();
  {
    std::lock_guard<std::mutex> lock(m.mu);
    m.state = s;
    m.finished = false;
  }
  m.start(s);
}

std::int64_t Loader::steps_in_epoch() const {
  SamplerState s = state();
  s.position = 0;
  Sampler sampler = impl_->make_sampler();
  sampler.restore(s);
  return sampler.steps_in_epoch();
}

LoaderStats Loader::stats() const {
  const Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  LoaderStats s = m.stats;
  s.elapsed_s = seconds_since(m.started);
  s.queue_depth = m.queue.size();
  s.mean_queue_depth = m.pops ? m.depth_sum / static_cast<double>(m.pops) : 0;
  s.fresh_buffers = m.memory->slabs_allocated();
  return s;
}

RecordShape Loader::shape() const { return impl_->shape; }
std::size_t Loader::samples() const { return impl_->samples.size(); }
bool Loader::pinned() const { return impl_->memory->pinned(); }

std::string LoaderStats::to_json() const {
  nlohmann::json j;
  j["batches"] = batches;
  j["samples"] = samples;
  j["skipped"] = skipped;
  j["tokens"] = tokens;
  j["bytes"] = bytes;
  j["wait_s"] = wait_s;
  j["elapsed_s"] = elapsed_s;
  j["samples_per_s"] = samples_per_s();
  j["bytes_per_s"] = bytes_per_s();
  j["wait_ms_per_batch"] = wait_ms_per_batch();
  j["queue_depth"] = queue_depth;
  j["mean_queue_depth"] = mean_queue_depth;
  j["max_queue_depth"] = max_queue_depth;
  j["fresh_buffers"] = fresh_buffers;
  return j.dump();
}

// ---------------------------------------------------------------------------------------

namespace {

bool all_row_named(const DatasetIndex& index) {
  for (std::size_t i = 0; i < index.size(); ++i)
    if (!row_of(index.conversation_id(i))) return false;
  return index.size() > 0;
}

}  // namespace

SelectedData select_data(const DataSelection& sel) {
  if (sel.split != "train" && sel.split != "eval" && sel.split != "all")
    throw UsageError("--split must be train, eval or all, not '" + sel.split + "'");
  if (sel.index.empty()) throw UsageError("--index is required (build one with eaglekit index)");
  const DatasetIndex index = DatasetIndex::load(sel.index);
  const std::set<std::string> quarantine =
      sel.quarantine.empty() ? std::set<std::string>{} : load_quarantine(sel.quarantine);
  SelectedData out;
  if (sel.data.empty()) {
    if (sel.match_by == MatchBy::kRow) throw UsageError("--match-by row needs --data (row i is conversation i)");
    out.dataset = index_dataset(index, quarantine);
  } else {
    out.dataset = match_dataset(load_conversations(sel.data), index, quarantine, sel.match_by);
  }
  const Split split = split_dataset(out.dataset.samples, sel.eval_fraction);
  if (sel.split == "train") out.samples = split.train;
  else if (sel.split == "eval") out.samples = split.eval;
  else out.samples = out.dataset.samples;
  const Dataset& d = out.dataset;
  if (d.matched_by == "index") {
    out.summary = std::to_string(d.samples.size()) + " of " + std::to_string(d.conversations) +
                  " records of the index (no --data: every usable record, in " + (all_row_named(index) ? "row" : "index") +
                  " order)";
  } else {
    out.summary = std::to_string(d.samples.size()) + " of " + std::to_string(d.conversations) +
                  " conversations matched a record" + (d.matched_by == "row" ? " by row (record data_{i} / hs_{i} is conversation i)" : "");
  }
  if (d.missing) out.summary += ", " + std::to_string(d.missing) + " have none";
  if (d.matched_by == "row" && sel.match_by == MatchBy::kAuto)
    out.summary += " (matched by row: no record id equals a conversation id and every record is row-named; "
                   "--match-by id to refuse)";
  if (d.quarantined) out.summary += ", " + std::to_string(d.quarantined) + " quarantined";
  if (d.duplicates) out.summary += ", " + std::to_string(d.duplicates) + " duplicate ids left out";
  if (d.unreadable) out.summary += ", " + std::to_string(d.unreadable) + " unreadable";
  if (d.too_short) out.summary += ", " + std::to_string(d.too_short) + " too short";
  out.summary += "; " + sel.split + " split: " + std::to_string(out.samples.size()) + " samples";
  if (out.samples.empty())
    throw Error("the " + sel.split + " split is empty (" + std::to_string(d.samples.size()) +
                " matched samples, eval fraction " + std::to_string(sel.eval_fraction) + ")");
  return out;
}

std::string CollateReport::to_json() const {
  nlohmann::json j = nlohmann::json::parse(stats.to_json());
  j["batches"] = batches;
  j["files"] = files;
  return j.dump();
}

CollateReport write_batches(Loader& loader, const std::string& out_dir, std::int64_t max_batches) {
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) throw IoError(out_dir + ": cannot create folder: " + ec.message());
  // The temp files of a killed earlier collate into DIR (docs/crash-consistency.md).
  remove_stale_temp_files(out_dir, [](const std::string& name) {
    return name == "batches.jsonl" || (name.rfind("batch_", 0) == 0 && name.size() > 3 &&
                                       name.compare(name.size() - 3, 3, ".pt") == 0);
  });
  CollateReport report;
  std::string manifest;
  int ends = 0;  // end-of-epoch marks in a row: two mean the loader is finished
  while (max_batches < 0 || report.batches < max_batches) {
    auto b = loader.next();
    if (!b) {
      if (max_batches < 0 || ++ends == 2) break;
      continue;
    }
    ends = 0;
    char name[32];
    std::snprintf(name, sizeof(name), "batch_%05lld.pt", static_cast<long long>(report.batches));
    const std::string path = out_dir + "/" + name;
    std::vector<PtEntry> entries;
    for (const auto& [key, t] : b->named_tensors()) entries.push_back({key, to_host_tensor(t)});
    write_pt(path, entries);
    nlohmann::json line;
    line["file"] = name;
    line["epoch"] = b->epoch;
    line["step"] = b->step;
    line["conversation_ids"] = b->conversation_ids;
    line["rows"] = b->sample_rows;
    line["length"] = b->length;
    line["first_token"] = b->first_token;
    line["last_token"] = b->last_token;
    line["tokens"] = b->tokens;
    line["skipped"] = b->skipped;
    line["state"] = nlohmann::json::parse(b->state.to_json());
    manifest += line.dump() + "\n";
    report.files.push_back(path);
    ++report.batches;
  }
  write_file_atomic(out_dir + "/batches.jsonl", manifest.data(), manifest.size());
  report.stats = loader.stats();
  return report;
}

std::string BenchReport::to_json() const {
  nlohmann::json j;
  const double s = seconds > 0 ? seconds : 1e-9;
  j["samples_per_s"] = static_cast<double>(stats.samples) / s;
  j["bytes_per_s"] = static_cast<double>(stats.bytes) / s;
  j["wait_ms_per_batch"] = stats.wait_ms_per_batch();
  j["batches"] = batches;
  j["samples"] = stats.samples;
  j["skipped"] = stats.skipped;
  j["bytes"] = stats.bytes;
  j["seconds"] = seconds;
  j["cpu_s"] = cpu_seconds;
  j["mean_queue_depth"] = stats.mean_queue_depth;
  j["fresh_buffers"] = stats.fresh_buffers;
  return j.dump();
}

std::string BenchReport::to_text() const {
  const double s = seconds > 0 ? seconds : 1e-9;
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "%lld batches, %llu samples (%llu skipped) in %.3f s: %.1f samples/s, %.1f MB/s, "
                "consumer wait %.3f ms/batch, mean queue depth %.2f, CPU %.3f s, "
                "fresh batch buffers %llu\n",
                static_cast<long long>(batches), static_cast<unsigned long long>(stats.samples),
                static_cast<unsigned long long>(stats.skipped), seconds,
                static_cast<double>(stats.samples) / s, static_cast<double>(stats.bytes) / s / 1e6,
                stats.wait_ms_per_batch(), stats.mean_queue_depth, cpu_seconds,
                static_cast<unsigned long long>(stats.fresh_buffers));
  return buf;
}

namespace {
double process_cpu_seconds() {
  struct rusage ru {};
  ::getrusage(RUSAGE_SELF, &ru);
  auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + 1e-6 * static_cast<double>(t.tv_usec); };
  return s(ru.ru_utime) + s(ru.ru_stime);
}
}  // namespace

BenchReport bench_loader(Loader& loader, std::int64_t max_batches) {
  BenchReport report;
  const double cpu0 = process_cpu_seconds();
  const LoaderStats before = loader.stats();
  const auto t0 = Clock::now();
  volatile double sink = 0;
  int ends = 0;
  while (max_batches < 0 || report.batches < max_batches) {
    auto b = loader.next();
    if (!b) {
      if (max_batches < 0 || ++ends == 2) break;
      continue;
    }
    ends = 0;
    // A consumer reads the batch; one value per tensor keeps the loop honest and cheap.
    for (const auto& [key, t] : b->named_tensors())
      if (t.numel() > 0) sink = sink + t.reshape({-1})[0].item<double>();
    ++report.batches;
  }
  report.seconds = seconds_since(t0);
  report.cpu_seconds = process_cpu_seconds() - cpu0;
  LoaderStats after = loader.stats();
  after.batches -= before.batches;
  after.samples -= before.samples;
  after.skipped -= before.skipped;
  after.tokens -= before.tokens;
  after.bytes -= before.bytes;
  after.wait_s -= before.wait_s;
  report.stats = after;
  return report;
}

LoaderOptions loader_options(const BatchOptions& b, int dp_rank, int dp_size, int cp_rank, int cp_size) {
  LoaderOptions lo;
  lo.collate.mode = b.mode;
  lo.collate.max_length = b.max_length;
  lo.collate.pad_multiple = b.pad_multiple;
  lo.collate.cp_rank = cp_rank;
  lo.collate.cp_size = cp_size;
  lo.sampler.batch_size = b.batch_size;
  lo.sampler.rank = dp_rank;
  lo.sampler.world_size = dp_size;
  lo.sampler.shuffle = b.shuffle;
  lo.sampler.seed = b.seed;
  lo.sampler.drop_last = b.drop_last;
  lo.sampler.epochs = 0;
  lo.jobs = b.jobs;
  lo.prefetch = b.prefetch;
  return lo;
}

}  // namespace eaglekit
