// .eks shards: codec pieces (byte planes, e4m3), round trips (bit-exact zstd, bounded fp8),
// prefix decode that touches only the blocks it needs, concurrent reads, atomic writes, a
// table of corruptions with their exact errors, and an independent Python reading of the
// documented layout (frames decoded by the zstd command line tool).
#include <doctest/doctest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <thread>

#include "formats/byte_source.h"
#include "formats/bytes.h"
#include "formats/codec.h"
#include "formats/eks_format.h"
#include "formats/error.h"
#include "formats/format.h"
#include "tests/compare.h"
#include "tests/support.h"

using namespace eaglekit;
namespace fs = std::filesystem;

namespace {

// Normal values with a few heavy outliers, stored as dt.
HostTensor random_floats(DType dt, std::vector<std::int64_t> shape, std::mt19937& rng) {
  HostTensor t = HostTensor::zeros(dt, shape);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    float v = nd(rng);
    if (u(rng) < 0.01f) v *= 40.0f;
    std::uint8_t* p = t.mutable_data() + i * static_cast<std::int64_t>(t.itemsize());
    if (dt == DType::kBFloat16) {
      const std::uint16_t b = float_to_bf16(v);
      std::memcpy(p, &b, 2);
    } else if (dt == DType::kFloat16) {
      const std::uint16_t b = float_to_fp16(v);
      std::memcpy(p, &b, 2);
    } else if (dt == DType::kFloat32) {
      std::memcpy(p, &v, 4);
    } else {
      const double d = v;
      std::memcpy(p, &d, 8);
    }
  }
  return t;
}

HostTensor ids_tensor(DType dt, std::int64_t t, std::mt19937& rng) {
  HostTensor ids = HostTensor::zeros(dt, {t});
  std::uniform_int_distribution<std::int64_t> tok(0, 128255);
  for (std::int64_t i = 0; i < t; ++i) {
    const std::int64_t v = tok(rng);
    if (dt == DType::kInt64) {
      std::memcpy(ids.mutable_data() + 8 * i, &v, 8);
    } else {
      const auto v32 = static_cast<std::int32_t>(v);
      std::memcpy(ids.mutable_data() + 4 * i, &v32, 4);
    }
  }
  return ids;
}

Record make_record(const std::string& id, std::int64_t t, std::int64_t h, int k, DType dt,
                   unsigned seed, std::optional<DType> mask = DType::kInt64,
                   DType ids = DType::kInt64) {
  std::mt19937 rng(seed);
  Record r;
  r.conversation_id = id;
  r.input_ids = ids_tensor(ids, t, rng);
  r.hidden_states = random_floats(dt, {t, h}, rng);
  r.aux_hidden_states = random_floats(dt, {t, k * h}, rng);
  if (mask) {
    HostTensor m = HostTensor::zeros(*mask, {t});
    for (std::int64_t i = 0; i < t; ++i) {
      const bool on = i >= t / 3;
      if (*mask == DType::kInt64) {
        const std::int64_t v = on;
        std::memcpy(m.mutable_data() + 8 * i, &v, 8);
      } else {
        m.mutable_data()[i] = on;
      }
    }
    r.loss_mask = m;
  }
  return r;
}

void check_same(const Record& a, const Record& b) {
  CHECK(a.conversation_id == b.conversation_id);
  CHECK(a.input_ids.equal(b.input_ids));
  CHECK(a.hidden_states.equal(b.hidden_states));
  CHECK(a.aux_hidden_states.equal(b.aux_hidden_states));
  REQUIRE(a.loss_mask.has_value() == b.loss_mask.has_value());
  if (a.loss_mask) CHECK(a.loss_mask->equal(*b.loss_mask));
}

EksEncodeOptions small_blocks(EksCodec c = EksCodec::kZstd) {
  EksEncodeOptions o;
  o.codec = c;
  o.block_bytes = 1024;  // several blocks per tensor even for small test records
  return o;
}

void write_shard(const std::string& path, const std::vector<Record>& recs,
                 const EksEncodeOptions& opts) {
  EksWriter w(path, opts);
  for (const auto& r : recs) w.add(r);
  w.finish();
}

// Byte positions of index fields, found by walking the documented layout (independently
// of the reader).
struct IndexMap {
  std::uint64_t index_offset = 0;
  struct Rec {
    std::uint64_t entry = 0, data_offset = 0, data_size = 0, codec = 0;
    std::vector<std::uint64_t> tensor_blocks;  // first block entry of each tensor
  };
  std::vector<Rec> recs;
};

IndexMap map_index(const std::vector<std::uint8_t>& b) {
  IndexMap m;
  const std::uint64_t tr = b.size() - 32;
  m.index_offset = load_le64(&b[tr]);
  std::uint64_t p = m.index_offset;
  const std::uint32_t n = load_le32(&b[p]);
  p += 4;
  for (std::uint32_t i = 0; i < n; ++i) {
    IndexMap::Rec r;
    r.entry = p;
    p += 2 + load_le16(&b[p]);
    r.data_offset = p;
    r.data_size = p + 8;
    p += 24;
    r.codec = p;
    const std::uint8_t nt = b[p + 1];
    p += 2;
    for (std::uint8_t k = 0; k < nt; ++k) {
      const std::uint8_t ndim = b[p + 3];
      p += 4 + 8ull * ndim + 4;
      const std::uint32_t nb = load_le32(&b[p]);
      p += 4;
      r.tensor_blocks.push_back(p);
      p += 20ull * nb;
    }
    m.recs.push_back(r);
  }
  return m;
}

// Re-seals the index checksum after an edit, so that the edit itself is what the reader sees.
void reseal(std::vector<std::uint8_t>& b) {
  const std::uint64_t tr = b.size() - 32;
  const std::uint64_t off = load_le64(&b[tr]);
  const std::uint64_t h = codec::xxh3_64(&b[off], tr - off);
  for (int i = 0; i < 8; ++i) b[tr + 16 + i] = static_cast<std::uint8_t>(h >> (8 * i));
}

void put_le(std::vector<std::uint8_t>& b, std::uint64_t at, std::uint64_t v, int n) {
  for (int i = 0; i < n; ++i) b[at + i] = static_cast<std::uint8_t>(v >> (8 * i));
}

template <class E>
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception type: ") + e.what();
  }
  return "no exception";
}

}  // namespace

TEST_CASE("eks: byte planes split most significant byte first and merge back") {
  for (std::size_t es : {1u, 2u, 4u, 8u}) {
    const std::size_t n = 37;
    std::vector<std::uint8_t> src(n * es), planes(n * es), back(n * es);
    for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::uint8_t>(i * 7 + 3);
    codec::split_byte_planes(src.data(), n, es, planes.data());
    CHECK(planes[0] == src[es - 1]);          // first plane: top byte of element 0
    CHECK(planes[n * (es - 1)] == src[0]);    // last plane: low byte of element 0
    CHECK(planes[1] == src[2 * es - 1]);
    codec::merge_byte_planes(planes.data(), n, es, back.data());
    CHECK(back == src);
  }
}

