// Small measuring helpers the C++ benchmarks share: resident memory now and at its peak
// (Linux), and the median of repeated timings. Header-only.
#pragma once

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <vector>

namespace eaglekit::bench {

// Resident set size of this process now, MiB (/proc/self/statm).
inline double rss_mib() {
  std::ifstream f("/proc/self/statm");
  long pages = 0, resident = 0;
  f >> pages >> resident;
  return static_cast<double>(resident) * static_cast<double>(::sysconf(_SC_PAGESIZE)) / (1 << 20);
}

// The process's peak resident set size so far, MiB (getrusage).
inline double peak_rss_mib() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

// The median of v (the upper one for an even count); v must not be empty.
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace eaglekit::bench
