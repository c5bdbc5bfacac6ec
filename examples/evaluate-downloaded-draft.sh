#!/usr/bin/env bash
# Evaluate a draft you did not train here on your own dumps, before serving it: per-step
# accuracy, conditional accuracy and the estimated acceptance length (est_ar) on a split,
# the same figures `train` logs, so that a downloaded draft and one trained here compare.
#
#   DRAFT=drafts/EAGLE3-LLaMA3.1-Instruct-8B BASE=models/Llama-3.1-8B-Instruct \
#     DATA=dumps/conversations.jsonl INDEX=dumps/index.eki examples/evaluate-downloaded-draft.sh
#
# DRAFT is a folder with config.json and the weights: model.safetensors as `eaglekit export`
# or ModelOpt write it, or the EAGLE authors' pytorch_model.bin (docs/export.md). The draft's
# aux layers must be the layers your dump holds, and its vocabulary mapping (d2t) is used as
# it is.
set -euo pipefail
cd "$(dirname "$0")/.."

EAGLEKIT=${EAGLEKIT:-build/bin/eaglekit}
: "${DRAFT:?set DRAFT to the draft folder}"
: "${BASE:?set BASE to the base model folder}"
: "${INDEX:?set INDEX to the dataset index (eaglekit index)}"
data=()
[ -n "${DATA:-}" ] && data=(--data "$DATA")

"$EAGLEKIT" evaluate --draft "$DRAFT" --base "$BASE" "${data[@]}" --index "$INDEX" \
  --split "${SPLIT:-eval}" --ttt-steps "${TTT_STEPS:-7}" --max-length "${MAX_LENGTH:-2048}" \
  --device "${DEVICE:-cpu}" "$@"
