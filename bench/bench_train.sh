#!/usr/bin/env bash
# Training throughput: `eaglekit train` against a PyTorch implementation of the same draft,
# TTT unroll, loss and optimizer (bench/bench_train.py), on the same synthetic data, the
# same starting weights, the same batches (reference order, pad collation), fp32, AdamW,
# grad clip 1.0, the same TTT steps and the same number of threads (--threads /
# torch.set_num_threads), --runs runs of each, alternating, side by side.
#
# Per run, both sides take the median over the steps after --warmup of: tokens/s (tokens =
# real, unpadded tokens of the batch) and process CPU time per step (every thread); and the
# overall rate, all timed tokens over all timed seconds, which counts the few steps a loaded
# machine stalls for seconds (the median hides them). Data
# loading is EXCLUDED on both sides: Python times batches already in memory, and eaglekit's
# time is its step time minus the time it waited for the loader (its loader threads' CPU
# still counts in its CPU time, which favours Python). OMP_WAIT_POLICY=passive on both
# sides unless set; --as-shipped leaves both as their users get them (eaglekit waits passively
# by itself, lib/wait_policy.h; PyTorch's OpenMP runtime spins first). Prints the medians over runs, the ratio, the step-1 loss of both (equal
# up to float rounding: the same computation), eaglekit's data-wait share (loader_wait_ms /
# step_ms from OUT/metrics.jsonl) and its end-to-end tokens/s (waits included).
#
# usage: bench/bench_train.sh [--hidden 128] [--vocab 2048] [--draft-vocab 1024]
#                             [--max-length 256] [--batch-size 4] [--steps 8] [--warmup 2]
#                             [--runs 3] [--threads N] [--jobs 2] [--dir DIR]
#                             [--busy N] [--adapt-threads] [--as-shipped] [--draft-arch A] [--json FILE]
#   --threads defaults to min(nproc, 2); --jobs is eaglekit's loader threads; --busy N runs N
#   busy loops (one process each) beside both sides for all their runs; --adapt-threads is
#   passed to eaglekit train; --draft-arch eagle3.1 makes the shared starting draft EAGLE 3.1's
#   (both sides then train it); --json FILE also writes the medians as JSON.
# The build dir is $EAGLEKIT_BUILD_DIR (default build/); eaglekit is built if missing.
set -euo pipefail
cd "$(dirname "$0")/.."

THREADS=$(nproc)
[ "$THREADS" -gt 2 ] && THREADS=2
HIDDEN=128 VOCAB=2048 DVOCAB=1024 LEN=256 BATCH=4 STEPS=8 JOBS=2 DIR="" WARMUP=2 RUNS=3 BUSY=0 ADAPT=() JSON_OUT="" AS_SHIPPED=0 ARCH=()
while [ $# -gt 0 ]; do
  case "$1" in
    --hidden) HIDDEN=$2; shift 2 ;;
    --vocab) VOCAB=$2; shift 2 ;;
    --draft-vocab) DVOCAB=$2; shift 2 ;;
    --max-length) LEN=$2; shift 2 ;;
    --batch-size) BATCH=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --warmup) WARMUP=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --jobs) JOBS=$2; shift 2 ;;
    --dir) DIR=$2; shift 2 ;;
    --busy) BUSY=$2; shift 2 ;;
    --adapt-threads) ADAPT=(--adapt-threads); shift ;;
    --as-shipped) AS_SHIPPED=1; shift ;;
    --draft-arch) ARCH=(--draft-arch "$2"); shift 2 ;;
    --json) JSON_OUT=$2; shift 2 ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    *) echo "bench_train.sh: unknown option $1" >&2; exit 2 ;;
  esac
done

PY=/usr/bin/python3
# Both sides run LibTorch on libgomp: sleeping, not spinning, OpenMP waits (spinning threads
# on a shared machine cost up to 30x the CPU; bench/bench_train_step shows it).
if [ "$AS_SHIPPED" = 1 ]; then
  unset OMP_WAIT_POLICY GOMP_SPINCOUNT KMP_BLOCKTIME EAGLEKIT_OMP_WAIT_POLICY
