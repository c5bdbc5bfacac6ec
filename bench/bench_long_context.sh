#!/usr/bin/env bash
# Long-context training benchmark (issue #16), side by side in one run: for each TTT step
# count S and row length L, a training step (forward, backward, clip, AdamW) of the same
# synthetic draft on the same rows by
#   tiled        eaglekit, --ttt-attention tiled (ttt_attention_flash, O(L) memory)
#   fused        eaglekit, --ttt-attention fused (ttt_attention_fused: LibTorch's fused SDPA
#                kernels, O(L) memory; a build against LibTorch >= 2.5: EAGLEKIT_BUILD_DIR=build-torch2)
#   local        eaglekit, --ttt-attention local (the explicit-mask path, O(L^2) memory)
#   eager-sdpa   bench/bench_train.py --synthetic --attention sdpa: PyTorch eager, one
#                scaled_dot_product_attention per step over the full TTT mask (torch >= 2.0;
#                older torch runs its masked matmul and the table says so)
#   eager-matmul bench/bench_train.py --synthetic --attention matmul: the masked matmul
#   dflash       eaglekit, a DFlash draft's training step on the same rows (bench_long_context
#                --draft dflash: one layer per aux layer, --block-size 8, --anchors 512 per row,
#                the base's full-vocabulary lm_head; docs/dflash.md). Another model: no first-loss
#                check and no tiled ratio; it runs at the first --ttt-steps value only (it has none)
# each cell in its own process (bench/bench_long_context.cpp's header defines the model and
# the rows; both sides draw them identically, so their first-step losses must agree).
#
# Per cell: tokens/s (median over the timed steps after --warmup), peak memory (CUDA: the
# caching allocator's max allocated bytes, weights and AdamW state included; CPU: eaglekit's
# allocator peak and, for every implementation, the growth of peak RSS), and the model FLOPs
# of docs/benchmarks.md ("Counting FLOPs") as MFU against --peak-tflops (default 989, an
# H200's dense bf16, on CUDA; on the CPU achieved GFLOP/s unless --peak-tflops is given).
# Ratios: tiled / eager and tiled / local tokens/s. A cell that runs out of memory reports
# OOM, one that passes --cell-seconds TIMEOUT, and that implementation then skips the
# lengths from there on up (the lengths run in the order given, so the ones that matter most
# can go first); cells not started within --deadline seconds are SKIPPED. Exit 1 when a first-step
# loss disagrees with the tiled one (relative 1e-5 in fp32, 1e-2 in bf16) or a cell fails.
#
# usage: bench/bench_long_context.sh [--preset small|8b|tiny] [--lengths 256,512,1024]
#          [--ttt-steps 7] (a list: 3,7) [--batch-size 1] [--device cpu|cuda] [--dtype fp32|bf16]
#          [--impls tiled,local,eager-sdpa] (also fused, eager-matmul; tiled-recompute: tiled with
#          train's --recompute) [--steps 3] [--warmup 1]
#          [--cell-seconds 300] [--deadline 0 (none)] [--threads 0] [--peak-tflops X]
#          [--block-size 8] [--anchors 512] (dflash)
#          [--out DIR] [--python PY] [--no-build] [--hidden H --heads N --kv-heads K --head-dim D
#          --intermediate I --vocab V --draft-vocab Vd --aux-layers k] (override the preset)
# Presets: small H 256, 4/1 heads x 64, I 768, V 2048, Vd 1024; 8b H 4096, 32/8 heads x 128,
# I 14336, V 128256, Vd 32000; tiny H 64, 4/1 x 16, I 128, V 512, Vd 256; all k = 3.
# --dtype defaults to bf16 on CUDA, fp32 on the CPU. Results: DIR/cells.jsonl (one line per
# cell), DIR/summary.md and DIR/summary.json, DIR/logs/ (each cell's stderr); DIR defaults
# to a temporary folder that is removed. The build dir is $EAGLEKIT_BUILD_DIR (default build/);
# bench_long_context is built there first unless --no-build.
# OMP_WAIT_POLICY=passive unless set. Exit status 0, 1 (runtime error, loss mismatch, a
# failed cell), 2 (usage).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,44p' "$0" | sed 's/^# \{0,1\}//'; }
die_usage() { echo "bench_long_context.sh: $1" >&2; exit 2; }

