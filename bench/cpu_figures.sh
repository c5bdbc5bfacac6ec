#!/usr/bin/env bash
# The CPU figures the README quotes, in one run, each against its competitor side by side:
#   1. the trainer against PyTorch eager on the same draft, data, weights and threads
#      (bench_train.sh) at the shape of issue #30 (hidden 128, V 2048, Vd 1024, length 256,
#      batch 4, 3 TTT steps) and at --max-length 1024;
#   2. the fused CPU kernels against the ATen composites inside one process
#      (bench_train_step --cpu-kernels both, the same shape);
#   3. the loader against the Python reference pipeline (bench_loader.sh);
#   4. the TTT attention kernels, local and fused against tiled (bench_ttt_attention);
#   5. the share of its idle speed each trainer keeps beside one busy loop per thread
#      (bench_under_load.sh: train --adapt-threads against PyTorch eager).
# It first prints the machine: CPU model, cores, vector extensions, load average, LibTorch,
# OpenBLAS's kernel choice and OMP_WAIT_POLICY; then every benchmark's own output; then one
# summary table of the ratios, each beside the README's claim.
#
# Each figure's claim and its floor are written once, in README.md's block "cpu-figures floors"
# after the CPU speed paragraph (bench/cpu_claims.py reads it; ctest cpu_figures_claims checks
# that every claim quoted there is still the README's text).
#
# usage: bench/cpu_figures.sh [--quick | --smoke] [--report-only] [--threads N]
#   --quick        fewer runs and steps (about 3 minutes on 2 cores)
#   --smoke        every benchmark once at its smallest (CI): proves that each still runs and
#                  that the summary still reads its output; its figures are not to be quoted
#   --report-only  exit 0 whatever the ratios (CI); otherwise exit 1 when a figure is under its
#                  floor on this machine. A benchmark that fails exits 1 in both modes.
#   --threads N    LibTorch threads on both sides (default: min(cores, 2), as bench_train.sh)
# The build is $EAGLEKIT_BUILD_DIR (default build/); missing targets are built.
# The machines are shared: read the medians, and the load average printed with them.
set -euo pipefail
cd "$(dirname "$0")/.."

QUICK=0 REPORT_ONLY=0 THREADS=$(nproc)
[ "$THREADS" -gt 2 ] && THREADS=2
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1; shift ;;
    --smoke) QUICK=2; shift ;;
    --report-only) REPORT_ONLY=1; shift ;;
    --threads) THREADS=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "cpu_figures.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

BUILD=${EAGLEKIT_BUILD_DIR:-build}
export EAGLEKIT_BUILD_DIR=$BUILD
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
for t in eaglekit bench_train_step bench_ttt_attention; do
  if [ ! -x "$BUILD/bin/$t" ]; then
    [ -f "$BUILD/build.ninja" ] || cmake -S . -B "$BUILD" -G Ninja >/dev/null
    ninja -C "$BUILD" "$t" >/dev/null
  fi
done
PY=/usr/bin/python3
if [ "$QUICK" = 2 ]; then
  RUNS=1 STEPS=4 RUNS_1K=1 STEPS_1K=3 REPS=1 LOADER_N=16 ATT_REPS=1 RUNS_LOAD=1 STEPS_LOAD=8
elif [ "$QUICK" = 1 ]; then
  RUNS=3 STEPS=8 RUNS_1K=2 STEPS_1K=6 REPS=8 LOADER_N=60 ATT_REPS=3 RUNS_LOAD=1 STEPS_LOAD=40
else
  RUNS=5 STEPS=12 RUNS_1K=3 STEPS_1K=8 REPS=20 LOADER_N=200 ATT_REPS=5 RUNS_LOAD=3 STEPS_LOAD=60
fi
LOG=$(mktemp -d /tmp/eaglekit-cpu-figures.XXXXXX)
trap 'rm -rf "$LOG"' EXIT

[ "$QUICK" = 2 ] && echo "cpu_figures.sh --smoke: each benchmark once at its smallest; the figures below are not measurements"
echo "== machine"
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(nproc) cores"
echo "vector extensions: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|avx512f|avx512_bf16|amx_tile|amx_bf16)$' | tr '\n' ' ')"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "LibTorch: $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo '?') (Python side); eaglekit build $BUILD"
echo "OpenBLAS kernels: $("$PY" -c 'import ctypes; l = ctypes.CDLL("libopenblas.so.0"); l.openblas_get_corename.restype = ctypes.c_char_p; print(l.openblas_get_corename().decode())' 2>/dev/null || echo '?')${OPENBLAS_CORETYPE:+ (OPENBLAS_CORETYPE=$OPENBLAS_CORETYPE)}"
echo "OMP_WAIT_POLICY=$OMP_WAIT_POLICY, $THREADS LibTorch threads per side"

run() {  # name, command...: the output to the terminal and LOG/name
  local name=$1
  shift
  echo
  echo "== $name: $*"
  if ! "$@" 2>&1 | tee "$LOG/$name"; then
    echo "cpu_figures.sh: $name failed" >&2
    exit 1
  fi
}

run train256 bench/bench_train.sh --threads "$THREADS" --runs "$RUNS" --steps "$STEPS"
run train1024 bench/bench_train.sh --threads "$THREADS" --runs "$RUNS_1K" --steps "$STEPS_1K" --max-length 1024
BASE="$LOG/base"
"$BUILD/bin/eaglekit" synth --out "$LOG/synth" --conversations 2 --hidden 128 --vocab 2048 --base-out "$BASE" >/dev/null
run kernels "$BUILD/bin/bench_train_step" --base "$BASE" --draft-vocab 1024 --batch-size 4 --length 256 \
  --threads "$THREADS" --reps "$REPS" --top 0 --cpu-kernels both
run loader bench/bench_loader.sh --conversations "$LOADER_N" --hidden 512 --runs "$RUNS"
run attention "$BUILD/bin/bench_ttt_attention" --lengths 512,2048 --steps 3 --reps "$ATT_REPS" --threads "$THREADS"
run load bench/bench_under_load.sh --passive-both --threads "$THREADS" --runs "$RUNS_LOAD" --steps "$STEPS_LOAD"

# The summary: each figure beside the README's claim for it and its floor (bench/cpu_claims.py).
if ! "$PY" bench/cpu_claims.py summary "$LOG" README.md && [ "$REPORT_ONLY" = 0 ]; then
  exit 1
fi