else
  export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
fi
BUILD=${EAGLEKIT_BUILD_DIR:-build}
if [ ! -x "$BUILD/bin/eaglekit" ]; then
  [ -f "$BUILD/build.ninja" ] || cmake -S . -B "$BUILD" -G Ninja >/dev/null
  ninja -C "$BUILD" eaglekit >/dev/null
fi
EK="$BUILD/bin/eaglekit"
CLEAN=0
if [ -z "$DIR" ]; then DIR=$(mktemp -d /tmp/eaglekit-bench-train.XXXXXX); CLEAN=1; fi
BUSY_PIDS=()
cleanup() {
  [ ${#BUSY_PIDS[@]} -gt 0 ] && kill "${BUSY_PIDS[@]}" 2>/dev/null
  [ "$CLEAN" = 1 ] && rm -rf "$DIR"
  return 0
}
trap cleanup EXIT

# Enough conversations that STEPS batches never wrap around the train split.
CONV=$(( (STEPS * BATCH * 100 + 94) / 95 + 2 ))
echo "data: $CONV conversations, H=$HIDDEN, V=$VOCAB (draft $DVOCAB), length $LEN, batch $BATCH, 3 TTT steps," \
     "fp32; $RUNS runs x $STEPS steps ($WARMUP warm-up) per side, $THREADS threads each" >&2
"$EK" synth --out "$DIR/data" --conversations "$CONV" --hidden "$HIDDEN" --vocab "$VOCAB" \
  --min-tokens $((LEN / 2)) --max-tokens $((LEN * 3 / 2)) --dtype bf16 --jobs "$JOBS" --base-out "$DIR/base" >/dev/null
"$EK" index "$DIR/data" --out "$DIR/index.eki" --jobs "$JOBS" >/dev/null 2>&1
COMMON=(--data "$DIR/data/conversations.jsonl" --index "$DIR/index.eki" --base "$DIR/base"
        --max-length "$LEN" --batch-size "$BATCH" --draft-vocab-size "$DVOCAB" --no-shuffle
        --schedule constant --lr 1e-3 --grad-clip 1.0 --threads "$THREADS" --jobs "$JOBS"
        --eval-every -1 --log-every 1 --no-progress)
# The shared starting point: a fresh draft saved before any real update (lr ~ 0).
"$EK" train "${COMMON[@]}" "${ARCH[@]}" --out "$DIR/init" --max-steps 1 --lr 1e-30 --export-dtype float32 >/dev/null 2>&1
INIT="$DIR/init/final"

# The load, when asked: started after the data and the starting draft, so both sides meet the
# same busy cores in every run.
for _ in $(seq 1 "$BUSY"); do
  bash -c 'while :; do :; done' &
  BUSY_PIDS+=($!)
done
[ "$BUSY" -gt 0 ] && echo "beside $BUSY busy loop(s)" >&2

for r in $(seq 1 "$RUNS"); do
  rm -rf "$DIR/ours"
  "$EK" train "${COMMON[@]}" "${ADAPT[@]}" --init-draft "$INIT" --out "$DIR/ours" --max-steps "$STEPS" --json >"$DIR/ours.json" 2>"$DIR/ours.err" \
    || { cat "$DIR/ours.err" >&2; exit 1; }
  cp "$DIR/ours/metrics.jsonl" "$DIR/ours-$r.jsonl"
  "$PY" bench/bench_train.py --data "$DIR/data/conversations.jsonl" --records "$DIR/data/records" --draft "$INIT" \
    --base "$DIR/base" --max-length "$LEN" --batch-size "$BATCH" --steps "$STEPS" --threads "$THREADS" \
    --lr 1e-3 --grad-clip 1.0 --warmup "$WARMUP" >"$DIR/python-$r.json"
  echo "run $r/$RUNS done" >&2
done

"$PY" - "$DIR" "$RUNS" "$WARMUP" "$THREADS" "$JSON_OUT" "$BUSY" <<'EOF'
import json, statistics as st, sys
d, runs, w, threads, json_out, busy = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], int(sys.argv[6])
ours, py = [], []
for r in range(1, runs + 1):
    lines = [json.loads(l) for l in open(f"{d}/ours-{r}.jsonl") if l.strip()]
    lines = [l for l in lines if "split" not in l]
    steps = [l for l in lines if l["step"] > w]
    tok = [l["tokens_per_s"] * l["step_ms"] / 1e3 for l in steps]
    ours.append({
        "tps": st.median(t / ((l["step_ms"] - l["loader_wait_ms"]) / 1e3) for t, l in zip(tok, steps)),
        "tps_e2e": st.median(l["tokens_per_s"] for l in steps),
        "overall": sum(tok) / sum((l["step_ms"] - l["loader_wait_ms"]) / 1e3 for l in steps),
        "cpu": st.median(l["cpu_ms"] / 1e3 for l in steps),
        "tpc": st.median(t / (l["cpu_ms"] / 1e3) for t, l in zip(tok, steps)),
        "wait": st.median(l["loader_wait_ms"] / l["step_ms"] for l in steps),
        "wait_ms": st.median(l["loader_wait_ms"] for l in steps),
        "step_ms": st.median(l["step_ms"] for l in steps),
        "loss1": lines[0]["loss"]})
    p = json.load(open(f"{d}/python-{r}.json"))
    py.append({"tps": p["tokens_per_s_median"], "cpu": p["cpu_s_median"], "tpc": p["tokens_per_cpu_s_median"],
               "overall": p["tokens_per_s_overall"],
               "loss1": p["losses"][0]})
m = lambda xs, k: st.median(x[k] for x in xs)
print(f"per run (median over steps > {w}):")
for r, (o, p) in enumerate(zip(ours, py), 1):
    print(f"  run {r}: eaglekit {o['tps']:8.0f} tok/s {o['cpu']:7.3f} CPU-s/step | "
          f"PyTorch {p['tps']:8.0f} tok/s {p['cpu']:7.3f} CPU-s/step")
print(f"medians over {runs} runs, {threads} threads each, data loading excluded on both sides:")
print(f"  eaglekit train    {m(ours, 'tps'):9.0f} tokens/s  {m(ours, 'cpu'):7.3f} CPU-s/step  {m(ours, 'tpc'):8.0f} tokens/CPU-s"
      f"  step-1 loss {ours[0]['loss1']:.6f}")
print(f"  PyTorch (Python)  {m(py, 'tps'):9.0f} tokens/s  {m(py, 'cpu'):7.3f} CPU-s/step  {m(py, 'tpc'):8.0f} tokens/CPU-s"
      f"  step-1 loss {py[0]['loss1']:.6f}")
print(f"  ratio eaglekit / PyTorch: {m(ours, 'tps') / m(py, 'tps'):.2f}x tokens/s (wall), "
      f"{m(ours, 'tpc') / m(py, 'tpc'):.2f}x tokens per CPU-second")
print(f"  overall (all timed tokens / all timed seconds, median over runs): eaglekit {m(ours, 'overall'):.0f}, "
      f"PyTorch {m(py, 'overall'):.0f} tokens/s, ratio {m(ours, 'overall') / m(py, 'overall'):.2f}x")
print(f"eaglekit with data loading: {m(ours, 'tps_e2e'):.0f} tokens/s end to end; waited for data "
      f"{m(ours, 'wait_ms'):.2f} ms of a {m(ours, 'step_ms'):.0f} ms step = {100 * m(ours, 'wait'):.3f}% (median)")
if json_out:
    json.dump({"threads": threads, "busy": busy, "runs": runs,
               "eaglekit": {"tokens_per_s": m(ours, "tps"), "overall": m(ours, "overall"), "loss1": ours[0]["loss1"]},
               "pytorch": {"tokens_per_s": m(py, "tps"), "overall": m(py, "overall"), "loss1": py[0]["loss1"]}},
              open(json_out, "w"), indent=1)
EOF
