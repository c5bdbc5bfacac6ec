// libFuzzer harness: the safe unpickler (formats/pickle.h) over the raw input, then a walk
// of the value tree bounded like a real consumer's (kMaxPickleDepth).
#include <cstddef>
#include <cstdint>

#include "formats/error.h"
#include "formats/pickle.h"
#include "tests/fuzz/fuzz_common.h"

namespace {

std::uint64_t walk(const eaglekit::pickle::Value& v, int depth, std::uint64_t& budget) {
  using eaglekit::pickle::Kind;
  if (depth > eaglekit::pickle::kMaxPickleDepth || budget == 0) return 0;
  --budget;
  std::uint64_t acc = static_cast<std::uint64_t>(v.kind) + v.s.size() + v.shape.size();
  acc += eaglekit::pickle::kind_name(v.kind).size();
  for (const auto* item : v.items) acc += walk(*item, depth + 1, budget);
  for (const auto& [k, val] : v.dict) {
    acc += walk(*k, depth + 1, budget);
    acc += walk(*val, depth + 1, budget);
  }
  if (v.kind == Kind::kTensor && v.storage != nullptr) acc += walk(*v.storage, depth + 1, budget);
  if (v.kind == Kind::kDict) acc += v.get("input_ids") != nullptr;
  return acc;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const auto p = eaglekit::pickle::unpickle(data, size, "fuzz.pt", "data.pkl");
    std::uint64_t budget = 1 << 16;
    eaglekit::fuzz::g_sink = walk(p.root(), 0, budget) + p.value_count();
  } catch (const eaglekit::Error&) {
  }
  return 0;
}
