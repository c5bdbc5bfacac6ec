#include "lib/dataset.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include "formats/atomic_file.h"
#include "formats/byte_source.h"
#include "formats/error.h"
#include "formats/registry.h"
#include "lib/conversation_text.h"
#include "lib/index.h"

namespace eaglekit {

namespace fs = std::filesystem;

namespace {

constexpr const char* kIdKeys[3] = {"conversation_id", "uuid", "id"};

// Reads the id keys of one top-level JSON object without building a DOM: conversations
// carry long texts that nobody here needs.
class IdSax final : public nlohmann::json_sax<nlohmann::json> {
 public:
  enum class State : std::uint8_t { kAbsent, kValue, kBadType };
  State state[3] = {State::kAbsent, State::kAbsent, State::kAbsent};
  std::string value[3];
  std::string bad_type[3];
  const char* top_kind = nullptr;  // what the top-level value is, when not an object
  std::string parse_error_text;
  std::uint64_t text_bytes = 0;  // every string value but the ids (conversation_text_bytes)

  bool null() override {
    if (at_id_value()) set(State::kAbsent, {}, {});  // null counts as absent (reference)
    return scalar("null");
  }
  bool boolean(bool) override {
    if (at_id_value()) set(State::kBadType, {}, "a boolean");
    return scalar("a boolean");
  }
  bool number_integer(number_integer_t v) override {
    if (at_id_value()) set(State::kValue, std::to_string(v), {});
    return scalar("a number");
  }
  bool number_unsigned(number_unsigned_t v) override {
    if (at_id_value()) set(State::kValue, std::to_string(v), {});
    return scalar("a number");
  }
  bool number_float(number_float_t, const string_t& text) override {
    if (at_id_value()) set(State::kBadType, {}, "the non-integer number " + text);
    return scalar("a number");
  }
  bool string(string_t& v) override {
    if (at_id_value()) set(State::kValue, std::move(v), {});
    else text_bytes += v.size();
    return scalar("a string");
  }
  bool binary(binary_t&) override { return scalar("binary"); }
  bool start_object(std::size_t) override {
    if (depth_ == 0) is_object_ = true;
    if (at_id_value()) set(State::kBadType, {}, "an object");
    pending_ = -1;
    ++depth_;
    return true;
  }
  bool key(string_t& k) override {
    if (depth_ == 1) {
      pending_ = -1;
      for (int i = 0; i < 3; ++i)
        if (k == kIdKeys[i]) pending_ = i;
    }
    return true;
  }
  bool end_object() override {
    --depth_;
    return true;
  }
  bool start_array(std::size_t) override {
    if (depth_ == 0) top_kind = "an array";
    if (at_id_value()) set(State::kBadType, {}, "an array");
    pending_ = -1;
    ++depth_;
    return true;
  }
  bool end_array() override {
    --depth_;
    return true;
  }
  bool parse_error(std::size_t, const std::string&,
                   const nlohmann::detail::exception& ex) override {
    parse_error_text = ex.what();
    return false;
  }

  bool is_object() const { return is_object_; }

