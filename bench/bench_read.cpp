// Reader benchmark, our side: reads every record of a folder of record files with
// open_reader() + read(0) and touches every byte of every tensor (a 64-bit word sum), so
// that lazy mmap views cannot look faster than they are. Prints one line per repetition:
//   rep N: FILES files, BYTES bytes in WALL s wall, CPU s cpu
// (CPU time = user + system of this process; the fairer number on a busy machine).
// bench/bench_read.sh runs it beside torch.load and cat on the same files.
//
// usage: bench_read DIR [REPS]
#include <chrono>
#include <ctime>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "formats/format.h"
#include "formats/host_tensor.h"

namespace {

std::uint64_t touch(const eaglekit::HostTensor& t) {
  const eaglekit::HostTensor c = t.is_contiguous() ? t : t.contiguous();
  const std::uint8_t* p = c.data;
  const std::size_t n = c.nbytes();
  std::uint64_t sum = 0;
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    std::uint64_t w;
    std::memcpy(&w, p + i, 8);
    sum += w;
  }
  for (; i < n; ++i) sum += p[i];
  return sum;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3) {
    std::fprintf(stderr, "usage: bench_read DIR [REPS]\n");
    return 2;
  }
  const int reps = argc == 3 ? std::atoi(argv[2]) : 3;
  try {
    const std::vector<std::string> files = eaglekit::find_record_files(argv[1]);
    if (files.empty()) {
      std::fprintf(stderr, "bench_read: no record files below %s\n", argv[1]);
      return 1;
    }
    std::uint64_t sink = 0;
    for (int rep = 0; rep < reps; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      const std::clock_t c0 = std::clock();
      std::uint64_t bytes = 0;
      for (const auto& f : files) {
        const auto reader = eaglekit::open_reader(f);
        for (std::size_t i = 0; i < reader->size(); ++i) {
          const eaglekit::Record r = reader->read(i);
          sink += touch(r.input_ids) + touch(r.hidden_states) + touch(r.aux_hidden_states);
          bytes += r.input_ids.nbytes() + r.hidden_states.nbytes() + r.aux_hidden_states.nbytes();
          if (r.loss_mask) {
            sink += touch(*r.loss_mask);
            bytes += r.loss_mask->nbytes();
          }
        }
      }
      const double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double cpu = static_cast<double>(std::clock() - c0) / CLOCKS_PER_SEC;
      std::printf("rep %d: %zu files, %llu bytes in %.6f s wall, %.6f s cpu\n", rep, files.size(),
                  static_cast<unsigned long long>(bytes), s, cpu);
    }
    std::fprintf(stderr, "checksum %llu\n", static_cast<unsigned long long>(sink));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_read: %s\n", e.what());
    return 1;
  }
  return 0;
}
