#include "formats/record.h"

#include "formats/error.h"

namespace eaglekit {

Record Record::prefix(std::int64_t n) const {
  Record r;
  r.conversation_id = conversation_id;
  r.input_ids = input_ids.rows(n);
  if (hidden_states.dim() > 0) r.hidden_states = hidden_states.rows(n);
  r.aux_hidden_states = aux_hidden_states.rows(n);
  if (loss_mask) r.loss_mask = loss_mask->rows(n);
  if (target_probs) r.target_probs = target_probs->rows(n);
  r.target_hidden_size = target_hidden_size;
  r.hidden_states_prenorm = hidden_states_prenorm;
  r.layout_prenorm = layout_prenorm;
  return r;
}

void Record::check(const std::string& where) const {
  auto fail = [&](const std::string& field, const std::string& what) {
    throw FormatError(where, std::nullopt, field, what);
  };
  if (input_ids.dim() != 1) fail("input_ids", "expected shape [T], got " + input_ids.shape_string());
  if (input_ids.dtype != DType::kInt64 && input_ids.dtype != DType::kInt32)
    fail("input_ids", "expected int64 or int32, got " + std::string(dtype_name(input_ids.dtype)));
  const std::int64_t t = input_ids.shape[0];
  // Hidden states (or, in their place, a stored target distribution) and aux, in the order
  // the messages have always come in for a record of hidden states.
  if (!target_probs && hidden_states.dim() != 2)
    fail("hidden_states", "expected shape [T, H], got " + hidden_states.shape_string());
  if (target_probs && hidden_states.dim() != 0)
    fail("hidden_states", "a record with target_probs holds no hidden states, got " + hidden_states.shape_string());
  if (aux_hidden_states.dim() != 2)
    fail("aux_hidden_states", "expected shape [T, k*H], got " + aux_hidden_states.shape_string());
  if (!target_probs && !is_floating(hidden_states.dtype))
    fail("hidden_states", "expected a floating dtype, got " +
                              std::string(dtype_name(hidden_states.dtype)));
  if (!is_floating(aux_hidden_states.dtype))
    fail("aux_hidden_states", "expected a floating dtype, got " +
                                  std::string(dtype_name(aux_hidden_states.dtype)));
  if (!target_probs && hidden_states.shape[0] != t)
    fail("hidden_states", std::to_string(hidden_states.shape[0]) + " rows but input_ids has " +
                              std::to_string(t) + " tokens");
  if (aux_hidden_states.shape[0] != t)
    fail("aux_hidden_states", std::to_string(aux_hidden_states.shape[0]) +
                                  " rows but input_ids has " + std::to_string(t) + " tokens");
  std::int64_t h = 0;
  if (target_probs) {
    // A record of stored target distributions (NeMo): no hidden states; H is stated.
    if (target_probs->dim() != 2 || target_probs->shape[0] != t || target_probs->shape[1] <= 0)
      fail("target_probs", "expected shape [" + std::to_string(t) + ", Vd], got " + target_probs->shape_string());
    if (target_probs->dtype != aux_hidden_states.dtype)
      fail("target_probs", "dtype " + std::string(dtype_name(target_probs->dtype)) + " differs from aux_hidden_states' " +
                               std::string(dtype_name(aux_hidden_states.dtype)));
    h = target_hidden_size;
    if (h <= 0) fail("target_hidden_size", "hidden size is 0");
  } else {
    h = hidden_states.shape[1];
    if (h <= 0) fail("hidden_states", "hidden size is 0");
  }
  if (aux_hidden_states.shape[1] % h != 0 || aux_hidden_states.shape[1] == 0)
    fail("aux_hidden_states", "width " + std::to_string(aux_hidden_states.shape[1]) +
                                  " is not a positive multiple of hidden size " + std::to_string(h));
  if (loss_mask) {
    if (loss_mask->dim() != 1 || loss_mask->shape[0] != t)
      fail("loss_mask", "expected shape [" + std::to_string(t) + "], got " +
                            loss_mask->shape_string());
  }
}

DType common_hidden_dtype(DType hidden, DType aux) {
  if (hidden == aux) return hidden;
  if (hidden == DType::kFloat64 || aux == DType::kFloat64) return DType::kFloat64;
  return DType::kFloat32;
}

HostTensor widened(const HostTensor& t, DType to) {
  HostTensor out = HostTensor::zeros(to, t.shape);
  const std::int64_t n = t.numel();
  if (to == DType::kFloat64) {
    auto* p = reinterpret_cast<double*>(out.mutable_data());
    for (std::int64_t i = 0; i < n; ++i) p[i] = t.get(i);
  } else if (to == DType::kFloat32) {
    auto* p = reinterpret_cast<float*>(out.mutable_data());
    for (std::int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(t.get(i));
  } else {
    throw UsageError("widened: to " + std::string(dtype_name(to)) + " is not float32 or float64");
  }
  return out;
}

Record Record::with_common_hidden_dtype() const {
  if (target_probs) return *this;  // one dtype: the producer's (NeMo writes both in its cache dtype)
  const DType want = common_hidden_dtype(hidden_states.dtype, aux_hidden_states.dtype);
  if (hidden_states.dtype == want && aux_hidden_states.dtype == want) return *this;
  Record r = *this;
  if (r.hidden_states.dtype != want) r.hidden_states = widened(r.hidden_states, want);
  if (r.aux_hidden_states.dtype != want) r.aux_hidden_states = widened(r.aux_hidden_states, want);
  return r;
}

RecordInfo info_of(const Record& r) {
  RecordInfo info;
  info.conversation_id = r.conversation_id;
  info.tokens = r.tokens();
  info.hidden_size = r.hidden_size();
  info.aux_width = r.aux_width();
  info.ids_dtype = r.input_ids.dtype;
  info.hidden_dtype = r.target_probs ? r.aux_hidden_states.dtype
                                     : common_hidden_dtype(r.hidden_states.dtype, r.aux_hidden_states.dtype);
  info.target_probs_width = r.target_probs_width();
  info.has_loss_mask = r.loss_mask.has_value();
  info.hidden_states_prenorm = r.hidden_states_prenorm;
  info.layout_prenorm = r.layout_prenorm;
  return info;
}

}  // namespace eaglekit
