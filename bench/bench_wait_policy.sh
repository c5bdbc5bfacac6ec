#!/usr/bin/env bash
# eaglekit's default OpenMP waiting (passive, lib/wait_policy.h) against spinning
# (OMP_WAIT_POLICY=active), the same `eaglekit train` on the same data and starting draft,
# alternated run by run, idle and beside --busy busy loops. Prints per condition the median
# over runs of the overall tokens/s (all timed tokens over the timed seconds, loader waits left
# out) and CPU-seconds per step, and the ratio default / active: >= 1 means the default is not
# slower. The training's shape is bench/bench_train.sh's, smaller by default.
#
# usage: bench/bench_wait_policy.sh [--runs 3] [--steps 20] [--busy N] [--threads N]
#                                   [--hidden 64] [--vocab 256] [--max-length 96] [--batch-size 8]
#   --busy defaults to the thread count; 0 measures idle only.
# The build dir is $EAGLEKIT_BUILD_DIR (default build/).
set -euo pipefail
cd "$(dirname "$0")/.."

THREADS=$(nproc)
[ "$THREADS" -gt 2 ] && THREADS=2
RUNS=3 STEPS=20 BUSY="" HIDDEN=64 VOCAB=256 LEN=96 BATCH=8
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) RUNS=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --busy) BUSY=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --hidden) HIDDEN=$2; shift 2 ;;
    --vocab) VOCAB=$2; shift 2 ;;
    --max-length) LEN=$2; shift 2 ;;
    --batch-size) BATCH=$2; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "bench_wait_policy.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
BUSY=${BUSY:-$THREADS}
BUILD=${EAGLEKIT_BUILD_DIR:-build}
EK="$BUILD/bin/eaglekit"
[ -x "$EK" ] || { echo "bench_wait_policy.sh: build $EK first (scripts/setup)" >&2; exit 1; }
unset OMP_WAIT_POLICY GOMP_SPINCOUNT KMP_BLOCKTIME EAGLEKIT_OMP_WAIT_POLICY

DIR=$(mktemp -d /tmp/eaglekit-bench-wait.XXXXXX)
BUSY_PIDS=()
cleanup() {
  [ ${#BUSY_PIDS[@]} -gt 0 ] && kill "${BUSY_PIDS[@]}" 2>/dev/null
  rm -rf "$DIR"
  return 0
}
trap cleanup EXIT

CONV=$(( STEPS * BATCH + 8 ))
"$EK" synth --out "$DIR/data" --conversations "$CONV" --hidden "$HIDDEN" --vocab "$VOCAB" \
  --min-tokens $((LEN / 2)) --max-tokens "$LEN" --dtype bf16 --base-out "$DIR/base" >/dev/null
"$EK" index "$DIR/data" --out "$DIR/index.eki" >/dev/null 2>&1
COMMON=(--data "$DIR/data/conversations.jsonl" --index "$DIR/index.eki" --base "$DIR/base"
        --max-length "$LEN" --batch-size "$BATCH" --no-shuffle --schedule constant --lr 1e-3
        --threads "$THREADS" --eval-every -1 --log-every 1 --no-progress)
"$EK" train "${COMMON[@]}" --out "$DIR/init" --max-steps 1 --lr 1e-30 --export-dtype float32 >/dev/null 2>&1

one() {  # one run: $1 condition name, $2 policy (default|active); appends a JSON line
  rm -rf "$DIR/run"
  local envs=()
  [ "$2" = active ] && envs=(OMP_WAIT_POLICY=active)
  env "${envs[@]}" "$EK" train "${COMMON[@]}" --init-draft "$DIR/init/final" --out "$DIR/run" --max-steps "$STEPS" \
    >/dev/null 2>"$DIR/err" || { cat "$DIR/err" >&2; exit 1; }
  /usr/bin/python3 - "$DIR/run/metrics.jsonl" "$1" "$2" >>"$DIR/results.jsonl" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
steps = [l for l in lines if "split" not in l and l["step"] > 2]
tok = sum(l["tokens_per_s"] * l["step_ms"] / 1e3 for l in steps)
sec = sum((l["step_ms"] - l["loader_wait_ms"]) / 1e3 for l in steps)
cpu = sorted(l["cpu_ms"] / 1e3 for l in steps)[len(steps) // 2]
print(json.dumps({"condition": sys.argv[2], "policy": sys.argv[3], "tps": tok / sec, "cpu": cpu}))
PY
}

conditions=(idle)
[ "$BUSY" -gt 0 ] && conditions+=(loaded)
for c in "${conditions[@]}"; do
  if [ "$c" = loaded ]; then
    for _ in $(seq 1 "$BUSY"); do bash -c 'while :; do :; done' & BUSY_PIDS+=($!); done
  fi
  for r in $(seq 1 "$RUNS"); do
    one "$c" default
    one "$c" active
    echo "$c: run $r/$RUNS done" >&2
  done
done

/usr/bin/python3 - "$DIR/results.jsonl" "$THREADS" "$BUSY" "$RUNS" "$STEPS" <<'PY'
import json, statistics as st, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
threads, busy, runs, steps = sys.argv[2:6]
print(f"OpenMP waiting: eaglekit's default (passive) against OMP_WAIT_POLICY=active; {threads} threads, "
      f"{runs} runs x {steps} steps each, alternated; median over runs")
for c in ("idle", "loaded"):
    sel = [r for r in rows if r["condition"] == c]
    if not sel:
        continue
    m = {p: (st.median(r["tps"] for r in sel if r["policy"] == p), st.median(r["cpu"] for r in sel if r["policy"] == p))
         for p in ("default", "active")}
    label = "idle" if c == "idle" else f"beside {busy} busy loop(s)"
    print(f"  {label:24s} default {m['default'][0]:9.0f} tok/s {m['default'][1]:6.3f} CPU-s/step | "
          f"active {m['active'][0]:9.0f} tok/s {m['active'][1]:6.3f} CPU-s/step | "
          f"default / active {m['default'][0] / m['active'][0]:.2f}x")
PY
