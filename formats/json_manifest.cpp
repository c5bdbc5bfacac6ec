#include "formats/json_manifest.h"

#include <nlohmann/json.hpp>

#include "formats/error.h"

namespace eaglekit {

using Json = nlohmann::json;

std::optional<std::uint64_t> json_key_offset(std::string_view text, const std::string& key) {
  const auto at = text.find("\"" + key + "\"");
  if (at == std::string_view::npos) return std::nullopt;
  return at;
}

JsonManifest::JsonManifest(std::string path, std::string_view text, std::string missing_hint)
    : path_(std::move(path)), text_(text), missing_hint_(std::move(missing_hint)) {
  json_ = std::make_unique<Json>(Json::parse(text.begin(), text.end(), nullptr, false));
  if (json_->is_discarded() || !json_->is_object()) throw FormatError(path_, 0, "manifest", "is not a JSON object");
}

JsonManifest::~JsonManifest() = default;

const Json& JsonManifest::need(const std::string& key) const {
  const auto it = json_->find(key);
  if (it == json_->end()) throw FormatError(path_, std::nullopt, key, "missing (" + missing_hint_ + ")");
  return *it;
}

std::int64_t JsonManifest::integer(const std::string& key, std::int64_t lo, std::int64_t hi) const {
  const Json& v = need(key);
  if (!v.is_number_integer() || v.get<std::int64_t>() < lo || v.get<std::int64_t>() > hi)
    throw FormatError(path_, where(key), key,
                      "is " + v.dump() + "; expected an integer in [" + std::to_string(lo) + ", " +
                          std::to_string(hi) + "]");
  return v.get<std::int64_t>();
}

std::vector<std::int64_t> JsonManifest::int_list(const std::string& key, std::int64_t lo, std::int64_t hi) const {
  const Json& v = need(key);
  if (!v.is_array()) throw FormatError(path_, where(key), key, "is " + v.dump() + "; expected a list");
  std::vector<std::int64_t> out;
  for (const Json& e : v) {
    if (!e.is_number_integer() || e.get<std::int64_t>() < lo || e.get<std::int64_t>() > hi)
      throw FormatError(path_, where(key), key,
                        "holds " + e.dump() + "; expected integers in [" + std::to_string(lo) + ", " +
                            std::to_string(hi) + "]");
    out.push_back(e.get<std::int64_t>());
  }
  return out;
}

}  // namespace eaglekit
