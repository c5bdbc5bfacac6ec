// formats/finite.h: NaN and Inf found at their exact index in every float dtype, whatever
// their lane in the vectors and 64-bit words the scan reads, and the largest finite values never taken
// for them.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "formats/finite.h"
#include "formats/host_tensor.h"
#include "formats/record.h"

using namespace eaglekit;

namespace {

// A [rows, cols] tensor of `fill` with `bad` at element `at` (bit patterns of the dtype).
template <typename U>
HostTensor tensor_of(DType dtype, std::int64_t rows, std::int64_t cols, U fill, U bad, std::int64_t at) {
  HostTensor t = HostTensor::zeros(dtype, {rows, cols});
  for (std::int64_t i = 0; i < rows * cols; ++i) {
    const U v = i == at ? bad : fill;
    std::memcpy(t.mutable_data() + sizeof(U) * static_cast<std::size_t>(i), &v, sizeof(U));
  }
  return t;
}

}  // namespace

TEST_CASE("finite: NaN and Inf are found at their index in every lane; the largest finite values are not") {
  // 4097 elements: a full chunk of 4096 plus one, and an odd tail after the 64-bit words.
  const std::int64_t rows = 17, cols = 241, n = rows * cols;
  for (const std::int64_t at : {std::int64_t{0}, std::int64_t{1}, std::int64_t{2}, std::int64_t{3}, std::int64_t{4},
                                std::int64_t{4095}, std::int64_t{4096}, n - 1}) {
    CAPTURE(at);
    // bfloat16: max finite 0x7f7f, NaN 0x7fc0, -Inf 0xff80.
    CHECK(first_nonfinite(tensor_of<std::uint16_t>(DType::kBFloat16, rows, cols, 0x7f7f, 0x7fc0, at)) == at);
    CHECK(first_nonfinite(tensor_of<std::uint16_t>(DType::kBFloat16, rows, cols, 0xff7f, 0xff80, at)) == at);
    // float16: max finite 0x7bff, Inf 0x7c00, NaN 0xfe00.
    CHECK(first_nonfinite(tensor_of<std::uint16_t>(DType::kFloat16, rows, cols, 0x7bff, 0x7c00, at)) == at);
    CHECK(first_nonfinite(tensor_of<std::uint16_t>(DType::kFloat16, rows, cols, 0xfbff, 0xfe00, at)) == at);
    // float32: max finite 0x7f7fffff, NaN 0x7fc00000, -Inf 0xff800000.
    CHECK(first_nonfinite(tensor_of<std::uint32_t>(DType::kFloat32, rows, cols, 0x7f7fffffu, 0x7fc00000u, at)) == at);
    CHECK(first_nonfinite(tensor_of<std::uint32_t>(DType::kFloat32, rows, cols, 0xff7fffffu, 0xff800000u, at)) == at);
    CHECK(first_nonfinite(tensor_of<std::uint64_t>(DType::kFloat64, rows, cols, 0x7fefffffffffffffull,
                                                   0x7ff8000000000000ull, at)) == at);
  }
  // 5 x 201 = 1005 elements: the vector steps (128 bytes) end before the last 45 elements
  // (bf16; 13 for float32), which the 64-bit words and then single elements cover.
  for (const std::int64_t at : {std::int64_t{959}, std::int64_t{960}, std::int64_t{991}, std::int64_t{1003},
                                std::int64_t{1004}}) {
    CAPTURE(at);
    CHECK(first_nonfinite(tensor_of<std::uint16_t>(DType::kBFloat16, 5, 201, 0x7f7f, 0x7fc0, at)) == at);
    CHECK(first_nonfinite(tensor_of<std::uint32_t>(DType::kFloat32, 5, 201, 0x7f7fffffu, 0xff800000u, at)) == at);
    CHECK(first_nonfinite(tensor_of<std::uint64_t>(DType::kFloat64, 5, 201, 0x7fefffffffffffffull,
                                                   0x7ff0000000000000ull, at)) == at);
  }
  // All finite, including the largest values and a pattern one bit short of all ones.
  CHECK_FALSE(first_nonfinite(tensor_of<std::uint16_t>(DType::kBFloat16, rows, cols, 0x7f7f, 0x7f00, 5)));
  CHECK_FALSE(first_nonfinite(tensor_of<std::uint16_t>(DType::kFloat16, rows, cols, 0x7bff, 0x7800, 5)));
  CHECK_FALSE(first_nonfinite(tensor_of<std::uint32_t>(DType::kFloat32, rows, cols, 0x7f7fffffu, 0xff7fffffu, 5)));
  // Two bad elements: the first is named.
  HostTensor t = tensor_of<std::uint16_t>(DType::kBFloat16, rows, cols, 0x3f80, 0x7f80, 3000);
  const std::uint16_t nan = 0x7fc0;
  std::memcpy(t.mutable_data() + 2 * 7, &nan, 2);
  CHECK(first_nonfinite(t) == 7);
  // The record form names the tensor, token and column.
  Record r;
  r.input_ids = HostTensor::zeros(DType::kInt64, {rows});
  r.hidden_states = tensor_of<std::uint16_t>(DType::kBFloat16, rows, 4, 0x3f80, 0x3f80, 0);
  r.aux_hidden_states = tensor_of<std::uint16_t>(DType::kBFloat16, rows, 12, 0x3f80, 0xff80, 2 * 12 + 5);
  CHECK(first_nonfinite(r) == std::optional<std::string>("Inf in aux_hidden_states at token 2, column 5"));
}
