#!/usr/bin/env bash
# TTT attention on the CPU: ttt_attention_local against ttt_attention_flash in one process on
# the same data, forward + backward of an S-step unroll's attention: time (median, ratio) and
# memory (bytes kept for backward, allocator peak, optionally peak RSS per fresh process).
# usage: bench/bench_ttt_attention.sh [BUILD_DIR] [--lengths 256,512,1024,2048] [--steps 3,7]
#          [--heads 8] [--kv-heads 2] [--head-dim 64] [--reps 3] [--threads N] [--rss]
# OMP_WAIT_POLICY=passive unless set (docs/benchmarks.md, settings that matter on a CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${EAGLEKIT_BUILD_DIR:-build}
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then BUILD=$1; shift; fi
cmake --build "$BUILD" --target bench_ttt_attention >/dev/null
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
exec "$BUILD/bin/bench_ttt_attention" "$@"