PRESET=small LENGTHS="" SSTEPS=7 BATCH=1 DEVICE=cpu DTYPE="" IMPLS="tiled,local,eager-sdpa" STEPS=3 WARMUP=1
CELL_S=300 DEADLINE=0 THREADS=0 PEAK="" OUT="" PY="" BUILD_IT=1 BLOCK=8 ANCHORS=512
declare -A OVR=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --no-build) BUILD_IT=0; shift ;;
    --preset|--lengths|--ttt-steps|--batch-size|--device|--dtype|--impls|--steps|--warmup|--cell-seconds|\
    --deadline|--threads|--peak-tflops|--out|--python|--hidden|--heads|--kv-heads|--head-dim|--intermediate|\
    --vocab|--draft-vocab|--aux-layers|--block-size|--anchors)
      [ $# -ge 2 ] || die_usage "$1 needs a value"
      case "$1" in
        --preset) PRESET=$2 ;; --lengths) LENGTHS=$2 ;; --ttt-steps) SSTEPS=$2 ;; --batch-size) BATCH=$2 ;;
        --device) DEVICE=$2 ;; --dtype) DTYPE=$2 ;; --impls) IMPLS=$2 ;; --steps) STEPS=$2 ;;
        --warmup) WARMUP=$2 ;; --cell-seconds) CELL_S=$2 ;; --deadline) DEADLINE=$2 ;; --threads) THREADS=$2 ;;
        --peak-tflops) PEAK=$2 ;; --out) OUT=$2 ;; --python) PY=$2 ;;
        --block-size) BLOCK=$2 ;; --anchors) ANCHORS=$2 ;;
        *) OVR[${1#--}]=$2 ;;
      esac
      shift 2 ;;
    *) die_usage "unknown option $1 (--help lists them)" ;;
  esac
done

case "$PRESET" in
  small) SHAPE=(256 4 1 64 768 2048 1024 3); DEF_LENGTHS=256,512,1024 ;;
  8b) SHAPE=(4096 32 8 128 14336 128256 32000 3); DEF_LENGTHS=2048,8192,16384,32768 ;;
  tiny) SHAPE=(64 4 1 16 128 512 256 3); DEF_LENGTHS=64,128 ;;
  *) die_usage "--preset takes small, 8b or tiny, not '$PRESET'" ;;
esac
NAMES=(hidden heads kv-heads head-dim intermediate vocab draft-vocab aux-layers)
for i in "${!NAMES[@]}"; do
  v=${OVR[${NAMES[$i]}]:-${SHAPE[$i]}}
  [[ "$v" =~ ^[0-9]+$ ]] || die_usage "--${NAMES[$i]} takes a positive integer, not '$v'"
  SHAPE[$i]=$v
done
LENGTHS=${LENGTHS:-$DEF_LENGTHS}
case "$DEVICE" in cpu|cuda|cuda:*) ;; *) die_usage "--device takes cpu, cuda or cuda:N, not '$DEVICE'" ;; esac
[ -n "$DTYPE" ] || { [ "$DEVICE" = cpu ] && DTYPE=fp32 || DTYPE=bf16; }
case "$DTYPE" in fp32|bf16) ;; *) die_usage "--dtype takes fp32 or bf16, not '$DTYPE'" ;; esac
for list in "$LENGTHS" "$SSTEPS"; do
  [[ "$list" =~ ^[0-9]+(,[0-9]+)*$ ]] || die_usage "'$list' is not a comma-separated list of integers"
done
for n in "$BATCH" "$STEPS" "$WARMUP" "$CELL_S" "$DEADLINE" "$THREADS" "$BLOCK" "$ANCHORS"; do
  [[ "$n" =~ ^[0-9]+$ ]] || die_usage "'$n' is not a non-negative integer"
done
[ -z "$PEAK" ] || [[ "$PEAK" =~ ^[0-9]+([.][0-9]+)?$ ]] || die_usage "--peak-tflops takes a number, not '$PEAK'"
IFS=, read -r -a IMPL_LIST <<<"$IMPLS"
for m in "${IMPL_LIST[@]}"; do
  case "$m" in tiled|tiled-recompute|fused|local|eager-sdpa|eager-matmul|dflash) ;; *) die_usage "--impls: unknown implementation '$m'" ;; esac
done

# A Python with torch: --python, else python3, else /usr/bin/python3.
if [ -z "$PY" ]; then
  for c in python3 /usr/bin/python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import torch' >/dev/null 2>&1; then PY=$c; break; fi
  done
  [ -n "$PY" ] || { echo "bench_long_context.sh: no python3 with torch found (--python PY)" >&2; exit 1; }
