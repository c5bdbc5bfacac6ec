#include "lib/synth.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "formats/atomic_file.h"
#include "formats/error.h"
#include "formats/registry.h"
#include "formats/safetensors_format.h"
#include "lib/clock.h"
#include "lib/progress.h"

namespace eaglekit {

namespace fs = std::filesystem;

namespace {

// Everything random is a hash of (seed, stream, index): no generator state is shared, so
// any thread can compute any value and the output cannot depend on the thread count.
inline std::uint64_t mix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
inline std::uint64_t key(std::uint64_t seed, std::uint64_t stream, std::uint64_t a) {
  return mix64(mix64(seed ^ (stream * 0xd1342543de82ef95ull)) + mix64(a));
}
inline double unit(std::uint64_t h) { return static_cast<double>(h >> 11) * 0x1.0p-53; }

// Streams.
enum : std::uint64_t {
  kEmbed = 1, kUnembed, kSucc, kConvTokens, kNoise, kPerm, kGamma, kOutlier, kZipf, kTemp,
};

constexpr int kTableBits = 16;
constexpr std::size_t kTableSize = std::size_t{1} << kTableBits;
constexpr double kJump = 0.05;       // chance that the next token ignores the chain
constexpr double kZipfOffset = 4.0;  // P(rank r) ~ 1 / (r + offset)
constexpr double kLogitScale = 12.0; // R: typical norm of the successor mixture
constexpr double kTokenWeight = 0.3; // share of the current token's embedding in h
constexpr double kHiddenNoise = 0.05;
constexpr double kAuxNoise = 0.15;

// Quantiles of N(0, 1) and of a unit-variance Student t with 3 degrees of freedom (heavy
// tails), indexed by 16 hash bits. Deterministic: built from a fixed stream.
struct Tables {
  std::vector<float> gauss, heavy;
  Tables() : gauss(kTableSize), heavy(kTableSize) {
    auto normal = [](std::uint64_t i) {
      const double u1 = (static_cast<double>(mix64(2 * i) >> 11) + 0.5) * 0x1.0p-53;
      const double u2 = unit(mix64(2 * i + 1));
      return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
    };
    for (std::size_t i = 0; i < kTableSize; ++i) {
      gauss[i] = static_cast<float>(normal(i));
      const double z = normal(kTableSize + i);
      double chi = 0;
      for (int k = 0; k < 3; ++k) {
        const double g = normal(2 * kTableSize + 3 * i + k);
        chi += g * g;
      }
      const double t = z / std::sqrt(std::max(chi, 1e-12) / 3.0) / std::sqrt(3.0);
      heavy[i] = static_cast<float>(std::clamp(t, -30.0, 30.0));
    }
  }
};
const Tables& tables() {
  static const Tables t;
  return t;
}

std::string syllable_word(std::int64_t v) {
  static const char* kSyl[16] = {"ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo",
                                 "be", "da", "fu", "go", "hi", "jo", "pe", "zu"};
  std::string w;
  std::uint64_t x = static_cast<std::uint64_t>(v);
  do {
    w += kSyl[x % 16];
    x /= 16;
  } while (x > 0);
  return w;
}

// Converts n floats to dt at out (the switch is outside the loop: this is the hot path).
void store_row(DType dt, const float* v, std::int64_t n, std::uint8_t* out) {
  switch (dt) {
    case DType::kBFloat16:
      for (std::int64_t i = 0; i < n; ++i) {
        const std::uint16_t b = float_to_bf16(v[i]);
        std::memcpy(out + 2 * i, &b, 2);
      }
      return;
    case DType::kFloat16:
      for (std::int64_t i = 0; i < n; ++i) {
        const std::uint16_t b = float_to_fp16(v[i]);
        std::memcpy(out + 2 * i, &b, 2);
      }
      return;
    case DType::kFloat32:
      std::memcpy(out, v, static_cast<std::size_t>(n) * 4);
      return;
    default:
      throw UsageError("synth: unsupported dtype " + std::string(dtype_name(dt)));
  }
}

// pt or safetensors (check_synth_options): the row's first extension, as convert names files.
std::string extension(Format f) { return std::string(format_row(f)->extensions.front()); }

}  // namespace

void check_synth_options(const SynthOptions& o) {
  if (o.conversations < 1) throw UsageError("--conversations must be at least 1");
  if (o.hidden < 8) throw UsageError("--hidden must be at least 8");
  if (o.hidden > (1 << 20)) throw UsageError("--hidden must be at most 1048576");
  if (o.aux_layers < 1 || o.aux_layers > 64) throw UsageError("--aux-layers must be in [1, 64]");
  if (o.vocab < 16) throw UsageError("--vocab must be at least 16");
  if (o.vocab > (std::int64_t{1} << 31)) throw UsageError("--vocab must be below 2^31");
  if (o.min_tokens < 2) throw UsageError("--min-tokens must be at least 2");
  if (o.max_tokens < o.min_tokens)
    throw UsageError("--max-tokens (" + std::to_string(o.max_tokens) + ") is below --min-tokens (" +
                     std::to_string(o.min_tokens) + ")");
  if (o.dtype != DType::kBFloat16 && o.dtype != DType::kFloat16 && o.dtype != DType::kFloat32)
    throw UsageError("--dtype must be bf16, fp16 or fp32, not " + std::string(dtype_name(o.dtype)));
  if (o.format != Format::kPt && o.format != Format::kSafetensors)
    throw UsageError("synth writes one file per record: --format must be pt or safetensors, not " +
                     std::string(format_name(o.format)));
  if (o.jobs < 0) throw UsageError("--jobs must not be negative");
  if (o.out_dir.empty()) throw UsageError("--out is required");
}

struct SynthGenerator::Impl {
  SynthOptions o;
  std::int64_t h = 0, v = 0, k = 0;
  std::vector<std::int64_t> rank_to_token;  // Zipf rank -> token id (a fixed permutation)
  std::vector<std::vector<std::int32_t>> perm;  // per aux layer: channel permutation
  std::vector<std::vector<float>> sign;         // per aux layer: +-1 per channel
  std::vector<float> gamma;                     // final-norm weight per channel
  // The base folder's model.norm.weight: gamma times a wide per-channel spread, as real
  // final norms are far from uniform. Post-norm states do not involve it (lm_head divides
  // gamma out); pre-norm states are the post-norm ones with it divided out, so the base's
  // RMSNorm gives them back, and reading one form as the other visibly changes the argmax.
  std::vector<float> norm_weight;
  std::vector<std::int32_t> outliers;           // outlier channels
  std::vector<float> outlier_value;             // their typical value in h
  std::vector<char> is_outlier;
  double zipf_log_span = 0;