TEST_CASE("eks: e4m3 encodes every finite code back to itself, rounds to even, saturates") {
  for (int v = 0; v < 256; ++v) {
    const float f = codec::e4m3_to_float(static_cast<std::uint8_t>(v));
    if ((v & 0x7f) == 0x7f) {
      CHECK(std::isnan(f));
      continue;
    }
    CHECK(codec::float_to_e4m3(f) == v);
  }
  CHECK(codec::e4m3_to_float(0x7e) == 448.0f);
  CHECK(codec::e4m3_to_float(0x08) == std::ldexp(1.0f, -6));  // smallest normal
  CHECK(codec::e4m3_to_float(0x01) == std::ldexp(1.0f, -9));  // smallest subnormal
  CHECK(codec::float_to_e4m3(1.0625f) == codec::float_to_e4m3(1.0f));    // tie -> even
  CHECK(codec::float_to_e4m3(1.1875f) == codec::float_to_e4m3(1.25f));   // tie -> even
  CHECK(codec::float_to_e4m3(1.07f) == codec::float_to_e4m3(1.125f));
  CHECK(codec::float_to_e4m3(3.0f * std::ldexp(1.0f, -10)) == 0x02);  // 1.5 sub-ulps -> 2
  CHECK(codec::float_to_e4m3(1e6f) == 0x7e);
  CHECK(codec::float_to_e4m3(-INFINITY) == 0xfe);
  CHECK(codec::float_to_e4m3(NAN) == 0x7f);
  CHECK(codec::float_to_e4m3(-0.0f) == 0x80);
}

TEST_CASE("eks: round trip is bit-exact for every dtype, with and without loss mask") {
  test::TempDir d("eks");
  std::vector<Record> recs = {
      make_record("a", 37, 16, 3, DType::kBFloat16, 1),
      make_record("b", 5, 8, 3, DType::kFloat16, 2, DType::kBool, DType::kInt32),
      make_record("c", 64, 12, 2, DType::kFloat32, 3, std::nullopt),
      make_record("d", 9, 4, 1, DType::kFloat64, 4, DType::kUInt8),
      make_record("empty", 0, 16, 3, DType::kBFloat16, 5),
  };
  // A non-contiguous hidden_states view (every other column of a wider tensor).
  Record nc = make_record("strided", 11, 8, 3, DType::kBFloat16, 6);
  std::mt19937 rng(7);
  HostTensor wide = random_floats(DType::kBFloat16, {11, 16}, rng);
  nc.hidden_states = wide;
  nc.hidden_states.shape = {11, 8};
  nc.hidden_states.strides = {16, 2};
  recs.push_back(nc);

  write_shard(d / "s.eks", recs, small_blocks());
  CHECK(detect_file_format(d / "s.eks") == Format::kEks);
  auto r = EksReader::open(d / "s.eks");
  REQUIRE(r->size() == recs.size());
  for (std::size_t i = 0; i < recs.size(); ++i) {
    check_same(r->read(i), recs[i]);
    const RecordInfo info = r->info(i);
    CHECK(info.conversation_id == recs[i].conversation_id);
    CHECK(info.tokens == recs[i].tokens());
    CHECK(info.hidden_size == recs[i].hidden_size());
    CHECK(info.aux_width == recs[i].aux_width());
    CHECK(info.hidden_dtype == recs[i].hidden_states.dtype);
    CHECK(info.ids_dtype == recs[i].input_ids.dtype);
    CHECK(info.has_loss_mask == recs[i].loss_mask.has_value());
    CHECK(info.codec == "zstd");
    CHECK(info.byte_offset >= kEksHeaderSize);
    CHECK((info.byte_size > 0) == (recs[i].tokens() > 0));
  }
  // Blocks of ~1 KiB: hidden rows of a are 32 bytes, so 32 rows per block, 2 blocks.
  const EksTensorEntry* h = r->entry(0).tensor(EksRole::kHiddenStates);
  REQUIRE(h != nullptr);
  CHECK(h->rows_per_block == 32);
  CHECK(h->blocks.size() == 2);
  CHECK(h->transform == EksTransform::kBytePlanes);
  CHECK(r->entry(1).tensor(EksRole::kLossMask)->transform == EksTransform::kNone);
  CHECK(r->find("c") == std::optional<std::size_t>(2));
  CHECK_FALSE(r->find("nope").has_value());

  // The generic interface finds the same shard by magic bytes.
  auto g = open_reader(d / "s.eks");
  CHECK(g->format() == Format::kEks);
  check_same(g->read(3), recs[3]);
}

TEST_CASE("eks: an encoded record is deterministic and bf16 hidden states shrink") {
  Record rec = make_record("x", 256, 256, 3, DType::kBFloat16, 11);
  EksEncodeOptions o;
  const EksEncodedRecord a = encode_eks_record(rec, o);
  const EksEncodedRecord b = encode_eks_record(rec, o);
  CHECK(a.data == b.data);
  CHECK(a.raw_bytes == static_cast<std::uint64_t>(256 * 8 + 256 * 256 * 2 * 4 + 256 * 8));
  // Gaussian bf16 has ~11-12 bits of entropy per value: well under 16 after the shuffle.
  CHECK(static_cast<double>(a.data.size()) < 0.85 * static_cast<double>(a.raw_bytes));
}

TEST_CASE("eks: read_prefix decodes only the blocks it needs") {
  test::TempDir d("eks");
  std::vector<Record> recs = {make_record("p", 100, 16, 3, DType::kBFloat16, 21),
                              make_record("q", 40, 16, 3, DType::kBFloat16, 22)};
  write_shard(d / "s.eks", recs, small_blocks());
  auto r = EksReader::open(d / "s.eks");
  for (std::int64_t n : {0, 1, 31, 32, 33, 64, 99, 100, 1000}) {
    const Record p = r->read_prefix(0, n);
    const Record want = recs[0].prefix(n);
    CHECK(p.tokens() == std::min<std::int64_t>(n, 100));
    check_same(p, Record{want.conversation_id, want.input_ids.contiguous(),
                         want.hidden_states.contiguous(), want.aux_hidden_states.contiguous(),
                         want.loss_mask->contiguous(), std::nullopt, 0, want.hidden_states_prenorm,
                         want.layout_prenorm});
  }
  // Wreck every frame of record 0 that starts at row 32 or later: a 32-row prefix still
  // decodes (those frames are never touched), the full record does not.
  auto bytes = test::read_bytes(d / "s.eks");
  const EksRecordEntry e = r->entry(0);
  int wrecked = 0;
  for (const auto& t : e.tensors)
    for (std::size_t b = 0; b < t.blocks.size(); ++b)
      if (b * t.rows_per_block >= 32) {
        std::memset(&bytes[e.data_offset + t.blocks[b].offset], 0xAB, t.blocks[b].stored_size);
        ++wrecked;
      }
  CHECK(wrecked >= 5);
  test::write_bytes(d / "wrecked.eks", bytes);
  auto w = EksReader::open(d / "wrecked.eks");
  const Record p = w->read_prefix(0, 32);
  CHECK(p.hidden_states.equal(recs[0].hidden_states.rows(32).contiguous()));
  CHECK_THROWS_AS(w->read(0), FormatError);
  check_same(w->read(1), recs[1]);
}

