#include "trainer/model/rope.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "formats/error.h"

namespace eaglekit::trainer {

namespace {

constexpr double kPi = 3.14159265358979323846;

struct TypeName {
  RopeType type;
  const char* name;
};
constexpr TypeName kTypes[] = {{RopeType::kDefault, "default"}, {RopeType::kLinear, "linear"},
                               {RopeType::kDynamic, "dynamic"}, {RopeType::kLlama3, "llama3"},
                               {RopeType::kYarn, "yarn"},       {RopeType::kLongrope, "longrope"}};

// YaRN's magnitude correction for a context extended `scale` times.
double yarn_mscale(double scale, double mscale = 1.0) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

// The rotary dimension whose wavelength fits `rotations` times into `context` positions.
double yarn_correction_dim(double rotations, std::int64_t dim, double theta, double context) {
  return static_cast<double>(dim) * std::log(context / (rotations * 2 * kPi)) / (2 * std::log(theta));
}

void need(bool ok, const std::string& what) {
  if (!ok) throw UsageError("rope_scaling: " + what);
}

}  // namespace

std::optional<RopeType> parse_rope_type(const std::string& name) {
  for (const auto& t : kTypes)
    if (name == t.name) return t.type;
  return std::nullopt;
}

const char* rope_type_name(RopeType type) {
  for (const auto& t : kTypes)
    if (type == t.type) return t.name;
  return "?";
}

bool RopeScaling::operator==(const RopeScaling& o) const {
  if (type != o.type) return false;
  switch (type) {
    case RopeType::kDefault:
      return true;
    case RopeType::kLinear:
    case RopeType::kDynamic:
      return factor == o.factor;
    case RopeType::kLlama3:
      return factor == o.factor && low_freq_factor == o.low_freq_factor && high_freq_factor == o.high_freq_factor &&
             original_max_position_embeddings == o.original_max_position_embeddings;
    case RopeType::kYarn:
      return factor == o.factor && original_max_position_embeddings == o.original_max_position_embeddings &&
             beta_fast == o.beta_fast && beta_slow == o.beta_slow && truncate == o.truncate &&
             attention_factor == o.attention_factor && mscale == o.mscale && mscale_all_dim == o.mscale_all_dim;
    case RopeType::kLongrope:
      return original_max_position_embeddings == o.original_max_position_embeddings &&
             short_factor == o.short_factor && long_factor == o.long_factor &&
             attention_factor == o.attention_factor && short_mscale == o.short_mscale &&
             long_mscale == o.long_mscale;
  }
  return false;
}

RopeFrequencies rope_frequencies(double theta, const RopeScaling& r, std::int64_t head_dim,
                                 std::int64_t max_position_embeddings) {
  need(theta > 0, "rope_theta must be positive");
  need(head_dim > 0 && head_dim % 2 == 0 && head_dim <= (1 << 16),
       "head_dim must be even and at most 65536, got " + std::to_string(head_dim));
  const std::int64_t half = head_dim / 2;
  const double dim = static_cast<double>(head_dim);
  RopeFrequencies out;
  out.inv_freq.resize(static_cast<std::size_t>(half));
  for (std::int64_t i = 0; i < half; ++i)
    out.inv_freq[static_cast<std::size_t>(i)] = 1.0 / std::pow(theta, static_cast<double>(2 * i) / dim);
  switch (r.type) {
    case RopeType::kDefault:
      break;
    case RopeType::kDynamic:
      // Dynamic NTK changes nothing up to max_position_embeddings in transformers, and vLLM
      // and SGLang keep the base everywhere (docs/rope.md).
      need(r.factor >= 1, "dynamic needs factor >= 1");
      break;
    case RopeType::kLinear:
      need(r.factor > 0, "linear needs factor > 0");
      for (double& f : out.inv_freq) f /= r.factor;
      break;
    case RopeType::kLlama3: {
      need(r.factor > 0 && r.low_freq_factor > 0 && r.high_freq_factor >= r.low_freq_factor &&
               r.original_max_position_embeddings > 0,
           "llama3 needs factor > 0, 0 < low_freq_factor <= high_freq_factor and original_max_position_embeddings > 0");
      // Keep high frequencies, divide low ones by `factor`, blend in between.
      const double old_len = static_cast<double>(r.original_max_position_embeddings);
      const double low_wavelen = old_len / r.low_freq_factor, high_wavelen = old_len / r.high_freq_factor;
      for (double& f : out.inv_freq) {
        const double wavelen = 2 * kPi / f;
        if (wavelen < high_wavelen) continue;
        // Equal factors (Llama 4) leave no band to blend.
        if (wavelen > low_wavelen || r.high_freq_factor == r.low_freq_factor) {
          f /= r.factor;
          continue;
        }
        const double smooth = (old_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
        f = (1 - smooth) * f / r.factor + smooth * f;
      }
      break;
    }
    case RopeType::kYarn: {
      need(r.factor > 0, "yarn needs factor > 0");
      need(r.original_max_position_embeddings > 0, "yarn needs original_max_position_embeddings > 0");
      need(r.beta_fast > 0 && r.beta_slow > 0, "yarn needs beta_fast and beta_slow > 0");
      if (r.attention_factor) {
        out.attention_factor = *r.attention_factor;
      } else if (r.mscale.value_or(0) != 0 && r.mscale_all_dim.value_or(0) != 0) {
        out.attention_factor = yarn_mscale(r.factor, *r.mscale) / yarn_mscale(r.factor, *r.mscale_all_dim);
      } else {
        out.attention_factor = yarn_mscale(r.factor);
      }
      const double context = static_cast<double>(r.original_max_position_embeddings);
      double low = yarn_correction_dim(r.beta_fast, head_dim, theta, context);
      double high = yarn_correction_dim(r.beta_slow, head_dim, theta, context);
      if (r.truncate) {
        low = std::floor(low);
        high = std::ceil(high);
      }
      low = std::max(low, 0.0);
      high = std::min(high, dim - 1);
      if (low == high) high += 0.001;  // as transformers: no division by zero
      for (std::int64_t i = 0; i < half; ++i) {
        double& f = out.inv_freq[static_cast<std::size_t>(i)];
        // 1 keeps the original frequency (fast dimensions), 0 interpolates it (slow ones).
        const double keep = 1 - std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
        f = f / r.factor * (1 - keep) + f * keep;
      }
      break;
    }
    case RopeType::kLongrope: {
      need(r.original_max_position_embeddings > 0, "longrope needs original_max_position_embeddings > 0");
      need(static_cast<std::int64_t>(r.short_factor.size()) == half &&
               static_cast<std::int64_t>(r.long_factor.size()) == half,
           "longrope needs short_factor and long_factor of head_dim / 2 = " + std::to_string(half) +
               " values, got " + std::to_string(r.short_factor.size()) + " and " +
               std::to_string(r.long_factor.size()));
      // vLLM uses the long factors whenever it serves contexts beyond the original one, and
      // it serves max_position_embeddings unless told otherwise.
      out.long_factors = max_position_embeddings > r.original_max_position_embeddings;
      const std::vector<double>& ext = out.long_factors ? r.long_factor : r.short_factor;
      for (std::int64_t i = 0; i < half; ++i) {
        need(ext[static_cast<std::size_t>(i)] > 0, "longrope factors must be positive");
        out.inv_freq[static_cast<std::size_t>(i)] /= ext[static_cast<std::size_t>(i)];
      }
      const double scale = static_cast<double>(max_position_embeddings) /
                           static_cast<double>(r.original_max_position_embeddings);
      const double derived =
          scale <= 1 ? 1.0 : std::sqrt(1 + std::log(scale) / std::log(static_cast<double>(r.original_max_position_embeddings)));
      const std::optional<double>& own = out.long_factors ? r.long_mscale : r.short_mscale;
      out.attention_factor = r.attention_factor ? *r.attention_factor : own ? *own : derived;
      break;
    }
  }
  return out;
}

nlohmann::ordered_json rope_scaling_json(const RopeScaling& r) {
  using oj = nlohmann::ordered_json;
  oj j;
  j["rope_type"] = rope_type_name(r.type);
  switch (r.type) {
    case RopeType::kDefault:
      return nullptr;
    case RopeType::kLinear:
    case RopeType::kDynamic:
      j["factor"] = r.factor;
      break;
    case RopeType::kLlama3:
      j["factor"] = r.factor;
      j["low_freq_factor"] = r.low_freq_factor;
      j["high_freq_factor"] = r.high_freq_factor;
      j["original_max_position_embeddings"] = r.original_max_position_embeddings;
      break;
    case RopeType::kYarn:
      j["factor"] = r.factor;
      j["original_max_position_embeddings"] = r.original_max_position_embeddings;
      j["beta_fast"] = r.beta_fast;
      j["beta_slow"] = r.beta_slow;
      j["truncate"] = r.truncate;
      if (r.attention_factor) j["attention_factor"] = *r.attention_factor;
      if (r.mscale) j["mscale"] = *r.mscale;
      if (r.mscale_all_dim) j["mscale_all_dim"] = *r.mscale_all_dim;
      break;
    case RopeType::kLongrope:
      j["short_factor"] = r.short_factor;
      j["long_factor"] = r.long_factor;
      j["original_max_position_embeddings"] = r.original_max_position_embeddings;
      if (r.attention_factor) j["attention_factor"] = *r.attention_factor;
      if (r.short_mscale) j["short_mscale"] = *r.short_mscale;
      if (r.long_mscale) j["long_mscale"] = *r.long_mscale;
      break;
  }
  return j;
}

}  // namespace eaglekit::trainer
