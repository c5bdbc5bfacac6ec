// Process groups for data- and context-parallel training on c10d, torch's own distributed
// engine: rendezvous through a c10d::TCPStore from the torchrun environment, Gloo on CPU,
// NCCL on CUDA (when built with it), and the dp x cp mesh the trainer runs on. Also the
// local launcher behind `eaglekit launch`.
//
// Mesh layout: with world size W and context-parallel size C (W % C == 0), DP = W / C and
//   rank = dp_rank * C + cp_rank
// so the C ranks of one context-parallel group are consecutive (one node's GPUs, when C
// divides the GPUs per node) and a data-parallel group holds the ranks with equal cp_rank.
//
// Every collective blocks until it completes or its timeout passes, and then throws
// DistributedError naming the operation, the group and the peer. A rank that dies makes
// its peers fail fast (Gloo sees the closed socket); a rank that hangs makes them fail
// after the timeout. Nothing here retries.
//
// Thread safety: a Group may be used by one thread at a time, and every member must issue
// the same collectives in the same order (the c10d contract). Groups and Meshes are cheap
// handles (shared ownership of the communicator).
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "formats/error.h"

namespace eaglekit::dist {

// A collective failed, timed out, or the rendezvous did not complete.
class DistributedError : public Error {
 public:
  using Error::Error;
};

// The torchrun contract. `torchrun --no-python --nproc-per-node N eaglekit train ...`,
// `eaglekit launch`, and Slurm/MPI wrappers that export these variables all work.
struct LaunchEnv {
  int rank = 0;              // RANK
  int world_size = 1;        // WORLD_SIZE
  int local_rank = 0;        // LOCAL_RANK (selects the CUDA device)
  std::string master_addr;   // MASTER_ADDR
  int master_port = 0;       // MASTER_PORT
  // TORCHELASTIC_USE_AGENT_STORE=True: the launcher hosts the TCPStore and every rank
  // connects as a client (torchrun and `eaglekit launch` do this); otherwise rank 0
  // hosts it.
  bool agent_store = false;
  int restart_count = 0;  // TORCHELASTIC_RESTART_COUNT (keys of a restarted job differ)
};

// Reads the environment. nullopt when WORLD_SIZE is not set (a plain single-process run);
// throws UsageError when a variable is missing or malformed, naming it.
std::optional<LaunchEnv> launch_env_from_environment();

enum class Backend { kGloo, kNccl };

struct GroupOptions {
  // CUDA tensors go through NCCL (requires a build with EAGLEKIT_WITH_NCCL, see README);
  // CPU tensors through Gloo.
  bool cuda = false;
  // Bound on every collective and point-to-point transfer.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // Bound on connecting to the store and on the creation of each group (every rank must
  // have started by then). 0: the same as `timeout`.
  std::chrono::milliseconds connect_timeout{0};
};

// True when this build can create NCCL groups.
bool nccl_available();

// A communicator over a fixed set of ranks. A group of size 1 does no communication.
// All functions throw DistributedError on failure or timeout.
class Group {
 public:
  Group();  // size 1
  int rank() const;
  int size() const;
  const std::string& name() const;  // "world", "cp[dp=1]", "dp[cp=0]", used in messages
  std::chrono::milliseconds timeout() const;
  Backend backend() const;

  // Sum over the group, in place. Tensors must be contiguous and on the group's device.
  void all_reduce_sum(at::Tensor& t) const;
  void all_reduce_sum(std::vector<at::Tensor>& ts) const;  // one call per tensor, all in flight
  void all_reduce_max(at::Tensor& t) const;
  // Every member's `t` stacked along a new leading dimension (same shape on every rank).
  at::Tensor all_gather(const at::Tensor& t) const;
  void broadcast(at::Tensor& t, int root) const;
  void barrier() const;

  // Communication in flight, started by start_*(). The tensors involved must stay alive
  // (and unmodified) until wait() returns; wait() throws on failure or timeout. Destroying
  // an unwaited Pending waits for it and drops any error (it runs during unwinding).
  class Pending {
   public:
    Pending();
    Pending(Pending&&) noexcept;
    Pending& operator=(Pending&&) noexcept;
    ~Pending();
    void wait();

