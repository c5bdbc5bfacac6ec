#include "tests/torch_doctest.h"

#include "formats/error.h"
#include "tests/support.h"
#include "trainer/model/vocab.h"

using namespace eaglekit;
using namespace eaglekit::trainer;

namespace {
std::vector<std::int64_t> to_vector(const at::Tensor& t) {
  std::vector<std::int64_t> v;
  for (std::int64_t i = 0; i < t.numel(); ++i) v.push_back(t[i].item<std::int64_t>());
  return v;
}
}  // namespace

TEST_CASE("vocab: d2t lists the most frequent tokens first, ties by smaller id") {
  //                 id: 0  1  2  3  4  5  6  7
  const std::vector<std::int64_t> counts = {0, 5, 9, 5, 0, 1, 9, 2};
  // Order: 2 (9), 6 (9), 1 (5), 3 (5), 7 (2), 5 (1), 0 (0), 4 (0).
  CHECK(to_vector(d2t_from_counts(counts, 5)) == std::vector<std::int64_t>{2 - 0, 6 - 1, 1 - 2, 3 - 3, 7 - 4});
  // Unseen tokens fill the tail, smaller id first.
  CHECK(to_vector(d2t_from_counts(counts, 7)) ==
        std::vector<std::int64_t>{2, 5, -1, 0, 3, 0, -6});
  // Vd == V: the identity, as ModelOpt uses when the draft keeps the full vocabulary.
  CHECK(to_vector(d2t_from_counts(counts, 8)) == std::vector<std::int64_t>(8, 0));
  CHECK_THROWS_AS(d2t_from_counts(counts, 9), UsageError);
  CHECK_THROWS_AS(d2t_from_counts(counts, 0), UsageError);
}

TEST_CASE("vocab: token counts from int32 and int64 ids; ids outside the vocabulary are an error") {
  TokenCounts c(10);
  std::vector<std::int32_t> ids32 = {3, 3, 9, 0};
  c.add(HostTensor::view(DType::kInt32, {4}, ids32.data(), nullptr), "a.pt");
  const std::vector<std::int64_t> ids64 = {3, 1};
  c.add(ids64.data(), ids64.size());
  CHECK(c.total() == 6);
  CHECK(c.counts() == std::vector<std::int64_t>{1, 1, 0, 3, 0, 0, 0, 0, 0, 1});
  TokenCounts other(10);
  other.add(ids64.data(), 1);
  c.merge(other);
  CHECK(c.counts()[3] == 4);
  std::vector<std::int64_t> bad = {2, 10};
  try {
    c.add(HostTensor::view(DType::kInt64, {2}, bad.data(), nullptr), "data/7.pt");
    FAIL("expected FormatError");
  } catch (const FormatError& e) {
    CHECK(std::string(e.what()) == "data/7.pt: input_ids: token 1 is 10, outside the vocabulary [0, 10)");
  }
  CHECK_THROWS_AS(c.merge(TokenCounts(11)), UsageError);
}

TEST_CASE("vocab: d2t.pt is a bare tensor that torch.load reads; ModelOpt-style files load back") {
  test::TempDir dir("vocab");
  const at::Tensor d2t = d2t_from_counts({0, 5, 9, 5, 0, 1, 9, 2}, 5);
  save_d2t(dir / "d2t.pt", d2t);
  const auto r = test::python(
      "import sys, torch\n"
      "t = torch.load(sys.argv[1])\n"
      "print(type(t).__name__, t.dtype, t.tolist())\n"
      "torch.save(torch.tensor([4, 4, 0], dtype=torch.int64), sys.argv[2])\n"
      "torch.save({'d2t': torch.tensor([1, 1], dtype=torch.int32)}, sys.argv[3])\n"
      "torch.save({'x': torch.zeros(2, 2)}, sys.argv[4])\n",
      {dir / "d2t.pt", dir / "bare.pt", dir / "dict.pt", dir / "bad.pt"});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out == "Tensor torch.int64 [2, 5, -1, 0, 3]\n");
  CHECK(at::equal(load_d2t(dir / "d2t.pt"), d2t));
  CHECK(to_vector(load_d2t(dir / "bare.pt")) == std::vector<std::int64_t>{4, 4, 0});
  CHECK(to_vector(load_d2t(dir / "dict.pt")) == std::vector<std::int64_t>{1, 1});
  CHECK_THROWS_AS(load_d2t(dir / "bad.pt"), FormatError);
}
