#!/usr/bin/env bash
# Training throughput: `eaglekit train` against a PyTorch implementation of the same draft,
# TTT unroll, loss and optimizer (bench/bench_train.py), on the same synthetic data, the
# same starting weights, the same batches (reference order, pad collation) and the same
# number of threads (--threads / torch.set_num_threads), one run each, side by side.
#
# Prints tokens/s (median over the steps after --warmup) of both, their ratio, the step-1
# loss of both (equal: it is the same computation), and the share of eaglekit's step time
# spent waiting for data (the loader reads, decodes and collates on its own threads; Python
# is timed on batches already in memory, which favours it).
#
# usage: bench/bench_train.sh [--hidden 256] [--vocab 4096] [--draft-vocab 2048]
#                             [--max-length 256] [--batch-size 4] [--steps 20] [--threads N]
#                             [--jobs 2] [--dir DIR]
#   --threads defaults to nproc; --jobs is eaglekit's loader threads.
# The build dir is $EAGLEKIT_BUILD_DIR (default build/); eaglekit is built if missing.
set -euo pipefail
cd "$(dirname "$0")/.."

HIDDEN=256 VOCAB=4096 DVOCAB=2048 LEN=256 BATCH=4 STEPS=20 THREADS=$(nproc) JOBS=2 DIR="" WARMUP=2
while [ $# -gt 0 ]; do
  case "$1" in
    --hidden) HIDDEN=$2; shift 2 ;;
    --vocab) VOCAB=$2; shift 2 ;;
    --draft-vocab) DVOCAB=$2; shift 2 ;;
    --max-length) LEN=$2; shift 2 ;;
    --batch-size) BATCH=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --jobs) JOBS=$2; shift 2 ;;
    --dir) DIR=$2; shift 2 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "bench_train.sh: unknown option $1" >&2; exit 2 ;;
  esac
done

PY=/usr/bin/python3
BUILD=${EAGLEKIT_BUILD_DIR:-build}
if [ ! -x "$BUILD/bin/eaglekit" ]; then
  [ -f "$BUILD/build.ninja" ] || cmake -S . -B "$BUILD" -G Ninja >/dev/null
  ninja -C "$BUILD" eaglekit >/dev/null
fi
EK="$BUILD/bin/eaglekit"
CLEAN=0
if [ -z "$DIR" ]; then DIR=$(mktemp -d /tmp/eaglekit-bench-train.XXXXXX); CLEAN=1; fi
trap '[ "$CLEAN" = 1 ] && rm -rf "$DIR"' EXIT

# Enough conversations that STEPS batches never wrap around the train split.
CONV=$(( (STEPS * BATCH * 100 + 94) / 95 + 2 ))
echo "data: $CONV conversations, H=$HIDDEN, V=$VOCAB (draft $DVOCAB), length $LEN, batch $BATCH, $STEPS steps, $THREADS threads" >&2
"$EK" synth --out "$DIR/data" --conversations "$CONV" --hidden "$HIDDEN" --vocab "$VOCAB" \
  --min-tokens $((LEN / 2)) --max-tokens $((LEN * 3 / 2)) --dtype bf16 --jobs "$JOBS" --base-out "$DIR/base" >/dev/null
"$EK" index "$DIR/data" --out "$DIR/index.eki" --jobs "$JOBS" >/dev/null 2>&1
COMMON=(--data "$DIR/data/conversations.jsonl" --index "$DIR/index.eki" --base "$DIR/base"
        --max-length "$LEN" --batch-size "$BATCH" --draft-vocab-size "$DVOCAB" --no-shuffle
        --schedule constant --lr 1e-3 --grad-clip 1.0 --threads "$THREADS" --jobs "$JOBS"
        --eval-every -1 --log-every 1 --no-progress)
# The shared starting point: a fresh draft saved before any real update (lr ~ 0).
"$EK" train "${COMMON[@]}" --out "$DIR/init" --max-steps 1 --lr 1e-30 --export-dtype float32 >/dev/null 2>&1
INIT="$DIR/init/final"

"$EK" train "${COMMON[@]}" --init-draft "$INIT" --out "$DIR/ours" --max-steps "$STEPS" --json >"$DIR/ours.json" 2>"$DIR/ours.err" \
  || { cat "$DIR/ours.err" >&2; exit 1; }
"$PY" bench/bench_train.py --data "$DIR/data/conversations.jsonl" --records "$DIR/data/records" --draft "$INIT" \
  --base "$DIR/base" --max-length "$LEN" --batch-size "$BATCH" --steps "$STEPS" --threads "$THREADS" \
  --lr 1e-3 --grad-clip 1.0 --warmup "$WARMUP" >"$DIR/python.json"

"$PY" - "$DIR/ours/metrics.jsonl" "$DIR/ours.json" "$DIR/python.json" "$WARMUP" <<'EOF'
import json, statistics, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip() and "split" not in l]
ours = json.load(open(sys.argv[2]))
py = json.load(open(sys.argv[3]))
w = int(sys.argv[4])
steps = [l for l in lines if l["step"] > w]
ours_tps = statistics.median(l["tokens_per_s"] for l in steps)
wait = statistics.median(l["data_wait_share"] for l in steps)
print(f"eaglekit train   {ours_tps:10.0f} tokens/s (median of {len(steps)} steps)  step-1 loss {lines[0]['loss']:.6f}")
print(f"PyTorch (Python) {py['tokens_per_s_median']:10.0f} tokens/s (median)                step-1 loss {py['losses'][0]:.6f}")
print(f"ratio eaglekit / PyTorch: {ours_tps / py['tokens_per_s_median']:.2f}x   ({py['threads']} threads each)")
print(f"eaglekit data wait: {100 * wait:.1f}% of step time (median), {100 * ours['data_wait_share']:.1f}% over the run")
EOF
