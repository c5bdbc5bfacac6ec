// One decision of a `train --dry-run --json` plan, by name (null when the plan has none).
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace eaglekit::test {

inline nlohmann::json plan_decision(const nlohmann::json& plan, const std::string& name) {
  for (const auto& d : plan["decisions"])
    if (d["name"] == name) return d;
  return nullptr;
}

}  // namespace eaglekit::test
