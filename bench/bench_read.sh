#!/usr/bin/env bash
# Reader benchmark: read every record of one synthetic dataset of .pt files, all bytes
# touched, with (a) eaglekit's reader (bench/bench_read.cpp), (b) torch.load in Debian's
# python3-torch (plus a uint8 sum of every tensor), (c) plain `cat` of the same files to
# /dev/null. The page cache is warmed first, so this measures parsing + memory bandwidth,
# not the disk. Prints medians and ratios.
#
# usage: bench/bench_read.sh [--files N] [--hidden H] [--min-tokens A] [--max-tokens B]
#                            [--reps R] [--dir DIR] [--synth] [--keep]
#   defaults: 200 files, H=1024, 128..1024 tokens, bf16, 5 repetitions.
#   --synth   generate the data with `eaglekit synth` instead of Python torch.save.
#   --dir     reuse/generate the data there (kept); otherwise a temp dir, removed at exit.
# The build dir is $EAGLEKIT_BUILD_DIR (default build/); bench_read is built if missing.
set -euo pipefail
cd "$(dirname "$0")/.."

FILES=200 HIDDEN=1024 MIN_T=128 MAX_T=1024 REPS=5 DIR="" SYNTH=0 KEEP=0
while [ $# -gt 0 ]; do
  case "$1" in
    --files) FILES=$2; shift 2 ;;
    --hidden) HIDDEN=$2; shift 2 ;;
    --min-tokens) MIN_T=$2; shift 2 ;;
    --max-tokens) MAX_T=$2; shift 2 ;;
    --reps) REPS=$2; shift 2 ;;
    --dir) DIR=$2; KEEP=1; shift 2 ;;
    --synth) SYNTH=1; shift ;;
    --keep) KEEP=1; shift ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "bench_read.sh: unknown option $1" >&2; exit 2 ;;
  esac
done

PY=/usr/bin/python3
BUILD=${EAGLEKIT_BUILD_DIR:-build}
if [ ! -x "$BUILD/bin/bench_read" ] || [ "$SYNTH" = 1 -a ! -x "$BUILD/bin/eaglekit" ]; then
  [ -f "$BUILD/build.ninja" ] || cmake -S . -B "$BUILD" -G Ninja >/dev/null
  ninja -C "$BUILD" bench_read $([ "$SYNTH" = 1 ] && echo eaglekit) >/dev/null
fi

if [ -z "$DIR" ]; then DIR=$(mktemp -d /tmp/eaglekit-bench-read.XXXXXX); fi
cleanup() { if [ "$KEEP" = 0 ]; then rm -rf "$DIR"; fi; }
trap cleanup EXIT
mkdir -p "$DIR"

if [ -z "$(find "$DIR" -name '*.pt' -print -quit)" ]; then
  echo "generating $FILES files (H=$HIDDEN, $MIN_T..$MAX_T tokens, bf16) in $DIR" >&2
  if [ "$SYNTH" = 1 ]; then
    "$BUILD/bin/eaglekit" synth --out "$DIR" --conversations "$FILES" --hidden "$HIDDEN" \
      --min-tokens "$MIN_T" --max-tokens "$MAX_T" --dtype bf16 --seed 1 >/dev/null
  else
    "$PY" bench/make_pt_dataset.py "$DIR" "$FILES" "$HIDDEN" "$MIN_T" "$MAX_T"
  fi
fi

mapfile -t PT_FILES < <(find "$DIR" -name '*.pt' | sort)
TOTAL=$(du -cb "${PT_FILES[@]}" | tail -1 | cut -f1)
echo "dataset: ${#PT_FILES[@]} files, $TOTAL bytes; $REPS repetitions each; warm page cache" >&2
cat "${PT_FILES[@]}" >/dev/null  # warm the cache

median() { sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }

# Each method yields one "WALL CPU" line per repetition (CPU = user + system).
# (c) cat, timed by bash's `time` keyword
CAT_LINES=$(
  TIMEFORMAT='%R %U %S'
  for ((r = 0; r < REPS; r++)); do
    { time cat "${PT_FILES[@]}" >/dev/null; } 2>&1 | awk '{print $1, $2 + $3}'
  done
)
# (a) eaglekit
OURS_LINES=$("$BUILD/bin/bench_read" "$DIR" "$REPS" 2>/dev/null |
  sed -n 's/.* in \([0-9.]*\) s wall, \([0-9.]*\) s cpu$/\1 \2/p')
# (b) torch.load (import time excluded; timed inside the process)
TORCH_LINES=$("$PY" bench/torch_load_read.py "$DIR" "$REPS")

wall() { echo "$1" | awk '{print $1}' | median; }
cpu() { echo "$1" | awk '{print $2}' | median; }
OURS=$(wall "$OURS_LINES") TORCH=$(wall "$TORCH_LINES") CAT=$(wall "$CAT_LINES")
OURS_CPU=$(cpu "$OURS_LINES") TORCH_CPU=$(cpu "$TORCH_LINES") CAT_CPU=$(cpu "$CAT_LINES")

echo
printf '%-24s %10s %8s %9s %10s %9s\n' "reader" "wall s" "GB/s" "wall/cat" "cpu s" "cpu/cat"
for row in "eaglekit (bench_read):$OURS:$OURS_CPU" "torch.load (python3):$TORCH:$TORCH_CPU" \
           "cat > /dev/null:$CAT:$CAT_CPU"; do
  IFS=: read -r name t c <<<"$row"
  awk -v n="$name" -v t="$t" -v c="$c" -v b="$TOTAL" -v ct="$CAT" -v cc="$CAT_CPU" \
    'BEGIN {printf "%-24s %10.4f %8.2f %9.2f %10.4f %9.2f\n", n, t, b / t / 1e9, t / ct, c, c / cc}'
done
awk -v a="$TORCH" -v b="$OURS" -v c="$TORCH_CPU" -v d="$OURS_CPU" \
  'BEGIN {printf "\ntorch.load / eaglekit: %.2fx wall, %.2fx cpu (medians of each)\n", a / b, c / d}'
