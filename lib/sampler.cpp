#include "lib/sampler.h"

#include <nlohmann/json.hpp>

#include <numeric>

#include "formats/error.h"

namespace eaglekit {

namespace {

struct SplitMix64 {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, m), m >= 1, without modulo bias.
  std::uint64_t below(std::uint64_t m) {
    // 2^64 mod m, computed in 64 bits as (2^64 - m) mod m.
    const std::uint64_t rem = (0 - m) % m;
    const std::uint64_t limit = 0 - rem;  // 2^64 - rem, wraps to 0 when rem == 0
    for (;;) {
      const std::uint64_t x = next();
      if (rem == 0 || x < limit) return x % m;
    }
  }
};

[[noreturn]] void bad_state(const std::string& what) {
  throw FormatError("<sampler state>", std::nullopt, "state", what);
}

}  // namespace

std::vector<std::size_t> epoch_order(std::size_t n, bool shuffle, std::uint64_t seed,
                                     std::uint64_t epoch) {
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), std::size_t{0});
  if (!shuffle || n < 2) return order;
  SplitMix64 rng{seed ^ (0x9E3779B97F4A7C15ull * (epoch + 1))};
  for (std::size_t i = n - 1; i >= 1; --i) {
    const auto j = static_cast<std::size_t>(rng.below(static_cast<std::uint64_t>(i) + 1));
    std::swap(order[i], order[j]);
  }
  return order;
}

std::string SamplerState::to_json() const {
  nlohmann::json j;
  j["epoch"] = epoch;
  j["position"] = position;
  j["seed"] = seed;
  j["shuffle"] = shuffle;
  j["samples"] = samples;
  return j.dump();
}

SamplerState SamplerState::from_json(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    bad_state(std::string("not JSON: ") + e.what());
  }
  if (!j.is_object()) bad_state("expected a JSON object");
  SamplerState s;
  auto get_u64 = [&](const char* key, std::uint64_t& out) {
    if (!j.contains(key) || !j[key].is_number_unsigned())
      bad_state(std::string("field '") + key + "' missing or not a non-negative integer");
    out = j[key].get<std::uint64_t>();
  };
  get_u64("epoch", s.epoch);
  get_u64("position", s.position);
  get_u64("seed", s.seed);
  get_u64("samples", s.samples);
  if (!j.contains("shuffle") || !j["shuffle"].is_boolean())
    bad_state("field 'shuffle' missing or not a boolean");
  s.shuffle = j["shuffle"].get<bool>();
  return s;
}

bool SamplerState::operator==(const SamplerState& o) const {
  return epoch == o.epoch && position == o.position && seed == o.seed && shuffle == o.shuffle &&
         samples == o.samples;
}

Sampler::Sampler(std::size_t samples, SamplerOptions opts, Planner planner)
    : samples_(samples), opts_(opts), planner_(std::move(planner)) {
  if (samples_ == 0) throw UsageError("no samples to load");
  if (opts_.batch_size < 1) throw UsageError("batch size must be at least 1");
  if (opts_.world_size < 1) throw UsageError("world size must be at least 1");
  if (opts_.rank < 0 || opts_.rank >= opts_.world_size)
    throw UsageError("rank " + std::to_string(opts_.rank) + " is outside world size " +
                     std::to_string(opts_.world_size));
  if (opts_.epochs < 0) throw UsageError("epochs must be >= 0");
}

void Sampler::plan_epoch() {
  if (planned_epoch_ == epoch_) return;
  auto order = epoch_order(samples_, opts_.shuffle, opts_.seed, epoch_);
  if (planner_) {
    units_ = planner_(order);
  } else {
    units_.clear();
    units_.reserve(order.size());
    for (auto i : order) units_.push_back(Unit{i});
  }
  planned_epoch_ = epoch_;
}

std::int64_t Sampler::steps_in_epoch() const {
  const_cast<Sampler*>(this)->plan_epoch();
  const auto u = static_cast<std::int64_t>(units_.size());
  const std::int64_t g = global_batch();
  return opts_.drop_last ? u / g : (u + g - 1) / g;
}

Sampler::Step Sampler::next() {
  Step out;
  if (opts_.epochs > 0 && epoch_ >= static_cast<std::uint64_t>(opts_.epochs)) {
    out.epoch = epoch_;
    out.finished = true;
    out.end_of_epoch = true;
    out.after = state();
    return out;
  }
  plan_epoch();
  const auto g = static_cast<std::uint64_t>(global_batch());
  const std::uint64_t steps = static_cast<std::uint64_t>(steps_in_epoch());
  // Ceil: the last step of an epoch may end on the unit count, not a multiple of g.
  const std::uint64_t step = (position_ + g - 1) / g;
  out.epoch = epoch_;
  out.step = step;
  if (step >= steps) {
    out.end_of_epoch = true;
    ++epoch_;
    position_ = 0;
    out.after = state();
    return out;
  }
  const std::uint64_t begin = step * g;
  const std::uint64_t end = std::min<std::uint64_t>(begin + g, units_.size());
  for (std::uint64_t u = begin + static_cast<std::uint64_t>(opts_.rank); u < end;
       u += static_cast<std::uint64_t>(opts_.world_size))
    out.rows.push_back(units_[u]);
  position_ = end;
  out.after = state();
  return out;
}

SamplerState Sampler::state() const {
  SamplerState s;
  s.epoch = epoch_;
  s.position = position_;
  s.seed = opts_.seed;
  s.shuffle = opts_.shuffle;
  s.samples = samples_;
  return s;
}

void Sampler::restore(const SamplerState& s) {
  if (s.samples != samples_)
    throw UsageError("sampler state is for " + std::to_string(s.samples) +
                     " samples but this dataset has " + std::to_string(samples_));
  if (s.shuffle != opts_.shuffle || (s.shuffle && s.seed != opts_.seed))
    throw UsageError("sampler state was saved with " +
                     (s.shuffle ? "--shuffle --seed " + std::to_string(s.seed)
                                : std::string("reference order")) +
                     "; resume with the same order options");
  const std::uint64_t saved_epoch = epoch_, saved_position = position_;
  epoch_ = s.epoch;
  position_ = 0;
  plan_epoch();
  const auto g = static_cast<std::uint64_t>(global_batch());
  if (s.position > units_.size() || (s.position % g != 0 && s.position != units_.size())) {
    epoch_ = saved_epoch;
    position_ = saved_position;
    throw UsageError("sampler state position " + std::to_string(s.position) +
                     " does not fall on a step boundary of global batch " + std::to_string(g) +
                     " (epoch has " + std::to_string(units_.size()) + " rows)");
  }
  position_ = s.position;
}

}  // namespace eaglekit
