// The fuzz build compiles trainer/model's LibTorch-free half: the config readers and the
// draft-architecture rows (architecture_rows.cpp, eagle3.cpp), whose answers the harnesses
// exercise. The rows' networks are LibTorch (eagle3_net.cpp) and no harness builds one; this
// definition of EAGLE-3's make_net stands in for that file in the fuzz link and refuses.
#include "formats/error.h"
#include "trainer/model/eagle3.h"

namespace eaglekit::trainer {

std::shared_ptr<DraftNet> Eagle3Architecture::make_net(const DraftConfig&) const {
  throw UsageError("the fuzz build has no LibTorch: it builds no draft network");
}

}  // namespace eaglekit::trainer
