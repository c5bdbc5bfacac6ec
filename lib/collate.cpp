#include "lib/collate.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <new>

#include <sys/mman.h>

#include "formats/error.h"
#include "formats/stream_copy.h"

namespace eaglekit {

std::string_view collate_mode_name(CollateMode m) { return name_in(kCollateModeNames, m); }

std::optional<CollateMode> parse_collate_mode(std::string_view name) { return value_in(kCollateModeNames, name); }

void CollateOptions::check() const {
  if (max_length < 1) throw UsageError("max length must be at least 1");
  if (pad_multiple < 1) throw UsageError("pad multiple must be at least 1");
  if (cp_size < 1) throw UsageError("context-parallel size must be at least 1");
  if (cp_rank < 0 || cp_rank >= cp_size)
    throw UsageError("context-parallel rank " + std::to_string(cp_rank) + " is outside size " +
                     std::to_string(cp_size));
  if (first_token < 0) throw UsageError("first token must be >= 0");
  if (last_token >= 0 && last_token <= first_token)
    throw UsageError("last token must be greater than first token");
  if (cp_size > 1 && (first_token != 0 || last_token >= 0))
    throw UsageError("give either a token range or a context-parallel rank, not both");
}

std::vector<std::pair<std::string, at::Tensor>> Batch::named_tensors() const {
  std::vector<std::pair<std::string, at::Tensor>> out = {
      {"input_ids", input_ids},         {"attention_mask", attention_mask},
      {"loss_mask", loss_mask},         {"labels", labels},
      {target_probs.defined() ? "target_probs" : "hidden_states", target_probs.defined() ? target_probs : hidden_states},
      {"aux_hidden_states", aux_hidden_states},
  };
  if (document_ids.defined()) out.emplace_back("document_ids", document_ids);
  if (position_ids.defined()) out.emplace_back("position_ids", position_ids);
  if (hidden_states_prenorm.defined()) out.emplace_back("hidden_states_prenorm", hidden_states_prenorm);
  return out;
}

std::int64_t batch_length(const CollateOptions& opts, std::int64_t longest) {
  if (opts.mode != CollateMode::kLongest) return opts.max_length;
  longest = std::clamp<std::int64_t>(longest, 0, opts.max_length);
  const std::int64_t m = opts.pad_multiple;
  return std::min(opts.max_length, (longest + m - 1) / m * m);
}

std::pair<std::int64_t, std::int64_t> token_window(const CollateOptions& opts,
                                                   std::int64_t length) {
  if (opts.cp_size > 1)
    return {opts.cp_rank * length / opts.cp_size, (opts.cp_rank + 1) * length / opts.cp_size};
  const std::int64_t first = std::clamp<std::int64_t>(opts.first_token, 0, length);
  const std::int64_t last =
      opts.last_token < 0 ? length : std::clamp<std::int64_t>(opts.last_token, first, length);
  return {first, last};
}

std::vector<std::vector<std::size_t>> pack_rows(const std::vector<std::size_t>& order,
                                                const std::vector<std::int64_t>& lengths,
                                                std::int64_t max_length) {
  std::vector<std::vector<std::size_t>> rows;
  std::vector<std::int64_t> fill;
  std::vector<std::size_t> open;  // row numbers still accepting samples, oldest first
  for (const std::size_t s : order) {
    const std::int64_t len = std::clamp<std::int64_t>(lengths.at(s), 0, max_length);
    std::size_t chosen = rows.size();
    for (const std::size_t r : open) {
      if (fill[r] + len <= max_length) {
        chosen = r;
        break;
      }
    }
    if (chosen == rows.size()) {
      rows.emplace_back();
      fill.push_back(0);
      open.push_back(chosen);
      // A bounded window keeps packing close to the sample order (and O(n)).
      if (open.size() > kPackWindow) open.erase(open.begin());
    }
    rows[chosen].push_back(s);
    fill[chosen] += len;
    if (fill[chosen] == max_length) open.erase(std::find(open.begin(), open.end(), chosen));
  }
  return rows;
}

// ---------------------------------------------------------------------------------------
// Memory

namespace {

constexpr std::size_t kAlign = 64;
// Slabs this big come straight from the kernel, populated in one call (one page fault per
// 4 KiB page costs more than the copy into it) and known to be zero-filled.
constexpr std::size_t kMapMin = std::size_t{1} << 20;

struct Slab {
  explicit Slab(std::size_t n) : bytes(n) {
    if (n >= kMapMin) {
      void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
      if (p != MAP_FAILED) {
        data = static_cast<std::uint8_t*>(p);
        mapped = true;
        zeroed = true;
        return;
      }
    }
    data = static_cast<std::uint8_t*>(::operator new(n, std::align_val_t(kAlign)));
  }
  ~Slab() {
    if (mapped) ::munmap(data, bytes);
    else ::operator delete(data, std::align_val_t(kAlign));
  }
  Slab(const Slab&) = delete;
  Slab& operator=(const Slab&) = delete;
  std::size_t bytes;
  std::uint8_t* data = nullptr;
  bool mapped = false;
  bool zeroed = false;  // fresh from the kernel and never handed out: every byte is 0
};

std::size_t align_up(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

}  // namespace

struct BatchMemory::Impl {
  std::mutex mu;
  std::vector<std::shared_ptr<Slab>> slabs;
  std::size_t keep = 4;
  bool pinned = false;
  std::atomic<std::uint64_t> allocated{0};
};

BatchMemory::BatchMemory(std::size_t keep, int pinned) : impl_(std::make_unique<Impl>()) {
  impl_->keep = keep;
  impl_->pinned = pinned < 0 ? at::hasCUDA() : pinned != 0;
}

BatchMemory::~BatchMemory() = default;

bool BatchMemory::pinned() const { return impl_->pinned; }

std::uint64_t BatchMemory::slabs_allocated() const { return impl_->allocated.load(); }

std::vector<at::Tensor> BatchMemory::allocate(
    const std::vector<std::pair<std::vector<std::int64_t>, at::ScalarType>>& specs,
    bool* zeroed) {
  if (zeroed) *zeroed = false;
  std::vector<at::Tensor> out;
  out.reserve(specs.size());
  if (impl_->pinned) {
    // Pinned tensors come from the CUDA caching host allocator, which records the events
    // of non_blocking copies and never hands a block back while a copy may still read it.
    for (const auto& [shape, type] : specs)
      out.push_back(at::empty(shape, at::TensorOptions().dtype(type).pinned_memory(true)));
    ++impl_->allocated;
    return out;
  }
  std::vector<std::size_t> offsets;
  std::size_t total = 0;
  for (const auto& [shape, type] : specs) {
    std::size_t n = c10::elementSize(type);
    for (auto d : shape) n *= static_cast<std::size_t>(d);
    offsets.push_back(total);
    total += align_up(n);
  }
  total = std::max<std::size_t>(total, kAlign);
  std::shared_ptr<Slab> slab;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    auto& slabs = impl_->slabs;
    // A slab is free when the pool holds the only reference: every tensor carved from it
    // (and every view of those) has been destroyed.
    std::size_t best = slabs.size();
    for (std::size_t i = 0; i < slabs.size(); ++i) {
      if (slabs[i].use_count() != 1 || slabs[i]->bytes < total) continue;
      if (best == slabs.size() || slabs[i]->bytes < slabs[best]->bytes) best = i;
    }
    if (best < slabs.size()) {
      slab = slabs[best];
    } else {
      // Too small free slabs are dropped first, so the pool does not grow past `keep`.
      if (slabs.size() >= impl_->keep) {
        for (auto it = slabs.begin(); it != slabs.end(); ++it) {
          if (it->use_count() == 1) {
            slabs.erase(it);
            break;
          }
        }
      }
      slab = std::make_shared<Slab>(total);
      ++impl_->allocated;
      if (slabs.size() < impl_->keep) slabs.push_back(slab);
    }
    if (zeroed) *zeroed = slab->zeroed;
    slab->zeroed = false;
  }
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const auto& [shape, type] = specs[i];
    out.push_back(at::from_blob(
        slab->data + offsets[i], shape, [slab](void*) {},
        at::TensorOptions().dtype(type).device(at::kCPU)));
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// Types

at::ScalarType to_scalar_type(DType t) {
  switch (t) {
    case DType::kBool: return at::kBool;
    case DType::kUInt8: return at::kByte;
    case DType::kInt8: return at::kChar;
    case DType::kInt16: return at::kShort;
    case DType::kInt32: return at::kInt;
    case DType::kInt64: return at::kLong;
    case DType::kFloat16: return at::kHalf;
    case DType::kBFloat16: return at::kBFloat16;
    case DType::kFloat32: return at::kFloat;
    case DType::kFloat64: return at::kDouble;
  }
  return at::kFloat;
}

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kBool: return DType::kBool;
    case at::kByte: return DType::kUInt8;
    case at::kChar: return DType::kInt8;
    case at::kShort: return DType::kInt16;
    case at::kInt: return DType::kInt32;
    case at::kLong: return DType::kInt64;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kFloat: return DType::kFloat32;
    case at::kDouble: return DType::kFloat64;
    default:
      throw UnsupportedError("<tensor>", std::nullopt, "dtype",
                             std::string("no record dtype for ") + c10::toString(t));
  }
}