TEST_CASE("eks: fp8 codec keeps ids and mask exact and hidden states within e4m3 error") {
  test::TempDir d("eks");
  std::vector<Record> recs = {make_record("f", 70, 32, 3, DType::kBFloat16, 31),
                              make_record("g", 20, 16, 3, DType::kFloat32, 32)};
  // Row 3 of f: all zeros; row 4: holds an infinity and a NaN.
  HostTensor& hs = recs[0].hidden_states;
  std::memset(hs.mutable_data() + 3 * 32 * 2, 0, 32 * 2);
  const std::uint16_t inf = 0x7f80, nan = 0x7fc0;
  std::memcpy(hs.mutable_data() + (4 * 32 + 1) * 2, &inf, 2);
  std::memcpy(hs.mutable_data() + (4 * 32 + 2) * 2, &nan, 2);

  write_shard(d / "f.eks", recs, small_blocks(EksCodec::kFp8));
  auto r = EksReader::open(d / "f.eks");
  for (std::size_t i = 0; i < recs.size(); ++i) {
    const Record got = r->read(i);
    CHECK(r->info(i).codec == "fp8");
    CHECK(got.input_ids.equal(recs[i].input_ids));
    CHECK(got.loss_mask->equal(*recs[i].loss_mask));
    for (const auto* pair : {&recs[i].hidden_states, &recs[i].aux_hidden_states}) {
      const HostTensor& want = *pair;
      const HostTensor& have = pair == &recs[i].hidden_states ? got.hidden_states
                                                              : got.aux_hidden_states;
      REQUIRE(have.shape == want.shape);
      CHECK(have.dtype == want.dtype);
      const std::int64_t cols = want.shape[1];
      double worst = 0;
      for (std::int64_t row = 0; row < want.shape[0]; ++row) {
        double amax = 0;
        for (std::int64_t c = 0; c < cols; ++c) {
          const double v = want.get(row * cols + c);
          if (std::isfinite(v)) amax = std::max(amax, std::fabs(v));
        }
        const double scale = amax / 448.0;
        for (std::int64_t c = 0; c < cols; ++c) {
          const double v = want.get(row * cols + c), q = have.get(row * cols + c);
          if (std::isnan(v)) {
            CHECK(std::isnan(q));
            continue;
          }
          if (std::isinf(v)) {
            CHECK(q == doctest::Approx(std::copysign(amax, v)).epsilon(0.01));
            continue;
          }
          // Half an e4m3 ulp (1/16 relative) or half a subnormal step, plus the rounding
          // of the result back to bf16.
          const double bound = std::max(std::fabs(v) / 16.0, scale * std::ldexp(1.0, -10)) +
                               std::fabs(v) / 128.0 + 1e-30;
          worst = test::worst_of(worst, std::fabs(q - v) / bound);
        }
      }
      CHECK(worst <= 1.0);
      CHECK(worst > 0.0);  // it is lossy: a test that cannot tell would pass with raw bytes
    }
  }
  // The all-zero row stays zero.
  const Record got = r->read(0);
  for (int c = 0; c < 32; ++c) CHECK(got.hidden_states.get(3 * 32 + c) == 0.0);
  // fp8 of float64 is refused.
  Record f64 = make_record("h", 4, 4, 1, DType::kFloat64, 33);
  CHECK(error_of<UsageError>([&] { encode_eks_record(f64, small_blocks(EksCodec::kFp8)); }) ==
        "fp8 codec: hidden_states is float64; only bfloat16, float16 and float32 can be "
        "quantized");
}

