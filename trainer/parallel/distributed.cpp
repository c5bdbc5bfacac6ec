#include "trainer/parallel/distributed.h"

// ProcessGroupGloo.hpp compiles only with USE_C10D_GLOO, which LibTorch's CMake config does
// not export; Debian's libtorch is built with Gloo (libgloo-dev has the headers).
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO 1
#endif
// NCCL is opt-in (CMake option EAGLEKIT_WITH_NCCL, which needs a CUDA LibTorch and nccl.h):
// a CPU LibTorch ships ProcessGroupNCCL.hpp but not the symbols.
#if defined(EAGLEKIT_WITH_NCCL) && !defined(USE_C10D_NCCL)
#define USE_C10D_NCCL 1
#endif

#include <ATen/ATen.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/version.h>
#include <unistd.h>

#ifdef USE_C10D_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <set>
#include <sstream>


extern char** environ;

namespace eaglekit::dist {

// c10d moved the collective interface from ProcessGroup to Backend in 2.0; both have the
// same virtual functions for what we use.
#if TORCH_VERSION_MAJOR >= 2
using PgBase = c10d::Backend;
#else
using PgBase = c10d::ProcessGroup;
#endif

namespace {

using Ms = std::chrono::milliseconds;

std::string first_line(const std::string& s) {
  const auto nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

std::string seconds_text(Ms ms) {
  std::ostringstream os;
  os << static_cast<double>(ms.count()) / 1000.0 << " s";
  return os.str();
}

std::optional<std::string> get_env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

int parse_env_int(const char* name, const std::string& value, int lo, int hi) {
  std::size_t used = 0;
  long v = 0;
  try {
    v = std::stol(value, &used, 10);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != value.size() || v < lo || v > hi)
    throw UsageError(std::string("environment variable ") + name + "='" + value +
                     "' is not an integer in [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "]");
  return static_cast<int>(v);
}

int require_env_int(const char* name, int lo, int hi) {
  const auto v = get_env(name);
  if (!v)
    throw UsageError(std::string("environment variable ") + name +
                     " is not set (WORLD_SIZE is, so a distributed launch was expected; "
                     "use torchrun or eaglekit launch)");
  return parse_env_int(name, *v, lo, hi);
}

}  // namespace

std::optional<LaunchEnv> launch_env_from_environment() {
  if (!get_env("WORLD_SIZE")) return std::nullopt;
  LaunchEnv e;
  e.world_size = require_env_int("WORLD_SIZE", 1, 1 << 20);
  e.rank = require_env_int("RANK", 0, e.world_size - 1);
  e.local_rank = get_env("LOCAL_RANK") ? require_env_int("LOCAL_RANK", 0, 1 << 20) : 0;
  if (e.world_size > 1) {
    const auto addr = get_env("MASTER_ADDR");
    if (!addr || addr->empty())
      throw UsageError("environment variable MASTER_ADDR is not set (WORLD_SIZE=" +
                       std::to_string(e.world_size) + ")");
    e.master_addr = *addr;
    e.master_port = require_env_int("MASTER_PORT", 1, 65535);
  } else {
    e.master_addr = get_env("MASTER_ADDR").value_or("127.0.0.1");
  }
  e.agent_store = get_env("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True";
  if (const auto rc = get_env("TORCHELASTIC_RESTART_COUNT"))
    e.restart_count = parse_env_int("TORCHELASTIC_RESTART_COUNT", *rc, 0, 1 << 30);
  return e;
}

bool nccl_available() {
#ifdef USE_C10D_NCCL
  return true;
#else
  return false;
#endif
}

// ---------------------------------------------------------------------------------------
// Group

struct Group::Impl {
  std::string name = "self";
  int rank = 0;
  int size = 1;
  Ms timeout{std::chrono::minutes(5)};
  Backend backend = Backend::kGloo;
  c10::intrusive_ptr<PgBase> pg;  // null when size == 1
  // Set once a collective failed. The communicator may then have work stuck behind a dead
  // or hung peer, and destroying it would wait for that work: we leak it instead (the
  // process is about to exit with the error).
  mutable bool broken = false;

  ~Impl() {
    if (broken && pg) (void)pg.release();
  }

  [[noreturn]] void fail(const std::string& op, int peer, const std::string& why) const {
    broken = true;
    std::ostringstream os;
    os << "distributed: " << op << " in group " << name << " (rank " << rank << " of " << size;
    if (peer >= 0) os << ", peer rank " << peer;
    os << ") failed: " << why;
    throw DistributedError(os.str());
  }

  // Waits for `work`; wraps errors and timeouts into DistributedError.
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& op, int peer) const {
    try {
      if (!work->wait(timeout)) fail(op, peer, "did not complete");
    } catch (const DistributedError&) {
      throw;
    } catch (const std::exception& e) {
      const std::string msg = first_line(e.what());
      if (msg.find("timed out") != std::string::npos || msg.find("Timed out") != std::string::npos)
        fail(op, peer, "timed out after " + seconds_text(timeout) +
                           " (a peer is hung, dead or far behind): " + msg);
      fail(op, peer, msg + " (a peer rank probably died; see its log)");
    }
  }

  template <typename F>
  c10::intrusive_ptr<c10d::Work> post(const std::string& op, int peer, F&& f) const {
    try {
      return f();
    } catch (const std::exception& e) {
      fail(op, peer, first_line(e.what()));
    }
  }

  // NCCL reduces CUDA tensors only; metrics often live on the CPU.
  at::Tensor to_comm(const at::Tensor& t) const {
    if (backend == Backend::kNccl && !t.is_cuda()) return t.to(at::kCUDA);
    return t;
  }
};

Group::Group() : impl_(std::make_shared<Impl>()) {}
Group::Group(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
int Group::rank() const { return impl_->rank; }
int Group::size() const { return impl_->size; }
const std::string& Group::name() const { return impl_->name; }
std::chrono::milliseconds Group::timeout() const { return impl_->timeout; }
Backend Group::backend() const { return impl_->backend; }

namespace {

void check_comm_tensor(const Group::Impl& g, const at::Tensor& t, const char* op) {
  if (!t.defined()) g.fail(op, -1, "undefined tensor");
  if (!t.is_contiguous()) g.fail(op, -1, "tensor is not contiguous");
}

}  // namespace

static void all_reduce_impl(const Group::Impl& g, std::vector<at::Tensor>& ts,
                            c10d::ReduceOp::RedOpType op, const char* name) {
  if (g.size == 1) return;
  std::vector<std::vector<at::Tensor>> bufs;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  bufs.reserve(ts.size());
  for (auto& t : ts) {
    check_comm_tensor(g, t, name);
    bufs.push_back({g.to_comm(t)});
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp(op);
    o.timeout = g.timeout;
    works.push_back(g.post(name, -1, [&] { return g.pg->allreduce(bufs.back(), o); }));
  }
  for (std::size_t i = 0; i < ts.size(); ++i) {
    g.wait(works[i], name, -1);
    if (!bufs[i][0].is_same(ts[i])) ts[i].copy_(bufs[i][0]);
  }
}

void Group::all_reduce_sum(at::Tensor& t) const {
  std::vector<at::Tensor> v{t};
  all_reduce_impl(*impl_, v, c10d::ReduceOp::SUM, "all_reduce(sum)");
}

void Group::all_reduce_sum(std::vector<at::Tensor>& ts) const {
  all_reduce_impl(*impl_, ts, c10d::ReduceOp::SUM, "all_reduce(sum)");
}

void Group::all_reduce_max(at::Tensor& t) const {
  std::vector<at::Tensor> v{t};
  all_reduce_impl(*impl_, v, c10d::ReduceOp::MAX, "all_reduce(max)");
}

at::Tensor Group::all_gather(const at::Tensor& t) const {
  const auto& g = *impl_;
  if (g.size == 1) return t.unsqueeze(0).clone();
  const at::Tensor src = g.to_comm(t.contiguous());
  std::vector<std::vector<at::Tensor>> out(1);
  for (int i = 0; i < g.size; ++i) out[0].push_back(at::empty_like(src));
  std::vector<at::Tensor> in{src};
  c10d::AllgatherOptions o;
  o.timeout = g.timeout;
  auto w = g.post("all_gather", -1, [&] { return g.pg->allgather(out, in, o); });
  g.wait(w, "all_gather", -1);
  return at::stack(out[0]).to(t.device());
}

void Group::broadcast(at::Tensor& t, int root) const {
  const auto& g = *impl_;
  if (root < 0 || root >= g.size) g.fail("broadcast", root, "root rank out of range");
  if (g.size == 1) return;
  check_comm_tensor(g, t, "broadcast");
  std::vector<at::Tensor> v{g.to_comm(t)};
  c10d::BroadcastOptions o;
  o.rootRank = root;
  o.timeout = g.timeout;
  auto w = g.post("broadcast", root, [&] { return g.pg->broadcast(v, o); });
  g.wait(w, "broadcast", root);
  if (!v[0].is_same(t)) t.copy_(v[0]);
}

void Group::barrier() const {
  const auto& g = *impl_;
  if (g.size == 1) return;
  // An all-reduce of one element rather than pg->barrier(): Gloo's barrier ignores the
  // per-call timeout in some versions, and NCCL's needs a device guess.
  at::Tensor one = at::ones({1}, at::kFloat);
  std::vector<at::Tensor> v{one};
  all_reduce_impl(g, v, c10d::ReduceOp::SUM, "barrier");
}

struct Group::Pending::State {
  std::shared_ptr<const Group::Impl> group;
  struct Op {
    c10::intrusive_ptr<c10d::Work> work;
    std::string name;
    int peer = -1;
    std::vector<at::Tensor> buf;  // what the backend reads or writes
    at::Tensor target;            // where the result goes when buf is a device copy
  };
  std::vector<Op> ops;
  bool done = false;

  void wait() {
    if (done) return;
    done = true;
    for (auto& op : ops) group->wait(op.work, op.name, op.peer);
    for (auto& op : ops)
      if (op.target.defined() && !op.buf[0].is_same(op.target)) op.target.copy_(op.buf[0]);
  }
};

Group::Pending::Pending() = default;
Group::Pending::Pending(Pending&&) noexcept = default;
Group::Pending& Group::Pending::operator=(Pending&& o) noexcept {
  if (this != &o) {
    if (state_ && !state_->done) {
      try {
        state_->wait();
      } catch (...) {
      }
    }
    state_ = std::move(o.state_);
  }
  return *this;
}
Group::Pending::~Pending() {
  if (state_ && !state_->done) {
    try {
      state_->wait();
    } catch (...) {
      // Destruction happens while unwinding from another error; that error is the one
      // worth reporting.
    }
  }
}

void Group::Pending::wait() {
  if (state_) state_->wait();
}

Group::Pending Group::start_exchange(const at::Tensor& send, int to, at::Tensor& recv, int from,
                                    int tag) const {
  const auto& g = *impl_;
  if (to < 0 || to >= g.size) g.fail("send", to, "destination rank out of range");
  if (from < 0 || from >= g.size) g.fail("recv", from, "source rank out of range");
  check_comm_tensor(g, send, "send");
  check_comm_tensor(g, recv, "recv");
  Pending p;
  p.state_ = std::make_unique<Pending::State>();
  auto& st = *p.state_;
  st.group = impl_;
  if (g.size == 1) {
    recv.copy_(send);
    st.done = true;
    return p;
  }
  st.ops.resize(2);
  auto& s_op = st.ops[0];
  auto& r_op = st.ops[1];
  s_op.name = "send";
  s_op.peer = to;
  s_op.buf = {g.to_comm(send)};
  r_op.name = "recv";
  r_op.peer = from;
  r_op.buf = {g.to_comm(recv)};
  r_op.target = recv;
  auto post_send = [&] {
    s_op.work = g.post("send", to, [&] { return g.pg->send(s_op.buf, to, tag); });
  };
  auto post_recv = [&] {
    r_op.work = g.post("recv", from, [&] { return g.pg->recv(r_op.buf, from, tag); });
  };
  // NCCL runs a pair's sends and receives in posting order on one stream: in a ring,
  // even ranks send first and odd ranks receive first, or both ends of a pair would wait
  // in send. Gloo does not care.
  if (g.rank % 2 == 0) {
    post_send();
    post_recv();
  } else {
    post_recv();
    post_send();
  }
  return p;
}

Group::Pending Group::start_all_reduce_sum(at::Tensor& t) const {
  const auto& g = *impl_;
  Pending p;
  p.state_ = std::make_unique<Pending::State>();
  auto& st = *p.state_;
  st.group = impl_;
  if (g.size == 1) {
    st.done = true;
    return p;
  }
  check_comm_tensor(g, t, "all_reduce(sum)");
  st.ops.resize(1);
  auto& op = st.ops[0];
  op.name = "all_reduce(sum)";
  op.buf = {g.to_comm(t)};
  op.target = t;
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp(c10d::ReduceOp::SUM);
  o.timeout = g.timeout;
  op.work = g.post(op.name, -1, [&] { return g.pg->allreduce(op.buf, o); });
  return p;
}

void Group::exchange(const at::Tensor& send, int to, at::Tensor& recv, int from, int tag) const {
  start_exchange(send, to, recv, from, tag).wait();
}

// ---------------------------------------------------------------------------------------
// Mesh

namespace {

std::shared_ptr<::gloo::transport::Device> gloo_device(const std::string& master_addr) {
  if (const auto ifname = get_env("GLOO_SOCKET_IFNAME"); ifname && !ifname->empty())
    return c10d::ProcessGroupGloo::createDeviceForInterface(*ifname);
  // A job on one host talks over loopback, whatever the host name resolves to.
  if (master_addr == "localhost" || master_addr.rfind("127.", 0) == 0 || master_addr == "::1")
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

Group make_group(const c10::intrusive_ptr<c10d::Store>& base, const std::string& name, int rank,
                 int size, const LaunchEnv& env, const GroupOptions& opt) {
  auto impl = std::make_shared<Group::Impl>();
  impl->name = name;
  impl->rank = rank;
  impl->size = size;
  impl->timeout = opt.timeout;
  impl->backend = opt.cuda ? Backend::kNccl : Backend::kGloo;
  if (size == 1) return Group(impl);
  auto store = c10::make_intrusive<c10d::PrefixStore>(name, base);
  const Ms connect = opt.connect_timeout.count() > 0 ? opt.connect_timeout : opt.timeout;
  try {
    if (opt.cuda) {
#ifdef USE_C10D_NCCL
      auto o = c10d::ProcessGroupNCCL::Options::create();
      o->timeout = opt.timeout;  // NCCL's watchdog bound on each collective
      impl->pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, o);
#else
      throw UsageError(
          "distributed training on CUDA needs NCCL, and this eaglekit was built without it "
          "(configure with -DEAGLEKIT_WITH_NCCL=ON against a CUDA LibTorch; see README)");
#endif
    } else {
      // The group's own timeout bounds its creation; every operation passes `timeout`.
      auto o = c10d::ProcessGroupGloo::Options::create(connect);
      o->devices.push_back(gloo_device(env.master_addr));
      impl->pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, o);
    }
  } catch (const UsageError&) {
    throw;
  } catch (const std::exception& e) {
    throw DistributedError("distributed: creating group " + name + " (rank " +
                           std::to_string(rank) + " of " + std::to_string(size) +
                           ") failed within " + seconds_text(connect) + ": " +
                           first_line(e.what()));
  }
  return Group(impl);
}

}  // namespace

Mesh Mesh::single() { return Mesh(); }

Mesh Mesh::create(const LaunchEnv& env, int cp_size, const GroupOptions& options) {
  if (env.world_size < 1 || env.rank < 0 || env.rank >= env.world_size)
    throw UsageError("rank " + std::to_string(env.rank) + " is outside world size " +
                     std::to_string(env.world_size));
  if (cp_size < 1 || env.world_size % cp_size != 0)
    throw UsageError("--cp " + std::to_string(cp_size) + " does not divide the world size " +
                     std::to_string(env.world_size));
  Mesh m;
  m.rank_ = env.rank;
  m.world_size_ = env.world_size;
  m.local_rank_ = env.local_rank;
  m.cp_size_ = cp_size;
  if (env.world_size == 1) return m;

#ifdef USE_C10D_NCCL
  if (options.cuda) {
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(env.local_rank));
    // Without async error handling a dead peer leaves NCCL kernels spinning forever.
    setenv("NCCL_ASYNC_ERROR_HANDLING", "1", 0);
    setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1", 0);
  }
#endif

