// Codec benchmark: the same records stored as raw tensor bytes (what a .pt holds), gzip -6
// of those bytes (zlib; what SpecForge's .ckpt.gz does), .eks zstd at levels 1, 3 and 9,
// and .eks fp8; size and single-thread decode speed of each, side by side, one run.
// Sizes are relative to the raw source (the files themselves when each holds one record,
// e.g. .pt from `eaglekit synth`; else the tensor bytes). Speeds count decoded tensor bytes
// per second on one thread, data in memory (page cache), median of --reps. bench/bench_codec.sh runs it on `eaglekit synth` data and on
// the built-in generator.
//
// usage: bench_codec [--dir DIR] [--records N] [--tokens T] [--hidden H] [--reps R]
//   --dir DIR   records of any format below DIR (e.g. from `eaglekit synth`)
//   otherwise   built-in bf16 data with heavy tails (see make_record), N records of T
//               tokens, hidden size H, 3 aux layers; defaults N=16, T=512, H=2048.
#include <tbb/task_arena.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "formats/eks_format.h"
#include "formats/error.h"
#include "formats/format.h"

using namespace eaglekit;
namespace fs = std::filesystem;

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// CPU time of the calling thread: on a shared machine the wall clock also counts the time
// other processes held the core; this does not.
double cpu_s() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

struct Timing {
  double wall = 0;
  double cpu = 0;
};

Timing time_median(int reps, const std::function<void()>& f) {
  std::vector<double> w, c;
  for (int r = 0; r < reps; ++r) {
    const double a = now_s(), b = cpu_s();
    f();
    c.push_back(cpu_s() - b);
    w.push_back(now_s() - a);
  }
  return Timing{median(w), median(c)};
}

// Hidden states the way LLM dumps look: per-channel scales spread over an order of
// magnitude (log-normal), Student-t(3) values (heavy tails), a handful of "massive
// activation" channels 50-200x the rest, the first token (BOS) much larger, aux layers
// from earlier layers with smaller typical magnitude. Stored as bf16.
Record make_record(int index, std::int64_t t, std::int64_t h, std::mt19937& rng) {
  const int k = 3;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::chi_squared_distribution<float> chi(3.0f);
  auto student = [&] { return nd(rng) / std::sqrt(chi(rng) / 3.0f); };
  Record r;
  r.conversation_id = "bench-" + std::to_string(index);
  r.input_ids = HostTensor::zeros(DType::kInt64, {t});
  std::uniform_int_distribution<std::int64_t> tok(0, 128255);
  for (std::int64_t i = 0; i < t; ++i) {
    const std::int64_t v = tok(rng);
    std::memcpy(r.input_ids.mutable_data() + 8 * i, &v, 8);
  }
  auto fill = [&](HostTensor& x, std::int64_t width, float layer_scale) {
    std::lognormal_distribution<float> ln(0.0f, 0.6f);
    std::vector<float> ch(static_cast<std::size_t>(width));
    for (auto& c : ch) c = ln(rng) * layer_scale;
    for (int m = 0; m < std::max<int>(1, static_cast<int>(width / 1000)); ++m)
      ch[rng() % ch.size()] *= 50.0f + 150.0f * std::uniform_real_distribution<float>(0, 1)(rng);
    for (std::int64_t row = 0; row < t; ++row) {
      const float tok_scale = (row == 0 ? 20.0f : 1.0f) * std::exp(0.2f * nd(rng));
      for (std::int64_t c = 0; c < width; ++c) {
        const float v = student() * ch[static_cast<std::size_t>(c % width)] * tok_scale;
        const std::uint16_t b = float_to_bf16(v);
        std::memcpy(x.mutable_data() + 2 * (row * width + c), &b, 2);
      }
    }
  };
  r.hidden_states = HostTensor::zeros(DType::kBFloat16, {t, h});
  fill(r.hidden_states, h, 1.0f);
  r.aux_hidden_states = HostTensor::zeros(DType::kBFloat16, {t, k * h});
  for (int layer = 0; layer < k; ++layer) {
    HostTensor part = HostTensor::zeros(DType::kBFloat16, {t, h});
    fill(part, h, 0.1f * static_cast<float>(layer + 1));
    for (std::int64_t row = 0; row < t; ++row)
      std::memcpy(r.aux_hidden_states.mutable_data() + 2 * (row * k * h + layer * h),
                  part.data + 2 * row * h, static_cast<std::size_t>(2 * h));
  }
  return r;
}

