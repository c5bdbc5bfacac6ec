// The dataset index file format (formats/index_format.h): a round trip field by field, and
// corrupt bytes failing with the exact error. Building an index from folders is tested in
// tests/lib/test_index.cpp.
#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include <xxhash.h>

#include "formats/byte_source.h"
#include "formats/bytes.h"
#include "formats/error.h"
#include "formats/format.h"
#include "formats/index_format.h"
#include "tests/support.h"

using namespace eaglekit;

namespace {

template <class E, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  FAIL("expected an exception");
  return {};
}

std::vector<std::uint8_t> sample_index_bytes(const std::string& path) {
  IndexedFile f;
  f.path = "/d/a.pt";
  f.size = 100;
  f.mtime_ns = 5;
  f.format = Format::kPt;
  IndexedRecord r;
  r.info.conversation_id = "a";
  r.info.tokens = 3;
  r.info.hidden_size = 4;
  r.info.aux_width = 12;
  f.records.push_back(r);
  write_index(path, {"/d"}, {f});
  return test::read_bytes(path);
}

}  // namespace

TEST_CASE("index: written entries read back field by field") {
  test::TempDir dir("idx");
  const std::string path = dir / "x.ekidx";
  IndexedFile shard;
  shard.path = "/data/s.eks";
  shard.size = 123456789012ull;
  shard.mtime_ns = 1700000000123456789LL;
  shard.format = Format::kEks;
  for (int i = 0; i < 3; ++i) {
    IndexedRecord r;
    r.record = static_cast<std::uint32_t>(i);
    r.info.conversation_id = i == 1 ? "dup" : "s" + std::to_string(i);
    r.info.key = r.info.conversation_id;
    r.info.tokens = 100 + i;
    r.info.hidden_size = 4096;
    r.info.aux_width = 3 * 4096;
    r.info.ids_dtype = DType::kInt32;
    r.info.hidden_dtype = DType::kFloat16;
    r.info.has_loss_mask = i == 2;
    if (i > 0) r.info.hidden_states_prenorm = i == 2;  // s0 states nothing, dup post, s2 pre
    r.info.codec = "zstd";
    r.info.byte_offset = 16 + 1000 * i;
    r.info.byte_size = 1000;
    shard.records.push_back(r);
  }
  IndexedFile bad;
  bad.path = "/data/sub/7.pt";
  bad.format = Format::kPt;
  bad.error = "/data/sub/7.pt: zip: truncated";
  IndexedRecord br;
  br.info.conversation_id = "7";
  br.id_from_file_name = true;
  br.error = bad.error;
  br.error_kind = EntryError::kFormat;
  bad.records.push_back(br);
  IndexedFile one;
  one.path = "/data/dup.pt";
  one.format = Format::kPt;
  IndexedRecord r1;
  r1.info.conversation_id = "dup";
  r1.info.tokens = 9;
  r1.info.hidden_size = 4096;
  r1.info.aux_width = 3 * 4096;
  one.records.push_back(r1);
  IndexedFile empty_shard;
  empty_shard.path = "/data/empty.h5";
  empty_shard.format = Format::kHdf5;

  write_index(path, {"/data", "/more"}, {shard, bad, one, empty_shard});
  const DatasetIndex index = DatasetIndex::load(path);
  CHECK(index.path() == path);
  CHECK(index.size() == 5);
  CHECK(index.file_count() == 4);
  CHECK(index.bad_count() == 1);
  CHECK(index.roots() == std::vector<std::string>{"/data", "/more"});

  const IndexFile f0 = index.file(0);
  CHECK(f0.path == "/data/s.eks");
  CHECK(f0.size == 123456789012ull);
  CHECK(f0.mtime_ns == 1700000000123456789LL);
  CHECK(f0.format == Format::kEks);
  CHECK(f0.first_entry == 0);
  CHECK(f0.entry_count == 3);
  CHECK(f0.error.empty());
  CHECK(index.file(1).error == "/data/sub/7.pt: zip: truncated");
  CHECK(index.file(3).entry_count == 0);
  CHECK(index.file(3).first_entry == 5);

  const IndexEntry e2 = index.entry(2);
  CHECK(e2.conversation_id == "s2");
  CHECK(e2.key == "s2");
  CHECK(e2.codec == "zstd");
  CHECK(e2.file == 0);
  CHECK(e2.record == 2);
  CHECK(e2.tokens == 102);
  CHECK(e2.hidden_size == 4096);
  CHECK(e2.aux_width == 12288);
  CHECK(e2.ids_dtype == DType::kInt32);
  CHECK(e2.hidden_dtype == DType::kFloat16);
  CHECK(e2.has_loss_mask);
  CHECK_FALSE(index.entry(1).has_loss_mask);
  CHECK(e2.hidden_states_prenorm == std::optional<bool>(true));
  CHECK(index.entry(1).hidden_states_prenorm == std::optional<bool>(false));
  CHECK_FALSE(index.entry(0).hidden_states_prenorm.has_value());
  CHECK_FALSE(index.entry(4).hidden_states_prenorm.has_value());
  // Byte 75 of each entry: 8 = stated, 16 = pre-norm (with 2 = loss mask for s2).
  {
    const auto bytes = test::read_bytes(path);
    const std::uint64_t entries = load_le64(&bytes[64]);
    CHECK(bytes[entries + 0 * 80 + 75] == 0);
    CHECK(bytes[entries + 1 * 80 + 75] == 8);
    CHECK(bytes[entries + 2 * 80 + 75] == (2 | 8 | 16));
  }
  CHECK(e2.byte_offset == 2016);
  CHECK(e2.byte_size == 1000);
  CHECK(e2.format == Format::kEks);
  CHECK(e2.ok);
  CHECK(e2.error_kind == EntryError::kNone);

  const IndexEntry e3 = index.entry(3);
  CHECK_FALSE(e3.ok);
  CHECK(e3.error == "/data/sub/7.pt: zip: truncated");
  CHECK(e3.error_kind == EntryError::kFormat);
  CHECK(e3.id_from_file_name);
  CHECK(e3.conversation_id == "7");
  CHECK(index.file_path(3) == "/data/sub/7.pt");
  CHECK(index.conversation_id(4) == "dup");

  CHECK(index.find("s0") == std::vector<std::size_t>{0});
  CHECK(index.find("dup") == std::vector<std::size_t>{1, 4});
  CHECK(index.find("7") == std::vector<std::size_t>{3});
  CHECK(index.find("nope").empty());
  CHECK(index.find("").empty());
  CHECK(index.duplicate_ids() == std::vector<std::string>{"dup"});
  std::vector<std::string> sorted;
  for (std::size_t r = 0; r < index.size(); ++r)
    sorted.emplace_back(index.conversation_id(index.sorted_entry(r)));
  CHECK(sorted == std::vector<std::string>{"7", "dup", "dup", "s0", "s2"});
  CHECK_THROWS_AS(index.entry(5), std::out_of_range);
  CHECK_THROWS_AS(index.file(4), std::out_of_range);

  // Moving keeps the views valid (the mapping moves with the object).
  DatasetIndex moved = std::move(const_cast<DatasetIndex&>(index));
  CHECK(moved.entry(0).conversation_id == "s0");
}