  c10::intrusive_ptr<c10d::Store> base;
  try {
    c10d::TCPStoreOptions so;
    so.port = static_cast<std::uint16_t>(env.master_port);
    so.isServer = env.rank == 0 && !env.agent_store;
    so.numWorkers = env.agent_store ? c10::nullopt : c10::optional<std::size_t>(env.world_size);
    so.waitWorkers = !env.agent_store;
    so.timeout = options.connect_timeout.count() > 0 ? options.connect_timeout : options.timeout;
    auto tcp = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
    base = tcp;
    if (env.agent_store)  // torchrun's key space for the workers of this attempt
      base = c10::make_intrusive<c10d::PrefixStore>(
          "/worker/attempt_" + std::to_string(env.restart_count), tcp);
  } catch (const std::exception& e) {
    throw DistributedError("distributed: rendezvous at " + env.master_addr + ":" +
                           std::to_string(env.master_port) + " failed for rank " +
                           std::to_string(env.rank) + " of " + std::to_string(env.world_size) +
                           " within " +
                           seconds_text(options.connect_timeout.count() > 0 ? options.connect_timeout
                                                                            : options.timeout) +
                           ": " + first_line(e.what()));
  }

  const int dp = m.dp_rank(), cp = m.cp_rank();
  m.world_ = make_group(base, "world", env.rank, env.world_size, env, options);
  m.cp_ = make_group(base, "cp[dp=" + std::to_string(dp) + "]", cp, cp_size, env, options);
  m.dp_ = make_group(base, "dp[cp=" + std::to_string(cp) + "]", dp, m.dp_size(), env, options);
  return m;
}

Mesh Mesh::from_environment(int cp_size, const GroupOptions& options) {
  const auto env = launch_env_from_environment();
  if (!env) {
    if (cp_size != 1)
      throw UsageError("--cp " + std::to_string(cp_size) +
                       " needs a distributed launch (eaglekit launch --nproc N -- ... or "
                       "torchrun); this is a single process");
    return single();
  }
  return create(*env, cp_size, options);
}

// ---------------------------------------------------------------------------------------
// Launcher

namespace {

std::string find_program(const std::string& name) {
  if (name.find('/') != std::string::npos) return name;
  const std::string path = get_env("PATH").value_or("/usr/local/bin:/usr/bin:/bin");
  std::size_t start = 0;
  while (start <= path.size()) {
    auto end = path.find(':', start);
    if (end == std::string::npos) end = path.size();
    std::string dir = path.substr(start, end - start);
    if (dir.empty()) dir = ".";
    const std::string cand = dir + "/" + name;
    if (::access(cand.c_str(), X_OK) == 0) return cand;
    start = end + 1;
  }
  throw UsageError("program '" + name + "' not found in PATH");
}

// argv/envp storage that outlives fork (built before it: the child may not allocate).
struct CStrings {
  std::vector<std::string> storage;
  std::vector<char*> ptrs;
  void finish() {
    ptrs.clear();
    for (auto& s : storage) ptrs.push_back(s.data());
    ptrs.push_back(nullptr);
  }
};

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

std::string describe_exit(int status) {
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return std::string("was killed by signal ") + std::to_string(sig) + " (" + strsignal(sig) + ")";
  }
  return "exited with code " + std::to_string(exit_code_of(status));
}

// Blocks SIGINT/SIGTERM/SIGCHLD for the launcher's lifetime (threads created meanwhile,
// such as the store's, inherit the mask), so they are only ever taken by sigtimedwait.
class SignalMask {
 public:
  SignalMask() {
    sigemptyset(&set_);
    sigaddset(&set_, SIGINT);
    sigaddset(&set_, SIGTERM);
    sigaddset(&set_, SIGCHLD);
    pthread_sigmask(SIG_BLOCK, &set_, &old_);
  }
  ~SignalMask() {
    // Drop a pending SIGCHLD so that unblocking does not run the default action for
    // stale children state (ignored anyway) and restore the caller's mask.
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  const sigset_t& set() const { return set_; }
  const sigset_t& old() const { return old_; }

 private:
  sigset_t set_, old_;
};

}  // namespace

LaunchResult launch_local(const LaunchOptions& options) {
  if (options.nproc < 1) throw UsageError("--nproc must be at least 1");
  if (options.argv.empty()) throw UsageError("nothing to launch: give the command after --");
  if (options.master_port < 0 || options.master_port > 65535)
    throw UsageError("--master-port must be in [0, 65535]");
  const std::string program = find_program(options.argv[0]);

  SignalMask mask;

  // The store lives here for the whole job: ranks only connect, so any of them may be
  // the first to start and port 0 gives a free port without races.
  c10::intrusive_ptr<c10d::TCPStore> store;
  try {
    c10d::TCPStoreOptions so;
    so.port = static_cast<std::uint16_t>(options.master_port);
    so.isServer = true;
    so.numWorkers = c10::nullopt;
    so.waitWorkers = false;
    store = c10::make_intrusive<c10d::TCPStore>(options.master_addr, so);
  } catch (const std::exception& e) {
    throw DistributedError("launch: cannot host the rendezvous store on " + options.master_addr +
                           ":" + std::to_string(options.master_port) + ": " +
                           first_line(e.what()));
  }
  const int port = store->getPort();

  static const std::set<std::string> kOurs = {
      "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
      "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT"};
  std::vector<std::string> inherited;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv = *e;
    const std::string key = kv.substr(0, kv.find('='));
    if (kOurs.count(key) || options.env.count(key)) continue;
    inherited.push_back(kv);
  }