 private:
  bool at_id_value() const { return depth_ == 1 && pending_ >= 0; }
  void set(State s, std::string v, std::string bad) {
    state[pending_] = s;
    value[pending_] = std::move(v);
    bad_type[pending_] = std::move(bad);
  }
  bool scalar(const char* kind) {
    if (depth_ == 0) top_kind = kind;
    if (depth_ == 1) pending_ = -1;
    return true;
  }
  int depth_ = 0;
  int pending_ = -1;
  bool is_object_ = false;
};

// nlohmann messages start "[json.exception.parse_error.101] parse error at line 1, column 7: ";
// the line is ours to name, so keep the column and the rest.
std::string tidy_parse_error(const std::string& what) {
  const auto col = what.find("column ");
  if (col != std::string::npos) {
    const auto colon = what.find(": ", col);
    if (colon != std::string::npos)
      return "invalid JSON at " + what.substr(col, colon - col) + ": " + what.substr(colon + 2);
  }
  return "invalid JSON: " + what;
}

struct Piece {
  std::uint64_t offset;  // in the file
  std::uint64_t size;
  std::uint64_t line;    // 1-based line where it starts
};

struct Parsed {
  std::string id;
  std::string error;  // non-empty: this piece is bad
  std::uint64_t text_bytes = 0;
};

Parsed parse_piece(const char* text, std::size_t size) {
  IdSax sax;
  Parsed out;
  const bool ok = nlohmann::json::sax_parse(text, text + size, &sax);
  if (!ok) {
    out.error = tidy_parse_error(sax.parse_error_text);
    return out;
  }
  out.text_bytes = sax.text_bytes;
  if (!sax.is_object()) {
    out.error = std::string("expected a JSON object (one conversation), got ") +
                (sax.top_kind ? sax.top_kind : "something else");
    return out;
  }
  for (int i = 0; i < 3; ++i) {
    if (sax.state[i] == IdSax::State::kAbsent) continue;
    if (sax.state[i] == IdSax::State::kBadType) {
      out.error = std::string("\"") + kIdKeys[i] + "\" must be a string or an integer, got " +
                  sax.bad_type[i];
      return out;
    }
    if (sax.value[i].empty()) {
      out.error = std::string("\"") + kIdKeys[i] + "\" is an empty string";
      return out;
    }
    out.id = std::move(sax.value[i]);
    return out;
  }
  out.error = "no conversation id (expected a \"conversation_id\", \"uuid\" or \"id\" key)";
  return out;
}

bool is_blank(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }

std::uint64_t skip_bom(const ByteSource& src) {
  const std::uint8_t* d = src.data();
  if (src.size() >= 3 && d[0] == 0xef && d[1] == 0xbb && d[2] == 0xbf) return 3;
  return 0;
}

std::vector<Piece> split_jsonl(const ByteSource& src) {
  std::vector<Piece> pieces;
  const char* d = reinterpret_cast<const char*>(src.data());
  const std::uint64_t n = src.size();
  std::uint64_t pos = skip_bom(src), line = 1;
  while (pos < n) {
    const void* nl = std::memchr(d + pos, '\n', static_cast<std::size_t>(n - pos));
    const std::uint64_t end = nl ? static_cast<std::uint64_t>(static_cast<const char*>(nl) - d) : n;
    bool blank = true;
    for (std::uint64_t i = pos; i < end && blank; ++i) blank = is_blank(d[i]);
    if (!blank) pieces.push_back({pos, end - pos, line});
    pos = end + 1;
    ++line;
  }
  return pieces;
}

// Splits one top-level JSON array into its elements (byte ranges), tracking lines; the
// elements themselves are checked when parsed.
std::vector<Piece> split_json_array(const ByteSource& src, const std::string& path) {
  std::vector<Piece> pieces;
  const char* d = reinterpret_cast<const char*>(src.data());
  const std::uint64_t n = src.size();
  std::uint64_t pos = skip_bom(src), line = 1;
  auto skip_ws = [&] {
    while (pos < n && is_blank(d[pos])) {
      if (d[pos] == '\n') ++line;
      ++pos;
    }
  };
  auto fail = [&](const std::string& detail) {
    throw FormatError(path, pos, "line " + std::to_string(line), detail);
  };
  skip_ws();
  if (pos >= n || d[pos] != '[')
    fail("expected a JSON array of conversations (a file named *.jsonl is read as one JSON "
         "object a line)");
  ++pos;
  skip_ws();
  if (pos < n && d[pos] == ']') {
    ++pos;
  } else {
    for (;;) {
      skip_ws();
      const std::uint64_t start = pos, start_line = line;
      int depth = 0;
      bool in_string = false;
      for (; pos < n; ++pos) {
        const char c = d[pos];
        if (c == '\n') ++line;
        if (in_string) {
          if (c == '\\') ++pos;
          else if (c == '"') in_string = false;
          continue;
        }
        if (c == '"') in_string = true;
        else if (c == '{' || c == '[') ++depth;
        else if (c == '}' || c == ']') {
          if (depth == 0) break;
          --depth;
        } else if (c == ',' && depth == 0) {
          break;
        }
      }
      if (pos >= n) fail("unterminated JSON array (the file ends inside it)");
      std::uint64_t end = pos;
      while (end > start && is_blank(d[end - 1])) --end;
      if (end == start) fail("empty element in the JSON array");
      pieces.push_back({start, end - start, start_line});
      if (d[pos] == ']') {
        ++pos;
        break;
      }
      ++pos;  // ','
    }
  }
  skip_ws();
  if (pos < n) fail("unexpected text after the JSON array");
  return pieces;
}

void read_conversation_file(const std::string& path, bool jsonl, std::vector<Conversation>& out,
                            std::vector<BadConversation>* bad, std::vector<std::uint64_t>* text_bytes = nullptr) {
  const auto src = ByteSource::open_file(path);
  const std::vector<Piece> pieces = jsonl ? split_jsonl(*src) : split_json_array(*src, path);
  std::vector<Parsed> parsed(pieces.size());
  const char* d = reinterpret_cast<const char*>(src->data());
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, pieces.size(), 256),
                    [&](const tbb::blocked_range<std::size_t>& r) {
    for (std::size_t i = r.begin(); i != r.end(); ++i)
      parsed[i] = parse_piece(d + pieces[i].offset, static_cast<std::size_t>(pieces[i].size));
  });
  out.reserve(out.size() + pieces.size());
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    if (!parsed[i].error.empty()) {
      if (bad == nullptr)
        throw FormatError(path, pieces[i].offset, "line " + std::to_string(pieces[i].line), parsed[i].error);
      bad->push_back({path + ":" + std::to_string(pieces[i].line), parsed[i].error});
      continue;
    }
    out.push_back({std::move(parsed[i].id), path + ":" + std::to_string(pieces[i].line)});
    if (text_bytes != nullptr) text_bytes->push_back(parsed[i].text_bytes);
  }
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string trim(const std::string& s) {
  std::size_t b = 0, e = s.size();
  while (b < e && is_blank(s[b])) ++b;
  while (e > b && is_blank(s[e - 1])) --e;
  return s.substr(b, e - b);
}

}  // namespace