HostTensor to_host_tensor(const at::Tensor& t) {
  if (!t.defined()) throw Error("to_host_tensor: undefined tensor");
  if (!t.device().is_cpu()) throw Error("to_host_tensor: tensor is not on the CPU");
  auto c = std::make_shared<at::Tensor>(t.contiguous());
  std::vector<std::int64_t> shape(c->sizes().begin(), c->sizes().end());
  const void* data = c->data_ptr();
  return HostTensor::view(to_dtype(c->scalar_type()), std::move(shape), data,
                          std::shared_ptr<const void>(c, data));
}

RecordShape RecordShape::of(const Record& r) {
  return RecordShape{r.hidden_size(), r.aux_width(), r.stored_dtype(), r.target_probs_width()};
}

RecordShape RecordShape::of(const RecordInfo& info) {
  return RecordShape{info.hidden_size, info.aux_width, info.hidden_dtype, info.target_probs_width};
}

// ---------------------------------------------------------------------------------------
// Collation

namespace {

template <typename T>
T load(const std::uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Elements [a, b) of a 1-D tensor as int64 into dst.
void copy_as_int64(const HostTensor& src, std::int64_t a, std::int64_t b, std::int64_t* dst) {
  const std::int64_t stride = src.strides.at(0);
  const std::size_t item = src.itemsize();
  const std::uint8_t* base = src.data + a * stride * static_cast<std::int64_t>(item);
  const std::int64_t n = b - a;
  const auto step = stride * static_cast<std::int64_t>(item);
  switch (src.dtype) {
    case DType::kInt64:
      if (stride == 1) {
        std::memcpy(dst, base, static_cast<std::size_t>(n) * 8);
      } else {
        for (std::int64_t i = 0; i < n; ++i) dst[i] = load<std::int64_t>(base + i * step);
      }
      return;
    case DType::kInt32:
      for (std::int64_t i = 0; i < n; ++i) dst[i] = load<std::int32_t>(base + i * step);
      return;
    case DType::kBool:
    case DType::kUInt8:
      for (std::int64_t i = 0; i < n; ++i) dst[i] = base[i * step];
      return;
    default:
      // Other mask dtypes convert as torch's .to(torch.int64) does (truncation).
      for (std::int64_t i = 0; i < n; ++i)
        dst[i] = static_cast<std::int64_t>(load_as_double(src.data, src.dtype, (a + i) * stride));
      return;
  }
}

void fill_i64(std::int64_t* p, std::int64_t n, std::int64_t v) { std::fill(p, p + n, v); }

struct Dest {
  std::int64_t width = 0;  // W
  std::int64_t hidden = 0, aux = 0;
  std::size_t item = 2;
  std::int64_t* ids = nullptr;
  std::int64_t* attn = nullptr;
  std::int64_t* loss = nullptr;
  std::int64_t* labels = nullptr;
  std::int64_t* docs = nullptr;  // pack only
  std::int64_t* pos = nullptr;   // pack only
  std::uint8_t* hs = nullptr;
  std::uint8_t* aux_hs = nullptr;
  bool zeroed = false;  // the hidden-state tensors are all zeros already

  // Columns [c0, c1) of row r become padding.
  void pad(std::int64_t r, std::int64_t c0, std::int64_t c1) const {
    if (c1 <= c0) return;
    const std::int64_t at = r * width + c0, n = c1 - c0;
    fill_i64(ids + at, n, 0);
    fill_i64(attn + at, n, 0);
    fill_i64(loss + at, n, 0);
    fill_i64(labels + at, n, 0);
    if (docs) fill_i64(docs + at, n, -1);
    if (pos) fill_i64(pos + at, n, 0);
    if (zeroed) return;
    stream_zero(hs + static_cast<std::size_t>(at * hidden) * item,
                static_cast<std::size_t>(n * hidden) * item);
    stream_zero(aux_hs + static_cast<std::size_t>(at * aux) * item,
                static_cast<std::size_t>(n * aux) * item);
  }
};

// Rows of a record's [T, X] tensor into contiguous batch memory.
void copy_rows(const HostTensor& t, std::int64_t r0, std::int64_t r1, std::uint8_t* dst) {
  const HostTensor rows = t.slice_rows(r0, r1);
  if (rows.is_contiguous()) stream_copy(dst, rows.data, rows.nbytes());
  else rows.copy_to(dst);
}

struct Span {
  std::int64_t begin, end;  // columns of the window
};

void check_fits(const Placement& p, const RecordShape& shape) {
  const Record& r = *p.record;
  const std::string where = "conversation " + p.conversation_id;
  if (r.hidden_size() != shape.hidden)
    throw FormatError(where, std::nullopt, "hidden_states",
                      "hidden size " + std::to_string(r.hidden_size()) + " differs from the batch's " +
                          std::to_string(shape.hidden));
  if (r.aux_width() != shape.aux_width)
    throw FormatError(where, std::nullopt, "aux_hidden_states",
                      "width " + std::to_string(r.aux_width()) + " differs from the batch's " +
                          std::to_string(shape.aux_width));
  if (r.target_probs_width() != shape.target_probs_width)
    throw FormatError(where, std::nullopt, "target_probs",
                      (r.target_probs ? "a stored target distribution over " + std::to_string(r.target_probs_width()) +
                                            " draft tokens"
                                      : std::string("hidden states (no stored target distribution)")) +
                          ", but the batch's records " +
                          (shape.target_probs_width ? "store one over " + std::to_string(shape.target_probs_width)
                                                    : std::string("hold hidden states")));
  if (r.stored_dtype() != shape.dtype || r.aux_hidden_states.dtype != shape.dtype)
    throw FormatError(where, std::nullopt, r.target_probs ? "target_probs" : "hidden_states",
                      "dtype " + std::string(dtype_name(r.stored_dtype())) +
                          " differs from the batch's " + std::string(dtype_name(shape.dtype)));
}

}  // namespace

struct BatchBuilder::Impl {
  CollateOptions opts;
  bool pack = false;
  std::int64_t rows = 0, length = 0, first = 0, width = 0;
  RecordShape shape;
  Batch b;
  Dest d;
  // Per placement, written by place() (each by its own call): the columns it filled, its
  // record bytes, its norm form (-1 not stated) and whether it was placed at all.
  std::vector<Span> spans;
  std::vector<std::uint64_t> bytes;
  std::vector<std::int8_t> prenorm;
  std::vector<char> placed;
};

BatchBuilder::BatchBuilder(std::size_t placements, std::int64_t rows, std::int64_t length,
                           const CollateOptions& opts, const RecordShape& shape, BatchMemory* memory)
    : impl_(std::make_unique<Impl>()) {
  opts.check();
  Impl& m = *impl_;
  m.opts = opts;
  m.pack = opts.mode == CollateMode::kPack;
  m.rows = rows;
  m.shape = shape;
  if (opts.mode != CollateMode::kLongest) length = opts.max_length;
  m.length = std::max<std::int64_t>(length, 0);
  const auto [first, last] = token_window(opts, length);
  m.first = first;
  m.width = last - first;
  m.spans.assign(placements, Span{0, 0});
  m.bytes.assign(placements, 0);
  m.prenorm.assign(placements, -1);
  m.placed.assign(placements, 0);

  // Every row of the plan is allocated; finish() drops the rows of bad samples.
  const std::int64_t width = m.width;
  const at::ScalarType hs_type = to_scalar_type(shape.dtype);
  std::vector<std::pair<std::vector<std::int64_t>, at::ScalarType>> specs = {
      {{rows, width}, at::kLong},
      {{rows, width}, at::kLong},
      {{rows, width}, at::kLong},
      {{rows, width}, at::kLong},
      // hidden_states, or a stored target distribution in its place (the same copy path).
      {{rows, width, shape.target_probs_width > 0 ? shape.target_probs_width : shape.hidden}, hs_type},
      {{rows, width, shape.aux_width}, hs_type},
  };
  if (m.pack) {
    specs.push_back({{rows, width}, at::kLong});
    specs.push_back({{rows, width}, at::kLong});
  }
  std::vector<at::Tensor> t;
  bool zeroed = false;
  if (memory) {
    t = memory->allocate(specs, &zeroed);
  } else {
    for (const auto& [sz, type] : specs) t.push_back(at::empty(sz, at::TensorOptions().dtype(type)));
  }
  Batch& b = m.b;
  b.mode = opts.mode;
  b.length = length;
  b.first_token = first;
  b.last_token = last;
  b.input_ids = t[0];
  b.attention_mask = t[1];
  b.loss_mask = t[2];
  b.labels = t[3];
  (shape.target_probs_width > 0 ? b.target_probs : b.hidden_states) = t[4];
  b.aux_hidden_states = t[5];
  if (m.pack) {
    b.document_ids = t[6];
    b.position_ids = t[7];
  }
  Dest& d = m.d;
  d.width = width;
  d.hidden = shape.target_probs_width > 0 ? shape.target_probs_width : shape.hidden;  // the columns of t[4]
  d.aux = shape.aux_width;
  d.item = dtype_size(shape.dtype);
  d.zeroed = zeroed;
  d.ids = b.input_ids.data_ptr<std::int64_t>();
  d.attn = b.attention_mask.data_ptr<std::int64_t>();
  d.loss = b.loss_mask.data_ptr<std::int64_t>();
  d.labels = b.labels.data_ptr<std::int64_t>();
  d.hs = static_cast<std::uint8_t*>(t[4].data_ptr());
  d.aux_hs = static_cast<std::uint8_t*>(b.aux_hidden_states.data_ptr());
  if (m.pack) {
    d.docs = b.document_ids.data_ptr<std::int64_t>();
    d.pos = b.position_ids.data_ptr<std::int64_t>();
  }
}

BatchBuilder::~BatchBuilder() = default;

std::int64_t BatchBuilder::length() const { return impl_->length; }

void BatchBuilder::place(std::size_t i, const Placement& p) {
  Impl& m = *impl_;
  if (!p.record) return;
  if (i >= m.placed.size() || p.row < 0 || p.row >= m.rows)
    throw UsageError("placement " + std::to_string(i) + " (row " + std::to_string(p.row) +
                     ") is outside the batch's " + std::to_string(m.placed.size()) + " placements and " +
                     std::to_string(m.rows) + " rows");
  const Record& rec = *p.record;
  rec.check("conversation " + p.conversation_id);
  check_fits(p, m.shape);
  const Dest& d = m.d;
  const std::int64_t last = m.first + m.width;
  const std::int64_t n = std::min(rec.tokens(), m.length - p.offset);
  const std::int64_t a = std::max(p.offset, m.first), e = std::min(p.offset + n, last);
  m.placed[i] = 1;
  // The record's stated norm form, else (unless a --hidden-states-norm option names it) the one
  // its layout implies.
  const std::optional<bool> form =
      rec.hidden_states_prenorm ? rec.hidden_states_prenorm : m.opts.layout_norm ? rec.layout_prenorm : std::nullopt;
  if (form) m.prenorm[i] = *form ? 1 : 0;
  if (e <= a) return;
  const std::int64_t r = p.row;
  const std::int64_t s0 = a - p.offset, s1 = e - p.offset;  // record rows
  const std::int64_t at = r * m.width + (a - m.first), cnt = e - a;
  copy_as_int64(rec.input_ids, s0, s1, d.ids + at);
  fill_i64(d.attn + at, cnt, 1);
  if (rec.loss_mask) copy_as_int64(*rec.loss_mask, s0, s1, d.loss + at);
  else fill_i64(d.loss + at, cnt, 1);
  fill_i64(d.labels + at, cnt, -100);
  if (m.pack) {
    fill_i64(d.docs + at, cnt, p.document);
    for (std::int64_t k = 0; k < cnt; ++k) d.pos[at + k] = s0 + k;
  }
  copy_rows(rec.target_probs ? *rec.target_probs : rec.hidden_states, s0, s1,
            d.hs + static_cast<std::size_t>(at * d.hidden) * d.item);
  copy_rows(rec.aux_hidden_states, s0, s1, d.aux_hs + static_cast<std::size_t>(at * d.aux) * d.item);
  m.spans[i] = Span{a - m.first, e - m.first};
  m.bytes[i] = static_cast<std::uint64_t>(cnt) *
               (static_cast<std::uint64_t>(d.hidden + d.aux) * d.item + rec.input_ids.itemsize() +
                (rec.loss_mask ? rec.loss_mask->itemsize() : 0));
}

Batch BatchBuilder::finish(const std::vector<Placement>& placements, bool parallel) {
  Impl& m = *impl_;
  if (placements.size() != m.placed.size())
    throw UsageError("finish: " + std::to_string(placements.size()) + " placements, the builder was made for " +
                     std::to_string(m.placed.size()));
  const Dest& d = m.d;
  const std::int64_t rows = m.rows, width = m.width;
  Batch b = std::move(m.b);

  // Pad / longest: rows no sample was placed in are dropped and later rows move up, whole
  // rows (every column) so the bytes a fresh slab holds stay as they were.
  std::vector<std::int64_t> out_row(static_cast<std::size_t>(rows), -1);
  std::int64_t out_rows = rows;
  if (!m.pack) {
    std::vector<bool> good(static_cast<std::size_t>(rows), false);
    for (std::size_t i = 0; i < placements.size(); ++i)
      if (m.placed[i]) good.at(static_cast<std::size_t>(placements[i].row)) = true;
    out_rows = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      if (!good[static_cast<std::size_t>(r)]) continue;
      const std::int64_t k = out_rows++;
      out_row[static_cast<std::size_t>(r)] = k;
      if (k == r) continue;
      auto move_row = [&](void* base, std::size_t row_bytes) {
        auto* p = static_cast<std::uint8_t*>(base);
        std::memmove(p + static_cast<std::size_t>(k) * row_bytes, p + static_cast<std::size_t>(r) * row_bytes, row_bytes);
      };
      const std::size_t ids_row = static_cast<std::size_t>(width) * 8;
      for (std::int64_t* t : {d.ids, d.attn, d.loss, d.labels}) move_row(t, ids_row);
      move_row(d.hs, static_cast<std::size_t>(width * d.hidden) * d.item);
      move_row(d.aux_hs, static_cast<std::size_t>(width * d.aux) * d.item);
    }
    if (out_rows != rows) {
      b.input_ids = b.input_ids.narrow(0, 0, out_rows);
      b.attention_mask = b.attention_mask.narrow(0, 0, out_rows);
      b.loss_mask = b.loss_mask.narrow(0, 0, out_rows);
      b.labels = b.labels.narrow(0, 0, out_rows);
      if (b.hidden_states.defined()) b.hidden_states = b.hidden_states.narrow(0, 0, out_rows);
      if (b.target_probs.defined()) b.target_probs = b.target_probs.narrow(0, 0, out_rows);
      b.aux_hidden_states = b.aux_hidden_states.narrow(0, 0, out_rows);
    }
  } else {
    for (std::int64_t r = 0; r < rows; ++r) out_row[static_cast<std::size_t>(r)] = r;
  }