TEST_CASE("eks: concurrent reads from many threads return the right records") {
  test::TempDir d("eks");
  std::vector<Record> recs;
  for (int i = 0; i < 12; ++i)
    recs.push_back(make_record("c" + std::to_string(i), 20 + 7 * i, 16, 3, DType::kBFloat16,
                               100 + static_cast<unsigned>(i)));
  write_shard(d / "s.eks", recs, small_blocks());
  auto r = EksReader::open(d / "s.eks");
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      for (int k = 0; k < 40; ++k) {
        const std::size_t i = static_cast<std::size_t>((k * 5 + t * 3) % 12);
        const std::int64_t n = (k % 3 == 0) ? -1 : (k * 13) % 90;
        const Record got = r->read_prefix(i, n);
        const Record want = n < 0 ? recs[i] : recs[i].prefix(n);
        if (!got.hidden_states.equal(want.hidden_states.contiguous()) ||
            !got.aux_hidden_states.equal(want.aux_hidden_states.contiguous()) ||
            !got.input_ids.equal(want.input_ids.contiguous()))
          ++mismatches;
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(mismatches.load() == 0);
}

TEST_CASE("eks: writer is atomic and refuses misuse") {
  test::TempDir d("eks");
  const Record rec = make_record("w", 10, 8, 3, DType::kBFloat16, 41);
  {
    EksWriter w(d / "s.eks", small_blocks());
    w.add(rec);
    CHECK(w.size() == 1);
    CHECK(w.bytes_written() > kEksHeaderSize);
    CHECK_FALSE(fs::exists(d / "s.eks"));
  }
  // Destroyed before finish(): neither the shard nor its temp file remains.
  CHECK(fs::is_empty(d.path()));
  EksWriter w(d / "s.eks", small_blocks());
  w.add(rec);
  w.finish();
  CHECK(fs::exists(d / "s.eks"));
  CHECK_THROWS_AS(w.add(rec), Error);
  CHECK_THROWS_AS(w.finish(), Error);
  // A record that fails Record::check never reaches the shard.
  Record bad = rec;
  bad.hidden_states = bad.hidden_states.rows(5);
  EksWriter w2(d / "t.eks", small_blocks());
  CHECK(error_of<FormatError>([&] { w2.add(bad); }) ==
        "conversation 'w': hidden_states: 5 rows but input_ids has 10 tokens");
  // An empty shard is valid.
  w2.finish();
  CHECK(EksReader::open(d / "t.eks")->size() == 0);

  // Through the generic writer: codec and level come from WriterOptions.
  WriterOptions wo;
  wo.format = Format::kEks;
  wo.codec = "fp8";
  auto gw = create_writer(d / "g.eks", wo);
  gw->add(rec);
  gw->finish();
  CHECK(open_reader(d / "g.eks")->info(0).codec == "fp8");
  wo.codec = "lz4";
  CHECK(error_of<UsageError>([&] { create_writer(d / "h.eks", wo); }) ==
        "unknown .eks codec 'lz4' (use zstd or fp8)");
  wo.codec = "zstd";
  wo.level = 99;
  CHECK(error_of<UsageError>([&] { create_writer(d / "h.eks", wo); }) ==
        "zstd level 99 is out of range (1..22)");
}

TEST_CASE("eks: corrupt shards fail with errors that name shard, field and record") {
  test::TempDir d("eks");
  std::vector<Record> recs = {make_record("r0", 40, 16, 3, DType::kBFloat16, 51),
                              make_record("r1", 40, 16, 3, DType::kBFloat16, 52),
                              make_record("r2", 40, 16, 3, DType::kBFloat16, 53)};
  write_shard(d / "good.eks", recs, small_blocks());
  const auto good = test::read_bytes(d / "good.eks");
  const IndexMap m = map_index(good);
  const std::string p = d / "bad.eks";
  const std::uint64_t size = good.size(), tr = size - 32;
  auto reader_error = [&](std::vector<std::uint8_t> bytes) {
    test::write_bytes(p, bytes);
    return error_of<FormatError>([&] { EksReader::open(p); });
  };

  SUBCASE("whole-shard damage: open fails") {
    CHECK(reader_error({}) ==
          p + ": header at byte 0: file is 0 bytes, too short for an .eks shard (16-byte "
              "header + 32-byte trailer): truncated");
    auto b = good;
    b[3] = 'X';
    CHECK(reader_error(b) ==
          p + ": magic at byte 0: not an .eks shard (the file does not start with 'EKSHARD1')");
    b = good;
    b[8] = 2;
    test::write_bytes(p, b);
    CHECK(error_of<UnsupportedError>([&] { EksReader::open(p); }) ==
          p + ": version at byte 8: .eks version 2 (this build reads version 1)");
    // Truncated (a killed writer never produces this: it writes to a temp name).
    b.assign(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(size - 100));
    CHECK(reader_error(b) ==
          p + ": trailer at byte " + std::to_string(size - 132) +
              ": no 'EKSINDEX' trailer at the end of the file: the shard is truncated, was "
              "never finished, or its trailer is damaged");
    b = good;
    b[size - 1] = 'Y';
    CHECK(reader_error(b).find("no 'EKSINDEX' trailer") != std::string::npos);
    // Damaged trailer: the index offset points elsewhere.
    b = good;
    put_le(b, tr, m.index_offset + 8, 8);
    CHECK(reader_error(b) ==
          p + ": trailer at byte " + std::to_string(tr) + ": index at byte " +
              std::to_string(m.index_offset + 8) + " with " + std::to_string(tr - m.index_offset) +
              " bytes does not end where the trailer starts (byte " + std::to_string(tr) +
              "): trailer damaged");
    b = good;
    put_le(b, tr, 1ull << 62, 8);
    CHECK(reader_error(b).find("trailer damaged") != std::string::npos);
    // A flipped bit in the index: the index checksum catches it.
    b = good;
    b[m.recs[1].data_size] ^= 0x10;
    test::write_bytes(p, b);
    const std::string msg = error_of<ChecksumError>([&] { EksReader::open(p); });
    CHECK(msg.rfind(p + ": index at byte " + std::to_string(m.index_offset) + ": xxh3 0x", 0) == 0);
    CHECK(msg.find("in the trailer: index or trailer damaged") != std::string::npos);
    // A record count the index cannot hold (resealed, so only the count is wrong).
    b = good;
    put_le(b, m.index_offset, 0xffffffffu, 4);
    reseal(b);
    CHECK(reader_error(b) == p + ": index record_count at byte " + std::to_string(m.index_offset) +
                                 ": 4294967295 records cannot fit in " +
                                 std::to_string(tr - m.index_offset) + " index bytes");
  }

  SUBCASE("damage inside one record: only that record fails") {
    auto b = good;
    const auto ref = EksReader::open(d / "good.eks");
    const EksRecordEntry e1 = ref->entry(1);
    const EksTensorEntry& h1 = *e1.tensor(EksRole::kHiddenStates);
    const std::uint64_t frame_at = e1.data_offset + h1.blocks[0].offset;
    std::string want;
    SUBCASE("index entry points past the end of the data") {
      put_le(b, m.recs[1].data_size, size, 8);
      reseal(b);
      want = p + ": record 1 ('r1') at byte " + std::to_string(e1.data_offset) + ": data of " +
             std::to_string(size) + " bytes at byte " + std::to_string(e1.data_offset) +
             " lies outside the data area [16, " + std::to_string(m.index_offset) + ")";
    }
    SUBCASE("block entry points past the end of its record") {
      put_le(b, m.recs[1].tensor_blocks[1], e1.data_size - 4, 8);  // hidden block 0 offset
      reseal(b);
      want = p + ": record 1 ('r1') hidden_states block 0 at byte " +
             std::to_string(e1.data_offset + e1.data_size - 4) + ": frame of " +
             std::to_string(h1.blocks[0].stored_size) + " bytes at record offset " +
             std::to_string(e1.data_size - 4) + " lies past the record's end (" +
             std::to_string(e1.data_size) + " bytes)";
    }
    SUBCASE("checksum mismatch") {
      const std::uint64_t hash_at = m.recs[1].tensor_blocks[1] + 12;
      put_le(b, hash_at, h1.blocks[0].xxh3 ^ 1, 8);
      reseal(b);
      char buf[128];
      std::snprintf(buf, sizeof buf, "xxh3 of the decoded bytes is 0x%016llx but the index says 0x%016llx",
                    static_cast<unsigned long long>(h1.blocks[0].xxh3),
                    static_cast<unsigned long long>(h1.blocks[0].xxh3 ^ 1));
      want = p + ": record 1 ('r1') hidden_states block 0 at byte " + std::to_string(frame_at) +
             ": " + buf;
      test::write_bytes(p, b);
      CHECK(error_of<ChecksumError>([&] { EksReader::open(p)->read(1); }) == want);
      // Switched off, the wrong checksum goes unnoticed; verify_record always checks.
      EksReadOptions fast;
      fast.verify_checksums = false;
      auto r = EksReader::open(p, fast);
      check_same(r->read(1), recs[1]);
      CHECK_THROWS_AS(r->verify_record(1), ChecksumError);
    }
    SUBCASE("zstd frame header destroyed") {
      std::memset(&b[frame_at], 0, 4);
      want = p + ": record 1 ('r1') hidden_states block 0 at byte " + std::to_string(frame_at) +
             ": not a zstd frame (bad frame header)";
    }
    SUBCASE("zstd frame body that does not decode") {
      // Keep magic and frame header; give the first block the reserved block type 3.
      const std::uint8_t fhd = b[frame_at + 4];
      const bool single = (fhd >> 5) & 1;
      const int fcs[4] = {single ? 1 : 0, 2, 4, 8};
      const int dict[4] = {0, 1, 2, 4};
      const std::uint64_t header = 4 + 1 + (single ? 0 : 1) + dict[fhd & 3] + fcs[fhd >> 6];
      b[frame_at + header] |= 0x06;
      want = p + ": record 1 ('r1') hidden_states block 0 at byte " + std::to_string(frame_at) +
             ": zstd frame does not decode: ";
    }
    SUBCASE("unknown codec in the index") {
      b[m.recs[1].codec] = 7;
      reseal(b);
      want = p + ": record 1 ('r1') codec at byte " + std::to_string(m.recs[1].codec + 1) +
             ": unknown codec 7";
    }
    test::write_bytes(p, b);
    auto r = EksReader::open(p);  // opening still works
    REQUIRE(r->size() == 3);
    const std::string got = error_of<FormatError>([&] { r->read(1); });
    CHECK(got.rfind(want, 0) == 0);
    if (got.rfind(want, 0) != 0) MESSAGE(got);
    CHECK(r->info(1).conversation_id == "r1");
    check_same(r->read(0), recs[0]);
    check_same(r->read(2), recs[2]);
  }
}

TEST_CASE("eks: an independent Python reading of the documented layout agrees") {
  test::require_python("numpy");
  test::TempDir d("eks");
  std::vector<Record> recs = {make_record("py-0", 45, 16, 3, DType::kBFloat16, 61),
                              make_record("py-1", 7, 8, 2, DType::kFloat32, 62, DType::kBool)};
  write_shard(d / "s.eks", recs, small_blocks());
  // Parses header, trailer and index per eks_format.h, pipes each tensor's frames through
  // `zstd -dc`, undoes the byte planes and writes the tensor bytes out.
  const char* script = R"PY(
import struct, subprocess, sys, numpy as np
path, out = sys.argv[1], sys.argv[2]
b = open(path, "rb").read()
assert b[:8] == b"EKSHARD1" and struct.unpack_from("<HHI", b, 8) == (1, 0, 0)
io, isz, _ = struct.unpack_from("<QQQ", b, len(b) - 32)
assert b[-8:] == b"EKSINDEX" and io + isz == len(b) - 32
p = io
(n,) = struct.unpack_from("<I", b, p); p += 4
SIZE = [1, 1, 1, 2, 4, 8, 2, 2, 4, 8]
ROLE = ["input_ids", "hidden_states", "aux_hidden_states", "loss_mask"]
for r in range(n):
    (l,) = struct.unpack_from("<H", b, p); p += 2
    cid = b[p:p + l].decode(); p += l
    off, size, tokens, codec, nt = struct.unpack_from("<QQqBB", b, p); p += 26
    assert codec == 0
    for _ in range(nt):
        role, dt, tr, nd = struct.unpack_from("<BBBB", b, p); p += 4
        shape = struct.unpack_from("<%dq" % nd, b, p); p += 8 * nd
        rpb, nb = struct.unpack_from("<II", b, p); p += 8
        blocks = [struct.unpack_from("<QIQ", b, p + 20 * k) for k in range(nb)]; p += 20 * nb
        assert shape[0] == tokens
        frames = b"".join(b[off + o: off + o + s] for o, s, _ in blocks)
        raw = subprocess.run(["zstd", "-dc"], input=frames, capture_output=True, check=True).stdout
        es, row = SIZE[dt], int(np.prod(shape[1:])) * SIZE[dt]
        res, q = bytearray(), 0
        for k in range(nb):
            rows = min(rpb, tokens - k * rpb)
            chunk = np.frombuffer(raw[q:q + rows * row], np.uint8); q += rows * row
            if tr == 1:
                chunk = chunk.reshape(es, -1)[::-1].T.reshape(-1)
            res += chunk.tobytes()
        assert q == len(raw)
        open("%s/%s.%s" % (out, cid, ROLE[role]), "wb").write(res)
print(n)
)PY";
  const auto res = test::python(script, {d / "s.eks", d.path()});
  REQUIRE_MESSAGE(res.exit_code == 0, res.err);
  CHECK(res.out == "2\n");
  for (const auto& r : recs) {
    auto bytes_of = [](const HostTensor& t) {
      std::vector<std::uint8_t> v(t.nbytes());
      t.copy_to(v.data());
      return v;
    };
    CHECK(test::read_bytes(d / (r.conversation_id + ".input_ids")) == bytes_of(r.input_ids));
    CHECK(test::read_bytes(d / (r.conversation_id + ".hidden_states")) == bytes_of(r.hidden_states));
    CHECK(test::read_bytes(d / (r.conversation_id + ".aux_hidden_states")) ==
          bytes_of(r.aux_hidden_states));
    CHECK(test::read_bytes(d / (r.conversation_id + ".loss_mask")) == bytes_of(*r.loss_mask));
  }
}