namespace {

std::vector<Conversation> read_conversations(const std::string& path, std::vector<BadConversation>* bad,
                                             std::vector<std::uint64_t>* text_bytes) {
  std::vector<Conversation> out;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    std::vector<std::string> files;
    for (fs::directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec)) {
      const fs::path p = it->path();
      if (p.extension() == ".jsonl" && it->is_regular_file(ec)) files.push_back(p.string());
    }
    if (ec) throw IoError::from_errno(path, "cannot list", ec.value());
    if (files.empty())
      throw Error(path + ": no *.jsonl files in this folder (--data takes a .jsonl file, a "
                         "folder of them, or a JSON array file)");
    std::sort(files.begin(), files.end());
    for (const auto& f : files) read_conversation_file(f, true, out, bad, text_bytes);
    return out;
  }
  read_conversation_file(path, ends_with(path, ".jsonl"), out, bad, text_bytes);
  return out;
}

}  // namespace

std::vector<Conversation> load_conversations(const std::string& path) { return load_conversations(path, nullptr); }

std::vector<Conversation> load_conversations(const std::string& path, std::vector<BadConversation>* bad) {
  return read_conversations(path, bad, nullptr);
}

std::vector<ConversationText> conversation_text_bytes(const std::string& path) {
  std::vector<std::uint64_t> bytes;
  std::vector<Conversation> c = read_conversations(path, nullptr, &bytes);
  std::vector<ConversationText> out(c.size());
  for (std::size_t i = 0; i < c.size(); ++i) out[i] = {std::move(c[i].id), bytes[i]};
  return out;
}

// ---------------------------------------------------------------------------------------

std::optional<std::int64_t> row_of(std::string_view id) {
  const auto us = id.rfind('_');
  if (us == std::string_view::npos || us + 1 >= id.size() || id.size() - us - 1 > 12) return std::nullopt;
  const std::string_view digits = id.substr(us + 1);
  if (digits.find_first_not_of("0123456789") != std::string_view::npos) return std::nullopt;
  if (digits.size() > 1 && digits[0] == '0') return std::nullopt;
  std::int64_t v = 0;
  for (char c : digits) v = v * 10 + (c - '0');
  return v;
}

