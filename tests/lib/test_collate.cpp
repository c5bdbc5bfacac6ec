#include "tests/torch_doctest.h"

#include <cstring>

#include "formats/error.h"
#include "lib/collate.h"
#include "tests/support.h"

using namespace eaglekit;

namespace {

// A record whose values say where they come from: ids 100*tag + t, hidden t*H + h + tag/8.
Record make_record(const std::string& id, std::int64_t t, std::int64_t h, int tag,
                   DType ids = DType::kInt64, std::optional<DType> mask = std::nullopt) {
  Record r;
  r.conversation_id = id;
  auto ids_t = at::arange(t, at::kLong) + 100 * tag;
  if (ids == DType::kInt32) ids_t = ids_t.to(at::kInt);
  auto hs = (at::arange(t * h, at::kFloat).reshape({t, h}) + tag / 8.0).to(at::kBFloat16);
  auto aux = (-at::arange(t * 3 * h, at::kFloat).reshape({t, 3 * h}) - tag).to(at::kBFloat16);
  r.input_ids = to_host_tensor(ids_t);
  r.hidden_states = to_host_tensor(hs);
  r.aux_hidden_states = to_host_tensor(aux);
  if (mask) {
    auto m = (at::arange(t, at::kLong) % 3 != 0);
    r.loss_mask = to_host_tensor(*mask == DType::kBool ? m : m.to(to_scalar_type(*mask)));
  }
  return r;
}

at::Tensor tensor_of(const HostTensor& t) {
  const HostTensor c = t.contiguous();
  return at::from_blob(const_cast<std::uint8_t*>(c.data), c.shape,
                       at::TensorOptions().dtype(to_scalar_type(c.dtype)))
      .clone();
}

}  // namespace

TEST_CASE("collate: pad mode is the reference collator (zero pad to max_length, labels -100 then 0)") {
  CollateOptions o;
  o.max_length = 8;
  const std::vector<Record> recs = {make_record("a", 3, 4, 1),
                                    make_record("b", 12, 4, 2, DType::kInt64, DType::kBool),
                                    make_record("c", 8, 4, 3, DType::kInt32, DType::kInt64)};
  const Batch b = collate_records(recs, o);
  REQUIRE(b.rows() == 3);
  CHECK(b.length == 8);
  CHECK(b.first_token == 0);
  CHECK(b.last_token == 8);
  CHECK((b.input_ids.sizes() == at::IntArrayRef({3, 8})));
  CHECK((b.hidden_states.sizes() == at::IntArrayRef({3, 8, 4})));
  CHECK((b.aux_hidden_states.sizes() == at::IntArrayRef({3, 8, 12})));
  CHECK((b.hidden_states.scalar_type() == at::kBFloat16));
  for (const auto& t : {b.input_ids, b.attention_mask, b.loss_mask, b.labels})
    CHECK((t.scalar_type() == at::kLong));
  CHECK_FALSE(b.document_ids.defined());
  const std::int64_t lens[] = {3, 8, 8};
  for (int r = 0; r < 3; ++r) {
    const std::int64_t n = lens[r];
    const Record& rec = recs[static_cast<std::size_t>(r)];
    CHECK(at::equal(b.input_ids[r].slice(0, 0, n), tensor_of(rec.input_ids.rows(n)).to(at::kLong)));
    CHECK(at::equal(b.hidden_states[r].slice(0, 0, n), tensor_of(rec.hidden_states.rows(n))));
    CHECK(at::equal(b.aux_hidden_states[r].slice(0, 0, n), tensor_of(rec.aux_hidden_states.rows(n))));
    CHECK(b.attention_mask[r].sum().item<std::int64_t>() == n);
    CHECK(at::equal(b.labels[r].slice(0, 0, n), at::full({n}, -100, at::kLong)));
    // Padding: zeros everywhere, labels included (the reference pads labels with 0).
    CHECK(b.input_ids[r].slice(0, n).abs().sum().item<std::int64_t>() == 0);
    CHECK(b.labels[r].slice(0, n).abs().sum().item<std::int64_t>() == 0);
    CHECK(b.loss_mask[r].slice(0, n).abs().sum().item<std::int64_t>() == 0);
    CHECK(b.hidden_states[r].slice(0, n).abs().sum().item<float>() == 0);
    CHECK(b.aux_hidden_states[r].slice(0, n).abs().sum().item<float>() == 0);
  }
  // No stored mask: ones; stored bool / int64 masks: used as stored.
  CHECK(b.loss_mask[0].slice(0, 0, 3).sum().item<std::int64_t>() == 3);
  const auto stored = (at::arange(8, at::kLong) % 3 != 0).to(at::kLong);
  CHECK(at::equal(b.loss_mask[1], stored));
  CHECK(at::equal(b.loss_mask[2], stored));
  CHECK(b.tokens == 19);
  CHECK(b.conversation_ids == std::vector<std::string>{"a", "b", "c"});
  CHECK(b.bytes == 19u * (4 + 12) * 2 + 3 * 8 + 8 * (8 + 1) + 8 * (4 + 8));
}

