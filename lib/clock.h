// The seconds a piece of work took, on the steady clock every timing in eaglekit uses
// (metrics, reports, progress lines).
//
// Thread safety: a pure function of the clock.
#pragma once

#include <chrono>

namespace eaglekit {

// Seconds from `start` (a std::chrono::steady_clock::now() taken earlier) to now.
inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace eaglekit