namespace {

// The matching loop over keys: conversation c matches the entry whose key equals c's key.
// Ids stay the conversations' (quarantine and the loader name samples by them).
Dataset match_keys(const std::vector<Conversation>& conversations, const std::vector<std::string>& conversation_keys,
                   const DatasetIndex& index, const std::vector<std::string>& entry_keys,
                   const std::set<std::string>& quarantine) {
  Dataset d;
  d.conversations = conversations.size();
  d.loss_masks = index.loss_masks();
  d.index_path = index.path();
  struct Hit {
    std::uint32_t entry;
    std::uint32_t count;
  };
  std::unordered_map<std::string_view, Hit> by_key;
  by_key.reserve(entry_keys.size());
  for (std::size_t i = 0; i < entry_keys.size(); ++i) {
    if (entry_keys[i].empty()) continue;
    auto [it, inserted] = by_key.try_emplace(entry_keys[i], Hit{static_cast<std::uint32_t>(i), 0});
    ++it->second.count;
  }
  std::unordered_map<std::string_view, std::uint32_t> conv_count;
  conv_count.reserve(conversations.size());
  for (const auto& c : conversations) ++conv_count[c.id];

  std::unordered_map<std::uint32_t, std::uint32_t> file_slot;  // index file -> Dataset::files
  std::set<std::string> duplicates;
  for (std::size_t ci = 0; ci < conversations.size(); ++ci) {
    const Conversation& c = conversations[ci];
    const auto it = by_key.find(conversation_keys[ci]);
    if (it == by_key.end()) {
      ++d.missing;
      continue;
    }
    if (quarantine.count(c.id) != 0) {
      ++d.quarantined;
      continue;
    }
    if (it->second.count > 1 || conv_count[c.id] > 1) {
      ++d.duplicates;
      duplicates.insert(c.id);
      continue;
    }
    const IndexEntry e = index.entry(it->second.entry);
    if (!e.ok) {
      ++d.unreadable;
      continue;
    }
    if (e.tokens < 2) {
      ++d.too_short;
      continue;
    }
    auto [slot, added] = file_slot.try_emplace(e.file, static_cast<std::uint32_t>(d.files.size()));
    if (added) {
      d.files.emplace_back(index.file(e.file).path);
      d.file_formats.push_back(index.file(e.file).format);
    }
    d.samples.push_back({c.id, slot->second, e.record, e.tokens, e.hidden_states_prenorm, e.layout_prenorm,
                         e.has_loss_mask, e.joined_loss_mask});
  }
  d.duplicate_ids.assign(duplicates.begin(), duplicates.end());
  return d;
}

std::vector<std::string> entry_ids(const DatasetIndex& index) {
  std::vector<std::string> keys(index.size());
  for (std::size_t i = 0; i < index.size(); ++i) keys[i] = std::string(index.conversation_id(i));
  return keys;
}

// Rows of the entries as keys; false when some entry's id is not row-form.
bool entry_rows(const DatasetIndex& index, std::vector<std::string>& keys) {
  keys.assign(index.size(), std::string());
  bool all = index.size() > 0;
  for (std::size_t i = 0; i < index.size(); ++i) {
    const auto row = row_of(index.conversation_id(i));
    if (row) keys[i] = std::to_string(*row);
    else all = false;
  }
  return all;
}

}  // namespace

Dataset match_records(const std::vector<Conversation>& conversations, const DatasetIndex& index,
                      const std::set<std::string>& quarantine, MatchBy by) {
  std::vector<std::string> conversation_ids;
  conversation_ids.reserve(conversations.size());
  for (const auto& c : conversations) conversation_ids.push_back(c.id);
  if (by != MatchBy::kRow) {
    Dataset d = match_keys(conversations, conversation_ids, index, entry_ids(index), quarantine);
    if (by == MatchBy::kId || d.missing < conversations.size()) return d;
  }
  std::vector<std::string> rows;
  const bool all_rows = entry_rows(index, rows);
  if (by == MatchBy::kAuto && !all_rows)
    return match_keys(conversations, conversation_ids, index, entry_ids(index), quarantine);
  std::vector<std::string> positions(conversations.size());
  for (std::size_t i = 0; i < conversations.size(); ++i) positions[i] = std::to_string(i);
  Dataset d = match_keys(conversations, positions, index, rows, quarantine);
  d.matched_by = "row";
  return d;
}

