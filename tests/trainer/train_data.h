// A tiny synthetic training job shared by the loop, checkpoint and evaluation tests:
// `eaglekit synth` data (learnable: the base's lm_head on the last hidden state predicts
// the next token) with its base model folder, indexed, plus small TrainOptions for it.
#pragma once

#include <ATen/ATen.h>
#include <doctest/doctest.h>

#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "formats/safetensors_format.h"
#include "lib/index.h"
#include "lib/synth.h"
#include "tests/compare.h"
#include "tests/support.h"
#include "trainer/model/base_model.h"
#include "trainer/run/train.h"

namespace eaglekit::test {

struct SynthJob {
  TempDir dir{"train"};
  std::string data_dir = dir / "data";
  std::string data = dir / "data/conversations.jsonl";
  std::string index = dir / "index.eki";
  std::string base = dir / "base";
};

// H=32 gives one head of dim 32 and intermediate 128: a draft of ~40k parameters.
inline std::unique_ptr<SynthJob> make_synth_job(std::int64_t conversations = 40, std::int64_t vocab = 48,
                                                std::int64_t min_tokens = 10, std::int64_t max_tokens = 28,
                                                std::uint64_t seed = 3) {
  auto job = std::make_unique<SynthJob>();
  SynthOptions so;
  so.out_dir = job->data_dir;
  so.conversations = conversations;
  so.hidden = 32;
  so.vocab = vocab;
  so.min_tokens = min_tokens;
  so.max_tokens = max_tokens;
  so.dtype = DType::kFloat32;
  so.seed = seed;
  so.jobs = 2;
  so.base_out = job->base;
  synthesize(so);
  IndexOptions io;
  io.roots = {job->data_dir};
  io.out = job->index;
  io.jobs = 2;
  io.progress = 0;
  build_index(io);
  return job;
}

inline trainer::TrainOptions small_options(const SynthJob& job, const std::string& out) {
  trainer::TrainOptions o;
  o.data = job.data;
  o.index = job.index;
  o.base = job.base;
  o.out = out;
  o.max_length = 24;
  o.batch_size = 4;
  o.lr = 3e-3;
  o.log_every = 1;
  o.eval_every = -1;
  o.jobs = 2;
  o.prefetch = 2;
  o.progress = false;
  o.seed = 1;
  o.eval_fraction = 0.2;
  return o;
}

// Every JSON object of a .jsonl file (metrics.jsonl), in order.
inline std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::ifstream f(path);
  std::vector<nlohmann::json> out;
  std::string line;
  while (std::getline(f, line))
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  return out;
}

// The float weights of a model.safetensors, by name.
inline std::vector<std::pair<std::string, at::Tensor>> read_weights(const std::string& path) {
  const auto file = SafetensorsFile::open(path);
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& e : file->entries()) out.emplace_back(e.name, trainer::tensor_from_host(file->tensor(e)));
  return out;
}

// Largest |a - b| / (|b|_max + tiny) over every tensor of two weight lists with equal names;
// a NaN on either side makes it +inf (worst_of, tests/compare.h).
inline double max_rel_diff(const std::vector<std::pair<std::string, at::Tensor>>& a,
                           const std::vector<std::pair<std::string, at::Tensor>>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    REQUIRE(a[i].first == b[i].first);
    const at::Tensor x = a[i].second.to(at::kDouble), y = b[i].second.to(at::kDouble);
    REQUIRE(x.sizes() == y.sizes());
    if (x.numel() == 0) continue;
    const double scale = y.abs().max().item<double>() + 1e-12;
    // max() propagates NaN, and inf - inf is NaN: both reach worst_of as NaN.
    worst = worst_of(worst, (x - y).abs().max().item<double>() / scale);
  }
  return worst;
}

}  // namespace eaglekit::test
