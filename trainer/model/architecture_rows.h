// The draft-architecture rows (trainer/model/architecture.h): the built-in ones (kBuiltIn in
// architecture_rows.cpp: EAGLE-3) and any registered from outside the tree, found by name or
// by the config.json they claim.
//
// Thread safety: register/unregister are for start-up and tests (not concurrent with
// lookups). Errors: UsageError for an unknown or taken name; UnsupportedError (naming the
// file and key) for a config.json no row computes.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "trainer/model/architecture.h"

namespace eaglekit::trainer {

// The row named `name`; UsageError listing the known names otherwise.
const DraftArchitecture& draft_architecture(std::string_view name);
// Every row, registered ones first, then the built-in ones.
std::vector<const DraftArchitecture*> draft_architectures();
// The row that claims a flat config.json `config` (an object), read from `where`.
const DraftArchitecture& architecture_of_config(const nlohmann::json& config, const std::string& where);
// Adds a row that lives outside this tree (a test, a plugin). `row` must outlive every use;
// UsageError when its name is taken.
void register_draft_architecture(const DraftArchitecture& row);
// Removes a registered row (tests); built-in rows stay.
void unregister_draft_architecture(std::string_view name);

}  // namespace eaglekit::trainer
