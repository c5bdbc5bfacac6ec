#include "trainer/model/architecture_rows.h"

#include <nlohmann/json.hpp>

#include "formats/error.h"
#include "trainer/model/dflash.h"
#include "trainer/model/eagle3.h"

namespace eaglekit::trainer {

namespace {

// The built-in rows: one per architecture in this tree.
const Eagle3Architecture kEagle3;
const Eagle31Architecture kEagle31;
const DFlashArchitecture kDFlash;
// Asked in this order: EAGLE-3 claims every config without another row's keys.
const DraftArchitecture* const kBuiltIn[] = {&kDFlash, &kEagle31, &kEagle3};

std::vector<const DraftArchitecture*>& registered() {
  static std::vector<const DraftArchitecture*> rows;
  return rows;
}

std::string known_names() {
  std::string out;
  for (const DraftArchitecture* row : draft_architectures()) out += (out.empty() ? "" : ", ") + std::string(row->name());
  return out;
}

}  // namespace

std::vector<const DraftArchitecture*> draft_architectures() {
  std::vector<const DraftArchitecture*> rows = registered();
  rows.insert(rows.end(), std::begin(kBuiltIn), std::end(kBuiltIn));
  return rows;
}

const DraftArchitecture& draft_architecture(std::string_view name) {
  for (const DraftArchitecture* row : draft_architectures())
    if (row->name() == name) return *row;
  throw UsageError("unknown draft architecture '" + std::string(name) + "' (known: " + known_names() + ")");
}

const DraftArchitecture& architecture_of_config(const nlohmann::json& config, const std::string& where) {
  const std::vector<const DraftArchitecture*> rows = draft_architectures();
  for (const DraftArchitecture* row : rows)
    if (row->claims(config)) return *row;
  for (const DraftArchitecture* row : rows) row->explain_unclaimed(config, where);
  throw UnsupportedError(where, std::nullopt, "config",
                         "describes no draft architecture eaglekit computes (known: " + known_names() + ")");
}

void register_draft_architecture(const DraftArchitecture& row) {
  for (const DraftArchitecture* r : draft_architectures())
    if (r->name() == row.name())
      throw UsageError("a draft architecture named '" + std::string(row.name()) + "' exists already");
  registered().push_back(&row);
}

void unregister_draft_architecture(std::string_view name) {
  auto& rows = registered();
  for (auto it = rows.begin(); it != rows.end(); ++it)
    if ((*it)->name() == name) {
      rows.erase(it);
      return;
    }
}

}  // namespace eaglekit::trainer