// What tests/fuzz checks at scale (fuzz_eks), pinned here: an index entry claiming a
// tensor of 40 x 2^60 elements fails that record on the numbers alone, before anything
// is allocated for it; the other records still read.
TEST_CASE("eks: an absurd tensor shape in the index fails its record before any allocation") {
  test::TempDir d("eks");
  std::vector<Record> recs = {make_record("r0", 40, 16, 3, DType::kBFloat16, 51),
                              make_record("r1", 40, 16, 3, DType::kBFloat16, 52)};
  write_shard(d / "good.eks", recs, small_blocks());
  auto b = test::read_bytes(d / "good.eks");
  const IndexMap m = map_index(b);
  // hidden_states: ..., i64 shape[1], u32 rows_per_block, u32 block_count, blocks...
  put_le(b, m.recs[1].tensor_blocks[1] - 16, 1ull << 60, 8);
  reseal(b);
  const std::string p = d / "big.eks";
  test::write_bytes(p, b);
  const auto r = EksReader::open(p);
  const std::string msg = error_of<FormatError>([&] { r->read(1); });
  CHECK(msg.rfind(p + ": record 1 ('r1') hidden_states at byte ", 0) == 0);
  CHECK(msg.find(": shape 40 x ... is too large") != std::string::npos);
  check_same(r->read(0), recs[0]);
}

// The stated norm form (Record::hidden_states_prenorm): a hidden_norm byte per index entry
// behind header flag 1, only when some record states one.
TEST_CASE("eks: records keep their stated norm form; shards where none states one are unchanged") {
  test::TempDir d("eks");
  Record pre = make_record("pre", 9, 8, 2, DType::kBFloat16, 71);
  Record post = make_record("post", 5, 8, 2, DType::kBFloat16, 72);
  Record unstated = make_record("unstated", 6, 8, 2, DType::kBFloat16, 73);
  pre.hidden_states_prenorm = true;
  post.hidden_states_prenorm = false;
  write_shard(d / "flags.eks", {pre, post, unstated}, small_blocks());
  write_shard(d / "plain.eks", {unstated}, small_blocks());
  const auto flags = test::read_bytes(d / "flags.eks");
  const auto plain = test::read_bytes(d / "plain.eks");
  CHECK(load_le16(&flags[10]) == 1);
  CHECK(load_le16(&plain[10]) == 0);  // what older builds write and read
  const auto r = EksReader::open(d / "flags.eks");
  CHECK(r->info(0).hidden_states_prenorm == std::optional<bool>(true));
  CHECK(r->info(1).hidden_states_prenorm == std::optional<bool>(false));
  CHECK_FALSE(r->info(2).hidden_states_prenorm.has_value());
  CHECK(r->read(0).hidden_states_prenorm == std::optional<bool>(true));
  CHECK(r->read_prefix(1, 2).hidden_states_prenorm == std::optional<bool>(false));
  CHECK_FALSE(r->read(2).hidden_states_prenorm.has_value());
  check_same(r->read(0), pre);
  check_same(r->read(2), unstated);
  CHECK_FALSE(EksReader::open(d / "plain.eks")->read(0).hidden_states_prenorm.has_value());

  // An independent reading of the documented bytes: flag 1, then a hidden_norm byte after
  // each entry's codec byte (2 pre, 1 post, 0 not stated).
  const auto py = test::python(R"PY(
import struct, sys
b = open(sys.argv[1], "rb").read()
(flags,) = struct.unpack_from("<H", b, 10)
io, = struct.unpack_from("<Q", b, len(b) - 32)
p = io
(n,) = struct.unpack_from("<I", b, p); p += 4
out = []
for r in range(n):
    (l,) = struct.unpack_from("<H", b, p); p += 2
    cid = b[p:p + l].decode(); p += l
    off, size, tokens, codec, norm, nt = struct.unpack_from("<QQqBBB", b, p); p += 27
    for _ in range(nt):
        role, dt, tr, nd = struct.unpack_from("<BBBB", b, p); p += 4 + 8 * nd
        rpb, nb = struct.unpack_from("<II", b, p); p += 8 + 20 * nb
    out.append("%s=%d" % (cid, norm))
print(flags, " ".join(out))
)PY", {d / "flags.eks"});
  REQUIRE_MESSAGE(py.exit_code == 0, py.err);
  CHECK(py.out == "1 pre=2 post=1 unstated=0\n");

  SUBCASE("an unknown hidden_norm value fails that record only") {
    auto b = flags;
    // Record 0's hidden_norm byte follows its codec byte.
    std::uint64_t p = load_le64(&b[b.size() - 32]) + 4;
    p += 2 + load_le16(&b[p]) + 24 + 1;
    b[p] = 7;
    reseal(b);
    test::write_bytes(d / "norm.eks", b);
    const auto bad = EksReader::open(d / "norm.eks");
    CHECK(error_of<FormatError>([&] { bad->read(0); }) ==
          d / "norm.eks" + ": record 0 ('pre') hidden_norm at byte " + std::to_string(p + 1) +
              ": unknown value 7 (0, 1 or 2)");
    check_same(bad->read(1), post);
  }
  SUBCASE("an unknown header flag is refused") {
    // Bit 2 (4) is unknown to this build, as bit 1 (2, the facts block) is to the builds
    // before it: those refuse a shard with facts the same way.
    auto b = flags;
    put_le(b, 10, 5, 2);
    test::write_bytes(d / "flag.eks", b);
    CHECK(error_of<UnsupportedError>([&] { EksReader::open(d / "flag.eks"); }) ==
          d / "flag.eks" + ": flags at byte 10: unknown header flags 5");
  }
}

