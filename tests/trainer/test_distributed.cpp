// trainer/parallel/distributed.h: the torchrun environment, Gloo groups and the dp x cp mesh over
// real processes on localhost, failure behaviour (a dead or hung rank), and the launcher.
#include "trainer/parallel/distributed.h"

#include <signal.h>
#include <stdlib.h>

#include <chrono>
#include <optional>
#include <thread>

#include "tests/trainer/dist_harness.h"

using namespace eaglekit;
using namespace eaglekit::test;

// The entry point of every multi-process test's ranks (skipped in a normal run).
TEST_CASE("distributed: worker" * doctest::skip()) {
  const std::string name = env_or("EAGLEKIT_TEST_SCENARIO", "");
  const auto it = scenarios().find(name);
  REQUIRE_MESSAGE(it != scenarios().end(), "unknown scenario '" << name << "'");
  it->second();
}

namespace {

// Sets environment variables for one scope and restores them.
class EnvGuard {
 public:
  void set(const char* name, const char* value) {
    if (!saved_.count(name)) {
      const char* old = std::getenv(name);
      saved_[name] = old ? std::optional<std::string>(old) : std::nullopt;
    }
    if (value) ::setenv(name, value, 1);
    else ::unsetenv(name);
  }
  ~EnvGuard() {
    for (const auto& [k, v] : saved_) {
      if (v) ::setenv(k.c_str(), v->c_str(), 1);
      else ::unsetenv(k.c_str());
    }
  }

 private:
  std::map<std::string, std::optional<std::string>> saved_;
};

ScenarioRegistration collectives("collectives", [] {
  const auto mesh = dist::Mesh::from_environment(1, worker_group_options());
  const dist::Group& w = mesh.world();
  const int r = w.rank(), n = w.size();
  REQUIRE(n == 3);
  CHECK(w.name() == "world");

  at::Tensor t = at::full({3}, static_cast<double>(r + 1), at::kDouble);
  w.all_reduce_sum(t);
  CHECK(t.eq(n * (n + 1) / 2).all().item<bool>());

  at::Tensor m = at::full({2}, static_cast<float>(r), at::kFloat);
  w.all_reduce_max(m);
  CHECK(m.eq(n - 1).all().item<bool>());

  const at::Tensor g = w.all_gather(at::full({2}, r, at::kLong));
  CHECK(g.sizes() == at::IntArrayRef({n, 2}));
  CHECK(g.select(1, 0).equal(at::arange(n, at::kLong)));

  at::Tensor b = at::full({4}, r == 2 ? 7.0f : 0.0f, at::kFloat);
  w.broadcast(b, 2);
  CHECK(b.eq(7).all().item<bool>());

  // A ring step, in both directions, with two tags in flight at once.
  at::Tensor right = at::full({5}, r, at::kLong), left = at::full({5}, 10 + r, at::kLong);
  at::Tensor from_prev = at::empty({5}, at::kLong), from_next = at::empty({5}, at::kLong);
  auto p1 = w.start_exchange(right, (r + 1) % n, from_prev, (r + n - 1) % n, 1);
  auto p2 = w.start_exchange(left, (r + n - 1) % n, from_next, (r + 1) % n, 2);
  p2.wait();
  p1.wait();
  CHECK(from_prev.eq((r + n - 1) % n).all().item<bool>());
  CHECK(from_next.eq(10 + (r + 1) % n).all().item<bool>());

  at::Tensor a = at::ones({10}), c = at::full({10}, 2.0f);
  auto pa = w.start_all_reduce_sum(a);
  auto pc = w.start_all_reduce_sum(c);
  pc.wait();
  pa.wait();
  CHECK(a.eq(n).all().item<bool>());
  CHECK(c.eq(2 * n).all().item<bool>());
  w.barrier();

  // Single-member groups of a cp = 1 mesh do no communication.
  CHECK(mesh.cp().size() == 1);
  at::Tensor solo = at::full({2}, 5.0f);
  mesh.cp().all_reduce_sum(solo);
  CHECK(solo.eq(5).all().item<bool>());
});

ScenarioRegistration mesh_layout("mesh_layout", [] {
  const auto mesh = dist::Mesh::from_environment(2, worker_group_options());
  REQUIRE(mesh.world_size() == 4);
  CHECK(mesh.cp_size() == 2);
  CHECK(mesh.dp_size() == 2);
  CHECK(mesh.rank() == mesh.dp_rank() * 2 + mesh.cp_rank());
  CHECK(dist::Mesh::rank_of(mesh.dp_rank(), mesh.cp_rank(), 2) == mesh.rank());
  CHECK(mesh.cp().rank() == mesh.cp_rank());
  CHECK(mesh.dp().rank() == mesh.dp_rank());
  CHECK(mesh.cp().name() == "cp[dp=" + std::to_string(mesh.dp_rank()) + "]");
  CHECK(mesh.dp().name() == "dp[cp=" + std::to_string(mesh.cp_rank()) + "]");
  // The cp group of dp rank d is {2d, 2d+1}; the dp group of cp rank c is {c, c+2}.
  at::Tensor x = at::full({1}, static_cast<double>(mesh.rank()), at::kDouble);
  mesh.cp().all_reduce_sum(x);
  CHECK(x.item<double>() == 4 * mesh.dp_rank() + 1);
  at::Tensor y = at::full({1}, static_cast<double>(mesh.rank()), at::kDouble);
  mesh.dp().all_reduce_sum(y);
  CHECK(y.item<double>() == 2 * mesh.cp_rank() + 2);
  at::Tensor z = at::full({1}, static_cast<double>(mesh.rank()), at::kDouble);
  mesh.world().all_reduce_sum(z);
  CHECK(z.item<double>() == 6);
  CHECK(std::string(std::getenv("LOCAL_RANK")) == std::to_string(mesh.local_rank()));
});

// Rank 1 dies (SIGKILL), hangs (SIGSTOP) or fails before the rendezvous at the step given
// by EAGLEKIT_TEST_FAULT; the others must fail on their own with a clear error.
ScenarioRegistration faults("faults", [] {
  const std::string fault = env_or("EAGLEKIT_TEST_FAULT", "");
  const int rank = env_int("RANK", -1);
  if (fault == "exit-early" && rank == 1) std::_Exit(5);
  dist::GroupOptions opts = worker_group_options();
  opts.connect_timeout = std::chrono::seconds(60);  // start-up on a loaded machine is slow
  const auto mesh = dist::Mesh::from_environment(1, opts);
  for (int i = 0; i < 100000; ++i) {
    if (rank == 1 && i == 5) {
      if (fault == "kill") ::raise(SIGKILL);
      if (fault == "hang") ::raise(SIGSTOP);
    }
    at::Tensor t = at::ones({1000});
    mesh.world().all_reduce_sum(t);
  }
  FAIL("the collectives kept succeeding after rank 1's fault");
});

}  // namespace

