#!/usr/bin/env bash
# TTT attention on the CPU: local, tiled and (LibTorch >= 2.5) fused in one process on
# the same data, forward + backward of an S-step unroll's attention: time (median, ratio) and
# memory (bytes kept for backward, allocator peak, optionally peak RSS per fresh process).
# usage: bench/bench_ttt_attention.sh [BUILD_DIR] [--lengths 256,512,1024,2048] [--steps 3,7]
#          [--heads 8] [--kv-heads 2] [--head-dim 64] [--reps 3] [--threads N] [--rss]
#          [--variants local,tiled,fused] (default: all the build has; EAGLEKIT_BUILD_DIR=build-torch2 for fused)
# OMP_WAIT_POLICY=passive unless set (docs/benchmarks.md, settings that matter on a CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${EAGLEKIT_BUILD_DIR:-build}
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then BUILD=$1; shift; fi
cmake --build "$BUILD" --target bench_ttt_attention >/dev/null
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
exec "$BUILD/bin/bench_ttt_attention" "$@"