  CStrings argv;
  argv.storage = options.argv;
  argv.finish();

  std::vector<CStrings> envs(static_cast<std::size_t>(options.nproc));
  std::vector<int> log_fds(static_cast<std::size_t>(options.nproc), -1);
  for (int r = 0; r < options.nproc; ++r) {
    auto& e = envs[static_cast<std::size_t>(r)];
    e.storage = inherited;
    auto add = [&](const std::string& k, const std::string& v) { e.storage.push_back(k + "=" + v); };
    add("RANK", std::to_string(r));
    add("LOCAL_RANK", std::to_string(r));
    add("WORLD_SIZE", std::to_string(options.nproc));
    add("LOCAL_WORLD_SIZE", std::to_string(options.nproc));
    add("GROUP_RANK", "0");
    add("MASTER_ADDR", options.master_addr);
    add("MASTER_PORT", std::to_string(port));
    add("TORCHELASTIC_USE_AGENT_STORE", "True");
    add("TORCHELASTIC_RESTART_COUNT", "0");
    for (const auto& [k, v] : options.env) add(k, v);
    e.finish();
    if (!options.log_dir.empty()) {
      const std::string path = options.log_dir + "/rank_" + std::to_string(r) + ".log";
      const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (fd < 0) {
        const int err = errno;
        for (int f : log_fds)
          if (f >= 0) ::close(f);
        throw IoError::from_errno(path, "open rank log", err);
      }
      log_fds[static_cast<std::size_t>(r)] = fd;
    }
  }