TEST_CASE("collate: longest mode pads to the longest sample rounded up, capped at max_length") {
  const std::vector<Record> recs = {make_record("a", 3, 2, 1), make_record("b", 5, 2, 2)};
  CollateOptions o;
  o.mode = CollateMode::kLongest;
  o.max_length = 20;
  o.pad_multiple = 8;
  CHECK(collate_records(recs, o).length == 8);
  o.pad_multiple = 4;
  CHECK(collate_records(recs, o).length == 8);
  o.pad_multiple = 1;
  CHECK(collate_records(recs, o).input_ids.size(1) == 5);
  o.pad_multiple = 64;
  CHECK(collate_records(recs, o).length == 20);
  o.max_length = 4;  // truncation first: longest is 4
  o.pad_multiple = 8;
  const Batch b = collate_records(recs, o);
  CHECK(b.length == 4);
  CHECK(b.attention_mask.sum().item<std::int64_t>() == 7);
  // The first max_length columns of pad mode equal longest mode's batch.
  CollateOptions pad = o;
  pad.mode = CollateMode::kPad;
  pad.max_length = 4;
  const Batch p = collate_records(recs, pad);
  CHECK(at::equal(p.hidden_states, b.hidden_states));
  CHECK(at::equal(p.input_ids, b.input_ids));
}

TEST_CASE("collate: pack_rows is greedy first-fit over a bounded window of open rows") {
  const std::vector<std::int64_t> lens = {5, 3, 4, 2, 8, 1};
  const std::vector<std::size_t> order = {0, 1, 2, 3, 4, 5};
  const auto rows = pack_rows(order, lens, 8);
  CHECK(rows == std::vector<std::vector<std::size_t>>{{0, 1}, {2, 3, 5}, {4}});
  // Longer than max_length: cut, and a row of its own.
  CHECK(pack_rows({0, 1}, {20, 1}, 8) == std::vector<std::vector<std::size_t>>{{0}, {1}});
  // After kPackWindow more rows open, the oldest stops taking samples.
  std::vector<std::int64_t> many(kPackWindow + 1, 5);
  many.push_back(3);
  std::vector<std::size_t> ord(many.size());
  for (std::size_t i = 0; i < ord.size(); ++i) ord[i] = i;
  const auto packed = pack_rows(ord, many, 8);
  REQUIRE(packed.size() == kPackWindow + 1);
  CHECK(packed[0] == std::vector<std::size_t>{0});
  CHECK(packed[1] == std::vector<std::size_t>{1, kPackWindow + 1});
}