  explicit Impl(const SynthOptions& options) : o(options) {
    check_synth_options(o);
    h = o.hidden;
    v = o.vocab;
    k = o.aux_layers;
    const std::uint64_t s = o.seed;
    // Fisher-Yates with hashed draws.
    auto shuffle = [&](auto& vec, std::uint64_t stream, std::uint64_t salt) {
      for (std::size_t i = vec.size(); i > 1; --i) {
        const auto j = static_cast<std::size_t>(key(s, stream, salt * 0x100000001ull + i) % i);
        std::swap(vec[i - 1], vec[j]);
      }
    };
    rank_to_token.resize(static_cast<std::size_t>(v));
    for (std::int64_t i = 0; i < v; ++i) rank_to_token[static_cast<std::size_t>(i)] = i;
    shuffle(rank_to_token, kZipf, 0);
    zipf_log_span = std::log((static_cast<double>(v) + kZipfOffset) / kZipfOffset);

    perm.resize(static_cast<std::size_t>(k));
    sign.resize(static_cast<std::size_t>(k));
    for (std::int64_t l = 0; l < k; ++l) {
      auto& p = perm[static_cast<std::size_t>(l)];
      p.resize(static_cast<std::size_t>(h));
      for (std::int64_t i = 0; i < h; ++i) p[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i);
      shuffle(p, kPerm, static_cast<std::uint64_t>(l) + 1);
      auto& sg = sign[static_cast<std::size_t>(l)];
      sg.resize(static_cast<std::size_t>(h));
      for (std::int64_t i = 0; i < h; ++i)
        sg[static_cast<std::size_t>(i)] = (key(s, kPerm, 1000003ull * (l + 1) + i) & 1) ? 1.f : -1.f;
    }
    const auto& g = tables().gauss;
    gamma.resize(static_cast<std::size_t>(h));
    for (std::int64_t i = 0; i < h; ++i)
      gamma[static_cast<std::size_t>(i)] =
          static_cast<float>(std::exp(0.35 * g[key(s, kGamma, i) >> (64 - kTableBits)]));
    norm_weight.resize(static_cast<std::size_t>(h));
    for (std::int64_t i = 0; i < h; ++i)
      norm_weight[static_cast<std::size_t>(i)] =
          gamma[static_cast<std::size_t>(i)] *
          static_cast<float>(std::exp(1.2 * g[key(s, kGamma, 7919 * (h + i) + 1) >> (64 - kTableBits)]));
    // A few channels with large, mostly constant values ("massive activations").
    const std::int64_t n_out = std::min<std::int64_t>(std::max<std::int64_t>(2, h / 256), std::min<std::int64_t>(8, h / 8));
    std::vector<std::int32_t> channels(static_cast<std::size_t>(h));
    for (std::int64_t i = 0; i < h; ++i) channels[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i);
    shuffle(channels, kOutlier, 0);
    is_outlier.assign(static_cast<std::size_t>(h), 0);
    for (std::int64_t j = 0; j < n_out; ++j) {
      const std::int32_t c = channels[static_cast<std::size_t>(j)];
      outliers.push_back(c);
      is_outlier[static_cast<std::size_t>(c)] = 1;
      const double mag = 8.0 + 32.0 * unit(key(s, kOutlier, 1000 + j));
      outlier_value.push_back(static_cast<float>((key(s, kOutlier, 2000 + j) & 1) ? mag : -mag));
    }
  }