  // Everything no record wrote is padding.
  std::vector<std::vector<Span>> covered(static_cast<std::size_t>(out_rows));
  for (std::size_t i = 0; i < placements.size(); ++i) {
    if (m.spans[i].end <= m.spans[i].begin) continue;
    covered[static_cast<std::size_t>(out_row[static_cast<std::size_t>(placements[i].row)])].push_back(m.spans[i]);
  }
  auto pad_row = [&](std::int64_t r) {
    auto& c = covered[static_cast<std::size_t>(r)];
    std::sort(c.begin(), c.end(), [](const Span& x, const Span& y) { return x.begin < y.begin; });
    std::int64_t col = 0;
    for (const auto& s : c) {
      d.pad(r, col, s.begin);
      col = std::max(col, s.end);
    }
    d.pad(r, col, width);
  };
  if (parallel && out_rows > 1) {
    tbb::parallel_for(std::int64_t{0}, out_rows, pad_row);
  } else {
    for (std::int64_t r = 0; r < out_rows; ++r) pad_row(r);
  }

  const bool any_stated = std::any_of(m.prenorm.begin(), m.prenorm.end(), [](std::int8_t f) { return f >= 0; });
  if (any_stated) {
    b.hidden_states_prenorm = at::full({out_rows, width}, -1, at::TensorOptions().dtype(at::kChar));
    auto* flags = b.hidden_states_prenorm.data_ptr<std::int8_t>();
    for (std::size_t i = 0; i < placements.size(); ++i) {
      if (m.prenorm[i] < 0 || m.spans[i].end <= m.spans[i].begin) continue;
      const std::int64_t r = out_row[static_cast<std::size_t>(placements[i].row)];
      std::fill(flags + r * width + m.spans[i].begin, flags + r * width + m.spans[i].end, m.prenorm[i]);
    }
  }

