#include "formats/bytes.h"

#include <string>

#include "formats/error.h"

namespace eaglekit {

ByteCursor::ByteCursor(const ByteSource& src, std::uint64_t begin, std::uint64_t end,
                       std::string_view region)
    : src_(src), pos_(begin), end_(end), region_(region) {
  if (begin > end || end > src.size())
    throw FormatError(src.name(), begin, std::string(region),
                      "span of bytes [" + std::to_string(begin) + ", " + std::to_string(end) +
                          ") lies outside the source's " + std::to_string(src.size()) + " bytes");
}

void ByteCursor::overrun(std::uint64_t n, std::string_view field) const {
  const std::string region(region_);
  throw FormatError(src_.name(), pos_, std::string(field),
                    "needs " + std::to_string(n) + " bytes but the " + region + " has " +
                        std::to_string(end_ - pos_) + " left (" + region + " corrupt)");
}

}  // namespace eaglekit