TEST_CASE("collate: pack mode writes documents back to back with document and position ids") {
  CollateOptions o;
  o.mode = CollateMode::kPack;
  o.max_length = 8;
  const std::vector<Record> recs = {make_record("a", 5, 2, 1), make_record("b", 3, 2, 2),
                                    make_record("c", 4, 2, 3), make_record("d", 2, 2, 4)};
  const Batch b = collate_records(recs, o);
  REQUIRE(b.rows() == 2);  // {a, b} and {c, d}
  REQUIRE(b.document_ids.defined());
  CHECK(at::equal(b.document_ids[0], at::tensor({0, 0, 0, 0, 0, 1, 1, 1}, at::kLong)));
  CHECK(at::equal(b.position_ids[0], at::tensor({0, 1, 2, 3, 4, 0, 1, 2}, at::kLong)));
  CHECK(at::equal(b.document_ids[1], at::tensor({0, 0, 0, 0, 1, 1, -1, -1}, at::kLong)));
  CHECK(at::equal(b.position_ids[1], at::tensor({0, 1, 2, 3, 0, 1, 0, 0}, at::kLong)));
  CHECK(at::equal(b.attention_mask[1], at::tensor({1, 1, 1, 1, 1, 1, 0, 0}, at::kLong)));
  CHECK(at::equal(b.labels[1], at::tensor({-100, -100, -100, -100, -100, -100, 0, 0}, at::kLong)));
  CHECK(at::equal(b.input_ids[0].slice(0, 5), tensor_of(recs[1].input_ids)));
  CHECK(at::equal(b.hidden_states[1].slice(0, 4, 6), tensor_of(recs[3].hidden_states)));
  CHECK(b.hidden_states[1].slice(0, 6).abs().sum().item<float>() == 0);
  CHECK(b.sample_rows == std::vector<std::int64_t>{0, 0, 1, 1});
  CHECK(b.sample_documents == std::vector<std::int64_t>{0, 1, 0, 1});
  CHECK(b.conversation_ids == std::vector<std::string>{"a", "b", "c", "d"});
}

TEST_CASE("collate: token windows and context-parallel chunks tile the full batch") {
  const std::vector<Record> recs = {make_record("a", 7, 2, 1), make_record("b", 3, 2, 2),
                                    make_record("c", 6, 2, 3)};
  for (auto mode : {CollateMode::kPad, CollateMode::kLongest, CollateMode::kPack}) {
    CAPTURE(collate_mode_name(mode));
    CollateOptions o;
    o.mode = mode;
    o.max_length = 9;
    o.pad_multiple = 4;
    const Batch full = collate_records(recs, o);
    for (int c : {2, 3, 4}) {
      std::vector<std::vector<at::Tensor>> parts(full.named_tensors().size());
      std::int64_t prev_end = 0;
      for (int r = 0; r < c; ++r) {
        CollateOptions oc = o;
        oc.cp_size = c;
        oc.cp_rank = r;
        const Batch part = collate_records(recs, oc);
        CHECK(part.length == full.length);
        CHECK(part.first_token == prev_end);
        CHECK(part.first_token == r * full.length / c);
        prev_end = part.last_token;
        const auto named = part.named_tensors();
        for (std::size_t k = 0; k < named.size(); ++k) parts[k].push_back(named[k].second);
      }
      CHECK(prev_end == full.length);
      const auto named = full.named_tensors();
      for (std::size_t k = 0; k < named.size(); ++k) {
        CAPTURE(named[k].first);
        CHECK(at::equal(at::cat(parts[k], 1), named[k].second));
      }
    }
    CollateOptions ow = o;
    ow.first_token = 2;
    ow.last_token = 5;
    const Batch w = collate_records(recs, ow);
    CHECK(w.input_ids.size(1) == 3);
    CHECK(at::equal(w.hidden_states, full.hidden_states.slice(1, 2, 5)));
    CHECK(w.tokens == full.attention_mask.slice(1, 2, 5).sum().item<std::int64_t>());
  }
}

TEST_CASE("collate: strided (non-contiguous) record tensors are copied through their strides") {
  Record r = make_record("s", 4, 3, 1);
  // hidden_states as the transpose of a [3, 4] storage: same logical values, strides (1, 4).
  const auto logical = tensor_of(r.hidden_states);
  auto storage = logical.t().contiguous();  // [3, 4]
  HostTensor strided = to_host_tensor(storage);
  strided.shape = {4, 3};
  strided.strides = {1, 4};
  r.hidden_states = strided;
  CollateOptions o;
  o.max_length = 6;
  const Batch b = collate_records({r}, o);
  CHECK(at::equal(b.hidden_states[0].slice(0, 0, 4), logical));
}