TEST_CASE("distributed: torchrun environment") {
  EnvGuard env;
  for (const char* k : {"WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT"})
    env.set(k, nullptr);
  CHECK_FALSE(dist::launch_env_from_environment().has_value());

  env.set("WORLD_SIZE", "4");
  env.set("RANK", "3");
  env.set("LOCAL_RANK", "1");
  env.set("MASTER_ADDR", "10.0.0.7");
  env.set("MASTER_PORT", "29511");
  env.set("TORCHELASTIC_USE_AGENT_STORE", "True");
  env.set("TORCHELASTIC_RESTART_COUNT", "2");
  const auto e = dist::launch_env_from_environment();
  REQUIRE(e.has_value());
  CHECK(e->world_size == 4);
  CHECK(e->rank == 3);
  CHECK(e->local_rank == 1);
  CHECK(e->master_addr == "10.0.0.7");
  CHECK(e->master_port == 29511);
  CHECK(e->agent_store);
  CHECK(e->restart_count == 2);

  struct Bad {
    const char* name;
    const char* value;
    const char* message;
  };
  const Bad bad[] = {
      {"RANK", "4", "environment variable RANK='4' is not an integer in [0, 3]"},
      {"RANK", "1x", "environment variable RANK='1x' is not an integer in [0, 3]"},
      {"RANK", nullptr,
       "environment variable RANK is not set (WORLD_SIZE is, so a distributed launch was "
       "expected; use torchrun or eaglekit launch)"},
      {"MASTER_PORT", "70000", "environment variable MASTER_PORT='70000' is not an integer in [1, 65535]"},
      {"MASTER_ADDR", nullptr, "environment variable MASTER_ADDR is not set (WORLD_SIZE=4)"},
      {"WORLD_SIZE", "0", "environment variable WORLD_SIZE='0' is not an integer in [1, 1048576]"},
  };
  for (const auto& b : bad) {
    CAPTURE(b.name);
    EnvGuard inner;
    inner.set(b.name, b.value);
    CHECK_THROWS_WITH_AS(dist::launch_env_from_environment(), b.message, UsageError);
  }
}