// tests/data/eks/make_fixture.sh: shards the writer wrote before .eks could hold file facts
// or stored target distributions (eaglekit at a5a8c6e, libzstd 1.5.4), and the records they
// came from. Written again now, with the same options, they are the same bytes: a shard
// without facts or target_probs is what it always was, and older builds read it. (zstd's own
// frames could differ under another libzstd; the header, the index layout and the trailer
// are zstd's choice only through frame sizes.)
TEST_CASE("eks: shards without facts are byte for byte what the writer wrote before facts existed") {
  const std::string fx = test::source_dir() + "/tests/data/eks/";
  struct Golden {
    const char* shard;
    const char* records;
    EksCodec codec;
    std::uint16_t flags;
  };
  for (const Golden& g : {Golden{"zstd", "plain", EksCodec::kZstd, 0}, Golden{"fp8", "plain", EksCodec::kFp8, 0},
                          Golden{"norm", "norm", EksCodec::kZstd, 1}}) {
    CAPTURE(g.shard);
    const std::string golden = fx + "golden/" + g.shard + ".eks";
    const auto want = test::read_bytes(golden);
    REQUIRE(want.size() > 48);
    CHECK(load_le16(&want[10]) == g.flags);
    CHECK(EksReader::open(golden)->facts().empty());
    test::TempDir d("eks-golden");
    EksEncodeOptions o;
    o.codec = g.codec;
    o.block_bytes = 256;
    EksWriter w(d / "again.eks", o);
    CHECK(w.set_facts(FileFacts{}).empty());
    for (const std::string& f : find_record_files(fx + "records/" + g.records)) {
      const auto reader = open_reader(f);
      for (std::size_t i = 0; i < reader->size(); ++i) w.add(reader->read(i));
    }
    w.finish();
    const auto got = test::read_bytes(d / "again.eks");
    CHECK(got.size() == want.size());
    CHECK_MESSAGE(got == want, "the writer no longer writes " << golden << " byte for byte");
  }
}

namespace {

// A record of stored target distributions (Record::target_probs, as NeMo's cache reader
// returns one): ids, aux [T, k*H] and target_probs [T, Vd] in one dtype, a loss mask, no
// hidden states. Each target_probs row is a distribution (non-negative, summing to 1).
Record make_target_record(const std::string& id, std::int64_t t, std::int64_t h, int k, std::int64_t vd, DType dt,
                          unsigned seed) {
  std::mt19937 rng(seed);
  Record r;
  r.conversation_id = id;
  r.input_ids = ids_tensor(DType::kInt64, t, rng);
  r.aux_hidden_states = random_floats(dt, {t, k * h}, rng);
  HostTensor p = HostTensor::zeros(DType::kFloat32, {t, vd});
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  auto* q = reinterpret_cast<float*>(p.mutable_data());
  for (std::int64_t row = 0; row < t; ++row) {
    float sum = 0;
    for (std::int64_t c = 0; c < vd; ++c) sum += q[row * vd + c] = u(rng) < 0.7f ? 0.0f : u(rng);
    for (std::int64_t c = 0; c < vd; ++c) q[row * vd + c] = sum > 0 ? q[row * vd + c] / sum : 1.0f / static_cast<float>(vd);
  }
  if (dt == DType::kFloat32) {
    r.target_probs = p;
  } else {
    HostTensor c = HostTensor::zeros(dt, {t, vd});
    for (std::int64_t i = 0; i < t * vd; ++i) {
      const std::uint16_t b = dt == DType::kBFloat16 ? float_to_bf16(q[i]) : float_to_fp16(q[i]);
      std::memcpy(c.mutable_data() + 2 * i, &b, 2);
    }
    r.target_probs = c;
  }
  r.target_hidden_size = h;
  HostTensor m = HostTensor::zeros(DType::kInt64, {t});
  for (std::int64_t i = 1; i < t; ++i) {
    const std::int64_t v = i % 3 != 0;
    std::memcpy(m.mutable_data() + 8 * i, &v, 8);
  }
  r.loss_mask = m;
  return r;
}

FileFacts target_facts(std::int64_t vd, std::int64_t topk = 0) {
  FileFacts f;
  f.aux_layer_ids = {2, 17, 30};
  TargetVocabulary v;
  v.target_vocab_size = 1000;
  v.topk = topk;
  for (std::int64_t i = 0; i < vd; ++i) v.selected.push_back((i * 37 + 11) % 1000);  // not ascending
  f.target_vocabulary = v;
  return f;
}

void check_same_target(const Record& got, const Record& want) {
  CHECK(got.conversation_id == want.conversation_id);
  CHECK(got.tokens() == want.tokens());
  CHECK(got.hidden_states.dim() == 0);
  CHECK(got.hidden_size() == want.hidden_size());
  CHECK(got.target_hidden_size == want.target_hidden_size);
  CHECK(got.input_ids.equal(want.input_ids));
  CHECK(got.aux_hidden_states.equal(want.aux_hidden_states));
  REQUIRE(got.target_probs.has_value());
  CHECK(got.target_probs->equal(*want.target_probs));
  REQUIRE(got.loss_mask.has_value() == want.loss_mask.has_value());
  if (want.loss_mask) CHECK(got.loss_mask->equal(*want.loss_mask));
}

// The byte offset of the facts block (header flag 2): the start of the index.
std::uint64_t facts_at(const std::vector<std::uint8_t>& b) { return load_le64(&b[b.size() - 32]); }

}  // namespace