std::string no_loss_mask_line(const std::vector<SampleRef>& samples, std::int64_t max_length) {
  if (samples.empty()) return "";
  std::int64_t read = 0, trained = 0;
  for (const auto& s : samples) {
    if (s.has_loss_mask || s.joined_loss_mask) return "";
    const std::int64_t t = max_length > 0 ? std::min(s.tokens, max_length) : s.tokens;
    read += t;
    trained += std::max<std::int64_t>(t - 1, 0);  // each token after the first is a target
  }
  char share[32];
  std::snprintf(share, sizeof share, "%.1f%%", 100.0 * static_cast<double>(trained) / static_cast<double>(read));
  return "no loss mask found: none of the " + std::to_string(samples.size()) +
         " records stores one, so every token is trained: " + std::to_string(trained) + " of the " +
         std::to_string(read) + " tokens read (" + share +
         ", all but each record's first), prompts included; a chat dump usually trains only the assistant's "
         "replies, and some producers keep the mask outside the dump (speculators: in its prepared dataset folder)";
}

std::string joined_loss_mask_line(const std::optional<IndexLossMasks>& loss_masks,
                                  const std::vector<SampleRef>& samples) {
  std::size_t joined = 0, own = 0;
  for (const auto& s : samples) {
    if (s.joined_loss_mask) ++joined;
    else if (s.has_loss_mask) ++own;
  }
  if (joined == 0) return "";
  std::string line = "loss masks: " + std::to_string(joined) + " of the " + std::to_string(samples.size()) +
                     " records take theirs from " + (loss_masks ? loss_masks->path : std::string("?")) +
                     ", joined by `eaglekit index --loss-masks` (lengths checked then, token ids as each record is read)";
  if (own > 0) line += "; " + std::to_string(own) + " store their own";
  if (const std::size_t none = samples.size() - joined - own; none > 0)
    line += "; " + std::to_string(none) + " have none: every token of theirs is trained";
  return line;
}

Dataset index_dataset(const DatasetIndex& index, const std::set<std::string>& quarantine) {
  std::vector<std::size_t> order(index.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::vector<std::string> rows;
  if (entry_rows(index, rows)) {
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return *row_of(index.conversation_id(a)) <
                                                                *row_of(index.conversation_id(b)); });
  }
  // Each record as its own conversation, its id as the id: the matching rules then apply
  // unchanged (a duplicate id is left out, not resolved).
  std::vector<Conversation> records;
  std::vector<std::string> keys;
  records.reserve(order.size());
  for (std::size_t i : order) {
    const std::string id(index.conversation_id(i));
    if (id.empty()) continue;
    records.push_back({id, std::string(index.file_path(i))});
    keys.push_back(id);
  }
  Dataset d = match_keys(records, keys, index, entry_ids(index), quarantine);
  d.matched_by = "index";
  if (d.samples.empty()) {
    if (index.size() == 0) throw Error("no records to train on: the index " + index.path() + " holds none");
    throw Error("none of the " + std::to_string(index.size()) + " records of the index " + index.path() +
                " is usable: " + std::to_string(d.quarantined) + " quarantined, " + std::to_string(d.duplicates) +
                " with duplicate ids, " + std::to_string(d.unreadable) + " unreadable, " +
                std::to_string(d.too_short) + " with fewer than 2 tokens");
  }
  return d;
}

