#include <doctest/doctest.h>

#include "formats/byte_source.h"
#include "formats/error.h"
#include "formats/host_tensor.h"
#include "formats/atomic_file.h"
#include "tests/support.h"

#include <cmath>
#include <cstring>
#include <filesystem>

using namespace eaglekit;

TEST_CASE("host_tensor: strided copy follows strides (column-major 2x3)") {
  // storage 0..5 viewed as 2x3 with strides (1, 2): logical [[0,2,4],[1,3,5]]
  std::vector<std::uint8_t> bytes(6 * 4);
  for (int i = 0; i < 6; ++i) {
    float f = static_cast<float>(i);
    std::memcpy(bytes.data() + 4 * i, &f, 4);
  }
  HostTensor base = HostTensor::from_bytes(DType::kFloat32, {6}, bytes);
  HostTensor t = base;
  t.shape = {2, 3};
  t.strides = {1, 2};
  CHECK_FALSE(t.is_contiguous());
  const HostTensor c = t.contiguous();
  CHECK(c.is_contiguous());
  const double expect[] = {0, 2, 4, 1, 3, 5};
  for (int i = 0; i < 6; ++i) CHECK(c.get(i) == expect[i]);
  CHECK(t.rows(1).contiguous().get(2) == 4);
  CHECK(t.slice_rows(1, 2).get(0) == 1);
}

TEST_CASE("dtype: bf16 and fp16 conversions round to nearest even") {
  CHECK(bf16_to_float(float_to_bf16(1.5f)) == 1.5f);
  CHECK(float_to_bf16(1.0f + 1.0f / 256.0f) == float_to_bf16(1.0f));  // tie -> even
  CHECK(fp16_to_float(float_to_fp16(1.2f)) == doctest::Approx(1.2001953f));
  CHECK(fp16_to_float(float_to_fp16(-7.8f)) == doctest::Approx(-7.8007812f));
  CHECK(fp16_to_float(float_to_fp16(65504.f)) == 65504.f);
  CHECK(std::isinf(fp16_to_float(float_to_fp16(1e6f))));
  CHECK(fp16_to_float(float_to_fp16(1e-7f)) == doctest::Approx(1.1920929e-07f).scale(0));
}

TEST_CASE("byte_source: checked access names file, field and offset") {
  test::TempDir d;
  test::write_bytes(d / "f.bin", {1, 2, 3, 4});
  auto src = ByteSource::open_file(d / "f.bin");
  CHECK(src->size() == 4);
  CHECK(src->at(1, 3, "x")[0] == 2);
  try {
    src->at(2, 8, "zip header");
    FAIL("expected FormatError");
  } catch (const FormatError& e) {
    CHECK(std::string(e.what()) == d / "f.bin" + ": zip header at byte 2: needs 8 bytes but the file has 4 (truncated or corrupt)");
  }
  CHECK_THROWS_AS(ByteSource::open_file(d / "missing"), IoError);
  test::write_bytes(d / "empty", {});
  CHECK(ByteSource::open_file(d / "empty")->size() == 0);
}

TEST_CASE("atomic_file: nothing appears until commit; abandoned temp is removed") {
  test::TempDir d;
  {
    AtomicFile f(d / "out.bin");
    f.write("abc", 3);
    CHECK_FALSE(std::filesystem::exists(d / "out.bin"));
    CHECK(std::filesystem::exists(f.temp_path()));
  }
  CHECK_FALSE(std::filesystem::exists(d / "out.bin"));
  CHECK(std::distance(std::filesystem::directory_iterator(d.path()), {}) == 0);
  AtomicFile g(d / "out.bin");
  g.write("abcd", 4);
  g.pwrite("X", 1, 0);
  g.commit();
  CHECK(test::read_bytes(d / "out.bin") == std::vector<std::uint8_t>{'X', 'b', 'c', 'd'});
}
