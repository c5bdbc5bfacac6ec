#include "lib/inspect.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_reduce.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>

#include "formats/error.h"
#include "lib/loss_masks.h"

namespace eaglekit {

namespace {

// Chan et al.'s parallel merge of (count, mean, M2) keeps the variance exact enough for
// long tensors without a second pass.
struct Acc {
  std::int64_t n = 0;
  double mean = 0, m2 = 0;
  double lo = std::numeric_limits<double>::infinity();
  double hi = -std::numeric_limits<double>::infinity();
  std::int64_t nan = 0, inf = 0;

  void add(double x) {
    if (std::isnan(x)) {
      ++nan;
      return;
    }
    if (std::isinf(x)) {
      ++inf;
      return;
    }
    ++n;
    const double d = x - mean;
    mean += d / static_cast<double>(n);
    m2 += d * (x - mean);
    lo = std::min(lo, x);
    hi = std::max(hi, x);
  }
  void merge(const Acc& o) {
    nan += o.nan;
    inf += o.inf;
    if (o.n == 0) return;
    if (n == 0) {
      const auto keep_nan = nan, keep_inf = inf;
      *this = o;
      nan = keep_nan;
      inf = keep_inf;
      return;
    }
    const auto total = static_cast<double>(n + o.n);
    const double d = o.mean - mean;
    mean += d * static_cast<double>(o.n) / total;
    m2 += o.m2 + d * d * static_cast<double>(n) * static_cast<double>(o.n) / total;
    n += o.n;
    lo = std::min(lo, o.lo);
    hi = std::max(hi, o.hi);
  }
};

template <class Load>
void accumulate(const std::uint8_t* p, std::int64_t n, std::size_t item, Acc& acc, Load load) {
  for (std::int64_t i = 0; i < n; ++i) acc.add(load(p + static_cast<std::size_t>(i) * item));
}

void accumulate_contiguous(DType dt, const std::uint8_t* p, std::int64_t n, Acc& acc) {
  const std::size_t item = dtype_size(dt);
  switch (dt) {
    case DType::kBFloat16:
      accumulate(p, n, item, acc, [](const std::uint8_t* q) {
        std::uint16_t v;
        std::memcpy(&v, q, 2);
        return static_cast<double>(bf16_to_float(v));
      });
      return;
    case DType::kFloat16:
      accumulate(p, n, item, acc, [](const std::uint8_t* q) {
        std::uint16_t v;
        std::memcpy(&v, q, 2);
        return static_cast<double>(fp16_to_float(v));
      });
      return;
    case DType::kFloat32:
      accumulate(p, n, item, acc, [](const std::uint8_t* q) {
        float v;
        std::memcpy(&v, q, 4);
        return static_cast<double>(v);
      });
      return;
    default:
      for (std::int64_t i = 0; i < n; ++i) acc.add(load_as_double(p, dt, i));
  }
}

std::string fmt_double(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

nlohmann::json json_number(double v) {
  // JSON has no NaN: an empty tensor's statistics are null.
  return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr);
}

}  // namespace

TensorStats tensor_stats(const HostTensor& t) {
  const std::int64_t n = t.numel();
  Acc total;
  if (n > 0) {
    // Rows of the outermost dimension are the unit of work; views may be strided.
    const std::int64_t rows = t.dim() == 0 ? 1 : t.shape[0];
    const std::int64_t per_row = n / rows;
    total = tbb::parallel_reduce(
        tbb::blocked_range<std::int64_t>(0, rows, std::max<std::int64_t>(1, 65536 / std::max<std::int64_t>(per_row, 1))),
        Acc{},
        [&](const tbb::blocked_range<std::int64_t>& r, Acc acc) {
          const HostTensor part = t.dim() == 0 ? t : t.slice_rows(r.begin(), r.end());
          if (part.is_contiguous()) {
            accumulate_contiguous(t.dtype, part.data, part.numel(), acc);
          } else {
            const HostTensor c = part.contiguous();
            accumulate_contiguous(t.dtype, c.data, c.numel(), acc);
          }
          return acc;
        },
        [](Acc a, const Acc& b) {
          a.merge(b);
          return a;
        });
  }
  TensorStats s;
  s.count = total.n;
  s.nan = total.nan;
  s.inf = total.inf;
  if (total.n == 0) {
    s.min = s.max = s.mean = s.std = std::numeric_limits<double>::quiet_NaN();
  } else {
    s.min = total.lo;
    s.max = total.hi;
    s.mean = total.mean;
    s.std = std::sqrt(std::max(0.0, total.m2 / static_cast<double>(total.n)));
  }
  return s;
}

InspectResult inspect(const std::string& spec, const InspectOptions& options) {
  const RecordSpec rs = parse_record_spec(spec);
  const auto reader = open_reader(rs.path);
  InspectResult res;
  res.path = rs.path;
  res.format = reader->format();
  res.record_count = reader->size();
  res.loss_masks = options.loss_masks;
  res.facts = reader->facts();
  // Opened (and checked whole) before a record is read, as convert does.
  std::optional<LossMasks> masks;
  if (!options.loss_masks.empty()) masks.emplace(LossMasks::open(options.loss_masks));
  std::optional<std::size_t> pick;
  if (rs.conversation_id) {
    pick = reader->find(*rs.conversation_id);
    if (!pick)
      throw Error(rs.path + ": no record with conversation id '" + *rs.conversation_id + "' (" +
                  std::to_string(reader->size()) + " records in the file)");
  } else if (reader->size() == 1) {
    pick = 0;
  }
  if (!pick) {
    for (std::size_t i = 0; i < reader->size(); ++i) {
      RecordSummary s{reader->info(i), {}, std::nullopt};
      if (masks) s.loss_mask_row = masks->check_length(s.info.conversation_id, rs.path, s.info.tokens);
      res.records.push_back(std::move(s));
    }
    return res;
  }
  RecordSummary s;
  s.info = reader->info(*pick);
  Record r = reader->read(*pick);
  if (masks) {
    s.loss_mask_row = masks->check_length(r.conversation_id, rs.path, r.tokens());
    masks->apply(r, rs.path);
  }
  auto add = [&](const char* name, const HostTensor& t) {
    TensorSummary ts;
    ts.name = name;
    ts.dtype = t.dtype;
    ts.shape = t.shape;
    if (options.stats) ts.stats = tensor_stats(t);
    s.tensors.push_back(std::move(ts));
  };
  add("input_ids", r.input_ids);
  if (r.target_probs) add("target_probs", *r.target_probs);  // in place of hidden states (NeMo's cache)
  else add("hidden_states", r.hidden_states);
  add("aux_hidden_states", r.aux_hidden_states);
  if (r.loss_mask) add("loss_mask", *r.loss_mask);
  res.records.push_back(std::move(s));
  return res;
}

namespace {

std::string facts_ids_text(const std::vector<std::int64_t>& ids) {
  std::string s;
  for (std::size_t i = 0; i < ids.size(); ++i) s += (i ? ", " : "") + std::to_string(ids[i]);
  return "[" + s + "]";
}

void add_facts_json(nlohmann::ordered_json& j, const FileFacts& f) {
  if (f.empty()) return;
  nlohmann::ordered_json facts;
  facts["aux_layer_ids"] = f.aux_layer_ids;
  facts["target_vocabulary"] = nullptr;
  if (const auto& v = f.target_vocabulary)
    facts["target_vocabulary"] = {{"draft_vocab_size", v->selected.size()},
                                  {"target_vocab_size", v->target_vocab_size},
                                  {"topk", v->topk}};
  j["facts"] = std::move(facts);
}

std::string facts_text(const FileFacts& f) {
  std::string out;
  if (!f.aux_layer_ids.empty())
    out += "aux layer ids:   " + facts_ids_text(f.aux_layer_ids) + " (stated by the file; HF hidden_states indices)\n";
  if (const auto& v = f.target_vocabulary)
    out += "target vocab:    " + std::to_string(v->selected.size()) + " draft tokens of " +
           std::to_string(v->target_vocab_size) +
           (v->topk ? ", top " + std::to_string(v->topk) + " kept per position" : std::string(", full distribution")) +
           " (records store target_probs over them)\n";
  return out;
}

nlohmann::ordered_json prenorm_json(const std::optional<bool>& v) {
  return v ? nlohmann::ordered_json(*v) : nlohmann::ordered_json(nullptr);
}

std::string norm_text(const RecordInfo& i) {
  const std::optional<bool>& v = i.hidden_states_prenorm;
  if (!v && i.layout_prenorm)
    return std::string(*i.layout_prenorm ? "pre" : "post") + "-norm (not stated; implied by its layout)";
  return !v ? "not stated" : *v ? "pre-norm (stated by the record)" : "post-norm (stated by the record)";
}

}  // namespace

std::string inspect_json(const InspectResult& r) {
  nlohmann::ordered_json j;
  j["format"] = std::string(format_name(r.format));
  j["path"] = r.path;
  if (r.single()) {
    const RecordSummary& s = r.records[0];
    j["conversation_id"] = s.info.conversation_id;
    nlohmann::ordered_json tensors = nlohmann::ordered_json::object();
    for (const auto& t : s.tensors) {
      nlohmann::ordered_json e;
      e["dtype"] = std::string(dtype_name(t.dtype));
      e["shape"] = t.shape;
      if (t.stats) {
        e["min"] = json_number(t.stats->min);
        e["max"] = json_number(t.stats->max);
        e["mean"] = json_number(t.stats->mean);
        e["std"] = json_number(t.stats->std);
        e["nan"] = t.stats->nan;
        e["inf"] = t.stats->inf;
      }
      tensors[t.name] = std::move(e);
    }
    j["tensors"] = std::move(tensors);
    j["codec"] = s.info.codec;
    j["hidden_states_prenorm"] = prenorm_json(s.info.hidden_states_prenorm);
    if (s.loss_mask_row) j["loss_masks"] = {{"file", r.loss_masks}, {"row", *s.loss_mask_row}};
    add_facts_json(j, r.facts);
    return j.dump(2) + "\n";
  }
  j["record_count"] = r.record_count;
  nlohmann::ordered_json recs = nlohmann::ordered_json::array();
  for (const auto& s : r.records) {
    nlohmann::ordered_json e;
    e["conversation_id"] = s.info.conversation_id;
    e["tokens"] = s.info.tokens;
    e["hidden_size"] = s.info.hidden_size;
    e["aux_width"] = s.info.aux_width;
    e["dtype"] = std::string(dtype_name(s.info.hidden_dtype));
    e["loss_mask"] = s.info.has_loss_mask;
    e["hidden_states_prenorm"] = prenorm_json(s.info.hidden_states_prenorm);
    e["codec"] = s.info.codec;
    e["byte_offset"] = s.info.byte_offset;
    e["byte_size"] = s.info.byte_size;
    if (s.loss_mask_row) e["loss_mask_row"] = *s.loss_mask_row;
    recs.push_back(std::move(e));
  }
  j["records"] = std::move(recs);
  add_facts_json(j, r.facts);
  return j.dump(2) + "\n";
}

std::string inspect_text(const InspectResult& r) {
  std::string out;
  out += "path:            " + r.path + "\n";
  out += "format:          " + std::string(format_name(r.format)) + "\n";
  out += facts_text(r.facts);
  if (r.single()) {
    const RecordSummary& s = r.records[0];
    out += "conversation_id: " + s.info.conversation_id + "\n";
    out += "codec:           " + s.info.codec + "\n";
    out += "norm form:       " + norm_text(s.info) + "\n";
    if (s.loss_mask_row)
      out += "loss mask:       row " + std::to_string(*s.loss_mask_row) + " of " + r.loss_masks +
             " (--loss-masks: its length and token ids checked)\n";
    out += "tensors:\n";
    for (const auto& t : s.tensors) {
      char line[512];
      HostTensor shape_only;
      shape_only.shape = t.shape;
      std::snprintf(line, sizeof line, "  %-18s %-9s %-16s", t.name.c_str(),
                    std::string(dtype_name(t.dtype)).c_str(), shape_only.shape_string().c_str());
      out += line;
      if (t.stats) {
        out += " min " + fmt_double(t.stats->min) + "  max " + fmt_double(t.stats->max) +
               "  mean " + fmt_double(t.stats->mean) + "  std " + fmt_double(t.stats->std) +
               "  nan " + std::to_string(t.stats->nan) + "  inf " + std::to_string(t.stats->inf);
      }
      while (!out.empty() && out.back() == ' ') out.pop_back();
      out += "\n";
    }
    return out;
  }
  out += "records:         " + std::to_string(r.record_count) +
         " (FILE#conversation_id shows one)\n";
  if (!r.loss_masks.empty()) out += "loss masks:      " + r.loss_masks + " (--loss-masks: rows below, lengths checked)\n";
  for (const auto& s : r.records) {
    char line[512];
    std::snprintf(line, sizeof line, "  %-24s tokens %-7lld H %-6lld aux %-7lld %-9s %s%s%s\n",
                  s.info.conversation_id.c_str(), static_cast<long long>(s.info.tokens),
                  static_cast<long long>(s.info.hidden_size),
                  static_cast<long long>(s.info.aux_width),
                  std::string(dtype_name(s.info.hidden_dtype)).c_str(), s.info.codec.c_str(),
                  s.info.has_loss_mask ? " loss_mask" : "",
                  !s.info.hidden_states_prenorm ? "" : *s.info.hidden_states_prenorm ? " pre-norm" : " post-norm");
    out += line;
    if (s.loss_mask_row) {
      out.pop_back();
      out += " loss_mask row " + std::to_string(*s.loss_mask_row) + "\n";
    }
  }
  return out;
}

}  // namespace eaglekit