fi
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
BUILD=${EAGLEKIT_BUILD_DIR:-build}
if [ "$BUILD_IT" = 1 ]; then
  if [ ! -f "$BUILD/build.ninja" ]; then cmake -S . -B "$BUILD" -G Ninja >/dev/null; fi
  cmake --build "$BUILD" --target bench_long_context >/dev/null
fi
[ -x "$BUILD/bin/bench_long_context" ] || { echo "bench_long_context.sh: no $BUILD/bin/bench_long_context" >&2; exit 1; }
CLEAN=0
if [ -z "$OUT" ]; then OUT=$(mktemp -d /tmp/eaglekit-bench-long.XXXXXX); CLEAN=1; fi
trap '[ "$CLEAN" = 1 ] && rm -rf "$OUT"' EXIT
mkdir -p "$OUT/logs"
: >"$OUT/cells.jsonl"

COMMON=(--batch-size "$BATCH" --hidden "${SHAPE[0]}" --heads "${SHAPE[1]}" --kv-heads "${SHAPE[2]}"
        --head-dim "${SHAPE[3]}" --intermediate "${SHAPE[4]}" --vocab "${SHAPE[5]}" --draft-vocab "${SHAPE[6]}"
        --aux-layers "${SHAPE[7]}" --device "$DEVICE" --dtype "$DTYPE" --steps "$STEPS" --warmup "$WARMUP"
        --threads "$THREADS")
echo "bench_long_context: preset $PRESET (H ${SHAPE[0]}, ${SHAPE[1]}/${SHAPE[2]} heads x ${SHAPE[3]}, I ${SHAPE[4]}," \
     "V ${SHAPE[5]}, Vd ${SHAPE[6]}, k ${SHAPE[7]}), batch $BATCH, S $SSTEPS, L $LENGTHS, $DEVICE $DTYPE," \
     "implementations $IMPLS; $("$PY" -c 'import torch; print("torch", torch.__version__)')" >&2

start=$(date +%s)
declare -A FAILED_AT=() FAILED_L=()  # the first failure per implementation and S, and its length
IFS=, read -r -a S_LIST <<<"$SSTEPS"
IFS=, read -r -a L_LIST <<<"$LENGTHS"
for s in "${S_LIST[@]}"; do
  for l in "${L_LIST[@]}"; do
    for m in "${IMPL_LIST[@]}"; do
      [ "$m" = dflash ] && [ "$s" != "${S_LIST[0]}" ] && continue  # no TTT steps: the first S only
      cell="{\"impl\": \"$m\", \"length\": $l, \"ttt_steps\": $s"
      if [ -n "${FAILED_AT[$m/$s]:-}" ] && [ "$l" -ge "${FAILED_L[$m/$s]}" ]; then
        echo "$cell, \"status\": \"skip\", \"why\": \"${FAILED_AT[$m/$s]}\"}" >>"$OUT/cells.jsonl"; continue
      fi
      limit=$CELL_S
      if [ "$DEADLINE" -gt 0 ]; then
        left=$(( DEADLINE - ($(date +%s) - start) ))
        if [ "$left" -lt 10 ]; then
          echo "$cell, \"status\": \"skip\", \"why\": \"deadline\"}" >>"$OUT/cells.jsonl"; continue
        fi
        [ "$left" -lt "$limit" ] && limit=$left
      fi
      budget=$(( limit / 3 > 1 ? limit / 3 : 1 ))  # timed steps stop after this many seconds
      case "$m" in
        tiled|local|fused) cmd=("$BUILD/bin/bench_long_context" --attention "$m") ;;
        tiled-recompute) cmd=("$BUILD/bin/bench_long_context" --attention tiled --recompute 1) ;;
        dflash) cmd=("$BUILD/bin/bench_long_context" --draft dflash --block-size "$BLOCK" --anchors "$ANCHORS") ;;
        eager-*) cmd=("$PY" bench/bench_train.py --synthetic --attention "${m#eager-}") ;;
      esac
      log="$OUT/logs/$m-S$s-L$l.log"
      t0=$(date +%s.%N)
      set +e
      line=$(timeout -k 10 "$limit" "${cmd[@]}" "${COMMON[@]}" --ttt-steps "$s" --lengths "$l" --max-seconds "$budget" 2>"$log" | tail -n 1)
      rc=$?
      set -e
      wall=$("$PY" -c "import sys; print(round($(date +%s.%N) - $t0, 1))")
      if [ "$rc" = 0 ] && [ -n "$line" ]; then
        extra=""
        [ "$m" = dflash ] && extra="\"ttt_steps\": $s, "  # the row's S (a DFlash line has none of its own)
        echo "{\"impl\": \"$m\", \"cell_wall_s\": $wall, $extra${line#\{}" >>"$OUT/cells.jsonl"
        case "$line" in *'"status": "oom"'*) FAILED_AT[$m/$s]="oom at L=$l"; FAILED_L[$m/$s]=$l ;; esac
      else
        status=failed
        if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then status=timeout; fi
        if grep -qiE "out of memory|can't allocate|bad_alloc" "$log" || { [ "$rc" = 137 ] && [ "$status" != timeout ]; }; then
          status=oom
        fi
        echo "$cell, \"status\": \"$status\", \"rc\": $rc, \"cell_wall_s\": $wall}" >>"$OUT/cells.jsonl"
        FAILED_AT[$m/$s]="$status at L=$l"; FAILED_L[$m/$s]=$l
        [ "$status" = failed ] && { echo "bench_long_context.sh: $m S=$s L=$l failed (rc $rc); its log:" >&2; tail -n 5 "$log" >&2; }
      fi
      echo "  S=$s L=$l $m: $(tail -n 1 "$OUT/cells.jsonl" | "$PY" -c 'import json,sys; c=json.load(sys.stdin); print(c["status"], "%.0f tok/s" % c["tokens_per_s_median"] if c["status"] == "ok" else c.get("why", ""))')" >&2
    done
  done
