// Autocast for one device type for a scope (the unrolls' mixed precision): enables it with
// a dtype and restores the previous state. The API moved in LibTorch 2.4 (per-device-type
// setters); the .cpp hides which one is called.
//
// Thread safety: autocast state is per thread; a guard belongs to the thread that made it.
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

namespace eaglekit::trainer {

class AutocastGuard {
 public:
  AutocastGuard(c10::DeviceType device, c10::ScalarType dtype);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  c10::DeviceType device_;
  bool prev_enabled_ = false;
  c10::ScalarType prev_dtype_ = c10::ScalarType::BFloat16;
};

}  // namespace eaglekit::trainer
