#include "lib/loss_masks.h"

#include <charconv>
#include <filesystem>
#include <optional>

#include "formats/error.h"
#include "formats/index_format.h"
#include "formats/record.h"
#include "formats/safetensors_format.h"

namespace eaglekit {

namespace {

constexpr const char* kKind = "speculators loss masks";
constexpr const char* kKindById = "loss masks by conversation id";  // tools/python/eaglekit_masks.py

// Row i of hs_{i}.safetensors (hs_connectors' FileTransfer names them so); nullopt otherwise.
std::optional<std::int64_t> row_of(const std::string& source) {
  const std::string name = std::filesystem::path(source).filename().string();
  const std::string pre = "hs_", post = ".safetensors";
  if (name.size() <= pre.size() + post.size() || name.compare(0, pre.size(), pre) != 0 ||
      name.compare(name.size() - post.size(), post.size(), post) != 0)
    return std::nullopt;
  const char* b = name.data() + pre.size();
  const char* e = name.data() + name.size() - post.size();
  if (*b == '0' && e - b > 1) return std::nullopt;  // hs_01 is no file the connector writes
  std::int64_t i = 0;
  const auto [p, ec] = std::from_chars(b, e, i);
  if (ec != std::errc() || p != e || i < 0) return std::nullopt;
  return i;
}

}  // namespace

const std::string& LossMasks::path() const { return file_->path(); }

LossMasks LossMasks::open(const std::string& path) {
  LossMasks m;
  m.file_ = SafetensorsFile::open(path);
  const SafetensorsFile& f = *m.file_;
  const auto kind = f.metadata().find("eaglekit");
  if (kind == f.metadata().end() || (kind->second != kKind && kind->second != kKindById))
    throw FormatError(path, 8, "__metadata__",
                      "not a loss-mask file (expected \"eaglekit\": \"" + std::string(kKind) +
                          "\", written by scripts/speculators/loss_masks.py, or \"" + kKindById +
                          "\", written by tools/python/eaglekit_masks.py)");
  auto need = [&](const char* name, DType dtype) {
    const SafetensorsEntry* e = f.find(name);
    if (e == nullptr) throw FormatError(path, 8, name, "missing from the header");
    if (e->dtype != dtype || e->shape.size() != 1)
      throw FormatError(path, f.data_start() + e->begin, name,
                        "is " + e->dtype_code + " of " + std::to_string(e->shape.size()) +
                            " dimensions, expected " + std::string(dtype_name(dtype)) + " [n]");
    return std::make_pair(e, f.tensor(*e));
  };
  const auto [oe, offsets] = need("row_offsets", DType::kInt64);
  const auto [ie, ids] = need("input_ids", DType::kInt64);
  const auto [me, mask] = need("loss_mask", DType::kUInt8);
  if (offsets.shape[0] < 1) throw FormatError(path, f.data_start() + oe->begin, "row_offsets", "is empty");
  m.rows_ = offsets.shape[0] - 1;
  const std::int64_t total = mask.shape[0];
  if (ids.shape[0] != total)
    throw FormatError(path, f.data_start() + ie->begin, "input_ids",
                      "holds " + std::to_string(ids.shape[0]) + " tokens, loss_mask " +
                          std::to_string(total));
  const auto* off = reinterpret_cast<const std::int64_t*>(offsets.data);
  for (std::int64_t i = 0; i <= m.rows_; ++i) {
    const bool ok = i == 0 ? off[0] == 0 : (off[i] >= off[i - 1] && off[i] <= total);
    if (!ok || (i == m.rows_ && off[i] != total))
      throw FormatError(path, f.data_start() + oe->begin + 8 * static_cast<std::uint64_t>(i),
                        "row_offsets[" + std::to_string(i) + "]",
                        "is " + std::to_string(off[i]) + ": offsets must rise from 0 to the token count " +
                            std::to_string(total));
  }
  for (std::int64_t t = 0; t < total; ++t)
    if (mask.data[t] > 1)
      throw FormatError(path, f.data_start() + me->begin + static_cast<std::uint64_t>(t),
                        "loss_mask[" + std::to_string(t) + "]",
                        "is " + std::to_string(mask.data[t]) + ", expected 0 or 1");
  if (kind->second == kKindById) {
    const auto [ioe, id_offsets] = need("id_offsets", DType::kInt64);
    const auto [ne, names] = need("conversation_ids", DType::kUInt8);
    if (id_offsets.shape[0] != m.rows_ + 1)
      throw FormatError(path, f.data_start() + ioe->begin, "id_offsets",
                        "holds " + std::to_string(id_offsets.shape[0]) + " offsets, expected " +
                            std::to_string(m.rows_ + 1) + " (one more than the rows)");
    const auto* io = reinterpret_cast<const std::int64_t*>(id_offsets.data);
    const std::int64_t bytes = names.shape[0];
    auto ids = std::make_shared<std::unordered_map<std::string, std::int64_t>>();
    ids->reserve(static_cast<std::size_t>(m.rows_));
    for (std::int64_t i = 0; i <= m.rows_; ++i) {
      const bool ok = i == 0 ? io[0] == 0 : (io[i] > io[i - 1] && io[i] <= bytes);
      if (!ok || (i == m.rows_ && io[i] != bytes))
        throw FormatError(path, f.data_start() + ioe->begin + 8 * static_cast<std::uint64_t>(i),
                          "id_offsets[" + std::to_string(i) + "]",
                          "is " + std::to_string(io[i]) + ": offsets must rise (no empty id) from 0 to the "
                          "byte count " + std::to_string(bytes));
      if (i == 0) continue;
      std::string id(reinterpret_cast<const char*>(names.data) + io[i - 1],
                     static_cast<std::size_t>(io[i] - io[i - 1]));
      const auto [at, fresh] = ids->emplace(id, i - 1);
      if (!fresh)
        throw FormatError(path, f.data_start() + ne->begin + static_cast<std::uint64_t>(io[i - 1]),
                          "conversation_ids[" + std::to_string(i - 1) + "]",
                          "is '" + id + "' again (row " + std::to_string(at->second) +
                              "): a conversation id names one row");
    }
    m.by_id_ = std::move(ids);
  }
  return m;
}

LossMasks LossMasks::open_joined(const IndexLossMasks& recorded, const std::string& index_path) {
  const std::string problem = joined_problem(recorded, index_path);
  if (!problem.empty()) throw Error(problem);
  return open(recorded.path);
}

std::string LossMasks::joined_problem(const IndexLossMasks& recorded, const std::string& index_path) {
  const std::string change = index_loss_masks_change(recorded);
  if (change.empty()) return "";
  return index_path + " joins the loss masks of " + recorded.path + ", which " + change +
         ": index again, naming the file as it is now (`eaglekit index DIR... --out " + index_path +
         " --loss-masks FILE`), which checks its rows against the records";
}

LossMasks::Row LossMasks::find_row(const std::string& conversation_id, const std::string& source) const {
  Row out;
  if (by_id_) {
    const auto it = by_id_->find(conversation_id);
    if (it == by_id_->end())
      throw FormatError(path(), std::nullopt, "conversation '" + conversation_id + "'",
                        "has no row, but " + source +
                            " holds it: the dump and the conversations the masks were computed from differ");
    out.row = it->second;
    out.what = "conversation '" + conversation_id + "' (row " + std::to_string(out.row) + ")";
    return out;
  }
  const std::optional<std::int64_t> row = row_of(source);
  if (!row)
    throw UsageError(source + ": --loss-masks pairs a record with its dataset row by the file name "
                              "hs_{row}.safetensors, as speculators does; this name has no row");
  if (*row >= rows_)
    throw UsageError(source + ": row " + std::to_string(*row) + " is past the end of " + path() +
                     " (" + std::to_string(rows_) + " rows): the dump and the dataset differ");
  out.row = *row;
  out.what = "row " + std::to_string(*row);
  return out;
}

std::int64_t LossMasks::check_row_length(const Row& row, const std::string& source, std::int64_t tokens) const {
  const SafetensorsFile& f = *file_;
  const HostTensor offsets = *f.get("row_offsets");
  const auto* off = reinterpret_cast<const std::int64_t*>(offsets.data);
  const std::int64_t b = off[row.row], e = off[row.row + 1];
  if (e - b != tokens)
    throw FormatError(path(), f.data_start() + f.find("input_ids")->begin + 8 * static_cast<std::uint64_t>(b),
                      row.what,
                      "holds " + std::to_string(e - b) + " tokens, but " + source + " holds " +
                          std::to_string(tokens) + ": the dump and the dataset differ");
  return b;
}

std::int64_t LossMasks::check_length(const std::string& conversation_id, const std::string& source,
                                     std::int64_t tokens) const {
  const Row row = find_row(conversation_id, source);
  check_row_length(row, source, tokens);
  return row.row;
}

void LossMasks::apply(Record& r, const std::string& source) const { apply_prefix(r, source, r.tokens()); }

void LossMasks::apply_prefix(Record& r, const std::string& source, std::int64_t tokens) const {
  const Row row = find_row(r.conversation_id, source);
  const std::int64_t b = check_row_length(row, source, tokens);
  const std::int64_t n = r.tokens();  // the rows read
  if (n > tokens)
    throw FormatError(source, std::nullopt, "input_ids",
                      "record has " + std::to_string(n) + " tokens, more than the " + std::to_string(tokens) +
                          " its mask was joined for");
  const SafetensorsFile& f = *file_;
  const std::uint64_t ids_at = f.data_start() + f.find("input_ids")->begin + 8 * static_cast<std::uint64_t>(b);
  const HostTensor ids = f.get("input_ids")->slice_rows(b, b + n);
  const HostTensor rec_ids = r.input_ids.contiguous();
  for (std::int64_t t = 0; t < n; ++t)
    if (ids.get(t) != rec_ids.get(t))
      throw FormatError(path(), ids_at + 8 * static_cast<std::uint64_t>(t),
                        row.what + " input_ids[" + std::to_string(t) + "]",
                        "is " + std::to_string(static_cast<long long>(ids.get(t))) + ", but " + source +
                            " holds token " + std::to_string(static_cast<long long>(rec_ids.get(t))) +
                            ": the dump and the dataset differ");
  HostTensor mask = f.get("loss_mask")->slice_rows(b, b + n);
  if (r.loss_mask) {
    const HostTensor own = r.loss_mask->contiguous();
    const std::uint64_t mask_at = f.data_start() + f.find("loss_mask")->begin + static_cast<std::uint64_t>(b);
    for (std::int64_t t = 0; t < n; ++t)
      if ((own.get(t) != 0) != (mask.get(t) != 0))
        throw FormatError(path(), mask_at + static_cast<std::uint64_t>(t),
                          row.what + " loss_mask[" + std::to_string(t) + "]",
                          "is " + std::to_string(static_cast<int>(mask.get(t))) + ", but the loss_mask " + source +
                              " holds is " + std::to_string(static_cast<int>(own.get(t))) +
                              ": the dump and the dataset differ");
  }
  r.loss_mask = std::move(mask);
}

}  // namespace eaglekit