  std::int64_t zipf(std::uint64_t hsh) const {
    const double u = unit(hsh);
    auto r = static_cast<std::int64_t>(kZipfOffset * std::exp(u * zipf_log_span) - kZipfOffset);
    r = std::clamp<std::int64_t>(r, 0, v - 1);
    return rank_to_token[static_cast<std::size_t>(r)];
  }

  Successors successors(std::int64_t tok) const {
    Successors out;
    const std::uint64_t base = key(o.seed, kSucc, static_cast<std::uint64_t>(tok));
    const int n = 2 + static_cast<int>(mix64(base) % 5);
    double total = 0;
    for (int j = 0; j < n; ++j) {
      out.ids.push_back(zipf(mix64(base + 17 + j)));
      const double w = std::exp(-0.8 * j) * (0.6 + 0.8 * unit(mix64(base + 101 + j)));
      out.probs.push_back(w);
      total += w;
    }
    for (auto& p : out.probs) p /= total;
    // Most likely first (weights decay with j but the random factor can reorder them).
    std::vector<std::size_t> idx(static_cast<std::size_t>(n));
    for (std::size_t j = 0; j < idx.size(); ++j) idx[j] = j;
    std::stable_sort(idx.begin(), idx.end(),
                     [&](std::size_t a, std::size_t b) { return out.probs[a] > out.probs[b]; });
    Successors sorted;
    for (auto j : idx) {
      sorted.ids.push_back(out.ids[j]);
      sorted.probs.push_back(out.probs[j]);
    }
    return sorted;
  }

  std::vector<std::int64_t> tokens(std::int64_t i) const {
    const std::uint64_t base = key(o.seed, kConvTokens, static_cast<std::uint64_t>(i));
    const std::int64_t span = o.max_tokens - o.min_tokens + 1;
    const std::int64_t t = o.min_tokens + static_cast<std::int64_t>(mix64(base) % static_cast<std::uint64_t>(span));
    std::vector<std::int64_t> ids(static_cast<std::size_t>(t));
    ids[0] = zipf(mix64(base + 1));
    for (std::int64_t p = 1; p < t; ++p) {
      const std::uint64_t hh = mix64(base + 2 * static_cast<std::uint64_t>(p) + 2);
      if (unit(hh) < kJump) {
        ids[static_cast<std::size_t>(p)] = zipf(mix64(hh));
        continue;
      }
      const Successors sc = successors(ids[static_cast<std::size_t>(p - 1)]);
      double u = unit(mix64(base + 2 * static_cast<std::uint64_t>(p) + 3));
      std::size_t j = 0;
      while (j + 1 < sc.probs.size() && u >= sc.probs[j]) u -= sc.probs[j++];
      ids[static_cast<std::size_t>(p)] = sc.ids[j];
    }
    return ids;
  }