TEST_CASE("eks: a shard keeps its file facts and records of stored target distributions, target_probs lossless") {
  test::TempDir d("eks-facts");
  const std::vector<Record> recs = {make_target_record("t0", 37, 8, 3, 40, DType::kBFloat16, 81),
                                    make_target_record("t1", 5, 8, 3, 40, DType::kBFloat16, 82),
                                    make_target_record("empty", 0, 8, 3, 40, DType::kBFloat16, 83)};
  const FileFacts facts = target_facts(40, 4);
  for (const EksCodec codec : {EksCodec::kZstd, EksCodec::kFp8}) {
    CAPTURE(eks_codec_name(codec));
    const std::string path = d / (std::string(eks_codec_name(codec)) + ".eks");
    {
      EksWriter w(path, small_blocks(codec));
      CHECK(w.set_facts(facts).empty());  // keeps both
      for (const Record& r : recs) w.add(r);
      w.finish();
    }
    const auto bytes = test::read_bytes(path);
    CHECK(load_le16(&bytes[10]) == kEksFlagFacts);
    const auto r = EksReader::open(path);
    CHECK(r->facts().aux_layer_ids == facts.aux_layer_ids);
    CHECK(r->facts().target_vocabulary == facts.target_vocabulary);
    CHECK(r->target_hidden_size() == 8);
    // Through the generic interface too: what the trainer's plan reads.
    CHECK(open_reader(path)->facts().target_vocabulary == facts.target_vocabulary);
    REQUIRE(r->size() == recs.size());
    for (std::size_t i = 0; i < recs.size(); ++i) {
      CAPTURE(i);
      const Record got = r->read(i);
      got.check("read back");
      const EksTensorEntry* probs = r->entry(i).tensor(EksRole::kTargetProbs);
      REQUIRE(probs != nullptr);
      CHECK(r->entry(i).tensor(EksRole::kHiddenStates) == nullptr);
      // target_probs is lossless whatever the codec: byte planes, never fp8.
      CHECK(probs->transform == EksTransform::kBytePlanes);
      CHECK(got.target_probs->equal(*recs[i].target_probs));
      if (codec == EksCodec::kZstd) {
        check_same_target(got, recs[i]);
      } else {
        CHECK(r->entry(i).tensor(EksRole::kAuxHiddenStates)->transform == EksTransform::kFp8RowScaled);
        CHECK(got.input_ids.equal(recs[i].input_ids));
        CHECK(got.loss_mask->equal(*recs[i].loss_mask));
        CHECK(got.aux_hidden_states.shape == recs[i].aux_hidden_states.shape);
        if (recs[i].tokens() > 0) CHECK_FALSE(got.aux_hidden_states.equal(recs[i].aux_hidden_states));  // lossy
      }
      const RecordInfo info = r->info(i);
      CHECK(info.tokens == recs[i].tokens());
      CHECK(info.hidden_size == 8);
      CHECK(info.aux_width == 24);
      CHECK(info.target_probs_width == 40);
      CHECK(info.hidden_dtype == DType::kBFloat16);
      CHECK(info.has_loss_mask);
      CHECK(info.codec == eks_codec_name(codec));
      const RecordInfo from_record = info_of(got);
      CHECK(from_record.hidden_size == info.hidden_size);
      CHECK(from_record.target_probs_width == info.target_probs_width);
    }
    // A prefix decodes the first rows of each tensor, target_probs among them.
    const Record head = r->read_prefix(0, 33);
    CHECK(head.tokens() == 33);
    CHECK(head.target_hidden_size == 8);
    CHECK(head.target_probs->equal(recs[0].target_probs->rows(33).contiguous()));
    CHECK(r->entry(0).tensor(EksRole::kTargetProbs)->blocks.size() > 1);
  }
  // Facts without a target vocabulary (a DeepSpec cache's aux layer ids) and records of hidden
  // states: flag 2, a block of 5 + 8A bytes, the records as before.
  FileFacts ids_only;
  ids_only.aux_layer_ids = {1, 2, 3};
  const Record plain = make_record("h", 9, 8, 3, DType::kBFloat16, 84);
  {
    EksWriter w(d / "ids.eks", small_blocks());
    CHECK(w.set_facts(ids_only).empty());
    w.add(plain);
    w.finish();
  }
  const auto ids_bytes = test::read_bytes(d / "ids.eks");
  CHECK(load_le16(&ids_bytes[10]) == kEksFlagFacts);
  CHECK(load_le32(&ids_bytes[facts_at(ids_bytes)]) == 5 + 8 * 3);
  const auto ir = EksReader::open(d / "ids.eks");
  CHECK(ir->facts().aux_layer_ids == ids_only.aux_layer_ids);
  CHECK_FALSE(ir->facts().target_vocabulary.has_value());
  check_same(ir->read(0), plain);

  // An independent reading of the documented facts block (eks_format.h, docs/formats.md).
  const auto py = test::python(R"PY(
import struct, sys
b = open(sys.argv[1], "rb").read()
(flags,) = struct.unpack_from("<H", b, 10)
p, = struct.unpack_from("<Q", b, len(b) - 32)
size, a = struct.unpack_from("<II", b, p)
ids = struct.unpack_from("<%dq" % a, b, p + 8)
q = p + 8 + 8 * a
(voc,) = struct.unpack_from("<B", b, q)
V, topk, H, vd = struct.unpack_from("<qqqI", b, q + 1)
sel = struct.unpack_from("<%dI" % vd, b, q + 29)
assert size == 33 + 8 * a + 4 * vd, size
(n,) = struct.unpack_from("<I", b, p + 4 + size)
roles = []
r = p + 8 + size
for _ in range(n):
    (l,) = struct.unpack_from("<H", b, r); r += 2 + l
    off, sz, tokens, codec, nt = struct.unpack_from("<QQqBB", b, r); r += 26
    rs = []
    for _ in range(nt):
        role, dt, tr, nd = struct.unpack_from("<BBBB", b, r); r += 4
        shape = struct.unpack_from("<%dq" % nd, b, r); r += 8 * nd
        rpb, nb = struct.unpack_from("<II", b, r); r += 8 + 20 * nb
        rs.append("%d:%d:%s" % (role, tr, "x".join(map(str, shape))))
    roles.append(",".join(rs))
assert r == len(b) - 32
print(flags, list(ids), voc, V, topk, H, vd, sel[:3], roles[1])
)PY", {d / "zstd.eks"});
  REQUIRE_MESSAGE(py.exit_code == 0, py.err);
  CHECK(py.out == "2 [2, 17, 30] 1 1000 4 8 40 (11, 48, 85) 0:1:5,2:1:5x24,3:1:5,4:1:5x40\n");
}

TEST_CASE("eks: the writer refuses records of stored distributions its facts do not describe") {
  test::TempDir d("eks-facts");
  const Record probs = make_target_record("p", 6, 8, 3, 40, DType::kFloat32, 91);
  const Record hidden = make_record("h", 6, 8, 3, DType::kFloat32, 92);
  const std::string p = d / "s.eks";
  {
    EksWriter w(p, small_blocks());
    CHECK(error_of<UsageError>([&] { w.add(probs); }) ==
          p + ": conversation 'p' stores the target's distribution over a draft vocabulary (target_probs), but no "
              "target vocabulary was set (EksWriter::set_facts, before the first record): without it the "
              "distribution's columns name no token. convert passes the source's facts");
    FileFacts ids_only;
    ids_only.aux_layer_ids = {1, 2, 3};
    w.set_facts(ids_only);
    CHECK(error_of<UsageError>([&] { w.add(probs); }).find("but no target vocabulary was set") != std::string::npos);
    w.set_facts(target_facts(32));
    CHECK(error_of<UsageError>([&] { w.add(probs); }) ==
          p + ": conversation 'p': target_probs is 40 wide, but the shard's target vocabulary has 32 draft tokens");
    w.set_facts(target_facts(40));
    CHECK(error_of<UsageError>([&] { w.add(hidden); }).find(
              "conversation 'h' holds hidden states, but the shard's facts state a target vocabulary") != std::string::npos);
    w.add(probs);
    Record wider = make_target_record("w", 6, 12, 2, 40, DType::kFloat32, 93);
    CHECK(error_of<UsageError>([&] { w.add(wider); }) ==
          p + ": conversation 'w': hidden size 12 differs from 8, that of the shard's earlier records (one H a shard)");
    CHECK(error_of<Error>([&] { w.set_facts(target_facts(40)); }) == p + ": set_facts() after add() or finish()");
    CHECK(w.size() == 1);
    w.finish();
  }
  const auto r = EksReader::open(p);
  REQUIRE(r->size() == 1);
  check_same_target(r->read(0), probs);
  // Facts no shard can hold.
  EksWriter w(d / "t.eks", small_blocks());
  FileFacts bad = target_facts(4);
  bad.target_vocabulary->selected[2] = 1000;
  CHECK(error_of<UsageError>([&] { w.set_facts(bad); }) ==
        d / "t.eks" + ": draft id 2 selects target id 1000, outside the target vocabulary of 1000");
  bad = target_facts(4, 4);
  CHECK(error_of<UsageError>([&] { w.set_facts(bad); }).find("topk 4 is not in 0 .. 3") != std::string::npos);
  bad = FileFacts{};
  bad.aux_layer_ids = {1, -1};
  CHECK(error_of<UsageError>([&] { w.set_facts(bad); }).find("hold a negative id") != std::string::npos);
}

