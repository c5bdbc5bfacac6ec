#!/usr/bin/env bash
# Training under load (issue #30 item 3): how much of its idle speed each side keeps when
# another CPU-bound process runs beside it. bench/bench_train.sh twice on the same data and
# starting draft: idle, then beside one busy loop per thread (--busy THREADS); eaglekit runs
# with --adapt-threads in both (say --fixed to leave it out), PyTorch as it is. Prints, for
# each side, the overall tokens/s (all timed tokens over all timed seconds: stalled steps
# count) idle and loaded and the share kept, then the two shares side by side. Both sides run
# as their users get them (bench_train.sh --as-shipped: no OMP_WAIT_POLICY set; eaglekit waits
# passively by itself, PyTorch's OpenMP threads spin first); --passive-both sets
# OMP_WAIT_POLICY=passive on both sides, as this benchmark did before eaglekit's default.
#
# usage: bench/bench_under_load.sh [--fixed] [--passive-both] [--runs 3] [--steps 60] [bench_train.sh options]
# The build dir is $EAGLEKIT_BUILD_DIR (default build/).
set -euo pipefail
cd "$(dirname "$0")/.."

ADAPT=(--adapt-threads) SHIPPED=(--as-shipped) RUNS=3 STEPS=60 THREADS=$(nproc) PASS=()
[ "$THREADS" -gt 2 ] && THREADS=2
while [ $# -gt 0 ]; do
  case "$1" in
    --fixed) ADAPT=(); shift ;;
    --passive-both) SHIPPED=(); export OMP_WAIT_POLICY=passive; shift ;;
    --runs) RUNS=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) PASS+=("$1"); shift ;;
  esac
done

OUT=$(mktemp -d /tmp/eaglekit-under-load.XXXXXX)
trap 'rm -rf "$OUT"' EXIT
COMMON=(--runs "$RUNS" --steps "$STEPS" --threads "$THREADS" "${ADAPT[@]}" "${SHIPPED[@]}" "${PASS[@]}")
echo "== idle" >&2
bench/bench_train.sh "${COMMON[@]}" --json "$OUT/idle.json" >&2
echo "== beside $THREADS busy loop(s)" >&2
bench/bench_train.sh "${COMMON[@]}" --busy "$THREADS" --json "$OUT/loaded.json" >&2

/usr/bin/python3 - "$OUT" "${#ADAPT[@]}" "$THREADS" "${#SHIPPED[@]}" <<'EOF'
import json, sys
d, adapt, threads, shipped = sys.argv[1], sys.argv[2] != "0", sys.argv[3], sys.argv[4] != "0"
idle, loaded = (json.load(open(f"{d}/{n}.json")) for n in ("idle", "loaded"))
print("OpenMP waiting: " + ("as shipped (no OMP_WAIT_POLICY: eaglekit passive by its default, PyTorch its runtime's)"
                             if shipped else "OMP_WAIT_POLICY=passive on both sides"))
print(f"under load: {threads} threads each, beside {threads} busy loop(s); eaglekit "
      f"{'with --adapt-threads' if adapt else 'at a fixed thread count'}; overall tokens/s, median of "
      f"{idle['runs']} runs")
kept = {}
for side, name in (("eaglekit", "eaglekit train"), ("pytorch", "PyTorch (Python)")):
    a, b = idle[side]["overall"], loaded[side]["overall"]
    kept[side] = b / a
    print(f"  {name:17s} idle {a:8.0f}  loaded {b:8.0f}  kept {kept[side]:.2f}")
print(f"  kept, eaglekit / PyTorch: {kept['eaglekit'] / kept['pytorch']:.2f}x "
      f"(>= 1: eaglekit falls no more than PyTorch); loaded ratio "
      f"{loaded['eaglekit']['overall'] / loaded['pytorch']['overall']:.2f}x")
EOF
