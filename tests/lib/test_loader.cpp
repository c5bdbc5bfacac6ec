#include "tests/torch_doctest.h"
#include <fcntl.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>

#include <atomic>
#include <cstring>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <thread>

#include "formats/codec.h"
#include "formats/error.h"
#include "formats/byte_source.h"
#include "formats/pt_format.h"
#include "formats/safetensors_format.h"
#include "formats/zip.h"
#include "lib/convert.h"
#include "lib/index.h"
#include "lib/loader.h"
#include "tests/compare.h"
#include "tests/support.h"

using namespace eaglekit;
namespace fs = std::filesystem;

extern char** environ;

namespace {

std::string python_bin() {
  const char* p = std::getenv("EAGLEKIT_PYTHON");
  return p ? p : "/usr/bin/python3";
}

// Runs tests/lib/reference_loader.py (the Python port of the reference data path).
test::RunResult reference(const std::string& args) {
  return test::run(python_bin() + " " + test::quote(test::source_dir() + "/tests/lib/reference_loader.py") +
                   " " + args);
}

// Records written by Python's torch.save, conversations, and an index over them.
struct Data {
  test::TempDir dir{"loader"};
  std::string conversations = dir / "conversations.jsonl";
  std::string records = dir / "records";
  std::string index = dir / "index.eki";

  std::string args() const {
    return "--data " + test::quote(conversations) + " --records " + test::quote(records);
  }
  SelectedData select(const std::string& split = "train") const {
    DataSelection sel;
    sel.data = conversations;
    sel.index = index;
    sel.split = split;
    return select_data(sel);
  }
};

std::unique_ptr<Data> make_data(int n, const std::string& synth_args = "") {
  auto d = std::make_unique<Data>();
  const auto r = reference("synth --out " + test::quote(d->dir.path()) + " --conversations " +
                           std::to_string(n) + " " + synth_args);
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  IndexOptions io;
  io.roots = {d->records};
  io.out = d->index;
  io.progress = 0;
  io.jobs = 2;
  build_index(io);
  return d;
}

LoaderOptions options(std::int64_t batch, std::int64_t max_length,
                      CollateMode mode = CollateMode::kPad) {
  LoaderOptions o;
  o.sampler.batch_size = batch;
  o.collate.max_length = max_length;
  o.collate.mode = mode;
  o.jobs = 2;
  o.on_warning = [](const std::string&) {};
  return o;
}

std::vector<Batch> drain(Loader& l) {
  std::vector<Batch> out;
  while (auto b = l.next()) out.push_back(std::move(*b));
  return out;
}

void check_same(const std::vector<Batch>& a, const std::vector<Batch>& b) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    CAPTURE(i);
    CHECK(a[i].conversation_ids == b[i].conversation_ids);
    CHECK(a[i].state == b[i].state);
    const auto x = a[i].named_tensors(), y = b[i].named_tensors();
    REQUIRE(x.size() == y.size());
    for (std::size_t k = 0; k < x.size(); ++k) {
      CAPTURE(x[k].first);
      CHECK(at::equal(x[k].second, y[k].second));
    }
  }
}

// A reader that forwards to the real one, with a fault planted for one conversation.
class FaultyReader final : public RecordReader {
 public:
  FaultyReader(std::unique_ptr<RecordReader> inner, int fault) : inner_(std::move(inner)), fault_(fault) {}
  Format format() const override { return inner_->format(); }
  const std::string& path() const override { return inner_->path(); }
  std::size_t size() const override { return inner_->size(); }
  RecordInfo info(std::size_t i) const override { return inner_->info(i); }
  Record read_prefix(std::size_t i, std::int64_t n) const override {
    if (fault_ == 1) throw std::runtime_error("disk on fire");
    Record r = inner_->read_prefix(i, n);
    if (fault_ == 2) return r.prefix(1);  // fewer tokens than the index says
    return r;
  }

 private:
  std::unique_ptr<RecordReader> inner_;
  int fault_;
};

// Peak RSS (KiB) of a child process running `eaglekit ARGS` (fresh process: its own peak).
long child_peak_rss_kib(const std::vector<std::string>& args, int& exit_code) {
  std::vector<std::string> argv_s = {test::eaglekit_path()};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
  pid_t pid = 0;
  REQUIRE(posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ) == 0);
  posix_spawn_file_actions_destroy(&fa);
  int status = 0;
  struct rusage ru {};
  REQUIRE(wait4(pid, &status, 0, &ru) == pid);
  exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return ru.ru_maxrss;
}

