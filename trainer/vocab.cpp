#include "trainer/vocab.h"

#include <ATen/ATen.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <algorithm>
#include <numeric>

#include "formats/atomic_file.h"
#include "formats/error.h"
#include "formats/pt_format.h"

namespace eaglekit::trainer {

TokenCounts::TokenCounts(std::int64_t vocab_size) {
  if (vocab_size <= 0) throw UsageError("vocabulary size must be positive");
  counts_.assign(static_cast<std::size_t>(vocab_size), 0);
}

void TokenCounts::add(const std::int64_t* ids, std::size_t n, const std::string& where) {
  const std::int64_t v = vocab_size();
  for (std::size_t i = 0; i < n; ++i) {
    const std::int64_t id = ids[i];
    if (id < 0 || id >= v) {
      throw FormatError(where, std::nullopt, "input_ids",
                        "token " + std::to_string(i) + " is " + std::to_string(id) +
                            ", outside the vocabulary [0, " + std::to_string(v) + ")");
    }
    ++counts_[static_cast<std::size_t>(id)];
  }
  total_ += static_cast<std::int64_t>(n);
}

void TokenCounts::add(const HostTensor& ids, const std::string& where) {
  if (ids.dim() != 1 || (ids.dtype != DType::kInt64 && ids.dtype != DType::kInt32)) {
    throw FormatError(where, std::nullopt, "input_ids",
                      "expected a [T] int64/int32 tensor, got " + std::string(dtype_name(ids.dtype)) +
                          " " + ids.shape_string());
  }
  std::vector<std::int64_t> buf(static_cast<std::size_t>(ids.numel()));
  if (ids.dtype == DType::kInt64 && ids.is_contiguous()) {
    if (!buf.empty()) std::memcpy(buf.data(), ids.data, buf.size() * sizeof(std::int64_t));
  } else {
    for (std::int64_t i = 0; i < ids.numel(); ++i) buf[static_cast<std::size_t>(i)] = static_cast<std::int64_t>(ids.get(i));
  }
  add(buf.data(), buf.size(), where);
}

void TokenCounts::merge(const TokenCounts& other) {
  if (other.vocab_size() != vocab_size()) throw UsageError("cannot merge token counts of different vocabularies");
  for (std::size_t i = 0; i < counts_.size(); ++i) counts_[i] += other.counts_[i];
  total_ += other.total_;
}

at::Tensor identity_d2t(std::int64_t vocab_size) { return at::zeros({vocab_size}, at::kLong); }

at::Tensor d2t_from_counts(const std::vector<std::int64_t>& counts, std::int64_t draft_vocab_size) {
  const auto v = static_cast<std::int64_t>(counts.size());
  if (draft_vocab_size <= 0 || draft_vocab_size > v) {
    throw UsageError("draft vocabulary size " + std::to_string(draft_vocab_size) + " must be in [1, " +
                     std::to_string(v) + "]");
  }
  if (draft_vocab_size == v) return identity_d2t(v);
  std::vector<std::int64_t> order(counts.size());
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + draft_vocab_size, order.end(),
                    [&](std::int64_t a, std::int64_t b) {
                      const auto ca = counts[static_cast<std::size_t>(a)], cb = counts[static_cast<std::size_t>(b)];
                      return ca != cb ? ca > cb : a < b;
                    });
  at::Tensor d2t = at::empty({draft_vocab_size}, at::kLong);
  auto* p = d2t.data_ptr<std::int64_t>();
  for (std::int64_t i = 0; i < draft_vocab_size; ++i) p[i] = order[static_cast<std::size_t>(i)] - i;
  return d2t;
}

void save_d2t(const std::string& path, const at::Tensor& d2t) {
  if (!d2t.defined() || d2t.dim() != 1 || d2t.scalar_type() != at::kLong)
    throw UsageError("d2t must be a 1-D int64 tensor");
  const std::vector<char> bytes = torch::jit::pickle_save(d2t.cpu().contiguous());
  write_file_atomic(path, bytes.data(), bytes.size());
}

at::Tensor load_d2t(const std::string& path) {
  const PtContents contents = read_pt(path);
  const HostTensor* t = contents.tensor("");
  if (t == nullptr) t = contents.tensor("d2t");
  if (t == nullptr || t->dim() != 1 || !is_integral(t->dtype)) {
    throw FormatError(path, std::nullopt, "d2t",
                      "expected a 1-D integer tensor (bare, or under the key \"d2t\")");
  }
  at::Tensor out = at::empty({t->numel()}, at::kLong);
  auto* p = out.data_ptr<std::int64_t>();
  for (std::int64_t i = 0; i < t->numel(); ++i) p[i] = static_cast<std::int64_t>(t->get(i));
  return out;
}

}  // namespace eaglekit::trainer
