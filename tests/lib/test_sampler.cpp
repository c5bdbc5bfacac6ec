#include <doctest/doctest.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <sstream>

#include "formats/error.h"
#include "lib/sampler.h"
#include "tests/support.h"

using namespace eaglekit;

namespace {

std::vector<std::vector<std::size_t>> flat_rows(const Sampler::Step& s) {
  return s.rows;
}

// All steps of one epoch for a rank: each step's sample indices (one unit per sample).
std::vector<std::vector<std::size_t>> epoch_steps(std::size_t n, SamplerOptions o) {
  Sampler s(n, o);
  std::vector<std::vector<std::size_t>> out;
  for (;;) {
    const auto step = s.next();
    if (step.end_of_epoch) break;
    std::vector<std::size_t> ids;
    for (const auto& u : step.rows) ids.insert(ids.end(), u.begin(), u.end());
    out.push_back(ids);
  }
  return out;
}

}  // namespace

TEST_CASE("sampler: reference order is the identity, shuffled orders are permutations") {
  const auto id = epoch_order(10, false, 123, 4);
  for (std::size_t i = 0; i < id.size(); ++i) CHECK(id[i] == i);
  const auto a = epoch_order(1000, true, 7, 0);
  auto sorted = a;
  std::sort(sorted.begin(), sorted.end());
  for (std::size_t i = 0; i < sorted.size(); ++i) REQUIRE(sorted[i] == i);
  CHECK(a != id);
  CHECK(epoch_order(1000, true, 7, 0) == a);  // deterministic
  CHECK(epoch_order(1000, true, 7, 1) != a);  // per epoch
  CHECK(epoch_order(1000, true, 8, 0) != a);  // per seed
  CHECK(epoch_order(1, true, 7, 0) == std::vector<std::size_t>{0});
  CHECK(epoch_order(0, true, 7, 0).empty());
}

TEST_CASE("sampler: the permutation is the documented algorithm (Python port agrees)") {
  test::require_python("torch");
  const std::string script =
      "import sys; sys.path.insert(0, sys.argv[1])\n"
      "import reference_loader as r\n"
      "for n, seed, epoch in [(10, 42, 0), (10, 42, 1), (37, 2**64 - 1, 5), (2, 0, 0)]:\n"
      "    print(' '.join(map(str, r.splitmix_permutation(n, seed, epoch))))\n";
  const auto res = test::python(script, {test::source_dir() + "/tests/lib"});
  REQUIRE_MESSAGE(res.exit_code == 0, res.err);
  std::istringstream lines(res.out);
  const std::vector<std::tuple<std::size_t, std::uint64_t, std::uint64_t>> cases = {
      {10, 42, 0}, {10, 42, 1}, {37, ~0ull, 5}, {2, 0, 0}};
  for (const auto& [n, seed, epoch] : cases) {
    std::string line;
    REQUIRE(std::getline(lines, line));
    std::istringstream nums(line);
    std::vector<std::size_t> py;
    std::size_t v;
    while (nums >> v) py.push_back(v);
    CHECK(py == epoch_order(n, true, seed, epoch));
  }
}

TEST_CASE("sampler: data-parallel ranks split every step round-robin, no overlap, nothing lost") {
  const std::size_t n = 23;
  SamplerOptions one;
  one.batch_size = 6;
  one.shuffle = true;
  one.seed = 3;
  const auto global = epoch_steps(n, one);  // global batch 6 at world size 1
  REQUIRE(global.size() == 4);              // 6 + 6 + 6 + 5
  for (int world : {2, 3}) {
    std::vector<std::vector<std::vector<std::size_t>>> ranks;
    for (int r = 0; r < world; ++r) {
      SamplerOptions o = one;
      o.batch_size = 6 / world;
      o.world_size = world;
      o.rank = r;
      ranks.push_back(epoch_steps(n, o));
      REQUIRE(ranks.back().size() == global.size());  // every rank runs the same steps
    }
    std::multiset<std::size_t> all;
    for (std::size_t step = 0; step < global.size(); ++step) {
      std::multiset<std::size_t> step_union;
      for (int r = 0; r < world; ++r) {
        // Round-robin: rank r holds global positions r, r + W, ... of the step.
        for (std::size_t k = 0; k < ranks[r][step].size(); ++k)
          CHECK(ranks[r][step][k] == global[step][r + k * world]);
        step_union.insert(ranks[r][step].begin(), ranks[r][step].end());
      }
      // The global batch of step n is the same set whatever the DP size.
      CHECK(step_union == std::multiset<std::size_t>(global[step].begin(), global[step].end()));
      all.insert(step_union.begin(), step_union.end());
    }
    CHECK(all.size() == n);
    CHECK(std::set<std::size_t>(all.begin(), all.end()).size() == n);
  }
}

TEST_CASE("sampler: the last partial step, drop_last, and a rank with no rows in it") {
  SamplerOptions o;
  o.batch_size = 2;
  o.world_size = 3;
  o.rank = 2;
  // 7 units, global batch 6: step 0 = 6, step 1 = 1 unit (rank 0 only).
  auto steps = epoch_steps(7, o);
  REQUIRE(steps.size() == 2);
  CHECK(steps[0] == std::vector<std::size_t>{2, 5});
  CHECK(steps[1].empty());
  o.rank = 0;
  steps = epoch_steps(7, o);
  CHECK(steps[1] == std::vector<std::size_t>{6});
  o.drop_last = true;
  CHECK(epoch_steps(7, o).size() == 1);
  CHECK(Sampler(7, o).steps_in_epoch() == 1);
  o.drop_last = false;
  CHECK(Sampler(7, o).steps_in_epoch() == 2);
}

