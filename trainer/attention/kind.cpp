#include "trainer/attention/kind.h"

#include <string>

#include "formats/error.h"
#include "trainer/attention/ttt_fused.h"

namespace eaglekit::trainer {

void check_ttt_attention(TttAttention a, std::string_view flag) {
  std::string why;
  if (a == TttAttention::kFused && !ttt_fused_available(&why))
    throw UsageError(std::string(flag) + " fused is not available: " + why);
}

}  // namespace eaglekit::trainer
