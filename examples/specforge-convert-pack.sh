#!/usr/bin/env bash
# A SpecForge dump (scripts/prepare_hidden_states.py: DUMP/rows_A-B/data_{i}.ckpt[.gz],
# named by row, no conversation id inside) -> checked, packed into zstd .eks shards, and
# planned for training.
#
#   DUMP=/data/specforge-dump CONVERSATIONS=/data/sharegpt.jsonl BASE=models/Llama-3.1-8B-Instruct \
#     OUT=/data/eaglekit examples/specforge-convert-pack.sh
#
# Record data_{i} is row i of the dataset SpecForge read: with CONVERSATIONS (that same
# file, in the same order) records match conversations by row; without it every record is
# a sample, in row order. Packing keeps every value (zstd is lossless) and can be rerun
# after an interruption: it continues where it stopped.
set -euo pipefail
cd "$(dirname "$0")/.."

EAGLEKIT=${EAGLEKIT:-build/bin/eaglekit}
: "${DUMP:?set DUMP to the SpecForge output folder}"
: "${OUT:?set OUT to a folder for the index and the shards}"
: "${BASE:?set BASE to the base model folder (its config.json is enough here)}"
JOBS=${JOBS:-0}
mkdir -p "$OUT"

# 1. Index the dump as it is; stats says what it holds (lengths, dtypes, bytes per token).
"$EAGLEKIT" index "$DUMP" --out "$OUT/dump.eki" --jobs "$JOBS"
"$EAGLEKIT" stats --index "$OUT/dump.eki"

# 2. Pack into shards of about 1 GiB (lossless zstd), then check every byte of them.
"$EAGLEKIT" pack "$DUMP" --out "$OUT/shards" --codec zstd --jobs "$JOBS"
"$EAGLEKIT" verify "$OUT/shards"
"$EAGLEKIT" index "$OUT/shards" --out "$OUT/shards.eki" --jobs "$JOBS"

# 3. The plan of a run on the shards: matching, split, draft, steps, memory.
data=()
[ -n "${CONVERSATIONS:-}" ] && data=(--data "$CONVERSATIONS")
"$EAGLEKIT" train "${data[@]}" --index "$OUT/shards.eki" --base "$BASE" --out "$OUT/run" \
  --max-length "${MAX_LENGTH:-2048}" --dry-run "$@"