TEST_CASE("sampler: epochs end, start again reshuffled, and stop after `epochs`") {
  SamplerOptions o;
  o.batch_size = 4;
  o.shuffle = true;
  o.seed = 11;
  o.epochs = 2;
  Sampler s(8, o);
  std::vector<std::vector<std::size_t>> epochs(2);
  for (int e = 0; e < 2; ++e) {
    for (;;) {
      const auto st = s.next();
      CHECK_FALSE(st.finished);
      if (st.end_of_epoch) {
        CHECK(st.after.epoch == static_cast<std::uint64_t>(e + 1));
        CHECK(st.after.position == 0);
        break;
      }
      CHECK(st.epoch == static_cast<std::uint64_t>(e));
      for (const auto& u : st.rows) epochs[e].push_back(u[0]);
    }
  }
  CHECK(epochs[0] == epoch_order(8, true, 11, 0));
  CHECK(epochs[1] == epoch_order(8, true, 11, 1));
  CHECK(s.next().finished);
  CHECK(s.next().finished);
}

TEST_CASE("sampler: state saved mid-epoch restores the exact remaining steps") {
  SamplerOptions o;
  o.batch_size = 3;
  o.world_size = 2;
  o.rank = 1;
  o.shuffle = true;
  o.seed = 99;
  Sampler a(40, o);
  a.next();
  a.next();
  const SamplerState saved = a.state();
  CHECK(saved.position == 12);
  std::vector<std::vector<std::vector<std::size_t>>> rest_a, rest_b;
  for (int i = 0; i < 6; ++i) rest_a.push_back(flat_rows(a.next()));  // crosses the epoch end
  Sampler b(40, o);
  b.restore(SamplerState::from_json(saved.to_json()));
  for (int i = 0; i < 6; ++i) rest_b.push_back(flat_rows(b.next()));
  CHECK(rest_a == rest_b);
  CHECK(a.state() == b.state());
}

TEST_CASE("sampler: a planner groups samples into rows") {
  SamplerOptions o;
  o.batch_size = 2;
  Sampler s(5, o, [](const std::vector<std::size_t>& order) {
    std::vector<Sampler::Unit> units;
    for (std::size_t i = 0; i < order.size(); i += 2) {
      Sampler::Unit u{order[i]};
      if (i + 1 < order.size()) u.push_back(order[i + 1]);
      units.push_back(u);
    }
    return units;
  });
  CHECK(s.steps_in_epoch() == 2);
  const auto st = s.next();
  REQUIRE(st.rows.size() == 2);
  CHECK(st.rows[0] == std::vector<std::size_t>{0, 1});
  CHECK(st.rows[1] == std::vector<std::size_t>{2, 3});
  CHECK(s.next().rows == std::vector<Sampler::Unit>{{4}});
  CHECK(s.next().end_of_epoch);
}

TEST_CASE("sampler: bad options and states are refused with a message") {
  SamplerOptions o;
  CHECK_THROWS_WITH_AS(Sampler(0, o), "no samples to load", UsageError);
  o.batch_size = 0;
  CHECK_THROWS_WITH_AS(Sampler(3, o), "batch size must be at least 1", UsageError);
  o.batch_size = 1;
  o.rank = 2;
  o.world_size = 2;
  CHECK_THROWS_WITH_AS(Sampler(3, o), "rank 2 is outside world size 2", UsageError);

  SamplerOptions good;
  good.batch_size = 4;
  Sampler s(10, good);
  SamplerState st = s.state();
  st.samples = 11;
  CHECK_THROWS_WITH_AS(s.restore(st), "sampler state is for 11 samples but this dataset has 10",
                       UsageError);
  st = s.state();
  st.shuffle = true;
  st.seed = 5;
  CHECK_THROWS_WITH_AS(
      s.restore(st),
      "sampler state was saved with --shuffle --seed 5; resume with the same order options",
      UsageError);
  st = s.state();
  st.position = 3;
  CHECK_THROWS_WITH_AS(s.restore(st),
                       "sampler state position 3 does not fall on a step boundary of global "
                       "batch 4 (epoch has 10 rows)",
                       UsageError);
  st.position = 10;  // the end of the epoch is a valid place to stop
  s.restore(st);
  CHECK(s.next().end_of_epoch);

  CHECK_THROWS_AS(SamplerState::from_json("{"), FormatError);
  CHECK_THROWS_WITH_AS(SamplerState::from_json("[1]"),
                       "<sampler state>: state: expected a JSON object", FormatError);
  CHECK_THROWS_WITH_AS(
      SamplerState::from_json(R"({"epoch": -1, "position": 0, "seed": 0, "samples": 1, "shuffle": false})"),
      "<sampler state>: state: field 'epoch' missing or not a non-negative integer", FormatError);
  CHECK_THROWS_WITH_AS(
      SamplerState::from_json(R"({"epoch": 1, "position": 0, "seed": 0, "samples": 1})"),
      "<sampler state>: state: field 'shuffle' missing or not a boolean", FormatError);
}