done

"$PY" - "$OUT" "$DEVICE" "$DTYPE" "${PEAK}" "$BATCH" "${SHAPE[@]}" <<'EOF'
import json, sys
out, device, dtype, peak, batch = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
H, nh, nkv, hd, I, V, Vd, k = map(int, sys.argv[6:14])
cells = [json.loads(l) for l in open(out + "/cells.jsonl") if l.strip()]
peak_tflops = float(peak) if peak else (989.0 if device.startswith("cuda") else None)

def flops(L, S):
    """Model FLOPs of one training step (docs/benchmarks.md, counting FLOPs)."""
    per_token = 2 * (2 * H * (nh + 2 * nkv) * hd + nh * hd * H + 3 * H * I + H * Vd)  # qkv, o, MLP, lm_head
    total = 0.0
    for s in range(S):
        pairs0 = max(L - s, 0) * (max(L - s, 0) + 1) / 2  # block 0: keys j <= q - s
        chain = sum(max(L - (s - i), 0) for i in range(1, s + 1))  # one key per query and block i >= 1
        total += 3 * (L * per_token + 4 * nh * hd * (pairs0 + chain))
    total += 3 * L * 2 * (k * H) * H  # fc
    total += L * 2 * H * Vd           # the target head (no gradient)
    return batch * total

def dflash_flops(c):
    """Model FLOPs of a DFlash step: the trained parts 3x (forward, backward), the frozen
    lm_head 2x (forward, the input's gradient), the teacher's lm_head 1x; attention counted
    over the keys a block sees (on average half the context before its anchor, and its block)."""
    L, Q, nl, bs = c["length"], c["query_tokens"] / batch, c["draft_layers"], c["block_size"]
    layer = (4 * Q * H * nh * hd + 4 * (L + Q) * H * nkv * hd + 6 * Q * H * I
             + 4 * nh * hd * Q * (L / 2 + bs))
    return batch * (3 * (2 * L * k * H * H + nl * layer) + 3 * 2 * Q * H * V)

def mib(x):
    return None if x is None or x < 0 else x / 2**20