  LaunchResult result;
  result.ranks.resize(static_cast<std::size_t>(options.nproc));
  std::vector<pid_t> pids(static_cast<std::size_t>(options.nproc), -1);
  const pid_t parent = ::getpid();
  auto say = [&](const std::string& s) {
    if (!options.quiet) std::cerr << "eaglekit launch: " << s << "\n" << std::flush;
  };
  auto signal_alive = [&](int sig) {
    for (pid_t p : pids) {
      if (p <= 0) continue;
      ::kill(-p, sig);  // the rank's whole process group
      if (sig == SIGTERM) ::kill(-p, SIGCONT);  // a stopped rank must run to handle it
    }
  };

  int alive = 0;
  for (int r = 0; r < options.nproc; ++r) {
    const int log_fd = log_fds[static_cast<std::size_t>(r)];
    char** envp = envs[static_cast<std::size_t>(r)].ptrs.data();
    const pid_t pid = ::fork();
    if (pid < 0) {
      const int err = errno;
      signal_alive(SIGKILL);
      for (pid_t p : pids)
        if (p > 0) ::waitpid(p, nullptr, 0);
      throw IoError::from_errno(program, "fork", err);
    }
    if (pid == 0) {
      // Child: only async-signal-safe calls until exec.
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != parent) ::_exit(129);
      if (log_fd >= 0) {
        ::dup2(log_fd, 1);
        ::dup2(log_fd, 2);
      }
      // Default dispositions before unblocking: a signal landing before exec must not run
      // the launcher's own handlers in this copy of it (exec resets them only afterwards).
      for (const int sig : {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2}) {
        struct sigaction dfl {};
        dfl.sa_handler = SIG_DFL;
        ::sigaction(sig, &dfl, nullptr);
      }
      ::pthread_sigmask(SIG_SETMASK, &mask.old(), nullptr);
      ::execve(program.c_str(), argv.ptrs.data(), envp);
      const char msg[] = "eaglekit launch: exec failed\n";
      (void)!::write(2, msg, sizeof msg - 1);
      ::_exit(127);
    }
    ::setpgid(pid, pid);
    pids[static_cast<std::size_t>(r)] = pid;
    result.ranks[static_cast<std::size_t>(r)].rank = r;
    ++alive;
  }
  for (int f : log_fds)
    if (f >= 0) ::close(f);

  using Clock = std::chrono::steady_clock;
  std::optional<Clock::time_point> term_at, kill_at, deadline;
  if (options.timeout.count() > 0) deadline = Clock::now() + options.timeout;
  bool stopping = false;
  bool signalled = false;  // SIGTERM/SIGKILL sent to the ranks still running
  while (alive > 0) {
    // Reap whatever has exited.
    for (int r = 0; r < options.nproc; ++r) {
      pid_t& pid = pids[static_cast<std::size_t>(r)];
      if (pid <= 0) continue;
      int status = 0;
      const pid_t got = ::waitpid(pid, &status, WNOHANG);
      if (got != pid) continue;
      pid = -1;
      --alive;
      auto& re = result.ranks[static_cast<std::size_t>(r)];
      re.exit_code = exit_code_of(status);
      re.stopped = signalled;
      if (re.exit_code == kExitInterrupted && !signalled) {
        // Stopped by a signal after its checkpoint: every rank of the job stops at the same
        // step on its own (the stop flag is all-reduced), so this is no failure to stop the
        // others for; the job's code says it was interrupted unless a rank fails.
        if (result.first_failed < 0 && !result.timed_out) result.exit_code = kExitInterrupted;
      } else if (re.exit_code != 0 && result.first_failed < 0 && !result.timed_out) {
        result.first_failed = r;
        result.exit_code = re.exit_code;
        stopping = true;
        if (alive > 0) {
          say("rank " + std::to_string(r) + " " + describe_exit(status) +
              "; stopping the other ranks");
          term_at = Clock::now() + options.stop_grace;
        } else {
          say("rank " + std::to_string(r) + " " + describe_exit(status));
        }
      }
    }
    if (alive == 0) break;
    const auto now = Clock::now();
    if (deadline && now >= *deadline) {
      deadline.reset();
      result.timed_out = true;
      say("the job ran past its " + seconds_text(options.timeout) + " limit; stopping every rank");
      if (!stopping) {
        stopping = true;
        result.exit_code = 124;
        term_at = now;
      }
    }
    if (term_at && now >= *term_at) {
      signal_alive(SIGTERM);
      signalled = true;
      term_at.reset();
      kill_at = now + options.kill_grace;
    }
    if (kill_at && now >= *kill_at) {
      say("ranks still alive " + seconds_text(options.kill_grace) + " after SIGTERM; killing them");
      signal_alive(SIGKILL);
      kill_at.reset();
    }
    // SIGCHLD may be taken by another thread of this process: poll as well.
    Ms wait_for{200};
    for (const auto& t : {term_at, kill_at, deadline})
      if (t) wait_for = std::min(wait_for, std::chrono::duration_cast<Ms>(*t - now) + Ms(1));
    timespec ts{static_cast<time_t>(wait_for.count() / 1000),
                static_cast<long>((wait_for.count() % 1000) * 1000000)};
    const int sig = ::sigtimedwait(&mask.set(), nullptr, &ts);
    if (sig == SIGINT || sig == SIGTERM) {
      say(std::string("forwarding ") + (sig == SIGINT ? "SIGINT" : "SIGTERM") + " to the ranks");
      signal_alive(sig);
    }
  }
  return result;
}

}  // namespace eaglekit::dist
