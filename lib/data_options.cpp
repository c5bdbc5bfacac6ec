#include "lib/data_options.h"

#include <utility>

namespace eaglekit {

opt::Group data_options(DataSelection& d) {
  using opt::field;
  return {"Data",
          {
              opt::note(field("data", "PATH", d.data,
                              "Conversations: a .jsonl file, a folder of them, or a JSON array file"),
                        "none: every usable record of the index, in index order"),
              field("index", "FILE", d.index, "Dataset index (eaglekit index)"),
              opt::choice("match_by", d.match_by, {{MatchBy::kAuto, "auto"}, {MatchBy::kId, "id"}, {MatchBy::kRow, "row"}},
                          "How records find conversations: by id, or by row for dumps named data_{i} / hs_{i} "
                          "(auto: id, else row when every record is row-named)"),
              field("quarantine", "FILE", d.quarantine, "File of conversation ids to leave out (eaglekit validate --quarantine)"),
              field("split", "NAME", d.split, "train, eval or all"),
              opt::below(opt::at_least(field("eval_fraction", "X", d.eval_fraction,
                                             "Share of the matched samples, at the end, that form the eval split"),
                                       0),
                         1),
          }};
}

opt::Group split_data_options(DataSelection& d) {
  return data_options(d).with("eval_fraction", [](opt::Option o) { return opt::at_most(std::move(o), 1); });
}

opt::Group batch_options(BatchOptions& b) {
  using opt::at_least;
  using opt::field;
  return {"Batches",
          {
              at_least(field("batch_size", "N", b.batch_size, "Rows per batch, per data-parallel rank"), 1),
              at_least(
                  field("max_length", "N", b.max_length, "Tokens per sample (and the row length in pad and pack mode)"),
                  2),
              opt::choice_of("mode", b.mode, kCollateModeNames,
                             "Collation: pad (the reference), longest or pack (docs/data.md)"),
              at_least(field("pad_multiple", "N", b.pad_multiple, "longest: round the batch length up to this"), 1),
              field("shuffle", "", b.shuffle, "A seeded permutation of the samples per epoch (off: reference order)"),
              field("seed", "N", b.seed, "Seed of the shuffle (train: and of the draft's initialisation)"),
              field("drop_last", "", b.drop_last, "Drop the last, partial global batch of an epoch"),
              at_least(field("jobs", "N", b.jobs, "Loader threads (0: all cores)"), 0),
              at_least(field("prefetch", "N", b.prefetch, "Batches in flight and ready ahead of the consumer"), 1),
          }};
}

}  // namespace eaglekit