rows = []
by = {(c["impl"], c["ttt_steps"], c["length"]): c for c in cells}
keys = sorted({(c["ttt_steps"], c["length"]) for c in cells})
impls = list(dict.fromkeys(c["impl"] for c in cells))
tol = 1e-5 if dtype == "fp32" else 1e-2
mismatch, failed = [], []
for S, L in keys:
    ref = by.get(("tiled", S, L))
    for m in impls:
        c = by.get((m, S, L))
        if c is None:
            continue
        r = {"impl": m, "S": S, "L": L, "status": c["status"]}
        if c["status"] == "failed":
            failed.append((m, S, L))
        if c["status"] == "ok":
            f = dflash_flops(c) if m == "dflash" else flops(L, S)
            tps = c["tokens_per_s_median"]
            r.update(tokens_per_s=tps, step_s=c["step_s_median"], timed_steps=len(c["step_s"]),
                     first_loss=c["first_loss"], flops_per_step=f, achieved_tflops=f / c["step_s_median"] / 1e12,
                     peak_mib=mib(c.get("peak_bytes")), peak_kind=c.get("peak_kind"),
                     rss_delta_mib=mib(c.get("rss_peak_delta_bytes")), attention_used=c.get("attention_used", c.get("attention")))
            if peak_tflops:
                r["mfu"] = r["achieved_tflops"] / peak_tflops
            if m == "dflash":
                r.update(block_size=c["block_size"], anchors=c["anchors"], query_tokens=c["query_tokens"],
                         draft_layers=c["draft_layers"], context=c["context"])
            elif ref and ref["status"] == "ok" and m != "tiled":
                d = abs(c["first_loss"] - ref["first_loss"]) / max(abs(ref["first_loss"]), 1e-12)
                r["first_loss_rel_diff_vs_tiled"] = d
                if d > tol:
                    mismatch.append((m, S, L, d))
                r["tiled_over_this"] = ref["tokens_per_s_median"] / tps
        else:
            r["why"] = c.get("why", "")
        rows.append(r)

def fmt(x, f):
    return "-" if x is None else f % x

lines = [f"device {device}, {dtype}, batch {batch}; H {H}, heads {nh}/{nkv} x {hd}, I {I}, V {V}, Vd {Vd}, k {k}",
         "", "| S | L | implementation | tokens/s | step s | " + ("MFU" if peak_tflops else "GFLOP/s") +
         " | peak MiB | peak RSS growth MiB | peak KiB/token | tiled ÷ this, tokens/s | first loss | vs tiled |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
for r in rows:
    if r["status"] != "ok":
        lines.append(f"| {r['S']} | {r['L']} | {r['impl']} | {r['status'].upper()} {r.get('why', '')} | | | | | | | | |")
        continue
    perf = "%.1f%%" % (100 * r["mfu"]) if peak_tflops else "%.1f" % (r["achieved_tflops"] * 1e3)
    name = (f"dflash (block {r['block_size']}, {r['anchors']} blocks, {r['draft_layers']} layers)" if r["impl"] == "dflash" else
            r["impl"]) + ("" if r["impl"] == "dflash" or r.get("attention_used") in (None, "tiled", "local", "fused", "matmul", "sdpa", "auto") else
                        " (" + r["attention_used"] + ")")
    lines.append(f"| {r['S']} | {r['L']} | {name} | {r['tokens_per_s']:.0f} | {r['step_s']:.3f} | {perf} | "
                 f"{fmt(r['peak_mib'], '%.1f')} | {fmt(r['rss_delta_mib'], '%.1f')} | "
                 f"{fmt(None if r['peak_mib'] is None else r['peak_mib'] * 1024 / (r['L'] * batch), '%.1f')} | "
                 f"{fmt(r.get('tiled_over_this'), '%.2f')} | {r['first_loss']:.6f} | "
                 f"{fmt(r.get('first_loss_rel_diff_vs_tiled'), '%.1e')} |")
lines.append("")
lines.append("peak MiB: " + ("the CUDA caching allocator's max allocated (weights and AdamW state included)"
                             if device.startswith("cuda") else
                             "eaglekit's CPU allocator peak above what was live at the start (trainer/run/cpu_memory.h); "
                             "peak RSS growth: VmHWM over VmRSS at the start, every implementation"))
lines.append(f"first loss check (relative {tol:g} against tiled): " +
             ("ok" if not mismatch else "MISMATCH " + ", ".join(f"{m} S={S} L={L} {d:.1e}" for m, S, L, d in mismatch)))
text = "\n".join(lines)
open(out + "/summary.md", "w").write(text + "\n")
json.dump({"device": device, "dtype": dtype, "batch": batch, "peak_tflops": peak_tflops,
           "shape": {"hidden": H, "heads": nh, "kv_heads": nkv, "head_dim": hd, "intermediate": I, "vocab": V,
                     "draft_vocab": Vd, "aux_layers": k},
           "rows": rows, "loss_mismatch": mismatch, "failed": failed}, open(out + "/summary.json", "w"), indent=1)
print(text)
sys.exit(1 if mismatch or failed else 0)
EOF
