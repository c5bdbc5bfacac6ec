#include "formats/host_tensor.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "formats/error.h"

namespace eaglekit {

std::int64_t HostTensor::numel() const {
  std::int64_t n = 1;
  for (auto s : shape) n *= s;
  return n;
}

std::vector<std::int64_t> HostTensor::contiguous_strides(const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> st(shape.size(), 1);
  std::int64_t acc = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    st[i] = acc;
    acc *= std::max<std::int64_t>(shape[i], 1);
  }
  return st;
}

bool HostTensor::is_contiguous() const {
  std::int64_t expected = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    if (shape[i] != 1 && strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

HostTensor HostTensor::rows(std::int64_t n) const {
  if (shape.empty()) throw Error("HostTensor::rows on a 0-d tensor");
  return slice_rows(0, std::min(std::max<std::int64_t>(n, 0), shape[0]));
}

HostTensor HostTensor::slice_rows(std::int64_t begin, std::int64_t end) const {
  if (shape.empty()) throw Error("HostTensor::slice_rows on a 0-d tensor");
  begin = std::clamp<std::int64_t>(begin, 0, shape[0]);
  end = std::clamp<std::int64_t>(end, begin, shape[0]);
  HostTensor t = *this;
  t.shape[0] = end - begin;
  if (t.data != nullptr) t.data += begin * strides[0] * static_cast<std::int64_t>(itemsize());
  return t;
}

HostTensor HostTensor::squeeze0() const {
  if (shape.empty() || shape[0] != 1) return *this;
  HostTensor t = *this;
  t.shape.erase(t.shape.begin());
  t.strides.erase(t.strides.begin());
  return t;
}

HostTensor HostTensor::reshaped(std::vector<std::int64_t> new_shape) const {
  HostTensor t = *this;
  t.shape = std::move(new_shape);
  if (t.numel() != numel()) throw Error("HostTensor::reshaped: element count differs");
  if (!is_contiguous()) return contiguous().reshaped(t.shape);
  t.strides = contiguous_strides(t.shape);
  return t;
}

void HostTensor::copy_to(void* dst) const {
  const std::size_t item = itemsize();
  auto* out = static_cast<std::uint8_t*>(dst);
  const std::int64_t n = numel();
  if (n == 0) return;
  if (is_contiguous()) {
    std::memcpy(out, data, static_cast<std::size_t>(n) * item);
    return;
  }
  // Walk the index space; copy the innermost contiguous run at once when it is stride 1.
  const std::size_t nd = shape.size();
  const std::int64_t inner = shape[nd - 1];
  const bool inner_unit = strides[nd - 1] == 1;
  std::vector<std::int64_t> idx(nd, 0);
  const std::int64_t outer = n / std::max<std::int64_t>(inner, 1);
  for (std::int64_t o = 0; o < outer; ++o) {
    std::int64_t off = 0;
    for (std::size_t d = 0; d + 1 < nd; ++d) off += idx[d] * strides[d];
    const std::uint8_t* src = data + off * static_cast<std::int64_t>(item);
    if (inner_unit) {
      std::memcpy(out, src, static_cast<std::size_t>(inner) * item);
      out += static_cast<std::size_t>(inner) * item;
    } else {
      for (std::int64_t j = 0; j < inner; ++j) {
        std::memcpy(out, src + j * strides[nd - 1] * static_cast<std::int64_t>(item), item);
        out += item;
      }
    }
    for (std::size_t d = nd - 1; d-- > 0;) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
}

HostTensor HostTensor::contiguous() const {
  std::vector<std::uint8_t> bytes(nbytes());
  copy_to(bytes.data());
  return from_bytes(dtype, shape, std::move(bytes));
}

double HostTensor::get(std::int64_t i) const {
  std::int64_t off = 0;
  std::int64_t rem = i;
  for (std::size_t d = shape.size(); d-- > 0;) {
    off += (rem % shape[d]) * strides[d];
    rem /= shape[d];
  }
  return load_as_double(data, dtype, off);
}

bool HostTensor::equal(const HostTensor& other) const {
  if (dtype != other.dtype || shape != other.shape) return false;
  if (is_contiguous() && other.is_contiguous())
    return nbytes() == 0 || std::memcmp(data, other.data, nbytes()) == 0;
  const HostTensor a = contiguous(), b = other.contiguous();
  return nbytes() == 0 || std::memcmp(a.data, b.data, nbytes()) == 0;
}

std::string HostTensor::shape_string() const {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

HostTensor HostTensor::zeros(DType dtype, std::vector<std::int64_t> shape) {
  HostTensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(t.numel()) * dtype_size(dtype), 0);
  return from_bytes(dtype, t.shape, std::move(bytes));
}

HostTensor HostTensor::from_bytes(DType dtype, std::vector<std::int64_t> shape,
                                  std::vector<std::uint8_t> bytes) {
  HostTensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.strides = contiguous_strides(t.shape);
  if (bytes.size() != static_cast<std::size_t>(t.numel()) * dtype_size(dtype))
    throw Error("HostTensor::from_bytes: byte count does not match shape " + t.shape_string());
  auto buf = std::make_shared<std::vector<std::uint8_t>>(std::move(bytes));
  t.data = buf->data();
  t.owner = std::move(buf);
  return t;
}

HostTensor HostTensor::view(DType dtype, std::vector<std::int64_t> shape, const void* data,
                            std::shared_ptr<const void> owner) {
  HostTensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.strides = contiguous_strides(t.shape);
  t.data = static_cast<const std::uint8_t*>(data);
  t.owner = std::move(owner);
  return t;
}

}  // namespace eaglekit
