// Finding NaN and Inf in records: what the loader checks in every record it reads and
// `validate --deep` in every record it lists, so that a damaged value is named where it lies
// instead of surfacing as a NaN loss steps later.
//
// Both functions read every value (AVX2 where the CPU has it: about 65 GB/s from the cache on
// one Zen 5 core; 64-bit words elsewhere: about 5 GB/s), throw nothing, and are safe to call
// from many threads at once.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "formats/host_tensor.h"
#include "formats/record.h"

namespace eaglekit {

// Row-major index of the first NaN or Inf of a floating tensor; nullopt when every value is
// finite or the dtype is not floating.
std::optional<std::int64_t> first_nonfinite(const HostTensor& t);

// Where the first NaN or Inf of hidden_states, then aux_hidden_states, then target_probs
// lies ("NaN in hidden_states at token 3, column 5"); nullopt when every value is finite.
std::optional<std::string> first_nonfinite(const Record& r);

// For a record of stored target distributions (Record::target_probs): the first row that is
// not a distribution (a NaN/Inf, a negative value, or a sum off 1 by more than the dtype's
// rounding allows: 2e-2 bf16, 5e-3 fp16, 1e-4 fp32), in words; nullopt when every row is
// one, or the record has none. validate --deep runs it; it reads every value once.
std::optional<std::string> first_bad_distribution(const Record& r);

}  // namespace eaglekit