TEST_CASE("index: corrupt index files fail with a clear error") {
  test::TempDir dir("idx");
  const std::string good_path = dir / "good.ekidx";
  const std::vector<std::uint8_t> good = sample_index_bytes(good_path);
  REQUIRE(good.size() > 136);
  REQUIRE(DatasetIndex::load(good_path).size() == 1);
  const std::string p = dir / "bad.ekidx";
  auto load_error = [&](std::vector<std::uint8_t> bytes) {
    test::write_bytes(p, bytes);
    return error_of<FormatError>([&] { DatasetIndex::load(p); });
  };

  auto bytes = good;
  bytes[0] = 'X';
  CHECK(load_error(bytes) == p + ": magic at byte 0: not an eaglekit dataset index (expected "
                                 "\"EKINDEX\"); build one with `eaglekit index DIR --out FILE`");
  CHECK(load_error({}) == p + ": magic at byte 0: file is 0 bytes, too short to be an eaglekit "
                              "dataset index (truncated?)");
  CHECK(load_error(std::vector<std::uint8_t>(good.begin(), good.begin() + 100)) ==
        p + ": header at byte 0: file is 100 bytes, shorter than the 136 of an empty index "
            "(truncated)");
  CHECK(load_error(std::vector<std::uint8_t>(good.begin(), good.end() - 9)) ==
        p + ": total size at byte 96: header says " + std::to_string(good.size()) +
            " bytes but the file has " + std::to_string(good.size() - 9) + " (truncated)");
  bytes = good;
  bytes[8] = 9;
  test::write_bytes(p, bytes);
  CHECK(error_of<UnsupportedError>([&] { DatasetIndex::load(p); }) ==
        p + ": version at byte 8: index version 9; this build reads 2 to 4: rebuild it with "
            "`eaglekit index`");
  bytes = good;
  bytes[16] = 81;
  CHECK(load_error(bytes) == p + ": header at byte 12: record sizes 128/81/48 differ from "
                                 "version 3's 128/80/48");
  bytes = good;
  bytes[good.size() - 20] ^= 0x40;  // a string byte
  test::write_bytes(p, bytes);
  const std::string sum = error_of<ChecksumError>([&] { DatasetIndex::load(p); });
  CHECK(sum.rfind(p + ": checksum at byte " + std::to_string(good.size() - 8) + ": stored ", 0) == 0);
  CHECK(sum.find(": the index is corrupt; rebuild it with `eaglekit index`") != std::string::npos);

  // A section pointing outside the file, with a checksum that matches (a buggy writer).
  bytes = good;
  bytes[64] = 0xf0;  // entries offset
  bytes[65] = 0xff;
  auto fix_checksum = [](std::vector<std::uint8_t>& b) {
    const std::uint64_t h = XXH3_64bits(b.data(), b.size() - 8);
    for (int i = 0; i < 8; ++i) b[b.size() - 8 + i] = static_cast<std::uint8_t>(h >> (8 * i));
  };
  fix_checksum(bytes);
  CHECK(load_error(bytes) == p + ": entries at byte 64: section at byte 65520 of 80 bytes lies "
                                 "outside the file's " + std::to_string(good.size() - 8) + " bytes");
  // An entry whose string reference points past the strings section.
  bytes = good;
  const std::uint64_t entries_off = load_le64(good.data() + 64);
  bytes[entries_off + 4] = 0x7f;  // conversation id offset high bits
  fix_checksum(bytes);
  test::write_bytes(p, bytes);
  const DatasetIndex damaged = DatasetIndex::load(p);  // nothing per entry is parsed at load
  CHECK(error_of<FormatError>([&] { damaged.entry(0); })
            .rfind(p + ": entry conversation_id at byte " + std::to_string(entries_off) +
                       ": string reference (offset ", 0) == 0);
  CHECK_THROWS_AS(DatasetIndex::load(dir / "absent.ekidx"), IoError);
}

