#!/usr/bin/env bash
# Train on NNODES machines with NPROC GPUs each, under torchrun. Run this same script on
# every node (NODE_RANK differs); MASTER is a host every node can reach.
#
#   NNODES=2 NPROC=8 NODE_RANK=0 MASTER=node0 examples/torchrun-multinode.sh
#
# Options come from examples/llama-3.1-8b/train.json; flags after it win. With CP > 1 each
# group of CP ranks shares one sequence (context parallelism, docs/context-parallel.md).
# DRY_RUN=1 prints the plan for the whole job (eaglekit train --dry-run, as rank 0 of
# NNODES x NPROC ranks would see it) and exits without starting torchrun: check it first.
set -euo pipefail
cd "$(dirname "$0")/.."

EAGLEKIT=${EAGLEKIT:-build/bin/eaglekit}
CONFIG=${CONFIG:-examples/llama-3.1-8b/train.json}
NNODES=${NNODES:-2}
NPROC=${NPROC:-8}
NODE_RANK=${NODE_RANK:-0}
MASTER=${MASTER:-127.0.0.1}
PORT=${PORT:-29500}
CP=${CP:-1}

args=(train --config "$CONFIG" --cp "$CP" --timeout 1800)
[ -n "${DATA:-}" ] && args+=(--data "$DATA")
[ -n "${INDEX:-}" ] && args+=(--index "$INDEX")
[ -n "${BASE:-}" ] && args+=(--base "$BASE")
[ -n "${OUT:-}" ] && args+=(--out "$OUT")
# A restarted job continues from its newest complete checkpoint.
[ -n "${RESUME:-}" ] && args+=(--resume)

if [ "${DRY_RUN:-0}" = 1 ]; then
  # The torchrun variables of rank 0, so that the plan is for the whole job; nothing joins.
  exec env RANK=0 LOCAL_RANK=0 WORLD_SIZE=$((NNODES * NPROC)) MASTER_ADDR="$MASTER" MASTER_PORT="$PORT" \
    "$EAGLEKIT" "${args[@]}" --dry-run "$@"
fi
exec torchrun --nnodes "$NNODES" --nproc-per-node "$NPROC" --node-rank "$NODE_RANK" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER:$PORT" \
  --no-python "$EAGLEKIT" "${args[@]}" "$@"