Record owned(const Record& r) {
  Record o;
  o.conversation_id = r.conversation_id;
  o.input_ids = r.input_ids.contiguous();
  o.hidden_states = r.hidden_states.contiguous();
  o.aux_hidden_states = r.aux_hidden_states.contiguous();
  if (r.loss_mask) o.loss_mask = r.loss_mask->contiguous();
  // contiguous() returns *this for contiguous views into a mapping: copy those too.
  for (HostTensor* t : {&o.input_ids, &o.hidden_states, &o.aux_hidden_states}) {
    std::vector<std::uint8_t> b(t->nbytes());
    t->copy_to(b.data());
    *t = HostTensor::from_bytes(t->dtype, t->shape, std::move(b));
  }
  return o;
}

std::vector<std::uint8_t> raw_bytes(const Record& r) {
  std::vector<std::uint8_t> out;
  for (const HostTensor* t : {&r.input_ids, &r.hidden_states, &r.aux_hidden_states}) {
    const std::size_t at = out.size();
    out.resize(at + t->nbytes());
    t->copy_to(out.data() + at);
  }
  if (r.loss_mask) {
    const std::size_t at = out.size();
    out.resize(at + r.loss_mask->nbytes());
    r.loss_mask->copy_to(out.data() + at);
  }
  return out;
}

struct Row {
  std::string name;
  std::uint64_t bytes = 0;
  Timing encode;  // one thread
  Timing decode;  // one thread, median
  std::string note;
};

}  // namespace