TEST_CASE("distributed: a single process needs no rendezvous; cp must divide the world") {
  const dist::Mesh m = dist::Mesh::single();
  CHECK(m.world_size() == 1);
  CHECK(m.cp_size() == 1);
  CHECK(m.dp_size() == 1);
  CHECK(m.is_main());
  at::Tensor t = at::ones({3});
  m.world().all_reduce_sum(t);
  CHECK(t.eq(1).all().item<bool>());
  CHECK(m.world().all_gather(t).sizes() == at::IntArrayRef({1, 3}));
  at::Tensor recv = at::zeros({3});
  m.cp().exchange(at::full({3}, 2.0f), 0, recv, 0);
  CHECK(recv.eq(2).all().item<bool>());

  dist::LaunchEnv env;
  env.world_size = 4;
  env.rank = 0;
  env.master_addr = "127.0.0.1";
  env.master_port = 1;
  CHECK_THROWS_WITH_AS(dist::Mesh::create(env, 3, {}), "--cp 3 does not divide the world size 4",
                       UsageError);
  CHECK_THROWS_WITH_AS(dist::Mesh::from_environment(2, {}),
                       "--cp 2 needs a distributed launch (eaglekit launch --nproc N -- ... or "
                       "torchrun); this is a single process",
                       UsageError);
}

TEST_CASE("distributed: the rendezvous fails within its timeout when nobody listens") {
  dist::LaunchEnv env;
  env.world_size = 2;
  env.rank = 1;
  env.master_addr = "127.0.0.1";
  env.master_port = 1;  // privileged and unused: connect is refused until the timeout
  dist::GroupOptions o;
  o.timeout = std::chrono::milliseconds(500);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    dist::Mesh::create(env, 1, o);
    FAIL("rendezvous succeeded");
  } catch (const dist::DistributedError& e) {
    CHECK(std::string(e.what()).rfind("distributed: rendezvous at 127.0.0.1:1 failed for rank 1 of 2 within 0.5 s: ", 0) == 0);
  }
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20));
}

TEST_CASE("distributed: collectives and point-to-point over 3 processes") {
  TempDir d("dist");
  const JobResult r = run_job(3, "collectives", d.path());
  INFO(r.all_logs());
  CHECK(r.launch.exit_code == 0);
  CHECK(r.launch.first_failed == -1);
}

TEST_CASE("distributed: mesh layout rank = dp_rank * cp + cp_rank on 4 processes") {
  TempDir d("dist");
  JobOptions jo;
  const JobResult r = run_job(4, "mesh_layout", d.path(), jo);
  INFO(r.all_logs());
  CHECK(r.launch.exit_code == 0);
}

TEST_CASE("distributed: a killed rank makes the others fail fast with a clear error") {
  TempDir d("dist");
  JobOptions jo;
  jo.env["EAGLEKIT_TEST_FAULT"] = "kill";
  jo.stop_grace = std::chrono::seconds(60);  // let the survivors notice on their own
  jo.collective_timeout_ms = 60000;          // a dead peer must not need the timeout
  const JobResult r = run_job(3, "faults", d.path(), jo);
  INFO(r.all_logs());
  CHECK(r.launch.first_failed == 1);
  CHECK(r.launch.exit_code == 128 + SIGKILL);
  for (int rank : {0, 2}) {
    CAPTURE(rank);
    CHECK(r.launch.ranks[static_cast<std::size_t>(rank)].exit_code == 1);
    CHECK_FALSE(r.launch.ranks[static_cast<std::size_t>(rank)].stopped);
    CHECK(r.logs[static_cast<std::size_t>(rank)].find(
              "distributed: all_reduce(sum) in group world (rank " + std::to_string(rank) +
              " of 3) failed: ") != std::string::npos);
  }
  CHECK(r.seconds < 40);
}

