// `eaglekit stats`: what a dataset index holds in numbers, from the index (every ok record
// of it; no conversations): the token-count distribution, bytes on disk per token, records
// per format and dtype, and a disk estimate for a planned dump of the same width. The one
// thing not in the index, SpecForge's batch padding (lib/validate.h scan_padding), is
// measured by reading the torch.save records that hold a loss mask, unless skip_padding.
//
// Thread safety: pure functions of their arguments.
// Throws: UsageError for bad options; what DatasetIndex accessors throw on a damaged index.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "lib/validate.h"

namespace eaglekit {

class DatasetIndex;

struct StatsOptions {
  std::int64_t plan_conversations = 0;  // > 0 (or plan_tokens > 0): estimate a planned dump
  double plan_tokens = 0;               // tokens per conversation; 0: the dataset's mean
  bool skip_padding = false;            // true: open no record (no padding figures)
  int jobs = 0;                         // threads reading records for the padding; 0: all cores
};

struct HistogramBin {
  std::int64_t lo = 0;  // tokens in [lo, hi]
  std::int64_t hi = 0;
  std::size_t count = 0;
};

struct DatasetStats {
  std::size_t records = 0;       // ok entries (everything below counts only these)
  std::size_t bad_records = 0;
  std::size_t files = 0;         // files holding at least one ok record
  std::int64_t total_tokens = 0;
  // Nearest-rank percentiles of tokens per record (0 when there are no records).
  std::int64_t min_tokens = 0, median_tokens = 0, p90_tokens = 0, p99_tokens = 0, max_tokens = 0;
  double mean_tokens = 0;
  std::vector<HistogramBin> histogram;  // power-of-two bins, empty ones inside the range kept
  std::uint64_t bytes_on_disk = 0;      // sizes of those files
  double bytes_per_token = 0;           // on disk, whatever the codec
  std::map<std::string, std::size_t> per_format;  // "pt" -> records
  std::map<std::string, std::size_t> per_dtype;   // hidden dtype -> records
  std::map<std::string, std::size_t> per_codec;
  std::map<std::int64_t, std::size_t> per_hidden_size;
  // The most common width, and the raw (uncompressed) bytes one token takes at it:
  // int64 id + (H, or target_probs_width, + aux width) elements of the dtype.
  std::int64_t hidden_size = 0;
  std::int64_t aux_width = 0;
  std::string dtype;
  // The most common records store the target's distribution over this many draft tokens in
  // the place of a last hidden state (NeMo's cache, an .eks converted from one: the file's
  // FileFacts::target_vocabulary), so their raw bytes count it instead of H; 0 otherwise.
  std::int64_t target_probs_width = 0;
  double raw_bytes_per_token = 0;
  // The planned dump, when asked for.
  bool has_plan = false;
  std::int64_t plan_conversations = 0;
  double plan_tokens = 0;           // per conversation
  double plan_bytes_raw = 0;        // uncompressed, at the dataset's width and dtype
  double plan_bytes_on_disk = 0;    // at this dataset's measured bytes per token
  bool padding_scanned = false;
  PaddingReport padding;
  // The index's loss-mask file (`eaglekit index --loss-masks`): its path ("" when none), the
  // records that take their mask from it, and why it cannot serve them: moved or changed
  // since indexing ("" when it can; the loader refuses it then).
  std::string loss_masks;
  std::size_t joined_loss_masks = 0;
  std::string loss_masks_problem;
};

DatasetStats compute_stats(const DatasetIndex& index, const StatsOptions& opts = {});

std::string stats_to_json(const DatasetStats& stats);
// Text form with a histogram of bars.
std::string stats_to_text(const DatasetStats& stats);

// --- `stats --plan-dump`: what a dump will take, before it is made -----------------------
//
// From the conversations (their text) and the base's config.json (its hidden size): the
// tokens, and the bytes of a dump in each format eaglekit reads, per token and in all, each
// with how it was obtained (arithmetic, measured on a sample, or an estimate and from what),
// and a suggested format. Tokens come from the text's UTF-8 bytes (every string value of a
// conversation but its id) divided by text bytes per token: given, or measured on a sample
// dump (an index of some of the same conversations already dumped, matched as train matches
// them). The sample also gives the measured size of `.eks` records when it holds only one
// codec. Nothing is dumped or read but the conversations, config.json and the sample's index.
struct DumpPlanOptions {
  std::string conversations;        // --data
  std::string base;                 // the base's folder (its config.json) or the file itself
  int aux_layers = 3;               // k: EAGLE-3 reads 3 (train's default aux ids)
  double text_bytes_per_token = 0;  // > 0: given; 0: measured on the sample or counted (below)
  // > 0: the conversations' tokens counted by the base's own tokenizer (tools/cmd_stats.cpp
  // runs tools/python/eaglekit_dump.py --count-tokens when the base folder has tokenizer.json),
  // with how, in words; used when neither text_bytes_per_token nor a sample is given.
  std::int64_t counted_tokens = 0;
  std::string counted_basis;
  double disk_bytes = 0;            // > 0: the disk the dump may take; the suggestion must fit it
};

struct DumpPlanFormat {
  std::string name;           // "raw-bf16", "eks-zstd", "eks-fp8"
  bool lossless = true;
  double bytes_per_token = 0;
  double bytes = 0;           // for all the planned tokens
  std::string basis;          // how bytes_per_token was obtained, in words
  bool measured = false;      // on the sample (else arithmetic or an estimate, said in basis)
};

struct DumpPlan {
  std::size_t conversations = 0;
  std::uint64_t text_bytes = 0;
  double text_bytes_per_token = 0;
  std::string tokens_basis;      // "given" or what it was measured on
  double tokens = 0;             // text_bytes / text_bytes_per_token
  std::int64_t hidden_size = 0;
  std::int64_t num_hidden_layers = 0;  // 0 when config.json does not say
  int aux_layers = 0;
  std::string base_config;       // the config.json read
  std::vector<DumpPlanFormat> formats;  // raw-bf16, eks-zstd, eks-fp8
  std::string suggestion;        // a name of formats, or "" when none fits disk_bytes
  std::string suggestion_why;
};

// Throws UsageError for bad options (neither text_bytes_per_token nor a sample; a sample
// that matches none of the conversations), FormatError for a config.json without a hidden
// size, and what load_conversations and DatasetIndex throw.
DumpPlan plan_dump(const DumpPlanOptions& opts, const DatasetIndex* sample = nullptr);
std::string dump_plan_to_json(const DumpPlan& plan);
std::string dump_plan_to_text(const DumpPlan& plan);

}  // namespace eaglekit