int main(int argc, char** argv) {
  std::string dir;
  int n = 16, reps = 3;
  std::int64_t tokens = 512, hidden = 2048;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_codec: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--dir") dir = next();
    else if (a == "--records") n = std::stoi(next());
    else if (a == "--tokens") tokens = std::stoll(next());
    else if (a == "--hidden") hidden = std::stoll(next());
    else if (a == "--reps") reps = std::stoi(next());
    else {
      std::fprintf(stderr, "usage: bench_codec [--dir DIR] [--records N] [--tokens T] [--hidden H] [--reps R]\n");
      return 2;
    }
  }

  try {
    std::vector<Record> recs;
    std::string source;
    // Whole source files when each holds one record (.pt): raw and gzip then use the real
    // file bytes, as `gzip -6 x.pt` would.
    std::vector<std::vector<std::uint8_t>> files;
    if (!dir.empty()) {
      bool one_per_file = true;
      for (const auto& f : find_record_files(dir)) {
        auto r = open_reader(f);
        one_per_file = one_per_file && r->size() == 1;
        for (std::size_t i = 0; i < r->size(); ++i) recs.push_back(owned(r->read(i)));
        if (one_per_file) {
          std::vector<std::uint8_t> b(fs::file_size(f));
          std::FILE* fp = std::fopen(f.c_str(), "rb");
          if (fp == nullptr || std::fread(b.data(), 1, b.size(), fp) != b.size())
            throw Error("cannot read " + f);
          std::fclose(fp);
          files.push_back(std::move(b));
        }
      }
      if (!one_per_file) files.clear();
      source = dir + (files.empty() ? "" : " (" + std::string(format_name(open_reader(find_record_files(dir)[0])->format())) + " files)");
    } else {
      std::mt19937 rng(1234);
      for (int i = 0; i < n; ++i) recs.push_back(make_record(i, tokens, hidden, rng));
      source = "built-in heavy-tailed bf16 (" + std::to_string(n) + " x " + std::to_string(tokens) +
               " tokens, H=" + std::to_string(hidden) + ", k=3)";
    }
    if (recs.empty()) {
      std::fprintf(stderr, "bench_codec: no records found in %s\n", dir.c_str());
      return 1;
    }
    std::uint64_t payload = 0;  // decoded tensor bytes: what every codec hands back
    std::int64_t total_tokens = 0;
    for (const auto& r : recs) {
      payload += raw_bytes(r).size();
      total_tokens += r.tokens();
    }
    const bool whole_files = !files.empty();
    std::vector<std::vector<std::uint8_t>> raw;
    if (whole_files) raw = std::move(files);
    else for (const auto& r : recs) raw.push_back(raw_bytes(r));
    std::uint64_t raw_total = 0;
    for (const auto& b : raw) raw_total += b.size();
    std::printf("data: %s\n      %zu records, %lld tokens, H=%lld, aux width %lld, %s, %.1f MiB of tensors\n\n",
                source.c_str(), recs.size(), static_cast<long long>(total_tokens),
                static_cast<long long>(recs[0].hidden_size()),
                static_cast<long long>(recs[0].aux_width()),
                std::string(dtype_name(recs[0].hidden_states.dtype)).c_str(),
                static_cast<double>(payload) / 1048576.0);

    std::vector<Row> rows;
    const double raw_d = static_cast<double>(raw_total);    // sizes are relative to this
    const double payload_d = static_cast<double>(payload);  // speeds count these bytes

    // raw: what reading a stored .pt costs once its bytes are in memory (a copy).
    {
      Row row{whole_files ? "raw (source files)" : "raw (tensor bytes)", raw_total, {}, {},
              "decode = memcpy"};
      std::vector<std::uint8_t> dst(raw.front().size());
      row.decode = time_median(reps, [&] {
        for (const auto& b : raw) {
          if (dst.size() < b.size()) dst.resize(b.size());
          std::memcpy(dst.data(), b.data(), b.size());
        }
      });
      rows.push_back(row);
    }

    // gzip -6 of each record's bytes (zlib deflate, gzip wrapper).
    {
      Row row{whole_files ? "gzip -6 of the files" : "gzip -6 (zlib)", 0, {}, {}, ""};
      std::vector<std::vector<std::uint8_t>> gz(raw.size());
      row.encode = time_median(1, [&] {
      row.bytes = 0;
      for (std::size_t i = 0; i < raw.size(); ++i) {
        z_stream s{};
        deflateInit2(&s, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY);
        gz[i].resize(deflateBound(&s, raw[i].size()));
        s.next_in = raw[i].data();
        s.avail_in = static_cast<uInt>(raw[i].size());
        s.next_out = gz[i].data();
        s.avail_out = static_cast<uInt>(gz[i].size());
        if (deflate(&s, Z_FINISH) != Z_STREAM_END) throw Error("deflate failed");
        gz[i].resize(s.total_out);
        deflateEnd(&s);
        row.bytes += gz[i].size();
      }
      });
      std::vector<std::uint8_t> dst;
      row.decode = time_median(reps, [&] {
        for (std::size_t i = 0; i < gz.size(); ++i) {
          dst.resize(raw[i].size());
          z_stream s{};
          inflateInit2(&s, 15 + 16);
          s.next_in = gz[i].data();
          s.avail_in = static_cast<uInt>(gz[i].size());
          s.next_out = dst.data();
          s.avail_out = static_cast<uInt>(dst.size());
          if (inflate(&s, Z_FINISH) != Z_STREAM_END) throw Error("inflate failed");
          inflateEnd(&s);
        }
      });
      rows.push_back(row);
    }

    const std::string tmp = (fs::temp_directory_path() / ("bench_codec." + std::to_string(::getpid()))).string();
    fs::create_directories(tmp);
    tbb::task_arena one(1);
    auto eks_rows = [&](const std::string& name, EksCodec codec, int level, bool also_noverify) {
      EksEncodeOptions eo;
      eo.codec = codec;
      eo.level = level;
      const std::string path = tmp + "/" + std::string(eks_codec_name(codec)) + std::to_string(level) + ".eks";
      std::vector<EksEncodedRecord> enc(recs.size());
      const Timing encode = time_median(1, [&] {
        one.execute([&] {
          for (std::size_t i = 0; i < recs.size(); ++i) enc[i] = encode_eks_record(recs[i], eo);
        });
      });
      {
        EksWriter w(path, eo);
        for (auto& e : enc) w.add_encoded(std::move(e));
        w.finish();
      }
      const std::uint64_t size = fs::file_size(path);
      for (bool verify : {true, false}) {
        if (!verify && !also_noverify) continue;
        EksReadOptions ro;
        ro.verify_checksums = verify;
        auto reader = EksReader::open(path, ro);
        Row row{name + (verify ? "" : ", no checksum"), size, encode, {}, ""};
        row.decode = time_median(reps, [&] {
          for (std::size_t i = 0; i < reader->size(); ++i) (void)reader->read(i);
        });
        if (codec == EksCodec::kFp8 && verify) {
          // Error of the lossy codec relative to each token's largest value.
          double worst = 0, sq = 0, ref = 0;
          for (std::size_t i = 0; i < reader->size(); ++i) {
            const Record got = reader->read(i);
            for (int which = 0; which < 2; ++which) {
              const HostTensor& w = which ? recs[i].aux_hidden_states : recs[i].hidden_states;
              const HostTensor& g = which ? got.aux_hidden_states : got.hidden_states;
              const std::int64_t cols = w.shape[1];
              for (std::int64_t r = 0; r < w.shape[0]; ++r) {
                double amax = 0;
                for (std::int64_t c = 0; c < cols; ++c) amax = std::max(amax, std::fabs(w.get(r * cols + c)));
                for (std::int64_t c = 0; c < cols; ++c) {
                  const double v = w.get(r * cols + c), q = g.get(r * cols + c);
                  if (!std::isfinite(v)) continue;
                  if (amax > 0) worst = std::max(worst, std::fabs(q - v) / amax);
                  sq += (q - v) * (q - v);
                  ref += v * v;
                }
              }
            }
          }
          char buf[160];
          std::snprintf(buf, sizeof buf, "max |err|/row amax %.4f, rel RMS err %.4f", worst,
                        ref > 0 ? std::sqrt(sq / ref) : 0.0);
          row.note = buf;
        }
        rows.push_back(row);
      }
    };
    eks_rows("eks zstd -1", EksCodec::kZstd, 1, false);
    eks_rows("eks zstd -3 (default)", EksCodec::kZstd, 3, true);
    eks_rows("eks zstd -9", EksCodec::kZstd, 9, false);
    eks_rows("eks fp8 (zstd -3)", EksCodec::kFp8, 3, false);
    fs::remove_all(tmp);

    std::printf("one thread; speeds in decoded bytes per CPU second of the thread (wall-clock "
                "speed in brackets)\n\n");
    std::printf("%-32s %8s %7s %8s %8s %15s  %s\n", "codec", "MiB", "vs raw", "smaller",
                "enc MB/s", "dec GB/s", "notes");
    for (const auto& r : rows) {
      const double mib = static_cast<double>(r.bytes) / 1048576.0;
      char enc[32] = "-";
      if (r.encode.cpu > 0) std::snprintf(enc, sizeof enc, "%.0f", payload_d / r.encode.cpu / 1e6);
      char dec[48];
      std::snprintf(dec, sizeof dec, "%.2f (%.2f)", payload_d / r.decode.cpu / 1e9,
                    payload_d / r.decode.wall / 1e9);
      std::printf("%-32s %8.1f %7.3f %7.1f%% %8s %15s  %s\n", r.name.c_str(), mib,
                  static_cast<double>(r.bytes) / raw_d,
                  100.0 * (1.0 - static_cast<double>(r.bytes) / raw_d), enc, dec, r.note.c_str());
    }
    const Row& gz = rows[1];
    const Row& z3 = rows[3];
    std::printf("\neks zstd -3 vs gzip -6: %.1f%% smaller, %.1fx faster to decode\n",
                100.0 * (1.0 - static_cast<double>(z3.bytes) / static_cast<double>(gz.bytes)),
                gz.decode.cpu / z3.decode.cpu);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_codec: %s\n", e.what());
    return 1;
  }
  return 0;
}