TEST_CASE("collate: bad samples drop their row (pad) or leave masked padding (pack)") {
  CollateOptions o;
  o.max_length = 6;
  std::vector<Placement> ps(3);
  for (int i = 0; i < 3; ++i) {
    ps[i].row = i;
    ps[i].conversation_id = std::to_string(i);
    if (i != 1) ps[i].record = make_record(ps[i].conversation_id, 4, 2, i);
  }
  Batch b = collate(ps, 3, 0, o);
  CHECK(b.rows() == 2);
  CHECK(b.skipped == 1);
  CHECK(b.conversation_ids == std::vector<std::string>{"0", "2"});
  CHECK(b.input_ids[1][0].item<std::int64_t>() == 200);

  o.mode = CollateMode::kPack;
  for (int i = 0; i < 3; ++i) {
    ps[i].row = 0;
    ps[i].offset = 2 * i;
    ps[i].document = i;
    if (ps[i].record) ps[i].record = ps[i].record->prefix(2);
  }
  b = collate(ps, 1, 0, o);
  CHECK(b.rows() == 1);
  CHECK(at::equal(b.attention_mask[0], at::tensor({1, 1, 0, 0, 1, 1}, at::kLong)));
  CHECK(at::equal(b.document_ids[0], at::tensor({0, 0, -1, -1, 2, 2}, at::kLong)));
}

TEST_CASE("collate: a record that does not fit the batch is a FormatError naming it") {
  CollateOptions o;
  o.max_length = 4;
  CHECK_THROWS_WITH_AS(collate_records({make_record("a", 3, 2, 1), make_record("b", 3, 4, 2)}, o),
                       "conversation b: hidden_states: hidden size 4 differs from the batch's 2",
                       FormatError);
  Record f = make_record("f", 3, 2, 1);
  f.hidden_states = to_host_tensor(tensor_of(f.hidden_states).to(at::kHalf));
  f.aux_hidden_states = to_host_tensor(tensor_of(f.aux_hidden_states).to(at::kHalf));
  CHECK_THROWS_WITH_AS(collate_records({make_record("a", 3, 2, 1), f}, o),
                       "conversation f: hidden_states: dtype float16 differs from the batch's bfloat16",
                       FormatError);
}

TEST_CASE("collate: options are checked") {
  CollateOptions o;
  o.max_length = 0;
  CHECK_THROWS_WITH_AS(o.check(), "max length must be at least 1", UsageError);
  o = CollateOptions{};
  o.cp_size = 2;
  o.cp_rank = 2;
  CHECK_THROWS_WITH_AS(o.check(), "context-parallel rank 2 is outside size 2", UsageError);
  o.cp_rank = 1;
  o.last_token = 5;
  CHECK_THROWS_WITH_AS(o.check(), "give either a token range or a context-parallel rank, not both",
                       UsageError);
  o = CollateOptions{};
  o.first_token = 4;
  o.last_token = 4;
  CHECK_THROWS_WITH_AS(o.check(), "last token must be greater than first token", UsageError);
  CHECK(parse_collate_mode("pack") == CollateMode::kPack);
  CHECK_FALSE(parse_collate_mode("packed").has_value());
}

TEST_CASE("collate: batch memory is reused once the consumer drops a batch") {
  BatchMemory mem(2, /*pinned=*/0);
  const std::vector<std::pair<std::vector<std::int64_t>, at::ScalarType>> specs = {
      {{4, 16}, at::kLong}, {{4, 16, 8}, at::kBFloat16}};
  {
    auto t = mem.allocate(specs);
    CHECK((t[0].sizes() == at::IntArrayRef({4, 16})));
    CHECK(reinterpret_cast<std::uintptr_t>(t[1].data_ptr()) % 64 == 0);
  }
  auto a = mem.allocate(specs);  // the first slab again
  CHECK(mem.slabs_allocated() == 1);
  auto view = a[1].slice(0, 1, 2);  // a view keeps the slab busy
  a.clear();
  auto b = mem.allocate(specs);
  CHECK(mem.slabs_allocated() == 2);
  view = at::Tensor();
  b.clear();
  auto c = mem.allocate({{{2, 2}, at::kLong}});
  CHECK(mem.slabs_allocated() == 2);
  auto d = mem.allocate({{{4096, 4096}, at::kLong}});  // bigger than any slab kept
  CHECK(mem.slabs_allocated() == 3);
}

