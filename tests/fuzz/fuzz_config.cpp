// libFuzzer harness: the base and draft config.json parsers with their RoPE
// (trainer/model/config.h, trainer/model/rope.h): parse as a base, derive the draft, compute its RoPE,
// write its config.json and parse that back; the input also goes through the draft parser.
#include <cstddef>
#include <cstdint>
#include <string>

#include "formats/error.h"
#include "tests/fuzz/fuzz_common.h"
#include "trainer/model/config.h"
#include "trainer/model/rope.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::uint64_t acc = 0;
  try {
    const eaglekit::trainer::BaseConfig b = eaglekit::trainer::parse_base_config(text, "fuzz/config.json");
    acc += b.defaults_applied.size();
    const eaglekit::trainer::DraftConfig d = eaglekit::trainer::draft_config_from_base(b, {});
    const auto f = eaglekit::trainer::rope_frequencies(d.rope_theta, d.rope_scaling, d.head_dim,
                                                       d.max_position_embeddings);
    acc += f.inv_freq.size();
    const auto back = eaglekit::trainer::parse_draft_config(eaglekit::trainer::draft_config_json(d), "fuzz/export");
    if (!(back.rope_scaling == d.rope_scaling)) __builtin_trap();  // the export must read back as written
  } catch (const eaglekit::Error&) {
  }
  try {
    acc += static_cast<std::uint64_t>(eaglekit::trainer::parse_draft_config(text, "fuzz/draft.json").head_dim);
  } catch (const eaglekit::Error&) {
  }
  eaglekit::fuzz::g_sink = acc;
  return 0;
}
