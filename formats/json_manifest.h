// A producer's JSON manifest (DeepSpec's target cache, NeMo AutoModel's cache), read field by
// field: every refusal is a FormatError naming the manifest, the byte offset of the key in its
// text and the field, as the readers' other errors do.
//
// Thread safety: immutable after construction. The text passed in must outlive the object
// (offsets are found in it on demand).
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace eaglekit {

// Where `"key"` first appears in `text` (a manifest, a safetensors header): the offset an
// error names; nullopt when it does not.
std::optional<std::uint64_t> json_key_offset(std::string_view text, const std::string& key);

class JsonManifest {
 public:
  // Throws FormatError (offset 0, field "manifest") unless `text` is a JSON object.
  // `missing_hint` completes "missing (...)" for a key the producer always writes.
  JsonManifest(std::string path, std::string_view text, std::string missing_hint);
  ~JsonManifest();
  JsonManifest(const JsonManifest&) = delete;
  JsonManifest& operator=(const JsonManifest&) = delete;

  const nlohmann::json& json() const { return *json_; }
  std::optional<std::uint64_t> where(const std::string& key) const { return json_key_offset(text_, key); }
  // The key's value; FormatError when it is missing.
  const nlohmann::json& need(const std::string& key) const;
  // An integer in [lo, hi], or FormatError saying what it is instead.
  std::int64_t integer(const std::string& key, std::int64_t lo, std::int64_t hi) const;
  // A list of integers each in [lo, hi], or FormatError.
  std::vector<std::int64_t> int_list(const std::string& key, std::int64_t lo, std::int64_t hi) const;

 private:
  std::string path_;
  std::string_view text_;
  std::string missing_hint_;
  std::unique_ptr<nlohmann::json> json_;
};

}  // namespace eaglekit