TEST_CASE("collate: big batches (streamed copies, kernel-zeroed and reused dirty slabs) are exact") {
  // Big enough for the paths small tests never reach: slabs mapped from the kernel (>= 1 MiB,
  // zero on first use, so padding is not written) and copies that bypass the cache (>= 256
  // KiB). A reused slab holds the previous batch's bytes, here overwritten by the consumer
  // too, and every padding byte must be zero again.
  {
    BatchMemory m(1, /*pinned=*/0);
    bool zeroed = false;
    auto t = m.allocate({{{1024, 1024}, at::kByte}}, &zeroed);
    CHECK(zeroed);  // fresh from the kernel
    CHECK(t[0].sum().item<std::int64_t>() == 0);
    t[0].fill_(1);
    t.clear();
    t = m.allocate({{{1024, 1024}, at::kByte}}, &zeroed);
    CHECK_FALSE(zeroed);  // reused: holds what the last user wrote
    CHECK(m.slabs_allocated() == 1);
  }
  const std::int64_t h = 512, max_length = 640;
  CollateOptions o;
  o.max_length = max_length;
  BatchMemory mem(2, /*pinned=*/0);
  auto expect_batch = [&](const Batch& b, const std::vector<Record>& recs) {
    REQUIRE(b.rows() == static_cast<std::int64_t>(recs.size()));
    for (std::size_t i = 0; i < recs.size(); ++i) {
      const auto r = static_cast<std::int64_t>(i);
      const std::int64_t t = std::min(recs[i].tokens(), max_length);
      const at::Tensor hs = tensor_of(recs[i].hidden_states).slice(0, 0, t);
      const at::Tensor aux = tensor_of(recs[i].aux_hidden_states).slice(0, 0, t);
      CHECK(at::equal(b.hidden_states[r].slice(0, 0, t), hs));
      CHECK(at::equal(b.aux_hidden_states[r].slice(0, 0, t), aux));
      CHECK(b.hidden_states[r].slice(0, t).abs().sum().item<double>() == 0);
      CHECK(b.aux_hidden_states[r].slice(0, t).abs().sum().item<double>() == 0);
      CHECK(b.attention_mask[r].sum().item<std::int64_t>() == t);
    }
  };
  // Pad mode through the batch memory: one row per record.
  auto collate_in_memory = [&](const std::vector<Record>& recs) {
    std::vector<Placement> ps(recs.size());
    for (std::size_t i = 0; i < recs.size(); ++i) {
      ps[i].row = static_cast<std::int64_t>(i);
      ps[i].conversation_id = recs[i].conversation_id;
      ps[i].record = recs[i];
    }
    return collate(ps, static_cast<std::int64_t>(recs.size()), 0, o, std::nullopt, &mem);
  };
  {
    const std::vector<Record> recs = {make_record("a", 600, h, 1), make_record("b", 333, h, 2)};
    Batch b = collate_records(recs, o);  // the plain path (at::empty), for reference
    expect_batch(b, recs);
    Batch first = collate_in_memory(recs);
    CHECK(mem.slabs_allocated() == 1);
    expect_batch(first, recs);
    for (const auto& [key, t] : first.named_tensors()) t.fill_(7);  // the consumer scribbles
  }
  // The source rows start 2 bytes into a buffer: unaligned loads into aligned streaming stores.
  Record odd = make_record("c", 700, h, 3);
  {
    const auto bytes = std::make_shared<std::vector<std::uint8_t>>(odd.hidden_states.nbytes() + 2);
    odd.hidden_states.copy_to(bytes->data() + 2);
    odd.hidden_states = HostTensor::view(odd.hidden_states.dtype, odd.hidden_states.shape,
                                         bytes->data() + 2, bytes);
  }
  const std::vector<Record> recs = {make_record("d", 100, h, 4), odd.prefix(max_length)};
  Batch again = collate_in_memory(recs);
  CHECK(mem.slabs_allocated() == 1);  // the dirty slab, reused
  expect_batch(again, recs);
}

TEST_CASE("collate: to_host_tensor views a tensor, contiguous first") {
  auto t = at::arange(12, at::kInt).reshape({3, 4}).t();
  const HostTensor h = to_host_tensor(t);
  CHECK(h.dtype == DType::kInt32);
  CHECK(h.shape == std::vector<std::int64_t>{4, 3});
  CHECK(h.is_contiguous());
  CHECK(h.get(1) == 4);
  CHECK(to_dtype(at::kBFloat16) == DType::kBFloat16);
  CHECK_THROWS_AS(to_dtype(at::kComplexFloat), UnsupportedError);
}
