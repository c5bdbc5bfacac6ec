// The option groups every data-reading command shares, as tables (lib/options.h): which
// samples (DataSelection: --data, --index, --quarantine, --split, --eval-fraction) and how
// they become batches (BatchOptions: --batch-size, --max-length, --mode, --shuffle, ...).
// LibTorch-free, so the `eaglekit` front end can print and check them too.
//
// Thread safety: plain structs; a Group points into one of them. Errors: UsageError from
// the tables when a value does not parse.
#pragma once

#include <cstdint>
#include <string>

#include "formats/names.h"
#include "lib/dataset.h"
#include "lib/options.h"

namespace eaglekit {

enum class CollateMode {
  kPad,      // the reference: every row padded to exactly max_length
  kLongest,  // rows padded to the batch's longest sample, rounded up to pad_multiple
  kPack,     // several samples per row of max_length, greedy, with document/position ids
};
inline constexpr NameTable<CollateMode, 3> kCollateModeNames{
    {{CollateMode::kPad, "pad"}, {CollateMode::kLongest, "longest"}, {CollateMode::kPack, "pack"}}};

// Which samples: the conversations, the index whose records they match, ids to leave out,
// and the reference split (docs/data.md). Without conversations (data empty) every usable
// record of the index is a sample, in index order (row order for data_{i} / hs_{i}).
struct DataSelection {
  std::string data;
  std::string index;
  std::string quarantine;        // "" = none
  std::string split = "train";   // train | eval | all
  double eval_fraction = 0.05;
  MatchBy match_by = MatchBy::kAuto;  // how records find conversations (lib/dataset.h)
};

// How samples become batches.
struct BatchOptions {
  std::int64_t batch_size = 8;     // rows per batch, per data-parallel rank
  std::int64_t max_length = 2048;  // tokens per sample, and the row length in pad and pack mode
  CollateMode mode = CollateMode::kPad;
  std::int64_t pad_multiple = 8;   // longest: batch length rounded up to this
  bool shuffle = true;             // a seeded permutation per epoch (off: reference order)
  std::uint64_t seed = 0;          // the shuffle's (train: and the draft's initialisation)
  bool drop_last = false;          // drop the last, partial global batch of an epoch
  int jobs = 0;                    // loader threads; 0: all cores
  int prefetch = 4;                // batches in flight and ready ahead of the consumer
};

// "Data": data, index, match_by, quarantine, split, eval_fraction (in [0, 1): train needs
// samples to train on).
opt::Group data_options(DataSelection& d);
// The same rows for a command that reads a split without training on it (evaluate, vocab,
// collate, loader-bench): --eval-fraction in [0, 1], 1 making every sample eval.
opt::Group split_data_options(DataSelection& d);
// "Batches": batch_size, max_length, mode, pad_multiple, shuffle, seed, drop_last, jobs,
// prefetch.
opt::Group batch_options(BatchOptions& b);

}  // namespace eaglekit