// Two torch.save files hold the same tensors under the same names.
bool same_pt(const std::string& a, const std::string& b) {
  const PtContents x = read_pt(a), y = read_pt(b);
  if (x.entries.size() != y.entries.size()) return false;
  for (std::size_t i = 0; i < x.entries.size(); ++i) {
    const HostTensor* tx = x.tensor(x.entries[i].name);
    const HostTensor* ty = y.tensor(x.entries[i].name);
    if (!tx || !ty || !tx->equal(*ty)) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("loader: pad batches equal the Python reference port, tensor by tensor") {
  test::require_python("torch");
  // 23 records of 2..64 tokens (some cut at 48), stored loss masks (int64 and bool), int and
  // string ids, 2 conversations without a record.
  auto d = make_data(23);
  struct Case {
    std::string split;
    bool shuffle;
    std::int64_t batch;
  };
  for (const Case& c : {Case{"train", false, 4}, Case{"eval", false, 4}, Case{"all", true, 5}}) {
    CAPTURE(c.split);
    const SelectedData sel = d->select(c.split);
    LoaderOptions o = options(c.batch, 48);
    o.sampler.shuffle = c.shuffle;
    o.sampler.seed = 5;
    Loader loader(sel.dataset, sel.samples, o);
    const std::string out = d->dir / ("ours-" + c.split);
    const CollateReport rep = write_batches(loader, out, -1);
    CHECK(rep.batches == static_cast<std::int64_t>((sel.samples.size() + c.batch - 1) / c.batch));
    const std::string ref_args = d->args() + " --split " + c.split + " --batch-size " +
                                 std::to_string(c.batch) + " --max-length 48" +
                                 (c.shuffle ? " --shuffle --seed 5" : "");
    const auto r = reference("compare " + ref_args + " --ours " + test::quote(out));
    CHECK_MESSAGE(r.exit_code == 0, (r.out + r.err));
    CHECK(r.out.find("\"equal\": true") != std::string::npos);
    // The comparison can fail: the same batches against another max_length do not match.
    if (c.split == "train") {
      const auto bad = reference("compare " + d->args() + " --split train --batch-size 4 "
                                 "--max-length 40 --ours " + test::quote(out));
      CHECK(bad.exit_code == 1);
      CHECK(bad.out.find("reference torch.int64 (4, 40)") != std::string::npos);
    }
  }
}

TEST_CASE("loader: the collate command writes the reference's batches") {
  test::require_python("torch");
  auto d = make_data(12);
  const std::string out = d->dir / "cli";
  const auto r = test::eaglekit("collate --data " + test::quote(d->conversations) + " --index " +
                                test::quote(d->index) + " --batch-size 3 --max-length 40 "
                                "--split all --shuffle --seed 9 --jobs 2 --json --out " +
                                test::quote(out));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const auto j = nlohmann::json::parse(r.out);
  CHECK(j["batches"] == 4);
  CHECK(j["samples"] == 12);
  const auto cmp = reference("compare " + d->args() + " --split all --batch-size 3 --max-length 40 "
                             "--shuffle --seed 9 --ours " + test::quote(out));
  CHECK_MESSAGE(cmp.exit_code == 0, (cmp.out + cmp.err));
  // The manifest names each batch's samples and the state to resume after it.
  std::ifstream manifest(out + "/batches.jsonl");
  std::string line;
  int lines = 0;
  while (std::getline(manifest, line)) {
    const auto m = nlohmann::json::parse(line);
    CHECK(m["conversation_ids"].size() == 3);
    CHECK(m["state"]["position"] == 3 * (lines + 1));
    ++lines;
  }
  CHECK(lines == 4);

  // --batches, --resume (from the manifest's state) and usage errors.
  const auto part = test::eaglekit("collate --data " + test::quote(d->conversations) + " --index " +
                                   test::quote(d->index) + " --batch-size 3 --max-length 40 --split all "
                                   "--shuffle --seed 9 --batches 2 --resume '{\"epoch\":0,\"position\":6,"
                                   "\"seed\":9,\"shuffle\":true,\"samples\":12}' --out " +
                                   test::quote(d->dir / "resumed"));
  REQUIRE_MESSAGE(part.exit_code == 0, part.err);
  CHECK(same_pt(d->dir / "resumed/batch_00000.pt", out + "/batch_00002.pt"));
  CHECK(same_pt(d->dir / "resumed/batch_00001.pt", out + "/batch_00003.pt"));
  CHECK_FALSE(same_pt(d->dir / "resumed/batch_00000.pt", out + "/batch_00001.pt"));
  CHECK_FALSE(fs::exists(d->dir / "resumed/batch_00002.pt"));

  const auto bad_mode = test::eaglekit("collate --data " + test::quote(d->conversations) + " --index " +
                                       test::quote(d->index) + " --mode packed --out x");
  CHECK(bad_mode.exit_code == 2);
  CHECK(bad_mode.err.find("--mode must be pad, longest or pack, not 'packed'") != std::string::npos);
  const auto no_index = test::eaglekit("collate --data " + test::quote(d->conversations) +
                                       " --index " + test::quote(d->dir / "nope.eki") + " --out x");
  CHECK(no_index.exit_code == 1);

  const auto bench = test::eaglekit("loader-bench --data " + test::quote(d->conversations) +
                                    " --index " + test::quote(d->index) +
                                    " --batch-size 4 --max-length 40 --json");
  REQUIRE_MESSAGE(bench.exit_code == 0, bench.err);
  const auto bj = nlohmann::json::parse(bench.out);
  for (const char* key : {"samples_per_s", "bytes_per_s", "wait_ms_per_batch", "batches"})
    CHECK(bj.contains(key));
  CHECK(bj["batches"] == 3);  // floor(12 * 0.95) = 11 train samples, batches of 4
  CHECK(bj["samples"] == 11);
}

TEST_CASE("loader: batches are identical whatever the thread count and prefetch depth") {
  auto d = make_data(30);
  const SelectedData sel = d->select("all");
  for (auto mode : {CollateMode::kPad, CollateMode::kLongest, CollateMode::kPack}) {
    CAPTURE(collate_mode_name(mode));
    LoaderOptions a = options(3, 40, mode);
    a.sampler.shuffle = true;
    a.sampler.seed = 17;
    a.jobs = 1;
    a.prefetch = 1;
    LoaderOptions b = a;
    b.jobs = 4;
    b.prefetch = 6;
    Loader la(sel.dataset, sel.samples, a), lb(sel.dataset, sel.samples, b);
    const auto ba = drain(la), bb = drain(lb);
    check_same(ba, bb);
    std::multiset<std::string> seen;
    for (const auto& x : ba) seen.insert(x.conversation_ids.begin(), x.conversation_ids.end());
    CHECK(seen.size() == sel.samples.size());
    CHECK(std::set<std::string>(seen.begin(), seen.end()).size() == sel.samples.size());
    if (mode == CollateMode::kPack) {
      CHECK(ba.size() < (sel.samples.size() + 2) / 3);  // packing needs fewer rows
      for (const auto& x : ba) CHECK(x.document_ids.max().item<std::int64_t>() >= 0);
    }
    if (mode == CollateMode::kLongest)
      for (const auto& x : ba) CHECK(x.length % 8 == 0);
  }
}

namespace {

// How far a batch tensor read from fp8 shards is from the source's, in units of the bound
// docs/formats.md gives: each token row r of hidden (and aux) states is quantized as
// e4m3(x / scale_r), scale_r = max |x| of that row / 448, and read back rounded to the
// source dtype. So |q - x| <= max(|x| / 16, scale_r * 2^-10) (half an e4m3 ulp of 3
// mantissa bits, or half its smallest subnormal step 2^-9) + one ulp of the source dtype.
// Returns the worst |q - x| / bound over the tensor ([B, W, C]; rows are the last dim).
double fp8_error_ratio(const at::Tensor& got, const at::Tensor& source) {
  REQUIRE(got.sizes() == source.sizes());
  const at::Tensor x = source.to(at::kDouble), q = got.to(at::kDouble);
  const double ulp = source.scalar_type() == at::kHalf       ? std::ldexp(1.0, -10)
                     : source.scalar_type() == at::kBFloat16 ? std::ldexp(1.0, -7)
                                                             : std::ldexp(1.0, -23);
  const at::Tensor scale = std::get<0>(x.abs().max(-1, /*keepdim=*/true)) / 448.0;
  const at::Tensor bound = at::maximum(x.abs() / 16.0, scale * std::ldexp(1.0, -10)) + x.abs() * ulp + 1e-30;
  return ((q - x).abs() / bound).max().item<double>();
}

// The source quantized as a broken codec would: e4m3 of x itself, no per-row scale.
at::Tensor e4m3_without_scale(const at::Tensor& source) {
  const at::Tensor f = source.to(at::kFloat).contiguous();
  at::Tensor out = at::empty_like(f);
  const float* in = f.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (std::int64_t i = 0; i < f.numel(); ++i) o[i] = codec::e4m3_to_float(codec::float_to_e4m3(in[i]));
  return out.to(source.scalar_type());
}

}  // namespace

TEST_CASE("loader: batches from `pack --codec fp8` shards are the source's within the e4m3 bound (fp16, bf16, fp32)") {
  for (const std::string dtype : {"fp16", "bf16", "fp32"}) {
    CAPTURE(dtype);
    test::TempDir dir("fp8");
    const std::string d = dir.path();
    // Pre-norm hidden states: a different scale per token, so each row's scale matters.
    auto r = test::eaglekit("synth --out " + test::quote(d + "/src") + " --conversations 12 --hidden 32 --vocab 64"
                            " --min-tokens 8 --max-tokens 40 --seed 3 --hidden-states-norm pre --jobs 2 --dtype " + dtype);
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    r = test::eaglekit("pack " + test::quote(d + "/src/records") + " --out " + test::quote(d + "/fp8") +
                       " --codec fp8 --jobs 2 --json");
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    CHECK(nlohmann::json::parse(r.out)["records"] == 12);
    for (const auto& [root, index] : {std::pair<std::string, std::string>{d + "/src/records", d + "/src.eki"},
                                      {d + "/fp8", d + "/fp8.eki"}}) {
      r = test::eaglekit("index " + test::quote(root) + " --out " + test::quote(index) + " --jobs 2");
      REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    }
    auto batches = [&](const std::string& index) {
      DataSelection sel;
      sel.data = d + "/src/conversations.jsonl";
      sel.index = index;
      sel.split = "all";
      const SelectedData data = select_data(sel);
      REQUIRE(data.samples.size() == 12);
      Loader loader(data.dataset, data.samples, options(4, 48));
      return drain(loader);
    };
    const std::vector<Batch> want = batches(d + "/src.eki"), got = batches(d + "/fp8.eki");
    REQUIRE(want.size() == 3);
    REQUIRE(got.size() == want.size());
    double worst = 0, scale_twice = 0, no_scale = 0;
    for (std::size_t i = 0; i < want.size(); ++i) {
      CAPTURE(i);
      CHECK(got[i].conversation_ids == want[i].conversation_ids);
      for (const char* exact : {"input_ids", "attention_mask", "loss_mask", "labels"}) {
        const auto g = got[i].named_tensors(), w = want[i].named_tensors();
        for (std::size_t k = 0; k < w.size(); ++k)
          if (w[k].first == exact) CHECK_MESSAGE(at::equal(g[k].second, w[k].second), exact);
      }
      for (auto pick : {&Batch::hidden_states, &Batch::aux_hidden_states}) {
        const at::Tensor& g = got[i].*pick;
        const at::Tensor& w = want[i].*pick;
        CHECK((g.scalar_type() == w.scalar_type()));  // read back in the source dtype
        worst = test::worst_of(worst, fp8_error_ratio(g, w));
        // Must-fail twins: a scale off by 2, and no scale at all, leave the bound.
        scale_twice = test::worst_of(scale_twice, fp8_error_ratio(g * 2, w));
        no_scale = test::worst_of(no_scale, fp8_error_ratio(e4m3_without_scale(w), w));
      }
    }
    MESSAGE(dtype << ": worst fp8 error " << worst << " of the bound; scale x2: " << scale_twice
                  << ", no scale: " << no_scale);
    CHECK(worst <= 1.0);
    CHECK(worst > 0.05);  // lossy: had pack stored the source bytes (codec skipped), 0
    CHECK(scale_twice > 1.0);
    CHECK(no_scale > 1.0);
  }
}

TEST_CASE("loader: data-parallel ranks see disjoint shards whose union is every sample") {
  auto d = make_data(21);
  const SelectedData sel = d->select("all");
  LoaderOptions one = options(4, 32);
  one.sampler.shuffle = true;
  one.sampler.seed = 1;
  Loader global(sel.dataset, sel.samples, one);
  const auto g = drain(global);
  std::vector<std::vector<Batch>> ranks;
  for (int r = 0; r < 2; ++r) {
    LoaderOptions o = one;
    o.sampler.batch_size = 2;
    o.sampler.world_size = 2;
    o.sampler.rank = r;
    Loader l(sel.dataset, sel.samples, o);
    ranks.push_back(drain(l));
    CHECK(ranks.back().size() == g.size());
  }
  std::set<std::string> all;
  for (std::size_t s = 0; s < g.size(); ++s) {
    std::multiset<std::string> step;
    for (const auto& rank : ranks)
      step.insert(rank[s].conversation_ids.begin(), rank[s].conversation_ids.end());
    CHECK(step == std::multiset<std::string>(g[s].conversation_ids.begin(), g[s].conversation_ids.end()));
    for (const auto& id : step) CHECK(all.insert(id).second);  // no sample twice
  }
  CHECK(all.size() == sel.samples.size());
}

TEST_CASE("loader: a state saved mid-epoch resumes with exactly the batches that followed") {
  auto d = make_data(17);
  const SelectedData sel = d->select("all");
  for (auto mode : {CollateMode::kPad, CollateMode::kPack}) {
    CAPTURE(collate_mode_name(mode));
    LoaderOptions o = options(2, 32, mode);
    o.sampler.shuffle = true;
    o.sampler.seed = 4;
    o.sampler.epochs = 2;
    Loader a(sel.dataset, sel.samples, o);
    REQUIRE(a.next());
    REQUIRE(a.next());
    const std::string saved = a.state().to_json();
    std::vector<Batch> rest_a = drain(a);  // rest of epoch 0
    const auto epoch1 = drain(a);
    rest_a.insert(rest_a.end(), epoch1.begin(), epoch1.end());
    CHECK_FALSE(a.next());  // both epochs done
    CHECK_FALSE(a.next());

    Loader b(sel.dataset, sel.samples, o);
    b.next();  // wherever b was, restore moves it
    b.restore(SamplerState::from_json(saved));
    std::vector<Batch> rest_b = drain(b);
    const auto epoch1b = drain(b);
    rest_b.insert(rest_b.end(), epoch1b.begin(), epoch1b.end());
    check_same(rest_a, rest_b);
    CHECK(b.state().epoch == 2);

    // Rewinding the same loader works too.
    a.restore(SamplerState::from_json(saved));
    const auto again = drain(a);
    REQUIRE(again.size() <= rest_a.size());
    check_same(again, std::vector<Batch>(rest_a.begin(), rest_a.begin() + static_cast<std::ptrdiff_t>(again.size())));
  }
}

TEST_CASE("loader: epochs end with nullopt, reshuffle, and the steps count is known") {
  auto d = make_data(9);
  const SelectedData sel = d->select("all");
  LoaderOptions o = options(4, 16);
  o.sampler.shuffle = true;
  o.sampler.seed = 2;
  o.sampler.epochs = 2;
  Loader l(sel.dataset, sel.samples, o);
  CHECK(l.steps_in_epoch() == 3);
  const auto e0 = drain(l);
  CHECK(l.state().epoch == 1);
  CHECK(l.state().position == 0);
  const auto e1 = drain(l);
  REQUIRE(e0.size() == 3);
  REQUIRE(e1.size() == 3);
  CHECK(e0[0].conversation_ids != e1[0].conversation_ids);
  CHECK(e1[0].epoch == 1);
  CHECK_FALSE(l.next());
  const LoaderStats st = l.stats();
  CHECK(st.batches == 6);
  CHECK(st.samples == 18);
  CHECK(st.bytes > 0);
  CHECK(st.max_queue_depth <= 4);
  CHECK(nlohmann::json::parse(st.to_json())["batches"] == 6);
}

TEST_CASE("loader: bad records are skipped with a warning and counted, or end a strict run") {
  auto d = make_data(12);
  const SelectedData sel = d->select("all");
  // Damage one record after indexing: the index still lists it as good.
  const SampleRef victim = sel.samples[5];
  const std::string path = sel.dataset.files[victim.file];
  const auto bytes = test::read_bytes(path);
  test::write_bytes(path, std::vector<std::uint8_t>(bytes.begin(), bytes.begin() + bytes.size() / 2));

  LoaderOptions o = options(4, 32);
  std::vector<std::string> warnings;
  o.on_warning = [&](const std::string& w) { warnings.push_back(w); };
  // The victim's batch (samples 4..7) is the other three collated on their own: the loader
  // copies each record into its planned row as soon as it has read it, and moves the rows
  // after the victim's up when it finds the victim bad.
  std::vector<Record> good;
  for (const int k : {4, 6, 7}) {
    const SampleRef& s = sel.samples[static_cast<std::size_t>(k)];
    good.push_back(open_reader(sel.dataset.files[s.file])->read_prefix(s.record, 32));
  }
  const Batch expected = collate_records(good, o.collate);
  // Every open of the victim is counted. One warning per bad record of each delivered
  // batch, whatever the thread count and prefetch depth: several threads with one batch in
  // flight, and, with no epoch limit, a loader left to read ahead into the next epoch
  // (which reads the victim again but must not report it before that batch is delivered).
  std::atomic<int> victim_opens{0};
  o.open = [&](const std::string& p) {
    if (p == path) ++victim_opens;
    return open_reader(p);
  };
  struct Run {
    int jobs, prefetch;
    std::int64_t epochs;
  };
  for (const Run& run : {Run{2, 4, 1}, Run{6, 1, 1}, Run{3, 2, 1}, Run{4, 4, 0}, Run{6, 1, 0}}) {
    for (int rep = 0; rep < 4; ++rep) {
      CAPTURE(run.jobs);
      CAPTURE(run.prefetch);
      CAPTURE(run.epochs);
      CAPTURE(rep);
      warnings.clear();
      victim_opens = 0;
      o.jobs = run.jobs;
      o.prefetch = run.prefetch;
      o.sampler.epochs = run.epochs;
      Loader l(sel.dataset, sel.samples, o);
      const auto batches = drain(l);
      REQUIRE(batches.size() == 3);
      CHECK(batches[1].rows() == 3);
      CHECK(batches[1].skipped == 1);
      {
        const auto x = batches[1].named_tensors(), y = expected.named_tensors();
        REQUIRE(x.size() == y.size());
        for (std::size_t k = 0; k < x.size(); ++k) {
          CAPTURE(x[k].first);
          CHECK(at::equal(x[k].second, y[k].second));
        }
      }
      if (run.epochs == 0) {
        // Let the pipeline fill its queue from epoch 1: the victim's batch (step 1) is read.
        while (l.stats().queue_depth < static_cast<std::size_t>(run.prefetch)) std::this_thread::yield();
        CHECK(victim_opens >= (run.prefetch >= 2 ? 2 : 1));
      } else {
        CHECK(victim_opens == 1);
      }
      CHECK(l.stats().skipped == 1);
      CHECK(l.stats().samples == 11);
      REQUIRE(warnings.size() == 1);
      CHECK(warnings[0].rfind("skipping conversation " + victim.conversation_id + ": " + path, 0) == 0);
    }
  }
  // restore() drops the batches read ahead and reads them again: the victim is read twice
  // but delivered, and reported, once.
  {
    warnings.clear();
    victim_opens = 0;
    o.jobs = 2;
    o.prefetch = 4;
    o.sampler.epochs = 1;
    Loader l(sel.dataset, sel.samples, o);
    REQUIRE(l.next());
    while (l.stats().queue_depth < 1) std::this_thread::yield();  // batch 1 (the victim's) is read
    l.restore(l.state());
    const auto rest = drain(l);
    REQUIRE(rest.size() == 2);
    CHECK(rest[0].skipped == 1);
    CHECK(victim_opens == 2);
    CHECK(l.stats().skipped == 1);
    REQUIRE(warnings.size() == 1);
  }
  o.open = nullptr;
  o.strict = true;
  {
    Loader l(sel.dataset, sel.samples, o);
    CHECK_THROWS_AS(drain(l), FormatError);
    CHECK_THROWS_AS(l.next(), FormatError);  // stays failed
  }

  // A record with fewer tokens than the index promised is bad too.
  o.strict = false;
  warnings.clear();
  const std::string short_path = sel.dataset.files[sel.samples[2].file];
  o.open = [&](const std::string& p) {
    return std::make_unique<FaultyReader>(open_reader(p), p == short_path ? 2 : 0);
  };
  Loader l(sel.dataset, sel.samples, o);
  drain(l);
  CHECK(l.stats().skipped == 2);
  CHECK(warnings.size() == 2);
  bool found = false;
  for (const auto& w : warnings)
    found |= w.find("tokens the index promised") != std::string::npos;
  CHECK(found);
}

TEST_CASE("loader: a .pt whose zip CRC-32 fails and a record holding NaN are skipped and named, never batched") {
  auto d = make_data(12, "--dtype bfloat16");
  const SelectedData sel = d->select("all");
  const SampleRef crc_victim = sel.samples[3], nan_victim = sel.samples[8];
  const std::string crc_path = sel.dataset.files[crc_victim.file];
  const std::string nan_path = sel.dataset.files[nan_victim.file];
  {
    // 64 bytes changed in the largest storage (hidden or aux states), every value still
    // finite: the file opens, the index calls it good, and only the CRC-32 tells.
    auto bytes = test::read_bytes(crc_path);
    std::uint64_t at = 0, largest = 0;
    {
      const ZipArchive z(ByteSource::open_file(crc_path));
      for (const ZipEntry& e : z.entries())
        if (e.size > largest) largest = e.size, at = e.data_offset + e.size / 2 / 4 * 4;
    }
    REQUIRE(largest >= 128);
    for (std::uint64_t i = 0; i < 64; i += 2) bytes[at + i] ^= 0x01;  // low mantissa bits
    test::write_bytes(crc_path, bytes);
  }
  {
    // A record whose values hold a NaN (a producer's bug; its file is intact).
    Record r = PtReader(nan_path).read(0);
    HostTensor h = HostTensor::zeros(r.hidden_states.dtype, r.hidden_states.shape);
    r.hidden_states.copy_to(h.mutable_data());
    REQUIRE(h.dtype == DType::kBFloat16);
    const std::uint16_t nan = 0x7fc0;
    std::memcpy(h.mutable_data() + 2 * (1 * h.shape[1] + 2), &nan, 2);  // token 1, column 2
    r.hidden_states = h;
    write_pt(nan_path, {{"input_ids", r.input_ids},
                        {"hidden_states", r.hidden_states},
                        {"aux_hidden_states", r.aux_hidden_states},
                        {"conversation_id", r.conversation_id}});
  }
  LoaderOptions o = options(4, 4096);  // every record read whole
  std::vector<std::string> warnings;
  o.on_warning = [&](const std::string& w) { warnings.push_back(w); };
  Loader l(sel.dataset, sel.samples, o);
  const auto batches = drain(l);
  CHECK(l.stats().skipped == 2);
  CHECK(l.stats().samples == 10);
  REQUIRE(warnings.size() == 2);
  const std::string crc_warning = warnings[0].find(crc_path) != std::string::npos ? warnings[0] : warnings[1];
  const std::string nan_warning = warnings[0].find(nan_path) != std::string::npos ? warnings[0] : warnings[1];
  CHECK(crc_warning.rfind("skipping conversation " + crc_victim.conversation_id + ": " + crc_path, 0) == 0);
  CHECK(crc_warning.find("CRC-32 stored ") != std::string::npos);
  CHECK(nan_warning.rfind("skipping conversation " + nan_victim.conversation_id + ": " + nan_path, 0) == 0);
  CHECK(nan_warning.find("NaN in hidden_states at token 1, column 2") != std::string::npos);
  for (const Batch& b : batches) {
    for (const auto& id : b.conversation_ids) {
      CHECK(id != crc_victim.conversation_id);
      CHECK(id != nan_victim.conversation_id);
    }
    CHECK(at::isfinite(b.hidden_states.to(at::kFloat)).all().item<bool>());
  }
}

TEST_CASE("loader: worker errors reach the consumer; destruction mid-epoch joins the threads") {
  auto d = make_data(16);
  const SelectedData sel = d->select("all");
  LoaderOptions o = options(2, 32);
  const std::string fire = sel.dataset.files[sel.samples[9].file];
  o.open = [&](const std::string& p) {
    return std::make_unique<FaultyReader>(open_reader(p), p == fire ? 1 : 0);
  };
  {
    Loader l(sel.dataset, sel.samples, o);
    int got = 0;
    try {
      while (l.next()) ++got;
      FAIL("no error reached the consumer");
    } catch (const std::runtime_error& e) {
      CHECK(std::string(e.what()) == "disk on fire");
    }
    CHECK(got <= 4);  // the batch holding sample 9 (step 4) never arrives
  }
  // Destroyed with the pipeline blocked on a full queue, and right after construction.
  LoaderOptions q = options(1, 32);
  q.prefetch = 2;
  for (int taken : {0, 1, 3}) {
    Loader l(sel.dataset, sel.samples, q);
    for (int i = 0; i < taken; ++i) REQUIRE(l.next());
  }
}

TEST_CASE("loader: context-parallel ranks read their chunk; the chunks tile the full rows") {
  auto d = make_data(10);
  const SelectedData sel = d->select("all");
  for (auto mode : {CollateMode::kPad, CollateMode::kLongest, CollateMode::kPack}) {
    CAPTURE(collate_mode_name(mode));
    LoaderOptions o = options(3, 40, mode);
    Loader full_l(sel.dataset, sel.samples, o);
    const auto full = drain(full_l);
    std::vector<std::vector<Batch>> parts;
    std::uint64_t part_bytes = 0;
    for (int r = 0; r < 3; ++r) {
      LoaderOptions oc = o;
      oc.collate.cp_size = 3;
      oc.collate.cp_rank = r;
      Loader l(sel.dataset, sel.samples, oc);
      parts.push_back(drain(l));
      part_bytes += l.stats().bytes;
    }
    CHECK(part_bytes == full_l.stats().bytes);  // each byte read by exactly one rank
    for (std::size_t s = 0; s < full.size(); ++s) {
      const auto named = full[s].named_tensors();
      for (std::size_t k = 0; k < named.size(); ++k) {
        std::vector<at::Tensor> chunks;
        for (const auto& p : parts) chunks.push_back(p[s].named_tensors()[k].second);
        CHECK(at::equal(at::cat(chunks, 1), named[k].second));
      }
    }
  }
}

// speculators keeps the loss mask in its prepared dataset folder (tests/data/speculators_masks,
// written by speculators 0.9's own code): `index --loss-masks` trains straight from its dump
// with exactly the masks `convert --loss-masks` writes into the records.
TEST_CASE("loader: index --loss-masks gives batches the loss masks of convert --loss-masks, whole or cut") {
  test::TempDir dir("loader-masks");
  const std::string fx = test::source_dir() + "/tests/data/speculators_masks";
  const std::string dump = fx + "/prepared/hidden_states";
  const std::string masks = dir / "loss_masks.safetensors";
  fs::copy_file(fx + "/loss_masks.safetensors", masks);
  IndexOptions io;
  io.jobs = 1;
  io.progress = 0;
  io.roots = {dump};
  io.out = dir / "joined.eki";
  io.loss_masks = masks;
  build_index(io);
  ConvertOptions co;
  co.loss_masks = masks;
  co.jobs = 1;
  convert_records(dump, dir / "masked.eks", co);
  io.roots = {dir / "masked.eks"};
  io.out = dir / "converted.eki";
  io.loss_masks.clear();
  build_index(io);
  io.roots = {dump};
  io.out = dir / "plain.eki";
  build_index(io);

  auto batches = [&](const std::string& index, std::int64_t max_length) {
    DataSelection sel;
    sel.index = index;
    sel.split = "all";
    const SelectedData data = select_data(sel);
    Loader l(data.dataset, data.samples, options(2, max_length));
    return drain(l);
  };
  for (const std::int64_t max_length : {8, 4}) {  // whole records, and hs_0 (6 tokens) cut to 4
    CAPTURE(max_length);
    const auto joined = batches(dir / "joined.eki", max_length);
    const auto converted = batches(dir / "converted.eki", max_length);
    const auto plain = batches(dir / "plain.eki", max_length);
    REQUIRE(joined.size() == 1);
    REQUIRE(converted.size() == 1);
    REQUIRE(plain.size() == 1);
    CHECK(joined[0].conversation_ids == std::vector<std::string>{"hs_0", "hs_1"});
    CHECK(joined[0].conversation_ids == converted[0].conversation_ids);
    CHECK(at::equal(joined[0].input_ids, converted[0].input_ids));
    CHECK(at::equal(joined[0].attention_mask, converted[0].attention_mask));
    CHECK(at::equal(joined[0].hidden_states, converted[0].hidden_states));
    CHECK(at::equal(joined[0].loss_mask, converted[0].loss_mask));
    // The dump alone trains every token; the masks do not (else the comparison shows nothing).
    CHECK_FALSE(at::equal(joined[0].loss_mask, plain[0].loss_mask));
    // Row k holds speculators' own mask of hs_k (expected/), cut to the row, 0 after it.
    for (int k = 0; k < 2; ++k) {
      CAPTURE(k);
      const HostTensor want = *SafetensorsFile::open(fx + "/expected/hs_" + std::to_string(k) + ".safetensors")->get("loss_mask");
      const std::int64_t n = std::min<std::int64_t>(want.shape[0], max_length);
      for (std::int64_t t = 0; t < max_length; ++t)
        CHECK(joined[0].loss_mask[k][t].item<std::int64_t>() == (t < n ? static_cast<std::int64_t>(want.get(t)) : 0));
    }
  }
  // The dataset says where the masks come from.
  DataSelection sel;
  sel.index = dir / "joined.eki";
  sel.split = "all";
  const SelectedData data = select_data(sel);
  CHECK(no_loss_mask_line(data.samples, 8).empty());
  CHECK(joined_loss_mask_line(data.dataset.loss_masks, data.samples) ==
        "loss masks: 2 of the 2 records take theirs from " + masks +
            ", joined by `eaglekit index --loss-masks` (lengths checked then, token ids as each record is read)");
  CHECK_FALSE(no_loss_mask_line(select_data([&] { DataSelection p = sel; p.index = dir / "plain.eki"; return p; }()).samples, 8)
                  .empty());

  // Changed after indexing (one mask value, same size), or moved: refused naming the index
  // and the file, before a batch is read.
  {
    auto bytes = test::read_bytes(masks);
    const auto f = SafetensorsFile::open(masks);
    bytes[f->data_start() + f->find("loss_mask")->begin + 2] ^= 1;
    test::write_bytes(masks, bytes);
  }
  const std::string head = dir / "joined.eki" + " joins the loss masks of " + masks + ", which ";
  try {
    Loader l(data.dataset, data.samples, options(2, 8));
    FAIL("a changed loss-mask file was read");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find(head + "holds other bytes than when indexed") == 0);
  }
  fs::rename(masks, dir / "moved.safetensors");
  try {
    Loader l(data.dataset, data.samples, options(2, 8));
    FAIL("a moved loss-mask file was read");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find(head + "is not there (moved or deleted since indexing?)") == 0);
  }
}

