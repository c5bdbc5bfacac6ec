#include "trainer/model/draft_net.h"

#include <ATen/ATen.h>

namespace eaglekit::trainer {

at::Tensor TttNet::logits(const at::Tensor& layer_out) const { return at::linear(final_norm(layer_out), lm_head_weight()); }

}  // namespace eaglekit::trainer
