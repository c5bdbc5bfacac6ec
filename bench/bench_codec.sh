#!/usr/bin/env bash
# Codec benchmark: size and single-thread decode speed of raw .pt files, gzip -6 of them,
# .eks zstd at levels 1/3/9 and .eks fp8, side by side on the same data, in one run
# (bench/bench_codec.cpp). Runs on (1) a dataset from `eaglekit synth` (.pt files) and
# (2) bench_codec's built-in heavy-tailed bf16 generator.
#
# usage: bench/bench_codec.sh [--conversations N] [--hidden H] [--min-tokens A]
#                             [--max-tokens B] [--reps R] [--dir DIR]
#   defaults: 24 conversations, H=2048, 256..1024 tokens, 3 aux layers, bf16, 3 reps.
#   --dir   reuse/generate the synth data there (kept); otherwise a temp dir, removed.
# The build dir is $EAGLEKIT_BUILD_DIR (default build/); binaries are built if missing.
set -euo pipefail
cd "$(dirname "$0")/.."

N=24 HIDDEN=2048 MIN_T=256 MAX_T=1024 REPS=3 DIR="" KEEP=0
while [ $# -gt 0 ]; do
  case "$1" in
    --conversations) N=$2; shift 2 ;;
    --hidden) HIDDEN=$2; shift 2 ;;
    --min-tokens) MIN_T=$2; shift 2 ;;
    --max-tokens) MAX_T=$2; shift 2 ;;
    --reps) REPS=$2; shift 2 ;;
    --dir) DIR=$2; KEEP=1; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "bench_codec.sh: unknown option $1" >&2; exit 2 ;;
  esac
done

BUILD=${EAGLEKIT_BUILD_DIR:-build}
if [ ! -x "$BUILD/bin/bench_codec" ] || [ ! -x "$BUILD/bin/eaglekit" ]; then
  [ -f "$BUILD/build.ninja" ] || cmake -S . -B "$BUILD" -G Ninja >/dev/null
  ninja -C "$BUILD" bench_codec eaglekit >/dev/null
fi

if [ -z "$DIR" ]; then DIR=$(mktemp -d /tmp/eaglekit-bench-codec.XXXXXX); fi
cleanup() { if [ "$KEEP" = 0 ]; then rm -rf "$DIR"; fi; }
trap cleanup EXIT
mkdir -p "$DIR"

echo "== eaglekit synth data =="
if [ -z "$(find "$DIR" -name '*.pt' -print -quit)" ]; then
  "$BUILD/bin/eaglekit" synth --out "$DIR" --conversations "$N" --hidden "$HIDDEN" \
    --min-tokens "$MIN_T" --max-tokens "$MAX_T" --dtype bf16 --seed 1 >/dev/null
fi
"$BUILD/bin/bench_codec" --dir "$DIR" --reps "$REPS"

echo
echo "== built-in heavy-tailed bf16 data =="
"$BUILD/bin/bench_codec" --records "$N" --tokens $(( (MIN_T + MAX_T) / 2 )) --hidden "$HIDDEN" --reps "$REPS"
