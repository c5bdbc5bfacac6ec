// The order in which samples reach the trainer: reference order or a seeded per-epoch
// permutation, grouped into batch rows ("units": one sample, or several packed into one
// row), and dealt round-robin to data-parallel ranks. Its state (epoch, position, seed)
// can be saved and restored so that a resumed run sees exactly the batches it would
// have seen.
//
// Data-parallel convention (issue 8): global step s covers units
// [s*G, (s+1)*G) of the epoch, G = batch_size * world_size; rank r gets units
// s*G + r, s*G + r + W, s*G + r + 2W, ... So the global batch of step s is the same set of
// samples for every DP size with the same G. In the last step of an epoch (when the unit
// count is not a multiple of G and drop_last is off) a rank may get fewer rows, or none.
//
// Thread safety: a Sampler is a plain value; use one per thread. Throws UsageError on bad
// options and FormatError on a state that does not parse.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace eaglekit {

// A deterministic permutation of [0, n) for (seed, epoch); identity when !shuffle.
// Algorithm (so other languages can reproduce it): splitmix64 seeded with
// seed ^ (0x9E3779B97F4A7C15 * (epoch + 1)) mod 2^64; Fisher-Yates from i = n-1 down to 1,
// j drawn uniformly from [0, i] by rejection (x < 2^64 - 2^64 mod (i+1), j = x mod (i+1)).
std::vector<std::size_t> epoch_order(std::size_t n, bool shuffle, std::uint64_t seed,
                                     std::uint64_t epoch);

struct SamplerOptions {
  std::int64_t batch_size = 1;  // rows per step for one data-parallel rank
  int rank = 0;
  int world_size = 1;
  bool shuffle = false;
  std::uint64_t seed = 0;
  bool drop_last = false;  // drop the last, partial global batch of each epoch
  std::int64_t epochs = 0;  // epochs to run; 0 = no limit
};

// Everything a resume needs. `position` counts units of the epoch already dealt, across
// all ranks (a multiple of the global batch, or the epoch's unit count at its end).
struct SamplerState {
  std::uint64_t epoch = 0;
  std::uint64_t position = 0;
  std::uint64_t seed = 0;
  bool shuffle = false;
  std::uint64_t samples = 0;  // sample count it was made for; checked on restore

  std::string to_json() const;
  // Throws FormatError (path "<sampler state>") when the text is not a state.
  static SamplerState from_json(const std::string& text);
  bool operator==(const SamplerState& o) const;
};

class Sampler {
 public:
  using Unit = std::vector<std::size_t>;  // sample indices that share one batch row
  // Groups an epoch's sample order into units (e.g. packing). Must be deterministic.
  using Planner = std::function<std::vector<Unit>(const std::vector<std::size_t>& order)>;

  // samples > 0. An empty planner gives one unit per sample.
  Sampler(std::size_t samples, SamplerOptions opts, Planner planner = {});

  struct Step {
    std::uint64_t epoch = 0;
    std::uint64_t step = 0;    // step number inside the epoch
    std::vector<Unit> rows;    // this rank's units, in row order
    bool end_of_epoch = false;  // no rows: the epoch is over (the next call starts the next)
    bool finished = false;      // `epochs` epochs are done; every later call says so again
    SamplerState after;         // the state once this step is consumed
  };
  Step next();

  std::int64_t steps_in_epoch() const;  // steps of the current epoch
  std::int64_t global_batch() const { return opts_.batch_size * opts_.world_size; }
  SamplerState state() const;
  // Throws UsageError when the state belongs to another dataset, seed or batch geometry.
  void restore(const SamplerState& s);
  const SamplerOptions& options() const { return opts_; }

 private:
  void plan_epoch();
  std::size_t samples_;
  SamplerOptions opts_;
  Planner planner_;
  std::uint64_t epoch_ = 0;
  std::uint64_t position_ = 0;
  std::uint64_t planned_epoch_ = ~0ull;
  std::vector<Unit> units_;  // the current epoch's units, in global order
};

}  // namespace eaglekit
