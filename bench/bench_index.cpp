// Helper of bench/bench_index.sh.
//
//   bench_index gen DIR N      N small .pt records (T=16, H=64, k=3, bf16) in nested folders
//                              DIR/rNN/sMM/conv-IIIIIII.pt, ids from the file stem like the
//                              reference expects; one torch.save zip copied N times, plain
//                              writes (no fsync), so generation is cheap.
//   bench_index open INDEX     times DatasetIndex::load of an existing index + hashing its ids
//                              (median of 5).
//   bench_index load N [REPS]  writes an index of N entries straight from memory (as if
//                              N files had been indexed), then times DatasetIndex::load,
//                              hashing every id (what matching does) and find() of random ids.
// Prints "key value" lines the script parses.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "formats/format.h"
#include "formats/host_tensor.h"
#include "formats/pt_format.h"
#include "lib/index.h"

using namespace eaglekit;
namespace fs = std::filesystem;

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string id_of(std::size_t i) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "conv-%07zu", i);
  return buf;
}

int gen(const std::string& dir, std::size_t n) {
  const std::string proto = dir + "/.proto.pt";
  fs::create_directories(dir);
  const std::int64_t t = 16, h = 64;
  write_pt(proto, {{"input_ids", HostTensor::zeros(DType::kInt64, {t})},
                   {"hidden_states", HostTensor::zeros(DType::kBFloat16, {t, h})},
                   {"aux_hidden_states", HostTensor::zeros(DType::kBFloat16, {t, 3 * h})}});
  std::ifstream in(proto, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  fs::remove(proto);
  const double t0 = now_s();
  for (std::size_t i = 0; i < n; ++i) {
    char sub[32];
    std::snprintf(sub, sizeof sub, "/r%02zu/s%02zu/", i % 100, (i / 100) % 10);
    const std::string folder = dir + sub;
    if (i < 1000) fs::create_directories(folder);
    std::ofstream out(folder + id_of(i) + ".pt", std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  std::cout << "gen_files " << n << "\ngen_bytes_per_file " << bytes.size() << "\ngen_seconds "
            << now_s() - t0 << "\n";
  return 0;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int walk(const std::string& dir) {
  const double t0 = now_s();
  const auto files = find_record_files(dir);
  const double t1 = now_s();
  std::size_t n = 0;
  for (const auto& f : files) {
    const auto r = open_reader(f);
    n += r->size();
    (void)r->info(0);
  }
  const double t2 = now_s();
  std::cout << "walk_files " << files.size() << "\nwalk_seconds " << t1 - t0
            << "\nopen_info_serial_seconds " << t2 - t1 << "\n";
  return n == files.size() ? 0 : 1;
}

int open_existing(const std::string& path) {
  std::vector<double> total;
  std::size_t n = 0;
  for (int r = 0; r < 5; ++r) {
    const double t0 = now_s();
    const DatasetIndex index = DatasetIndex::load(path);
    std::unordered_map<std::string_view, std::uint32_t> by_id;
    by_id.reserve(index.size());
    for (std::size_t i = 0; i < index.size(); ++i) by_id.emplace(index.conversation_id(i), i);
    total.push_back(now_s() - t0);
    n = by_id.size();
  }
  std::cout << "open_entries " << n << "\nopen_seconds_median " << median(total) << "\n";
  return 0;
}

int load(std::size_t n, int reps) {
  const std::string path = "/tmp/eaglekit-bench-index-" + std::to_string(::getpid()) + ".ekidx";
  std::vector<IndexedFile> files(n);
  for (std::size_t i = 0; i < n; ++i) {
    IndexedFile& f = files[i];
    char p[96];
    std::snprintf(p, sizeof p, "/data/dump/r%02zu/s%02zu/%s.pt", i % 100, (i / 100) % 10,
                  id_of(i).c_str());
    f.path = p;
    f.size = 200000 + i;
    f.mtime_ns = 1700000000000000000LL + static_cast<std::int64_t>(i);
    f.format = Format::kPt;
    f.records.resize(1);
    RecordInfo& info = f.records[0].info;
    info.conversation_id = id_of(i);
    info.tokens = 100 + static_cast<std::int64_t>(i % 4000);
    info.hidden_size = 4096;
    info.aux_width = 3 * 4096;
    info.byte_size = f.size;
  }
  double t0 = now_s();
  write_index(path, {"/data/dump"}, files);
  const double write_s = now_s() - t0;
  files.clear();
  files.shrink_to_fit();

  std::vector<double> load_s, hash_s, find_s;
  std::mt19937_64 rng(1);
  std::size_t checksum = 0;
  for (int r = 0; r < reps; ++r) {
    t0 = now_s();
    const DatasetIndex index = DatasetIndex::load(path);
    const double t1 = now_s();
    std::unordered_map<std::string_view, std::uint32_t> by_id;
    by_id.reserve(index.size());
    for (std::size_t i = 0; i < index.size(); ++i) by_id.emplace(index.conversation_id(i), i);
    const double t2 = now_s();
    for (int k = 0; k < 10000; ++k) checksum += index.find(id_of(rng() % n)).at(0);
    const double t3 = now_s();
    load_s.push_back(t1 - t0);
    hash_s.push_back(t2 - t1);
    find_s.push_back((t3 - t2) / 10000);
    checksum += by_id.size();
  }
  std::cout << "load_entries " << n << "\nload_file_bytes " << fs::file_size(path)
            << "\nload_write_seconds " << write_s << "\nload_seconds_median " << median(load_s)
            << "\nload_hash_all_ids_seconds_median " << median(hash_s)
            << "\nload_find_microseconds_median " << median(find_s) * 1e6 << "\nload_checksum "
            << checksum << "\n";
  fs::remove(path);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string cmd = argc > 1 ? argv[1] : "";
  try {
    if (cmd == "gen" && argc == 4) return gen(argv[2], std::stoul(argv[3]));
    if (cmd == "walk" && argc == 3) return walk(argv[2]);
    if (cmd == "open" && argc == 3) return open_existing(argv[2]);
    if (cmd == "load" && (argc == 3 || argc == 4))
      return load(std::stoul(argv[2]), argc == 4 ? std::stoi(argv[3]) : 5);
  } catch (const std::exception& e) {
    std::cerr << "bench_index: " << e.what() << "\n";
    return 1;
  }
  std::cerr << "usage: bench_index gen DIR N | bench_index open INDEX | bench_index load N [REPS]\n";
  return 2;
}