  for (std::size_t i = 0; i < placements.size(); ++i) {
    const auto& p = placements[i];
    if (!m.placed[i]) {
      ++b.skipped;
      continue;
    }
    b.conversation_ids.push_back(p.conversation_id);
    b.sample_rows.push_back(out_row[static_cast<std::size_t>(p.row)]);
    b.sample_documents.push_back(m.pack ? p.document : 0);
    b.tokens += m.spans[i].end - m.spans[i].begin;
    b.bytes += m.bytes[i];
  }
  return b;
}

Batch collate(std::vector<Placement>& placements, std::int64_t rows, std::int64_t length,
              const CollateOptions& opts, std::optional<RecordShape> shape, BatchMemory* memory,
              bool parallel) {
  opts.check();
  if (!shape) {
    for (const auto& p : placements)
      if (p.record) {
        shape = RecordShape::of(*p.record);
        break;
      }
  }
  const RecordShape sh = shape.value_or(RecordShape{0, 0, DType::kBFloat16});
  // Every record is checked before any memory is taken.
  std::int64_t longest = 0;
  for (const auto& p : placements) {
    if (!p.record) continue;
    p.record->check("conversation " + p.conversation_id);
    check_fits(p, sh);
    longest = std::max(longest, std::min(p.record->tokens(), opts.max_length));
  }
  if (opts.mode == CollateMode::kLongest && length <= 0) length = batch_length(opts, longest);
  BatchBuilder builder(placements.size(), rows, length, opts, sh, memory);
  if (parallel && placements.size() > 1) {
    tbb::parallel_for(tbb::blocked_range<std::size_t>(0, placements.size(), 1),
                      [&](const tbb::blocked_range<std::size_t>& range) {
                        for (auto i = range.begin(); i != range.end(); ++i) builder.place(i, placements[i]);
                      });
  } else {
    for (std::size_t i = 0; i < placements.size(); ++i) builder.place(i, placements[i]);
  }
  return builder.finish(placements, parallel);
}

