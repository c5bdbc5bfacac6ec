#include "formats/registry.h"
#include "formats/eks_format.h"
#include "formats/hdf5_format.h"
#include "formats/pt_format.h"
#include "formats/pt_gzip_format.h"
#include "formats/safetensors_format.h"

namespace eaglekit {

const std::vector<FormatEntry>& format_registry() {
  static const std::vector<FormatEntry> kEntries = {
      {Format::kPt, open_pt_reader, create_pt_writer},
      {Format::kSafetensors, open_safetensors_reader, create_safetensors_writer},
      {Format::kEks, open_eks_reader, create_eks_writer},
      {Format::kHdf5, open_hdf5_reader, create_hdf5_writer},
      {Format::kPtGzip, open_pt_gzip_reader, create_pt_gzip_writer},
  };
  return kEntries;
}

}  // namespace eaglekit
