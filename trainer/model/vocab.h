// The draft vocabulary (docs/draft.md, d2t and t2d): token frequencies counted over a dataset's
// input_ids, and d2t as ModelOpt calibrates it: draft id i is the i-th most frequent target
// token (ties by smaller id) and d2t[i] = that id - i, so target id = i + d2t[i].
//
// Thread safety: a TokenCounts is not thread-safe; count on several and merge().
// Errors: a token id outside [0, V) throws FormatError (with the caller's `where`);
// bad sizes throw UsageError; file errors IoError / FormatError.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "formats/host_tensor.h"
#include "lib/data_options.h"

namespace eaglekit {
struct Dataset;
struct SampleRef;
}  // namespace eaglekit

namespace eaglekit::trainer {

class TokenCounts {
 public:
  explicit TokenCounts(std::int64_t vocab_size);
  // ids: [T] int64 or int32 (any strides). `where` names the record in errors.
  void add(const HostTensor& ids, const std::string& where = "input_ids");
  void add(const std::int64_t* ids, std::size_t n, const std::string& where = "input_ids");
  void merge(const TokenCounts& other);
  const std::vector<std::int64_t>& counts() const { return counts_; }
  std::int64_t vocab_size() const { return static_cast<std::int64_t>(counts_.size()); }
  std::int64_t total() const { return total_; }

 private:
  std::vector<std::int64_t> counts_;
  std::int64_t total_ = 0;
};

// d2t [Vd] int64 from per-token counts [V] (ties and unseen tokens by smaller id). Vd == V
// gives the identity map (all zeros).
at::Tensor d2t_from_counts(const std::vector<std::int64_t>& counts, std::int64_t draft_vocab_size);
at::Tensor identity_d2t(std::int64_t vocab_size);

// d2t.pt: torch.save of the bare int64 tensor (what ModelOpt's draft vocab cache holds).
void save_d2t(const std::string& path, const at::Tensor& d2t);
// Reads a torch.save file holding the tensor bare or under the key "d2t". Throws
// FormatError when there is no 1-D integer tensor.
at::Tensor load_d2t(const std::string& path);

// --- vocabulary ------------------------------------------------------------------------

// Token frequencies over the input_ids of `samples` (full records, not truncated), read on
// `jobs` threads (0: all cores), one file open per file; hidden states are never copied
// (views into mapped files for .pt/safetensors). Throws FormatError for an id outside
// [0, vocab_size) naming the record.
std::vector<std::int64_t> count_tokens(const Dataset& dataset, const std::vector<SampleRef>& samples,
                                       std::int64_t vocab_size, int jobs = 0);

struct VocabOptions : DataSelection {
  std::string base;                 // config.json gives the vocabulary size...
  std::int64_t vocab_size = 0;      // ... unless given here
  std::int64_t draft_vocab_size = 0;
  std::string out;                  // d2t.pt
  int jobs = 0;
  opt::Groups groups();
  // UsageError for a missing --index or --out, then for a value outside its row's bound.
  void check() const;
};
struct VocabReport {
  std::int64_t vocab_size = 0;
  std::int64_t draft_vocab_size = 0;
  std::int64_t samples = 0;
  std::int64_t tokens = 0;
  std::int64_t distinct = 0;  // tokens seen at least once
  double coverage = 0;        // share of token occurrences inside the draft vocabulary
  double seconds = 0;
  std::string summary;
  std::string to_json() const;
};
// `eaglekit vocab`: counts, d2t_from_counts, save_d2t to options.out.
VocabReport build_vocab(const VocabOptions& options);

}  // namespace eaglekit::trainer
