// The fuzz build compiles trainer/model's LibTorch-free half: the config readers and the
// draft-architecture rows (architecture_rows.cpp, eagle3.cpp, dflash.cpp), whose answers the
// harnesses exercise. The rows' networks are LibTorch (eagle3_net.cpp, dflash_net.cpp) and no
// harness builds one; these definitions of make_net stand in for those files in the fuzz
// link and refuse.
#include "formats/error.h"
#include "trainer/model/dflash.h"
#include "trainer/model/eagle3.h"

namespace eaglekit::trainer {

std::shared_ptr<DraftNet> Eagle3Architecture::make_net(const DraftConfig&) const {
  throw UsageError("the fuzz build has no LibTorch: it builds no draft network");
}

std::shared_ptr<DraftNet> DFlashArchitecture::make_net(const DraftConfig&) const {
  throw UsageError("the fuzz build has no LibTorch: it builds no draft network");
}

}  // namespace eaglekit::trainer