  // Unit-RMS embedding of a token (what embed_tokens holds, up to a global scale).
  void embedding(std::int64_t tok, float* out) const {
    const auto& g = tables().gauss;
    const std::uint64_t base = key(o.seed, kEmbed, static_cast<std::uint64_t>(tok));
    for (std::int64_t i = 0; i < h; ++i) out[i] = g[mix64(base + i) >> (64 - kTableBits)];
  }
  // Approximately unit-norm readout direction of a token; zero on outlier channels.
  void direction(std::int64_t tok, float* out) const {
    const auto& g = tables().gauss;
    const std::uint64_t base = key(o.seed, kUnembed, static_cast<std::uint64_t>(tok));
    const float scale = 1.f / std::sqrt(static_cast<float>(h - static_cast<std::int64_t>(outliers.size())));
    for (std::int64_t i = 0; i < h; ++i)
      out[i] = is_outlier[static_cast<std::size_t>(i)] ? 0.f : g[mix64(base + i) >> (64 - kTableBits)] * scale;
  }

  Record record(std::int64_t conv) const {
    const std::vector<std::int64_t> ids = tokens(conv);
    const auto t = static_cast<std::int64_t>(ids.size());
    const DType dt = o.dtype;
    const std::size_t item = dtype_size(dt);
    std::vector<std::uint8_t> hid(static_cast<std::size_t>(t * h) * item);
    std::vector<std::uint8_t> aux(static_cast<std::size_t>(t * h * k) * item);
    std::vector<float> emb(static_cast<std::size_t>(h)), dir(static_cast<std::size_t>(h)),
        sem(static_cast<std::size_t>(h)), ctx(static_cast<std::size_t>(h), 0.f),
        x(static_cast<std::size_t>(h)), out(static_cast<std::size_t>(h));
    const auto& g = tables().gauss;
    const auto& heavy = tables().heavy;
    const std::uint64_t noise = key(o.seed, kNoise, static_cast<std::uint64_t>(conv));
    const float to_rms = std::sqrt(static_cast<float>(h)) / static_cast<float>(kLogitScale);
    // Successor j gets logit L * p_j above the rest. Linear, not log(p_j): with V >> H the
    // readout directions cannot be orthogonal, and the crosstalk grows with the norm of the
    // mixture; log-probabilities would all be large (about log(V/J)) and bury the gap
    // between the first and second successor in that crosstalk. L = 1.6 log(V/J) keeps the
    // most likely successor the argmax with a probability near its true one.
    const double logit_scale = 1.6 * std::log(static_cast<double>(v) / kJump);
    for (std::int64_t p = 0; p < t; ++p) {
      const std::int64_t tok = ids[static_cast<std::size_t>(p)];
      embedding(tok, emb.data());
      // The successor mixture: softmax(lm_head h) puts most mass on the likely successors.
      std::fill(sem.begin(), sem.end(), 0.f);
      const Successors sc = successors(tok);
      for (std::size_t j = 0; j < sc.ids.size(); ++j) {
        direction(sc.ids[j], dir.data());
        const auto c = static_cast<float>(logit_scale * sc.probs[j]);
        for (std::int64_t i = 0; i < h; ++i) sem[static_cast<std::size_t>(i)] += c * dir[static_cast<std::size_t>(i)];
      }
      const std::uint64_t row = noise + static_cast<std::uint64_t>(p) * static_cast<std::uint64_t>(h * (k + 2));
      // A per-token temperature, as real hidden-state norms vary.
      const auto temp = static_cast<float>(std::exp(0.1 * g[mix64(row ^ 0x5bd1e995ull) >> (64 - kTableBits)]));
      std::uint8_t* hrow = hid.data() + static_cast<std::size_t>(p * h) * item;
      for (std::int64_t i = 0; i < h; ++i) {
        const auto si = static_cast<std::size_t>(i);
        sem[si] *= to_rms;  // unit RMS from here on
        float val;
        if (is_outlier[si]) {
          val = 0.f;
        } else {
          const float n = static_cast<float>(kHiddenNoise) * heavy[mix64(row + i) >> (64 - kTableBits)];
          val = gamma[si] * (temp * sem[si] + static_cast<float>(kTokenWeight) * emb[si] + n);
        }
        out[si] = val;
      }
      for (std::size_t j = 0; j < outliers.size(); ++j) {
        const float n = 0.05f * g[mix64(row + h + j) >> (64 - kTableBits)];
        out[static_cast<std::size_t>(outliers[j])] = outlier_value[j] * (1.f + n);
      }
      if (o.prenorm) {
        // Before the final norm: the norm weight divided out and a per-token scale (real
        // pre-norm states are large and vary in size); RMSNorm then removes the scale.
        // The massive-activation channels stay O(1) here: the RMS that the norm divides by
        // is then about that of the directions, and the normed states predict as sharply as
        // the post-norm ones (those channels barely move logits either way).
        const auto scale = static_cast<float>(8.0 * std::exp(0.5 * g[mix64(row ^ 0x27d4eb2full) >> (64 - kTableBits)]));
        for (std::int64_t i = 0; i < h; ++i) {
          const auto si = static_cast<std::size_t>(i);
          out[si] = is_outlier[si] ? scale * 0.05f * g[mix64(row + 7 * h + i) >> (64 - kTableBits)]
                                   : out[si] * scale / norm_weight[si];
        }
      }
      store_row(dt, out.data(), h, hrow);
      // Aux layers: deeper layers carry less of the current token and more of the
      // prediction; norms grow with depth; each is an orthogonal (permuted, signed) view.
      for (std::int64_t l = 0; l < k; ++l) {
        const float f = static_cast<float>(l + 1) / static_cast<float>(k + 1);
        const auto gain = static_cast<float>(std::pow(1.5, static_cast<double>(l)));
        for (std::int64_t i = 0; i < h; ++i) {
          const auto si = static_cast<std::size_t>(i);
          x[si] = (1.f - f) * emb[si] + f * sem[si] + 0.4f * ctx[si];
        }
        const auto& pm = perm[static_cast<std::size_t>(l)];
        const auto& sg = sign[static_cast<std::size_t>(l)];
        std::uint8_t* arow = aux.data() + static_cast<std::size_t>((p * k + l) * h) * item;
        const std::uint64_t lrow = row + static_cast<std::uint64_t>((l + 1) * h);
        for (std::int64_t i = 0; i < h; ++i) {
          const auto si = static_cast<std::size_t>(i);
          const std::int32_t dst = pm[si];
          float val;
          if (is_outlier[static_cast<std::size_t>(dst)]) continue;  // written below
          const float n = static_cast<float>(kAuxNoise) * heavy[mix64(lrow + i) >> (64 - kTableBits)];
          val = gain * (sg[si] * x[si] + n);
          out[static_cast<std::size_t>(dst)] = val;
        }
        for (std::size_t j = 0; j < outliers.size(); ++j) {
          const float n = 0.05f * g[mix64(lrow + h + j) >> (64 - kTableBits)];
          out[static_cast<std::size_t>(outliers[j])] = gain * outlier_value[j] * (1.f + n);
        }
        store_row(dt, out.data(), h, arow);
      }
      for (std::int64_t i = 0; i < h; ++i) {
        const auto si = static_cast<std::size_t>(i);
        ctx[si] = 0.8f * ctx[si] + 0.2f * emb[si];
      }
    }
    Record r;
    r.conversation_id = conversation_id(conv);
    std::vector<std::uint8_t> idb(ids.size() * 8);
    std::memcpy(idb.data(), ids.data(), idb.size());
    r.input_ids = HostTensor::from_bytes(DType::kInt64, {t}, std::move(idb));
    r.hidden_states = HostTensor::from_bytes(dt, {t, h}, std::move(hid));
    r.aux_hidden_states = HostTensor::from_bytes(dt, {t, k * h}, std::move(aux));
    // The generator knows the form it wrote, and says so as a producer should.
    r.hidden_states_prenorm = o.prenorm;
    return r;
  }

