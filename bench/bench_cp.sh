#!/usr/bin/env bash
# Context parallelism on one long sequence (CPU, Gloo): per-rank peak memory and step time
# at CP = 1, 2, 4, for the TTT attention alone and for the whole draft unroll, with both ring
# pair kernels side by side (tiled, the default, and the dense reference).
# usage: bench/bench_cp.sh [BUILD_DIR] [--length L] [--steps S] [--reps N] [--cp 1,2,4] [--kernels tiled,dense] (--help)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=build
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then BUILD=$1; shift; fi
cmake --build "$BUILD" --target bench_cp >/dev/null
exec "$BUILD/bin/bench_cp" "$@"