// NeMo AutoModel's EAGLE-3 caches (tests/data/nemo_cache/, NeMo 0.7.0's own producer code) and
// their .eks conversions: the loader's batches are the same, tensor for tensor, the stored
// target distributions (target_probs) among them.
TEST_CASE("loader: an .eks converted from NeMo's cache gives the cache's batches, tensor for tensor") {
  test::TempDir dir("loader-nemo");
  for (const std::string name : {"lossless", "topk"}) {
    CAPTURE(name);
    const std::string cache = test::source_dir() + "/tests/data/nemo_cache/" + name;
    ConvertOptions co;
    co.jobs = 1;
    const std::string eks = dir / (name + ".eks");
    convert_records(cache + "/manifest.json", eks, co);
    auto batches = [&](const std::string& root, const std::string& index, CollateMode mode) {
      IndexOptions io;
      io.jobs = 1;
      io.progress = 0;
      io.roots = {root};
      io.out = index;
      build_index(io);
      DataSelection sel;
      sel.index = index;
      sel.split = "all";
      const SelectedData data = select_data(sel);
      Loader l(data.dataset, data.samples, options(2, mode == CollateMode::kPack ? 16 : 8, mode));
      return drain(l);
    };
    for (const CollateMode mode : {CollateMode::kPad, CollateMode::kPack}) {
      CAPTURE(collate_mode_name(mode));
      const auto from_cache = batches(cache, dir / (name + "-cache.eki"), mode);
      const auto from_eks = batches(eks, dir / (name + "-eks.eki"), mode);
      REQUIRE(from_cache.size() == from_eks.size());
      REQUIRE_FALSE(from_cache.empty());
      for (std::size_t i = 0; i < from_cache.size(); ++i) {
        CAPTURE(i);
        CHECK(from_cache[i].conversation_ids == from_eks[i].conversation_ids);
        REQUIRE(from_cache[i].target_probs.defined());
        CHECK_FALSE(from_eks[i].hidden_states.defined());
        const auto a = from_cache[i].named_tensors(), b = from_eks[i].named_tensors();
        REQUIRE(a.size() == b.size());
        for (std::size_t k = 0; k < a.size(); ++k) {
          CAPTURE(a[k].first);
          CHECK(a[k].first == b[k].first);
          CHECK(a[k].second.dtype() == b[k].second.dtype());
          CHECK(at::equal(a[k].second, b[k].second));
        }
      }
    }
  }
}

