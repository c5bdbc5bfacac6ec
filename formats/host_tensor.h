// A strided view of host memory with a dtype and a shape: what formats hand out. It is
// not a LibTorch tensor (formats/ does not depend on LibTorch); lib/ wraps it with
// torch::from_blob when a batch is built. Views into a mapped file are zero-copy and keep
// the mapping alive through `owner`.
//
// Thread safety: immutable; copies share the underlying bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "formats/dtype.h"

namespace eaglekit {

struct HostTensor {
  DType dtype = DType::kFloat32;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;  // in elements, like torch
  const std::uint8_t* data = nullptr;  // element [0, 0, ...]
  std::shared_ptr<const void> owner;   // keeps `data` alive

  std::int64_t dim() const { return static_cast<std::int64_t>(shape.size()); }
  std::int64_t size(std::int64_t d) const { return shape.at(static_cast<std::size_t>(d)); }
  std::int64_t numel() const;
  std::size_t itemsize() const { return dtype_size(dtype); }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * itemsize(); }
  bool is_contiguous() const;
  bool defined() const { return data != nullptr || numel() == 0; }

  // First n entries along dim 0 (n clamped to size(0)); a view, no copy.
  HostTensor rows(std::int64_t n) const;
  // Rows [begin, end) along dim 0; a view.
  HostTensor slice_rows(std::int64_t begin, std::int64_t end) const;
  // Drops a leading dimension of size 1; a view.
  HostTensor squeeze0() const;
  // Same bytes, new shape (must be contiguous and have the same numel).
  HostTensor reshaped(std::vector<std::int64_t> new_shape) const;
  // Writes the elements in row-major order to dst (nbytes() bytes).
  void copy_to(void* dst) const;
  // A contiguous copy that owns its bytes (or *this when already contiguous and owned).
  HostTensor contiguous() const;
  // Element i in row-major logical order, as double.
  double get(std::int64_t i) const;
  // Elementwise equality of dtype, shape and bytes.
  bool equal(const HostTensor& other) const;
  std::string shape_string() const;  // "[T, H]" form: "[12, 64]"

  static std::vector<std::int64_t> contiguous_strides(const std::vector<std::int64_t>& shape);
  // A new zero-filled, contiguous, owning tensor.
  static HostTensor zeros(DType dtype, std::vector<std::int64_t> shape);
  // Takes ownership of bytes (size must be numel * itemsize).
  static HostTensor from_bytes(DType dtype, std::vector<std::int64_t> shape,
                               std::vector<std::uint8_t> bytes);
  // A contiguous view of externally owned memory.
  static HostTensor view(DType dtype, std::vector<std::int64_t> shape, const void* data,
                         std::shared_ptr<const void> owner);
  // Mutable access to an owning tensor made by zeros()/from_bytes().
  std::uint8_t* mutable_data() { return const_cast<std::uint8_t*>(data); }
};

}  // namespace eaglekit
