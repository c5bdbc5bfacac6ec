// libFuzzer harness: the base and draft config.json parsers with their RoPE
// (trainer/model/config.h, trainer/model/rope.h): parse as a base, derive the draft, compute its RoPE,
// write its config.json and parse that back; the input also goes through the draft parser.
//
// The round trip is outside the try that takes the parsers' refusals of the fuzzer's input: a
// draft we derived and wrote is our own output, so the parser refusing it, or reading back any
// field other than we wrote, is a crash naming the field (not a refusal to shrug off).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

#include "formats/error.h"
#include "tests/fuzz/fuzz_common.h"
#include "trainer/model/config.h"
#include "trainer/model/rope.h"

namespace {

using eaglekit::trainer::DraftConfig;

[[noreturn]] void fail(const char* what, const std::string& written) {
  std::fprintf(stderr, "fuzz_config: the draft config we wrote does not read back: %s\n%s\n", what,
               written.c_str());
  __builtin_trap();
}

// Every field of DraftConfig (trainer/model/draft_config.h), each by name; the texts the
// writer makes of the two also agree, which catches a field added later and not listed here.
void check_same(const DraftConfig& d, const DraftConfig& back, const std::string& written) {
#define EAGLEKIT_SAME(field) \
  if (!(back.field == d.field)) fail(#field " differs", written)
  EAGLEKIT_SAME(architecture);
  EAGLEKIT_SAME(hidden_size);
  EAGLEKIT_SAME(intermediate_size);
  EAGLEKIT_SAME(num_attention_heads);
  EAGLEKIT_SAME(num_key_value_heads);
  EAGLEKIT_SAME(head_dim);
  EAGLEKIT_SAME(rms_norm_eps);
  EAGLEKIT_SAME(rope_theta);
  EAGLEKIT_SAME(rope_scaling);
  EAGLEKIT_SAME(vocab_size);
  EAGLEKIT_SAME(draft_vocab_size);
  EAGLEKIT_SAME(target_hidden_size);
  EAGLEKIT_SAME(num_aux_layers);
  EAGLEKIT_SAME(max_position_embeddings);
  EAGLEKIT_SAME(num_hidden_layers);
  EAGLEKIT_SAME(aux_layer_ids);
  EAGLEKIT_SAME(modelopt_norm);
  EAGLEKIT_SAME(fc_norm);
  EAGLEKIT_SAME(norm_before_fc);
  EAGLEKIT_SAME(norm_output);
  EAGLEKIT_SAME(norm_before_residual);
  EAGLEKIT_SAME(block_size);
  EAGLEKIT_SAME(mask_token_id);
  EAGLEKIT_SAME(torch_dtype);
#undef EAGLEKIT_SAME
  if (eaglekit::trainer::draft_config_json(back) != written) fail("written again, the text differs", written);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::uint64_t acc = 0;
  std::optional<DraftConfig> derived;
  std::string written;
  try {
    const eaglekit::trainer::BaseConfig b = eaglekit::trainer::parse_base_config(text, "fuzz/config.json");
    acc += b.defaults_applied.size();
    DraftConfig d = eaglekit::trainer::draft_config_from_base(b, {});
    const auto f = eaglekit::trainer::rope_frequencies(d.rope_theta, d.rope_scaling, d.head_dim,
                                                       d.max_position_embeddings);
    acc += f.inv_freq.size();
    // The writer may refuse a draft it cannot describe (UsageError: unknown aux ids).
    written = eaglekit::trainer::draft_config_json(d);
    derived = std::move(d);
  } catch (const eaglekit::Error&) {
  }
  if (derived) {
    std::optional<DraftConfig> back;
    try {
      back = eaglekit::trainer::parse_draft_config(written, "fuzz/export");
    } catch (const eaglekit::Error& e) {
      fail(e.what(), written);
    }
    check_same(*derived, *back, written);
  }
  try {
    acc += static_cast<std::uint64_t>(eaglekit::trainer::parse_draft_config(text, "fuzz/draft.json").head_dim);
  } catch (const eaglekit::Error&) {
  }
  eaglekit::fuzz::g_sink = acc;
  return 0;
}