   private:
    friend class Group;
    struct State;
    std::unique_ptr<State> state_;
  };
  // Point to point: `send` goes to rank `to` while `recv` is filled from rank `from`.
  // Members of a ring post their exchanges in an order that cannot deadlock on NCCL (even
  // ranks send first).
  Pending start_exchange(const at::Tensor& send, int to, at::Tensor& recv, int from,
                         int tag = 0) const;
  // start_exchange(...).wait()
  void exchange(const at::Tensor& send, int to, at::Tensor& recv, int from, int tag = 0) const;
  // all_reduce_sum(t) in flight.
  Pending start_all_reduce_sum(at::Tensor& t) const;

  struct Impl;
  explicit Group(std::shared_ptr<Impl> impl);

 private:
  std::shared_ptr<Impl> impl_;
};

// Who is who in the dp x cp mesh (layout in the file comment).
class Mesh {
 public:
  // World size 1: every group has size 1; nothing communicates.
  static Mesh single();
  // Rendezvous of the world and creation of the groups this rank belongs to. Throws
  // UsageError when env.world_size is not a multiple of cp_size, DistributedError when
  // the rendezvous fails (store unreachable, port in use, a rank missing until timeout).
  static Mesh create(const LaunchEnv& env, int cp_size, const GroupOptions& options);
  // create() from launch_env_from_environment(), or single() (cp_size must then be 1).
  static Mesh from_environment(int cp_size, const GroupOptions& options);

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  int local_rank() const { return local_rank_; }
  int dp_rank() const { return rank_ / cp_size_; }
  int dp_size() const { return world_size_ / cp_size_; }
  int cp_rank() const { return rank_ % cp_size_; }
  int cp_size() const { return cp_size_; }
  bool is_main() const { return rank_ == 0; }  // the rank that logs, checkpoints, exports
  static int rank_of(int dp_rank, int cp_rank, int cp_size) { return dp_rank * cp_size + cp_rank; }

  const Group& world() const { return world_; }
  const Group& dp() const { return dp_; }  // ranks with this cp_rank
  const Group& cp() const { return cp_; }  // ranks with this dp_rank

 private:
  int rank_ = 0, world_size_ = 1, local_rank_ = 0, cp_size_ = 1;
  Group world_, dp_, cp_;
};

// `eaglekit launch`: runs `argv` as `nproc` local processes with the torchrun variables
// set (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), hosting
// the TCPStore itself (TORCHELASTIC_USE_AGENT_STORE=True) on `master_port` (0: a free
// port, so concurrent jobs never collide).
struct LaunchOptions {
  int nproc = 1;
  std::vector<std::string> argv;  // argv[0]: a path, or a name looked up in PATH
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  // Extra variables for every rank (e.g. test scenarios); they override the inherited ones.
  std::map<std::string, std::string> env;
  // When set, rank i's stdout and stderr go to LOG_DIR/rank_i.log instead of ours.
  std::string log_dir;
  // When a rank fails, the others get this long to exit on their own (they see the dead
  // peer and fail with their own error) before SIGTERM, and as long again before SIGKILL.
  std::chrono::milliseconds stop_grace{std::chrono::seconds(0)};
  std::chrono::milliseconds kill_grace{std::chrono::seconds(10)};
  // Whole-job bound (0: none): when it passes, every rank is stopped as above and the
  // result says timed_out, exit code 124.
  std::chrono::milliseconds timeout{0};
  bool quiet = false;  // no "rank N exited ..." lines on stderr
};

struct RankExit {
  int rank = 0;
  int exit_code = 0;  // 128 + signal for a signal death
  bool stopped = false;  // terminated by the launcher after another rank failed
};

struct LaunchResult {
  int exit_code = 0;        // 0, the first failed rank's code, or 3 (all stopped on a signal)
  int first_failed = -1;    // that rank, -1 when all succeeded
  bool timed_out = false;
  std::vector<RankExit> ranks;
};

// The exit code of a rank stopped by SIGINT or SIGTERM after saving its checkpoint (train's
// kExitInterrupted): launch passes it on without stopping the other ranks.
constexpr int kExitInterrupted = 3;

// Blocks until every rank has exited. SIGINT and SIGTERM received meanwhile are forwarded
// to every rank (the ranks run in their own process group so a terminal's ^C reaches them
// once, through us; they get SIGTERM if we die). When one rank fails, the others are
// stopped (see stop_grace); exit 3, train's kExitInterrupted, is no failure. Throws
// UsageError on bad options, IoError when a process cannot be started.
LaunchResult launch_local(const LaunchOptions& options);

}  // namespace eaglekit::dist