TEST_CASE("loader: options and datasets it cannot use are refused") {
  auto d = make_data(4);
  const SelectedData sel = d->select("all");
  LoaderOptions o = options(2, 16);
  o.prefetch = 0;
  CHECK_THROWS_WITH_AS(Loader(sel.dataset, sel.samples, o), "prefetch must be at least 1", UsageError);
  o = options(2, 16);
  CHECK_THROWS_WITH_AS(Loader(sel.dataset, {}, o), "no samples to load", UsageError);
  Dataset gone = sel.dataset;
  for (auto& f : gone.files) f += ".missing";
  CHECK_THROWS_AS(Loader(gone, sel.samples, o), Error);
  DataSelection bad;
  bad.data = d->conversations;
  bad.index = d->index;
  bad.split = "test";
  CHECK_THROWS_WITH_AS(select_data(bad), "--split must be train, eval or all, not 'test'", UsageError);
}

TEST_CASE("loader: peak memory stays flat when the dataset grows 10x") {
  // 150 records of ~230 KiB (200..256 tokens, H=128, 3 aux layers, bf16); the small run
  // reads the first 15 conversations of the same files.
  auto d = make_data(150, "--extra 0 --hidden 128 --min-tokens 200 --max-tokens 256");
  const std::string small = d->dir / "small.jsonl";
  {
    std::ifstream in(d->conversations);
    std::ofstream out(small);
    std::string line;
    for (int i = 0; i < 15 && std::getline(in, line); ++i) out << line << "\n";
  }
  auto peak = [&](const std::string& conversations) {
    int code = -1;
    const long kib = child_peak_rss_kib({"loader-bench", "--data", conversations, "--index", d->index,
                                         "--split", "all", "--batch-size", "4", "--max-length", "256",
                                         "--jobs", "2", "--prefetch", "2", "--json"},
                                        code);
    REQUIRE(code == 0);
    return kib;
  };
  const long small_kib = peak(small);
  const long big_kib = peak(d->conversations);
  MESSAGE("peak RSS: 15 records " << small_kib << " KiB, 150 records " << big_kib << " KiB");
  // 135 more records are ~30 MiB of hidden states; a loader that kept them would show it.
  CHECK(big_kib - small_kib < 8 * 1024);
}