TEST_CASE("distributed: a hung rank makes the others fail after the timeout") {
  TempDir d("dist");
  JobOptions jo;
  jo.env["EAGLEKIT_TEST_FAULT"] = "hang";
  jo.stop_grace = std::chrono::seconds(5);  // the survivors time out, then rank 1 is stopped
  jo.kill_grace = std::chrono::seconds(2);
  jo.collective_timeout_ms = 1500;
  const JobResult r = run_job(3, "faults", d.path(), jo);
  INFO(r.all_logs());
  CHECK((r.launch.first_failed == 0 || r.launch.first_failed == 2));
  CHECK(r.launch.exit_code == 1);
  int timed_out = 0;
  for (int rank : {0, 2}) {
    CAPTURE(rank);
    const std::string& log = r.logs[static_cast<std::size_t>(rank)];
    const std::string head = "distributed: all_reduce(sum) in group world (rank " + std::to_string(rank) +
                             " of 3) failed: ";
    CHECK(log.find(head) != std::string::npos);
    // The first survivor to give up times out; the other may instead see it leave.
    if (log.find(head + "timed out after 1.5 s") != std::string::npos) ++timed_out;
    CHECK_FALSE(r.launch.ranks[static_cast<std::size_t>(rank)].stopped);
  }
  CHECK(timed_out >= 1);
  // The stopped rank was terminated by the launcher.
  CHECK(r.launch.ranks[1].stopped);
  CHECK(r.launch.ranks[1].exit_code == 128 + SIGTERM);
  CHECK(r.seconds < 40);
}

TEST_CASE("distributed: launch stops the job when a rank fails before the rendezvous") {
  TempDir d("dist");
  JobOptions jo;
  jo.env["EAGLEKIT_TEST_FAULT"] = "exit-early";
  const JobResult r = run_job(3, "faults", d.path(), jo);
  INFO(r.all_logs());
  CHECK(r.launch.first_failed == 1);
  CHECK(r.launch.exit_code == 5);
  CHECK(r.launch.ranks[0].stopped);
  CHECK(r.launch.ranks[2].stopped);
  CHECK(r.seconds < 30);
}

TEST_CASE("distributed: launch sets the torchrun variables and propagates exit codes") {
  dist::LaunchOptions o;
  o.nproc = 3;
  o.quiet = true;
  o.argv = {"/bin/sh", "-c",
            "test \"$WORLD_SIZE\" = 3 && test \"$LOCAL_RANK\" = \"$RANK\" && "
            "test \"$LOCAL_WORLD_SIZE\" = 3 && test \"$MASTER_ADDR\" = 127.0.0.1 && "
            "test \"$MASTER_PORT\" -gt 0 && test \"$TORCHELASTIC_USE_AGENT_STORE\" = True && "
            "test \"$EXTRA\" = yes"};
  o.env["EXTRA"] = "yes";
  const auto ok = dist::launch_local(o);
  CHECK(ok.exit_code == 0);
  CHECK(ok.first_failed == -1);
  REQUIRE(ok.ranks.size() == 3);
  for (const auto& re : ok.ranks) CHECK(re.exit_code == 0);

  o.argv = {"/bin/sh", "-c", "if [ \"$RANK\" = 2 ]; then exit 7; fi; exec sleep 30"};
  const auto t0 = std::chrono::steady_clock::now();
  const auto bad = dist::launch_local(o);
  CHECK(bad.exit_code == 7);
  CHECK(bad.first_failed == 2);
  CHECK(bad.ranks[0].stopped);
  CHECK(bad.ranks[0].exit_code == 128 + SIGTERM);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20));

  o.argv = {"/bin/sh", "-c", "exec sleep 30"};
  o.timeout = std::chrono::milliseconds(300);
  const auto slow = dist::launch_local(o);
  CHECK(slow.timed_out);
  CHECK(slow.exit_code == 124);

  o.argv = {"no-such-program-eaglekit"};
  CHECK_THROWS_WITH_AS(dist::launch_local(o), "program 'no-such-program-eaglekit' not found in PATH",
                       UsageError);
  o.argv = {};
  CHECK_THROWS_AS(dist::launch_local(o), UsageError);
}