Batch collate_records(const std::vector<Record>& records, const CollateOptions& opts) {
  opts.check();
  std::vector<Placement> placements;
  std::int64_t rows = 0;
  if (opts.mode == CollateMode::kPack) {
    std::vector<std::int64_t> lengths;
    std::vector<std::size_t> order;
    for (std::size_t i = 0; i < records.size(); ++i) {
      lengths.push_back(records[i].tokens());
      order.push_back(i);
    }
    const auto packed = pack_rows(order, lengths, opts.max_length);
    for (std::size_t r = 0; r < packed.size(); ++r) {
      std::int64_t offset = 0, doc = 0;
      for (const auto s : packed[r]) {
        Placement p;
        p.row = static_cast<std::int64_t>(r);
        p.offset = offset;
        p.document = doc++;
        p.conversation_id = records[s].conversation_id;
        p.record = records[s].prefix(opts.max_length);
        offset += p.record->tokens();
        placements.push_back(std::move(p));
      }
    }
    rows = static_cast<std::int64_t>(packed.size());
  } else {
    for (std::size_t i = 0; i < records.size(); ++i) {
      Placement p;
      p.row = static_cast<std::int64_t>(i);
      p.conversation_id = records[i].conversation_id;
      p.record = records[i].prefix(opts.max_length);
      placements.push_back(std::move(p));
    }
    rows = static_cast<std::int64_t>(records.size());
  }
  return collate(placements, rows, 0, opts);
}

}  // namespace eaglekit
