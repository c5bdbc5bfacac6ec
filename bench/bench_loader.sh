#!/usr/bin/env bash
# Loader benchmark, side by side on one synthetic dataset of .pt records, page cache warm:
#   (a) `eaglekit loader-bench`: the TBB loader producing padded (reference) batches;
#   (b) the Python reference pipeline: tests/lib/reference_loader.py (a port of ModelOpt's
#       OfflineSupervisedDataset + DataCollatorForOffline: torch.load per sample, zero padding
#       to max_length, torch.stack) driven by torch.utils.data.DataLoader(num_workers=2) in
#       Debian's python3-torch, same batch size, same max length, same batches;
#   (c) the raw-read limit: `cat` of the same files to /dev/null.
# max_length is the largest token count, so every byte of every record is read by all three.
# Prints medians (of --runs) and the ratios: loader/Python samples/s (target >= 5) and
# cat time / loader time (target >= 0.5, i.e. within 2x of the raw read). CPU seconds (user +
# system, all threads and worker processes) are printed too: on a shared, loaded machine wall
# times mostly measure the other tenants, CPU time what each pipeline costs.
#
# usage: bench/bench_loader.sh [--conversations N] [--hidden H] [--min-tokens A]
#                              [--max-tokens B] [--batch-size S] [--jobs J] [--runs R]
#                              [--dir DIR] [--keep]
#   defaults: 200 conversations, H=1024 (3 aux layers, bf16: 8 KiB/token), 256..1024 tokens,
#   batch 8, all cores, 3 runs.
# The build dir is $EAGLEKIT_BUILD_DIR (default build/); eaglekit is built if missing.
set -euo pipefail
cd "$(dirname "$0")/.."

N=200 HIDDEN=1024 MIN_T=256 MAX_T=1024 BATCH=8 JOBS=0 RUNS=3 DIR="" KEEP=0
while [ $# -gt 0 ]; do
  case "$1" in
    --conversations) N=$2; shift 2 ;;
    --hidden) HIDDEN=$2; shift 2 ;;
    --min-tokens) MIN_T=$2; shift 2 ;;
    --max-tokens) MAX_T=$2; shift 2 ;;
    --batch-size) BATCH=$2; shift 2 ;;
    --jobs) JOBS=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --dir) DIR=$2; KEEP=1; shift 2 ;;
    --keep) KEEP=1; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "bench_loader.sh: unknown option $1" >&2; exit 2 ;;
  esac
done

PY=/usr/bin/python3
BUILD=${EAGLEKIT_BUILD_DIR:-build}
EK="$BUILD/bin/eaglekit"
if [ ! -x "$EK" ]; then
  [ -f "$BUILD/build.ninja" ] || cmake -S . -B "$BUILD" -G Ninja >/dev/null
  ninja -C "$BUILD" eaglekit >/dev/null
fi

if [ -z "$DIR" ]; then DIR=$(mktemp -d /tmp/eaglekit-bench-loader.XXXXXX); fi
cleanup() { if [ "$KEEP" = 0 ]; then rm -rf "$DIR"; fi; }
trap cleanup EXIT
mkdir -p "$DIR"
CONV="$DIR/conversations.jsonl"
INDEX="$DIR/index.ekidx"

if [ ! -f "$CONV" ]; then
  echo "generating $N records (H=$HIDDEN, $MIN_T..$MAX_T tokens, bf16) in $DIR" >&2
  "$EK" synth --out "$DIR" --conversations "$N" --hidden "$HIDDEN" --min-tokens "$MIN_T" \
    --max-tokens "$MAX_T" --dtype bf16 --seed 1 >/dev/null
fi
[ -f "$INDEX" ] || "$EK" index "$DIR/records" --out "$INDEX" >/dev/null

mapfile -t FILES < <(find "$DIR/records" -name '*.pt' | sort)
TOTAL=$(du -cb "${FILES[@]}" | tail -1 | cut -f1)
cat "${FILES[@]}" >/dev/null  # warm the page cache
echo "dataset: ${#FILES[@]} files, $TOTAL bytes; batch $BATCH, max length $MAX_T, pad mode;" \
     "$RUNS runs each; cores: $(nproc), load average: $(cut -d' ' -f1-3 /proc/loadavg)"

median() { sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
json() { "$PY" -c "import json,sys; print(json.load(sys.stdin)[sys.argv[1]])" "$1"; }

ours_sps=() ours_s=() ours_cpu=() ours_wait=() py_sps=() py_cpu=() cat_s=() cat_cpu=()
for ((r = 0; r < RUNS; r++)); do
  out=$("$EK" loader-bench --data "$CONV" --index "$INDEX" --split all --batch-size "$BATCH" \
        --max-length "$MAX_T" --jobs "$JOBS" --json 2>/dev/null)
  ours_sps+=("$(json samples_per_s <<<"$out")")
  ours_s+=("$(json seconds <<<"$out")")
  ours_cpu+=("$(json cpu_s <<<"$out")")
  ours_wait+=("$(json wait_ms_per_batch <<<"$out")")
  out=$("$PY" tests/lib/reference_loader.py bench --data "$CONV" --records "$DIR/records" \
        --split all --batch-size "$BATCH" --max-length "$MAX_T" --workers 2)
  py_sps+=("$(json samples_per_s <<<"$out")")
  py_cpu+=("$(json cpu_s <<<"$out")")
  t=$( { /usr/bin/time -f "%e %U %S" cat "${FILES[@]}" >/dev/null; } 2>&1 )
  read -r e u s <<<"$t"
  cat_s+=("$e")
  cat_cpu+=("$(awk "BEGIN { print $u + $s }")")
done

O_SPS=$(printf '%s\n' "${ours_sps[@]}" | median)
O_S=$(printf '%s\n' "${ours_s[@]}" | median)
O_CPU=$(printf '%s\n' "${ours_cpu[@]}" | median)
O_WAIT=$(printf '%s\n' "${ours_wait[@]}" | median)
P_SPS=$(printf '%s\n' "${py_sps[@]}" | median)
P_CPU=$(printf '%s\n' "${py_cpu[@]}" | median)
C_S=$(printf '%s\n' "${cat_s[@]}" | median)
C_CPU=$(printf '%s\n' "${cat_cpu[@]}" | median)
awk -v osps="$O_SPS" -v os="$O_S" -v oc="$O_CPU" -v ow="$O_WAIT" -v psps="$P_SPS" -v pc="$P_CPU" \
    -v cs="$C_S" -v cc="$C_CPU" -v total="$TOTAL" -v n="${#FILES[@]}" 'BEGIN {
  printf "%-44s %10s %12s %8s\n", "", "samples/s", "MB/s (files)", "CPU s"
  printf "%-44s %10.1f %12.1f %8.2f   (consumer wait %.2f ms/batch)\n", "eaglekit loader-bench", osps, total / os / 1e6, oc, ow
  printf "%-44s %10.1f %12.1f %8.2f\n", "Python reference, DataLoader(num_workers=2)", psps, total * psps / n / 1e6, pc
  printf "%-44s %10.1f %12.1f %8.2f\n", "cat (raw read)", n / cs, total / cs / 1e6, cc
  printf "ratio loader / Python, samples/s: %.2fx (target >= 5); CPU per sample: %.2fx less\n", osps / psps, (oc > 0 ? pc / oc : 0)
  printf "ratio cat time / loader time:     %.2f (target >= 0.5: within 2x of the raw read); CPU: loader %.2fx cat\n", cs / os, (cc > 0 ? oc / cc : 0)
}'