TEST_CASE("index: paths below the index's folder are stored relative, so the index moves with its dumps") {
  test::TempDir dir("idxrel");
  const std::string a = dir / "a";
  std::filesystem::create_directories(a + "/dumps/000");
  auto file = [](const std::string& path) {
    IndexedFile f;
    f.path = path;
    f.format = Format::kPt;
    IndexedRecord r;
    r.info.conversation_id = "c";
    r.info.tokens = 3;
    r.info.hidden_size = 4;
    r.info.aux_width = 12;
    f.records.push_back(r);
    return f;
  };
  // One file below the index's folder, one elsewhere.
  write_index(a + "/dumps.eki", {a + "/dumps", "/elsewhere"},
              {file(a + "/dumps/000/x.pt"), file("/elsewhere/y.pt")});
  const auto bytes = test::read_bytes(a + "/dumps.eki");
  const std::string text(bytes.begin(), bytes.end());
  CHECK(text.find("dumps/000/x.pt") != std::string::npos);
  CHECK(text.find(a + "/dumps/000/x.pt") == std::string::npos);  // stored relative
  CHECK(text.find("/elsewhere/y.pt") != std::string::npos);
  {
    const DatasetIndex idx = DatasetIndex::load(a + "/dumps.eki");
    CHECK(idx.file(0).path == a + "/dumps/000/x.pt");
    CHECK(idx.file(1).path == "/elsewhere/y.pt");
    CHECK(idx.roots() == std::vector<std::string>{a + "/dumps", "/elsewhere"});
  }
  // `mv a b`: the index reads its dumps where they now are; the absolute path stays.
  std::filesystem::rename(a, dir / "b");
  const DatasetIndex moved = DatasetIndex::load(dir / "b/dumps.eki");
  CHECK(moved.file(0).path == dir / "b/dumps/000/x.pt");
  CHECK(moved.file_path(0) == dir / "b/dumps/000/x.pt");
  CHECK(moved.file(1).path == "/elsewhere/y.pt");
  CHECK(moved.roots() == std::vector<std::string>{dir / "b/dumps", "/elsewhere"});

  // A version 2 index (every path absolute) still loads, as written.
  auto v2 = sample_index_bytes(dir / "v2.ekidx");
  v2[8] = 2;
  const std::uint64_t h = XXH3_64bits(v2.data(), v2.size() - 8);
  for (int i = 0; i < 8; ++i) v2[v2.size() - 8 + i] = static_cast<std::uint8_t>(h >> (8 * i));
  test::write_bytes(dir / "v2.ekidx", v2);
  const DatasetIndex old = DatasetIndex::load(dir / "v2.ekidx");
  CHECK(old.file(0).path == "/d/a.pt");
  CHECK(old.roots() == std::vector<std::string>{"/d"});
}