Dataset match_dataset(const std::vector<Conversation>& conversations, const DatasetIndex& index,
                      const std::set<std::string>& quarantine, MatchBy by) {
  Dataset d = match_records(conversations, index, quarantine, by);
  if (!d.samples.empty()) return d;
  std::string roots;
  for (const auto& r : index.roots()) roots += (roots.empty() ? "" : ", ") + r;
  if (conversations.empty()) throw Error("no conversations to train on: the data holds none");
  if (index.size() == 0)
    throw Error("no records to train on: the index " + index.path() + " (built from " + roots +
                ") holds none; expected record files there (" +
                format_list(&FormatRow::name, [](const FormatRow& r) { return !r.noun.empty(); }, ", ", " or ") +
                ")");
  std::string msg = "none of the " + std::to_string(conversations.size()) +
                    " conversations matched a usable record in the index " + index.path() +
                    " (" + std::to_string(index.size()) + " records from " + roots + "): " +
                    std::to_string(d.missing) + " have no record, " +
                    std::to_string(d.quarantined) + " are quarantined, " +
                    std::to_string(d.duplicates) + " have duplicate ids, " +
                    std::to_string(d.unreadable) + " have an unreadable record, " +
                    std::to_string(d.too_short) + " have fewer than 2 tokens. ";
  if (d.missing == conversations.size()) {
    msg += "Records match conversations by id: the conversation_id stored in the record, else "
           "the file name without extension (conversation \"abc\" <- abc.pt); conversations take "
           "their id from \"conversation_id\", else \"uuid\", else \"id\". For example, the first "
           "conversation's id is \"" + conversations.front().id + "\" (" +
           conversations.front().source + ")";
    std::vector<std::string> rows;
    const bool row_named = entry_rows(index, rows);
    for (std::size_t i = 0; i < index.size(); ++i) {
      if (!index.conversation_id(i).empty()) {
        msg += " and the first record's id is \"" + std::string(index.conversation_id(i)) +
               "\" (" + std::string(index.file_path(i)) + ")";
        break;
      }
    }
    msg += ".";
    if (row_named && by == MatchBy::kId)
      msg += " The records are named by row (data_{i}, hs_{i}): pass --match-by row, or leave out --data to train on "
             "every record of the index.";
  } else {
    msg += "Run `eaglekit validate` for the details.";
  }
  throw Error(msg);
}

std::set<std::string> load_quarantine(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw IoError::from_errno(path, "cannot open quarantine file", errno);
  std::set<std::string> ids;
  std::string line;
  while (std::getline(f, line)) {
    const std::string t = trim(line);
    if (t.empty() || t[0] == '#') continue;
    ids.insert(t);
  }
  if (f.bad()) throw IoError::from_errno(path, "cannot read quarantine file", errno);
  return ids;
}

void write_quarantine(const std::string& path,
                      const std::vector<std::pair<std::string, std::vector<std::string>>>& groups) {
  std::string text =
      "# conversation ids to leave out of training (eaglekit validate --quarantine);\n"
      "# one id a line, '#' starts a comment line\n";
  std::unordered_set<std::string> written;
  for (const auto& [comment, ids] : groups) {
    std::string block;
    for (const auto& id : ids) {
      // Refuse what load_quarantine would read back differently rather than drop it.
      if (id.empty() || trim(id) != id || id[0] == '#' || id.find('\n') != std::string::npos)
        throw Error(path + ": conversation id \"" + id +
                    "\" cannot be written to a quarantine file (empty, surrounded by blanks, "
                    "starting with '#' or holding a newline)");
      if (!written.insert(id).second) continue;
      block += id + "\n";
    }
    if (!block.empty()) text += "# " + comment + "\n" + block;
  }
  write_file_atomic(path, text.data(), text.size());
}

Split split_dataset(const std::vector<SampleRef>& samples, double eval_fraction) {
  if (!(eval_fraction >= 0.0 && eval_fraction <= 1.0))
    throw UsageError("eval fraction must be between 0 and 1, got " + std::to_string(eval_fraction));
  const auto n_train = static_cast<std::size_t>(
      std::floor((1.0 - eval_fraction) * static_cast<double>(samples.size())));
  Split s;
  s.train.assign(samples.begin(), samples.begin() + static_cast<std::ptrdiff_t>(n_train));
  s.eval.assign(samples.begin() + static_cast<std::ptrdiff_t>(n_train), samples.end());
  return s;
}

}  // namespace eaglekit