  std::string conversation_id(std::int64_t i) const {
    char buf[32];
    std::snprintf(buf, sizeof buf, "synth-%06lld", static_cast<long long>(i));
    return buf;
  }
};

SynthGenerator::SynthGenerator(const SynthOptions& options)
    : impl_(std::make_unique<Impl>(options)) {}
SynthGenerator::~SynthGenerator() = default;

const SynthOptions& SynthGenerator::options() const { return impl_->o; }
std::string SynthGenerator::conversation_id(std::int64_t i) const {
  return impl_->conversation_id(i);
}

std::string SynthGenerator::record_path(std::int64_t i) const {
  char shard[32];
  std::snprintf(shard, sizeof shard, "%03lld", static_cast<long long>(i / 100));
  std::string p = std::string("records/") + shard + "/";
  if (i % 5 == 4) p += "more/";
  return p + conversation_id(i) + extension(impl_->o.format);
}

std::vector<std::int64_t> SynthGenerator::tokens(std::int64_t i) const { return impl_->tokens(i); }
Record SynthGenerator::record(std::int64_t i) const { return impl_->record(i); }
SynthGenerator::Successors SynthGenerator::successors(std::int64_t token) const {
  return impl_->successors(token);
}

std::string SynthGenerator::conversation_json(std::int64_t i) const {
  const auto ids = tokens(i);
  const std::size_t split = std::max<std::size_t>(1, ids.size() / 3);
  auto text = [&](std::size_t b, std::size_t e) {
    std::string s;
    for (std::size_t j = b; j < e; ++j) {
      if (j > b) s += ' ';
      s += syllable_word(ids[j]);
    }
    return s;
  };
  nlohmann::ordered_json j;
  j["conversation_id"] = conversation_id(i);
  j["conversations"] = nlohmann::ordered_json::array(
      {{{"role", "user"}, {"content", text(0, split)}},
       {{"role", "assistant"}, {"content", text(split, ids.size())}}});
  return j.dump();
}

HostTensor SynthGenerator::embed_tokens() const {
  const auto& m = *impl_;
  HostTensor t = HostTensor::zeros(m.o.dtype, {m.v, m.h});
  std::vector<float> row(static_cast<std::size_t>(m.h));
  // Real embedding tables are small (std ~0.02); the draft normalizes its inputs anyway.
  for (std::int64_t tok = 0; tok < m.v; ++tok) {
    m.embedding(tok, row.data());
    for (auto& x : row) x *= 0.02f;
    store_row(m.o.dtype, row.data(), m.h, t.mutable_data() + static_cast<std::size_t>(tok * m.h) * t.itemsize());
  }
  return t;
}

HostTensor SynthGenerator::final_norm() const {
  const auto& m = *impl_;
  HostTensor t = HostTensor::zeros(m.o.dtype, {m.h});
  store_row(m.o.dtype, m.norm_weight.data(), m.h, t.mutable_data());
  return t;
}

HostTensor SynthGenerator::lm_head() const {
  const auto& m = *impl_;
  HostTensor t = HostTensor::zeros(m.o.dtype, {m.v, m.h});
  std::vector<float> row(static_cast<std::size_t>(m.h)), out(row.size());
  // logits = <W_v, h> = <direction_v, successor mixture> + small terms: the final-norm
  // weight gamma is divided out and the unit-RMS scaling undone.
  const float undo = static_cast<float>(kLogitScale) / std::sqrt(static_cast<float>(m.h));
  for (std::int64_t tok = 0; tok < m.v; ++tok) {
    m.direction(tok, row.data());
    for (std::int64_t i = 0; i < m.h; ++i) {
      const auto si = static_cast<std::size_t>(i);
      // Outlier channels get a tiny weight, as in real heads, so they barely move logits.
      const float w = m.is_outlier[si]
                          ? 1e-4f * tables().gauss[mix64(key(m.o.seed, kUnembed, tok) + i) >> (64 - kTableBits)]
                          : row[si] * undo / m.gamma[si];
      out[si] = w;
    }
    store_row(m.o.dtype, out.data(), m.h, t.mutable_data() + static_cast<std::size_t>(tok * m.h) * t.itemsize());
  }
  return t;
}

std::string SynthGenerator::base_config_json() const {
  const auto& m = *impl_;
  const std::int64_t h = m.h;
  std::int64_t head_dim = (h >= 1024 && h % 128 == 0) ? 128 : (h % 32 == 0 ? 32 : h);
  const std::int64_t heads = h / head_dim;
  const std::int64_t kv_heads = heads % 4 == 0 ? heads / 4 : heads;
  const std::int64_t inter = (h * 7 / 2 + 63) / 64 * 64;
  std::int64_t max_pos = 2048;
  while (max_pos < m.o.max_tokens) max_pos *= 2;
  nlohmann::ordered_json j;
  j["architectures"] = {"LlamaForCausalLM"};
  j["model_type"] = "llama";
  j["hidden_size"] = h;
  j["intermediate_size"] = inter;
  j["num_hidden_layers"] = 32;
  j["num_attention_heads"] = heads;
  j["num_key_value_heads"] = kv_heads;
  j["head_dim"] = head_dim;
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = 1e-5;
  j["rope_theta"] = 500000.0;
  j["max_position_embeddings"] = max_pos;
  j["vocab_size"] = m.v;
  j["tie_word_embeddings"] = false;
  j["torch_dtype"] = std::string(dtype_name(m.o.dtype));
  j["eaglekit_synth"] = {{"seed", m.o.seed}, {"aux_layers", m.o.aux_layers}};
  return j.dump(2) + "\n";
}

void write_synth_base_model(const SynthGenerator& gen, const std::string& base_dir) {
  std::error_code ec;
  fs::create_directories(base_dir, ec);
  if (ec) throw IoError::from_errno(base_dir, "cannot create folder", ec.value());
  write_safetensors((fs::path(base_dir) / "model.safetensors").string(),
                    {{"model.embed_tokens.weight", gen.embed_tokens()},
                     {"lm_head.weight", gen.lm_head()},
                     {"model.norm.weight", gen.final_norm()}});
  const std::string cfg = gen.base_config_json();
  write_file_atomic((fs::path(base_dir) / "config.json").string(), cfg.data(), cfg.size());
}

SynthResult synthesize(const SynthOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  SynthGenerator gen(options);
  const SynthOptions& o = gen.options();
  const fs::path out(o.out_dir);
  std::error_code ec;
  std::set<std::string> dirs = {out.string()};
  for (std::int64_t i = 0; i < o.conversations; ++i)
    dirs.insert((out / gen.record_path(i)).parent_path().string());
  for (const auto& d : dirs) {
    fs::create_directories(d, ec);
    if (ec) throw IoError::from_errno(d, "cannot create folder", ec.value());
  }

  std::atomic<std::int64_t> tokens{0}, bytes{0};
  Progress progress("synth", o.conversations, o.progress ? -1 : 0);
  tbb::task_arena arena(o.jobs > 0 ? o.jobs : tbb::task_arena::automatic);
  arena.execute([&] {
    tbb::parallel_for(tbb::blocked_range<std::int64_t>(0, o.conversations, 1),
                      [&](const tbb::blocked_range<std::int64_t>& range) {
                        for (std::int64_t i = range.begin(); i != range.end(); ++i) {
                          const Record r = gen.record(i);
                          const std::string path = (out / gen.record_path(i)).string();
                          WriterOptions wo;
                          wo.format = o.format;
                          auto w = create_writer(path, wo);
                          w->add(r);
                          w->finish();
                          std::error_code fec;
                          const auto size = static_cast<std::int64_t>(fs::file_size(path, fec));
                          tokens += r.tokens();
                          bytes += fec ? 0 : size;
                          progress.add(1, fec ? 0 : size);
                        }
                      });
  });
  progress.finish();

  SynthResult res;
  res.jsonl_path = (out / "conversations.jsonl").string();
  {
    AtomicFile f(res.jsonl_path);
    std::string buf;
    for (std::int64_t i = 0; i < o.conversations; ++i) {
      buf += gen.conversation_json(i);
      buf += '\n';
      if (buf.size() > (1u << 20)) {
        f.write(buf.data(), buf.size());
        buf.clear();
      }
    }
    f.write(buf.data(), buf.size());
    f.commit();
  }
  if (!o.base_out.empty()) {
    write_synth_base_model(gen, o.base_out);
    res.base_dir = o.base_out;
  }
  res.conversations = o.conversations;
  res.tokens = tokens.load();
  res.bytes = bytes.load();
  res.seconds = seconds_since(start);
  return res;
}

}  // namespace eaglekit