// `eaglekit index --loss-masks` (lib/index.h): the index names the file and the entries
// whose mask is its. Such an index is version 4, which an older build refuses rather than
// train on no mask; any other stays version 3, which older builds read.
TEST_CASE("index: a joined loss-mask file is named by a version 4 index; without one it stays version 3") {
  test::TempDir dir("idxmask");
  const std::string d = dir.path();
  IndexedFile f;
  f.path = d + "/dump/hs_0.safetensors";
  f.format = Format::kSafetensors;
  IndexedRecord r;
  r.info.conversation_id = "hs_0";
  r.info.tokens = 6;
  r.info.hidden_size = 4;
  r.info.aux_width = 12;
  r.joined_loss_mask = true;
  f.records.push_back(r);
  IndexedFile plain = f;
  plain.path = d + "/dump/hs_1.safetensors";
  plain.records[0].joined_loss_mask = false;
  IndexLossMasks m;
  m.path = d + "/prepared/loss_masks.safetensors";  // below the index's folder: stored relative
  m.size = 1234;
  m.mtime_ns = 1700000000123456789LL;
  m.xxh3 = 0x0123456789abcdefull;
  write_index(d + "/masked.eki", {d + "/dump"}, {f, plain}, &m);
  {
    const auto bytes = test::read_bytes(d + "/masked.eki");
    CHECK(load_le32(&bytes[8]) == 4);
    const std::uint64_t entries = load_le64(&bytes[64]);
    CHECK(bytes[entries + 75] == 128);
    CHECK(bytes[entries + 80 + 75] == 0);
    const std::string text(bytes.begin(), bytes.end());
    CHECK(text.find(m.path) == std::string::npos);
    CHECK(text.find("prepared/loss_masks.safetensors") != std::string::npos);
  }
  const DatasetIndex idx = DatasetIndex::load(d + "/masked.eki");
  CHECK(idx.version() == 4);
  REQUIRE(idx.loss_masks().has_value());
  CHECK(idx.loss_masks()->path == m.path);
  CHECK(idx.loss_masks()->size == 1234);
  CHECK(idx.loss_masks()->mtime_ns == m.mtime_ns);
  CHECK(idx.loss_masks()->xxh3 == m.xxh3);
  CHECK(idx.entry(0).joined_loss_mask);
  CHECK_FALSE(idx.entry(0).has_loss_mask);
  CHECK_FALSE(idx.entry(1).joined_loss_mask);

  // Moved together with its index, the file is found where it now is.
  std::filesystem::create_directories(d + "/moved");
  std::filesystem::copy_file(d + "/masked.eki", d + "/moved/masked.eki");
  CHECK(DatasetIndex::load(d + "/moved/masked.eki").loss_masks()->path == d + "/moved/prepared/loss_masks.safetensors");

  // Without one: version 3, header bytes 112..127 zero, no entry flagged.
  write_index(d + "/plain.eki", {d + "/dump"}, {plain});
  {
    const auto bytes = test::read_bytes(d + "/plain.eki");
    CHECK(load_le32(&bytes[8]) == 3);
    CHECK(load_le64(&bytes[112]) == 0);
    CHECK(load_le64(&bytes[120]) == 0);
  }
  const DatasetIndex p3 = DatasetIndex::load(d + "/plain.eki");
  CHECK(p3.version() == 3);
  CHECK_FALSE(p3.loss_masks().has_value());

  // An entry that joins a mask needs the file: the writer refuses, and a reader refuses the flag
  // in an index that names none (its bytes made so, checksum fixed).
  CHECK(error_of<UsageError>([&] { write_index(d + "/x.eki", {d}, {f}); }) ==
        "index: " + f.path + " record 0 joins a loss mask, but no loss-mask file is given");
  CHECK_FALSE(std::filesystem::exists(d + "/x.eki"));
  auto bytes = test::read_bytes(d + "/plain.eki");
  bytes[8] = 4;
  const std::uint64_t entries = load_le64(&bytes[64]);
  bytes[entries + 75] = 128;
  const std::uint64_t h = XXH3_64bits(bytes.data(), bytes.size() - 8);
  for (int i = 0; i < 8; ++i) bytes[bytes.size() - 8 + i] = static_cast<std::uint8_t>(h >> (8 * i));
  const DatasetIndex flagged = DatasetIndex::from_source(ByteSource::from_bytes(bytes, "flag.eki"));
  CHECK(error_of<FormatError>([&] { flagged.entry(0); }) ==
        "flag.eki: entry flags at byte " + std::to_string(entries + 75) +
            ": the entry joins a loss mask, but the index names no loss-mask file");
  // A block outside the file.
  bytes[112] = 0xf8;
  bytes[113] = 0xff;
  const std::uint64_t h2 = XXH3_64bits(bytes.data(), bytes.size() - 8);
  for (int i = 0; i < 8; ++i) bytes[bytes.size() - 8 + i] = static_cast<std::uint8_t>(h2 >> (8 * i));
  CHECK(error_of<FormatError>([&] { DatasetIndex::from_source(ByteSource::from_bytes(bytes, "far.eki")); }) ==
        "far.eki: loss-mask file at byte 112: block at byte 65528 of 32 bytes lies outside the file's " +
            std::to_string(bytes.size() - 8) + " bytes");
}

