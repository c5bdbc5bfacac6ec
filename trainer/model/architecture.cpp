#include "trainer/model/architecture.h"

#include <nlohmann/json.hpp>

namespace eaglekit::trainer {

std::int64_t ParameterShape::numel() const {
  std::int64_t n = 1;
  for (const std::int64_t d : shape) n *= d;
  return n;
}

void DraftArchitecture::explain_unclaimed(const nlohmann::json&, const std::string&) const {}
std::optional<std::string> DraftArchitecture::unservable(const DraftConfig&) const { return std::nullopt; }
std::vector<std::string> DraftArchitecture::serving_warnings(const DraftConfig&) const { return {}; }

}  // namespace eaglekit::trainer
