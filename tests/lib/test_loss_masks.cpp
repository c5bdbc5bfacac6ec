#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <string>

#include "formats/error.h"
#include "formats/registry.h"
#include "formats/safetensors_format.h"
#include "lib/convert.h"
#include "lib/loss_masks.h"
#include "tests/support.h"

using namespace eaglekit;
namespace fs = std::filesystem;

// tests/data/speculators_masks/make_fixture.py: a prepared dataset folder written by
// speculators 0.9's own preprocessing, the loss masks its ArrowDataset pairs with each
// hs_{i}.safetensors (expected/), and scripts/speculators/loss_masks.py's file of them.
namespace {

std::string fixture(const std::string& name) {
  return test::source_dir() + "/tests/data/speculators_masks/" + name;
}

template <class E>
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "<no error>";
}

HostTensor i64(std::vector<std::int64_t> v) {
  std::vector<std::uint8_t> b(v.size() * 8);
  std::memcpy(b.data(), v.data(), b.size());
  return HostTensor::from_bytes(DType::kInt64, {static_cast<std::int64_t>(v.size())}, std::move(b));
}

HostTensor u8(std::vector<std::uint8_t> v) {
  const auto n = static_cast<std::int64_t>(v.size());
  return HostTensor::from_bytes(DType::kUInt8, {n}, std::move(v));
}

void write_masks(const std::string& path, HostTensor offsets, HostTensor ids, HostTensor mask,
                 std::string kind = "speculators loss masks") {
  write_safetensors(path, {{"row_offsets", offsets}, {"input_ids", ids}, {"loss_mask", mask}},
                    {{"eaglekit", kind}, {"version", "1"}});
}

}  // namespace

TEST_CASE("loss_masks: speculators' masks join each hs_{i} as its ArrowDataset pairs them") {
  const LossMasks masks = LossMasks::open(fixture("loss_masks.safetensors"));
  CHECK(masks.rows() == 3);
  for (int i : {0, 1}) {
    CAPTURE(i);
    const std::string src = fixture("prepared/hidden_states/hs_" + std::to_string(i) + ".safetensors");
    Record r = open_reader(src)->read(0);
    REQUIRE_FALSE(r.loss_mask.has_value());
    masks.apply(r, src);
    const auto want = SafetensorsFile::open(fixture("expected/hs_" + std::to_string(i) + ".safetensors"));
    REQUIRE(r.loss_mask.has_value());
    CHECK(r.loss_mask->equal(*want->get("loss_mask")));
    CHECK(r.input_ids.equal(*want->get("input_ids")));
  }
  // convert --loss-masks: the output holds them.
  test::TempDir dir("masks");
  ConvertOptions o;
  o.loss_masks = fixture("loss_masks.safetensors");
  o.jobs = 1;
  const std::string out = dir.path() + "/out.eks";
  const ConvertResult res = convert_records(fixture("prepared/hidden_states"), out, o);
  CHECK(res.records == 2);
  CHECK(res.loss_masks_joined == 2);
  const auto reader = open_reader(out);
  for (std::size_t k = 0; k < 2; ++k) {
    const Record r = reader->read(k);
    const auto want = SafetensorsFile::open(fixture("expected/" + r.conversation_id + ".safetensors"));
    REQUIRE(r.loss_mask.has_value());
    CHECK(r.loss_mask->equal(*want->get("loss_mask")));
  }
}

TEST_CASE("loss_masks: a dump and a dataset that differ are refused, naming the file and the row") {
  test::TempDir dir("masks");
  const std::string d = dir.path();
  const std::string hs0 = fixture("prepared/hidden_states/hs_0.safetensors");  // 6 tokens
  const auto record = [&] { return open_reader(hs0)->read(0); };
  const LossMasks good = LossMasks::open(fixture("loss_masks.safetensors"));
  SUBCASE("a file name without a row") {
    Record r = record();
    CHECK(error_of<UsageError>([&] { good.apply(r, d + "/x.safetensors"); }) ==
          d + "/x.safetensors: --loss-masks pairs a record with its dataset row by the file name "
              "hs_{row}.safetensors, as speculators does; this name has no row");
    CHECK(error_of<UsageError>([&] { good.apply(r, d + "/hs_01.safetensors"); }).find("this name has no row") !=
          std::string::npos);
  }
  SUBCASE("a row past the end") {
    Record r = record();
    CHECK(error_of<UsageError>([&] { good.apply(r, d + "/hs_3.safetensors"); }) ==
          d + "/hs_3.safetensors: row 3 is past the end of " + fixture("loss_masks.safetensors") +
              " (3 rows): the dump and the dataset differ");
  }
  SUBCASE("a row of another length") {
    Record r = record();
    const std::string e = error_of<FormatError>([&] { good.apply(r, d + "/hs_1.safetensors"); });
    CHECK(e.find(fixture("loss_masks.safetensors") + ": row 1 at byte ") == 0);
    CHECK(e.find(": holds 4 tokens, but " + d + "/hs_1.safetensors holds 6: the dump and the dataset differ") !=
          std::string::npos);
  }
  SUBCASE("other token ids") {
    const std::string p = d + "/ids.safetensors";
    write_masks(p, i64({0, 6}), i64({10, 29, 19, 4, 26, 20}), u8({0, 0, 1, 1, 1, 0}));
    Record r = record();
    const std::string e = error_of<FormatError>([&] { LossMasks::open(p).apply(r, hs0); });
    CHECK(e.find(p + ": row 0 input_ids[4] at byte ") == 0);
    CHECK(e.find("is 26, but " + hs0 + " holds token 25: the dump and the dataset differ") != std::string::npos);
  }
  SUBCASE("a record that holds another mask") {
    Record r = record();
    r.loss_mask = u8({0, 0, 1, 1, 1, 0});  // row 0's own: kept
    good.apply(r, hs0);
    CHECK(r.loss_mask->get(2) == 1);
    r.loss_mask = u8({0, 0, 1, 1, 1, 1});
    const std::string e = error_of<FormatError>([&] { good.apply(r, hs0); });
    CHECK(e.find(fixture("loss_masks.safetensors") + ": row 0 loss_mask[5] at byte ") == 0);
    CHECK(e.find("is 0, but the loss_mask " + hs0 + " holds is 1: the dump and the dataset differ") != std::string::npos);
  }
  SUBCASE("a mask that is not 0/1, offsets that do not add up, another file") {
    const std::string p = d + "/bad.safetensors";
    write_masks(p, i64({0, 6}), i64({10, 29, 19, 4, 25, 20}), u8({0, 0, 2, 1, 1, 0}));
    CHECK(error_of<FormatError>([&] { LossMasks::open(p); }).find(p + ": loss_mask[2] at byte ") == 0);
    write_masks(p, i64({0, 7}), i64({10, 29, 19, 4, 25, 20}), u8({0, 0, 1, 1, 1, 0}));
    CHECK(error_of<FormatError>([&] { LossMasks::open(p); }).find(p + ": row_offsets[1] at byte ") == 0);
    write_masks(p, i64({0, 6}), i64({10, 29, 19, 4, 25, 20}), u8({0, 0, 1, 1, 1, 0}), "other");
    CHECK(error_of<FormatError>([&] { LossMasks::open(p); }).find(p + ": __metadata__ at byte 8: not a loss-mask file") == 0);
  }
}