TEST_CASE("index: error kinds have stable names") {
  CHECK(entry_error_name(EntryError::kNone) == "none");
  CHECK(entry_error_name(EntryError::kShape) == "shape");
  CHECK(static_cast<int>(EntryError::kOther) == 6);  // the file's code
}

// What tests/fuzz checks at scale (fuzz_index), pinned here: section counts far past the
// file fail on the header alone (the checksum is made to match, so the counts are what
// the loader judges).
TEST_CASE("index: absurd section counts fail before any allocation") {
  test::TempDir dir("idx");
  const std::vector<std::uint8_t> good = sample_index_bytes(dir / "x.ekidx");
  auto load_with = [&](std::uint64_t at, std::uint64_t value) {
    std::vector<std::uint8_t> b = good;
    std::memcpy(b.data() + at, &value, 8);
    const std::uint64_t h = XXH3_64bits(b.data(), b.size() - 8);
    std::memcpy(b.data() + b.size() - 8, &h, 8);
    return error_of<FormatError>(
        [&] { DatasetIndex::from_source(ByteSource::from_bytes(b, "big.ekidx")); });
  };
  CHECK(load_with(24, 1ull << 60) ==
        "big.ekidx: entries at byte 64: count 1152921504606846976 is too large");
  CHECK(load_with(32, 1ull << 31).find("big.ekidx: files at byte 56: section at byte ") == 0);
  CHECK(load_with(88, 1ull << 41) ==
        "big.ekidx: strings at byte 80: count 2199023255552 is too large");
}