TEST_CASE("eks: a damaged facts block fails the open naming the shard, the byte offset and the field") {
  test::TempDir d("eks-facts");
  {
    EksWriter w(d / "good.eks", small_blocks());
    w.set_facts(target_facts(6));
    w.add(make_target_record("a", 4, 8, 3, 6, DType::kFloat32, 101));
    w.add(make_target_record("b", 3, 8, 3, 6, DType::kFloat32, 102));
    w.finish();
  }
  const auto good = test::read_bytes(d / "good.eks");
  REQUIRE(load_le16(&good[10]) == kEksFlagFacts);
  const std::uint64_t f = facts_at(good);
  // facts_size, aux_layer_count, 3 ids, vocabulary, V, topk, H, Vd, 6 selected ids.
  const std::uint64_t count = f + 4, vocab = f + 8 + 24, vsize = vocab + 1, topk = vocab + 9, hid = vocab + 17,
                      vd = vocab + 25, selected = vocab + 29;
  REQUIRE(load_le32(&good[f]) == 33 + 24 + 24);
  const std::string p = d / "bad.eks";
  struct Case {
    const char* name;
    std::function<void(std::vector<std::uint8_t>&)> damage;
    std::string want;  // the message after "p: "
  };
  const Case cases[] = {
      {"facts_size past the index", [&](auto& b) { put_le(b, f, 1u << 30, 4); },
       "facts block facts_size at byte " + std::to_string(f) + ": 1073741824 bytes, but the index has " +
           std::to_string(good.size() - 32 - f - 4) + " left (index corrupt)"},
      {"truncated block", [&](auto& b) { put_le(b, f, 30, 4); },
       "facts block target_vocab_size at byte " + std::to_string(vsize) +
           ": needs 8 bytes but the facts block has 1 left (facts block corrupt)"},
      {"aux_layer_count too large", [&](auto& b) { put_le(b, count, 0xffffffffu, 4); },
       "facts block aux_layer_count at byte " + std::to_string(count) + ": 4294967295 ids cannot fit in the 77 "
       "bytes left of the facts block"},
      {"negative layer id", [&](auto& b) { put_le(b, count + 4 + 8, static_cast<std::uint64_t>(-5), 8); },
       "facts block aux_layer_ids[1] at byte " + std::to_string(count + 12) + ": is -5; HF hidden_states indices are >= 0"},
      {"vocabulary byte", [&](auto& b) { b[vocab] = 7; },
       "facts block vocabulary at byte " + std::to_string(vocab) + ": is 7 (0 none, 1 a target vocabulary follows)"},
      {"target vocabulary of 0", [&](auto& b) { put_le(b, vsize, 0, 8); },
       "facts block target_vocab_size at byte " + std::to_string(vsize) + ": is 0 (1 .. 2^32)"},
      {"topk of Vd", [&](auto& b) { put_le(b, topk, 6, 8); },
       "facts block topk at byte " + std::to_string(topk) + ": is 6; 0 (the full distribution) or below "
       "draft_vocab_size 6"},
      {"negative hidden size", [&](auto& b) { put_le(b, hid, static_cast<std::uint64_t>(-1), 8); },
       "facts block target_hidden_size at byte " + std::to_string(hid) + ": is -1 (0 .. 2^31)"},
      {"draft_vocab_size too large", [&](auto& b) { put_le(b, vd, 1000000, 4); },
       "facts block draft_vocab_size at byte " + std::to_string(vd) + ": 1000000 ids cannot fit in the 24 bytes "
       "left of the facts block"},
      {"draft_vocab_size of 0", [&](auto& b) { put_le(b, vd, 0, 4); },
       "facts block draft_vocab_size at byte " + std::to_string(vd) + ": is 0"},
      {"a selected id past the target vocabulary", [&](auto& b) { put_le(b, selected + 4 * 3, 1000, 4); },
       "facts block selected[3] at byte " + std::to_string(selected + 12) +
           ": target id 1000 is not below target_vocab_size 1000"},
      {"bytes left in the block", [&](auto& b) { put_le(b, vd, 5, 4); },
       "facts block at byte " + std::to_string(selected + 20) + ": 4 bytes left after its last field (facts_size says " +
           std::to_string(load_le32(&good[f])) + "; facts block corrupt)"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.name);
    auto b = good;
    c.damage(b);
    reseal(b);
    test::write_bytes(p, b);
    CHECK(error_of<FormatError>([&] { EksReader::open(p); }) == p + ": " + c.want);
  }
  // Unsealed, any change to the block is the index checksum's.
  auto b = good;
  b[selected] ^= 1;
  test::write_bytes(p, b);
  CHECK(error_of<ChecksumError>([&] { EksReader::open(p); }).find("index or trailer damaged") != std::string::npos);
  // Without its flag the block is read as the record count: refused, not misread.
  b = good;
  put_le(b, 10, 0, 2);
  test::write_bytes(p, b);
  CHECK(error_of<FormatError>([&] { EksReader::open(p); }).find(p + ": index record_count at byte " + std::to_string(f)) == 0);
}

TEST_CASE("eks: a target_probs role the shard's facts do not describe fails that record only") {
  test::TempDir d("eks-facts");
  const std::vector<Record> recs = {make_target_record("r0", 4, 8, 3, 6, DType::kFloat32, 111),
                                    make_target_record("r1", 3, 8, 3, 6, DType::kFloat32, 112)};
  {
    EksWriter w(d / "good.eks", small_blocks());
    w.set_facts(target_facts(6));
    for (const Record& r : recs) w.add(r);
    w.finish();
  }
  const auto good = test::read_bytes(d / "good.eks");
  REQUIRE(load_le16(&good[10]) == kEksFlagFacts);
  const std::uint64_t f = facts_at(good), vocab = f + 8 + 24;
  const std::uint64_t block = load_le32(&good[f]);
  const std::string p = d / "bad.eks";
  auto check_record_1 = [&](const std::vector<std::uint8_t>& b, const std::string& want) {
    test::write_bytes(p, b);
    const auto r = EksReader::open(p);
    const std::string got = error_of<FormatError>([&] { r->read(1); });
    CHECK(got == p + ": record 1 ('r1') target_probs at byte " + std::to_string(r->entry(1).data_offset) + ": " + want);
    check_same_target(r->read(0), recs[0]);
  };
  SUBCASE("the facts block states no target vocabulary") {
    // The block without its vocabulary (5 + 8A bytes), the trailer's index_size to match.
    auto b = good;
    const std::uint64_t cut = block - (5 + 24);
    b.erase(b.begin() + static_cast<std::ptrdiff_t>(vocab + 1), b.begin() + static_cast<std::ptrdiff_t>(vocab + 1 + cut));
    b[vocab] = 0;
    put_le(b, f, 5 + 24, 4);
    put_le(b, b.size() - 24, load_le64(&b[b.size() - 24]) - cut, 8);
    reseal(b);
    test::write_bytes(p, b);
    const auto r = EksReader::open(p);
    REQUIRE_FALSE(r->facts().target_vocabulary.has_value());
    CHECK(r->facts().aux_layer_ids == std::vector<std::int64_t>{2, 17, 30});
    // Every record fails alone, naming itself; info still describes it.
    CHECK(error_of<FormatError>([&] { r->read(0); }).find("stored, but the shard states no target vocabulary") !=
          std::string::npos);
    CHECK(error_of<FormatError>([&] { r->read(1); }) ==
          p + ": record 1 ('r1') target_probs at byte " + std::to_string(r->entry(1).data_offset) +
              ": stored, but the shard states no target vocabulary (no facts block)");
    CHECK(r->info(1).conversation_id == "r1");
  }
  SUBCASE("target_probs narrower than the vocabulary") {
    auto b = good;
    // Record 1's last tensor is target_probs: i64 shape[1] sits 16 bytes before its block entries.
    const auto r = EksReader::open(d / "good.eks");
    const EksTensorEntry& t = *r->entry(1).tensor(EksRole::kTargetProbs);
    const std::uint64_t blocks_end = good.size() - 32;  // record 1 is the last entry, target_probs its last tensor
    const std::uint64_t shape1 = blocks_end - 20 * t.blocks.size() - 8 - 8;
    REQUIRE(load_le64(&b[shape1]) == 6);
    put_le(b, shape1, 5, 8);
    reseal(b);
    check_record_1(b, "5 wide, but the target vocabulary has 6 draft tokens");
  }
}
