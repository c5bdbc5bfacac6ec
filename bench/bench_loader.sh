#!/usr/bin/env bash
# Loader benchmark, side by side on one synthetic dataset of .pt records, in one run:
#   (a) `eaglekit loader-bench`: the TBB loader producing batches (--mode: pad, the
#       reference's batches, or pack);
#   (b) the Python reference pipeline: tests/lib/reference_loader.py (a port of ModelOpt's
#       OfflineSupervisedDataset + DataCollatorForOffline: torch.load per sample, zero padding
#       to max_length, torch.stack) driven by torch.utils.data.DataLoader(num_workers=2) in
#       Debian's python3-torch, same batch size, same max length, same batches (it has only
#       pad mode: with --mode pack the ratio compares samples delivered);
#   (c) cat of the same files to /dev/null (128 KiB buffer, stays in the CPU cache);
#   (d) a C read loop that reads each file whole into one reused, page-aligned buffer of the
#       largest file's size;
#   (e) the copy-and-pad limit (the target's reference): a C program that reads each file
#       whole (read(2)) into its row of a batch buffer whose rows are the largest file's
#       size and zeroes the rest of every row (pack: files fill rows in order), with as many
#       threads as the loader's --jobs, each reusing its own batch buffer: the same bytes
#       landing in batch memory, padded, as the loader's must, with no checks or decoding.
# max_length is the largest token count, so every record byte is read by all of them (the
# loader skips only the zip directory and pickle bytes it does not need).
# Timing: the loader's clock starts when streaming starts (after LibTorch has loaded and the
# index is read) and stops at the last batch; Python's includes starting its DataLoader
# workers; the C programs' and cat's are the whole process. Prints medians (of --runs) of
# wall and CPU seconds (user + system, all threads and worker processes) and the ratios:
# loader/Python samples/s (target >= 20) and limit time / loader time (target >= 0.8: the
# loader at 0.8x the copy-and-pad limit's speed), in wall time and in CPU time. On a shared,
# loaded machine wall times mostly measure the other tenants; CPU time measures what each
# pipeline costs.
# --cold drops the page cache (echo 3 > /proc/sys/vm/drop_caches, root only) before every
# competitor of every run, so each reads from disk; the default is a warm page cache.
# --epochs E makes every competitor do E passes over the data in one process (the C
# programs and cat get the file list E times; Python keeps its workers between epochs): the
# loader's one-time costs (its batch memory, about prefetch + 2 batches, is fresh memory the
# kernel must zero on first use; threads; the first files) then weigh what they weigh in
# training. --no-python leaves (b) out (its ratio is then not printed).
#
# usage: bench/bench_loader.sh [--conversations N] [--hidden H] [--min-tokens A]
#                              [--max-tokens B] [--batch-size S] [--jobs J] [--runs R]
#                              [--mode pad|pack] [--epochs E] [--cold] [--no-python]
#                              [--dir DIR] [--keep]
#   defaults: 200 conversations, H=1024 (3 aux layers, bf16: 8 KiB/token), 256..1024 tokens,
#   batch 8, pad mode, all cores (the limit gets as many threads), 3 runs.
# The build dir is $EAGLEKIT_BUILD_DIR (default build/); eaglekit is built if missing. The C
# programs are compiled with cc into the data folder.
set -euo pipefail
cd "$(dirname "$0")/.."

N=200 HIDDEN=1024 MIN_T=256 MAX_T=1024 BATCH=8 JOBS=0 RUNS=3 DIR="" KEEP=0 COLD=0 EPOCHS=1 MODE=pad PYTHON=1
while [ $# -gt 0 ]; do
  case "$1" in
    --conversations) N=$2; shift 2 ;;
    --hidden) HIDDEN=$2; shift 2 ;;
    --min-tokens) MIN_T=$2; shift 2 ;;
    --max-tokens) MAX_T=$2; shift 2 ;;
    --batch-size) BATCH=$2; shift 2 ;;
    --jobs) JOBS=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --epochs) EPOCHS=$2; shift 2 ;;
    --dir) DIR=$2; KEEP=1; shift 2 ;;
    --keep) KEEP=1; shift ;;
    --cold) COLD=1; shift ;;
    --mode) MODE=$2; shift 2 ;;
    --no-python) PYTHON=0; shift ;;
    -h|--help) sed -n '2,43p' "$0"; exit 0 ;;
    *) echo "bench_loader.sh: unknown option $1" >&2; exit 2 ;;
  esac
done

case "$MODE" in pad|pack) ;; *) echo "bench_loader.sh: --mode must be pad or pack" >&2; exit 2 ;; esac
PY=/usr/bin/python3
BUILD=${EAGLEKIT_BUILD_DIR:-build}
EK="$BUILD/bin/eaglekit"
if [ ! -x "$EK" ]; then
  [ -f "$BUILD/build.ninja" ] || cmake -S . -B "$BUILD" -G Ninja >/dev/null
  ninja -C "$BUILD" eaglekit >/dev/null
fi

if [ -z "$DIR" ]; then DIR=$(mktemp -d /tmp/eaglekit-bench-loader.XXXXXX); fi
cleanup() { if [ "$KEEP" = 0 ]; then rm -rf "$DIR"; fi; }
trap cleanup EXIT
mkdir -p "$DIR"
CONV="$DIR/conversations.jsonl"
INDEX="$DIR/index.ekidx"

if [ ! -f "$CONV" ]; then
  echo "generating $N records (H=$HIDDEN, $MIN_T..$MAX_T tokens, bf16) in $DIR" >&2
  "$EK" synth --out "$DIR" --conversations "$N" --hidden "$HIDDEN" --min-tokens "$MIN_T" \
    --max-tokens "$MAX_T" --dtype bf16 --seed 1 >/dev/null
fi
[ -f "$INDEX" ] || "$EK" index "$DIR/records" --out "$INDEX" >/dev/null

mapfile -t FILES < <(find "$DIR/records" -name '*.pt' | sort)
TOTAL1=$(du -cb "${FILES[@]}" | tail -1 | cut -f1)
PASSES=()  # the file list EPOCHS times, for cat and the C loop
for ((e = 0; e < EPOCHS; e++)); do PASSES+=("${FILES[@]}"); done
TOTAL=$((TOTAL1 * EPOCHS))
NSAMPLES=$((${#FILES[@]} * EPOCHS))
BATCHES=$(( (${#FILES[@]} + BATCH - 1) / BATCH * EPOCHS ))

# (d): read each file whole into one reused buffer.
RAWREAD="$DIR/raw_read"
if [ ! -x "$RAWREAD" ]; then
  cat >"$DIR/raw_read.c" <<'EOF'
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>
int main(int argc, char** argv) {
  size_t cap = 0;
  for (int i = 1; i < argc; ++i) {
    struct stat st;
    if (stat(argv[i], &st) == 0 && (size_t)st.st_size > cap) cap = (size_t)st.st_size;
  }
  cap = (cap + 4095) / 4096 * 4096 + 4096;
  char* buf = aligned_alloc(4096, cap);
  if (!buf) return 1;
  for (int i = 1; i < argc; ++i) {
    int fd = open(argv[i], O_RDONLY);
    if (fd < 0) { perror(argv[i]); return 1; }
    for (size_t got = 0;;) {
      ssize_t n = read(fd, buf + got, cap - got);
      if (n < 0) { perror(argv[i]); return 1; }
      if (n == 0) break;
      got += (size_t)n;
    }
    close(fd);
  }
  return 0;
}
EOF
  cc -O2 -o "$RAWREAD" "$DIR/raw_read.c"
fi

# (e): the copy-and-pad limit.
READPAD="$DIR/read_pad"
if [ ! -x "$READPAD" ]; then
  cat >"$DIR/read_pad.c" <<'EOF'
/* The copy-and-pad limit: each file read whole (read(2), page cache -> memory) into its row
   of a batch buffer, the rest of every row zeroed, batches of B rows reused per thread, as
   a loader's bytes must land. usage: read_pad pad|pack B THREADS ROWBYTES FILE... */
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
static int pack, B, nfiles;
static size_t row;
static char** files;
static size_t* sizes;
static atomic_int next_batch;
static int nbatches;
static int* batch_start; /* first file of each batch (pack: rows fill greedily in order) */
static size_t read_into(const char* path, char* dst, size_t cap) {
  int fd = open(path, O_RDONLY);
  if (fd < 0) { perror(path); exit(1); }
  size_t got = 0;
  for (;;) {
    ssize_t n = read(fd, dst + got, cap - got);
    if (n < 0) { perror(path); exit(1); }
    if (n == 0 || got + (size_t)n == cap) { got += (size_t)n; break; }
    got += (size_t)n;
  }
  close(fd);
  return got;
}
static void* worker(void* arg) {
  (void)arg;
  char* buf = aligned_alloc(4096, (size_t)B * row);
  if (!buf) exit(1);
  memset(buf, 0, (size_t)B * row);
  for (;;) {
    int b = atomic_fetch_add(&next_batch, 1);
    if (b >= nbatches) break;
    int f = batch_start[b], end = batch_start[b + 1];
    for (int r = 0; r < B; ++r) {
      size_t at = 0;
      while (f < end && at + sizes[f] <= row) {
        at += read_into(files[f], buf + (size_t)r * row + at, row - at);
        ++f;
        if (!pack) break;
      }
      memset(buf + (size_t)r * row + at, 0, row - at);
    }
  }
  free(buf);
  return NULL;
}
int main(int argc, char** argv) {
  if (argc < 6) { fprintf(stderr, "usage: read_pad pad|pack B THREADS ROWBYTES FILE...\n"); return 2; }
  pack = strcmp(argv[1], "pack") == 0;
  B = atoi(argv[2]);
  int threads = atoi(argv[3]);
  row = (size_t)atoll(argv[4]);
  files = argv + 5;
  nfiles = argc - 5;
  sizes = malloc(sizeof(size_t) * (size_t)nfiles);
  batch_start = malloc(sizeof(int) * (size_t)(nfiles + 2));
  for (int i = 0; i < nfiles; ++i) {
    struct stat st;
    if (stat(files[i], &st) != 0) { perror(files[i]); return 1; }
    sizes[i] = (size_t)st.st_size;
    if (sizes[i] > row) { fprintf(stderr, "%s: larger than a row\n", files[i]); return 1; }
  }
  /* Batches: B files (pad), or as many files as fill B rows in order (pack). */
  int i = 0;
  nbatches = 0;
  while (i < nfiles) {
    batch_start[nbatches++] = i;
    for (int r = 0; r < B && i < nfiles; ++r) {
      size_t at = 0;
      while (i < nfiles && at + sizes[i] <= row) {
        at += sizes[i++];
        if (!pack) break;
      }
    }
  }
  batch_start[nbatches] = nfiles;
  if (threads < 1) threads = 1;
  pthread_t t[64];
  if (threads > 64) threads = 64;
  for (int k = 0; k < threads; ++k) pthread_create(&t[k], NULL, worker, NULL);
  for (int k = 0; k < threads; ++k) pthread_join(t[k], NULL);
  return 0;
}
EOF
  cc -O2 -pthread -o "$READPAD" "$DIR/read_pad.c"
fi
ROWBYTES=$(stat -c %s "${FILES[@]}" | sort -n | tail -1)
THREADS=$JOBS
[ "$THREADS" -gt 0 ] || THREADS=$(nproc)

drop_caches() {
  [ "$COLD" = 1 ] || return 0
  sync
  if ! echo 3 >/proc/sys/vm/drop_caches 2>/dev/null; then
    echo "bench_loader.sh: --cold needs to write /proc/sys/vm/drop_caches (root)" >&2
    exit 2
  fi
}
[ "$COLD" = 1 ] || cat "${FILES[@]}" >/dev/null  # warm the page cache
echo "dataset: ${#FILES[@]} files, $TOTAL1 bytes; batch $BATCH, max length $MAX_T, $MODE mode;" \
     "loader jobs: $([ "$JOBS" = 0 ] && echo "all cores" || echo "$JOBS"), limit threads: $THREADS;" \
     "$EPOCHS epoch(s) per run, $RUNS runs each;" \
     "page cache: $([ "$COLD" = 1 ] && echo "dropped before each" || echo warm);" \
     "cores: $(nproc), load average: $(cut -d' ' -f1-3 /proc/loadavg)"

median() { sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
med() { printf '%s\n' "$@" | median; }
json() { "$PY" -c "import json,sys; print(json.load(sys.stdin)[sys.argv[1]])" "$1"; }
# Wall and CPU (user + system) seconds of a whole command: "WALL CPU".
timed() {
  local t e u s
  t=$( { /usr/bin/time -f "%e %U %S" "$@" >/dev/null; } 2>&1 | tail -1 )
  read -r e u s <<<"$t"
  echo "$e $(awk "BEGIN { print $u + $s }")"
}

if [ "$MODE" = pack ]; then
  # Packed rows hold several samples: count one epoch's batches with a first pass (it also
  # warms the loader's files), so every competitor does the same EPOCHS passes.
  PER_EPOCH=$("$EK" loader-bench --data "$CONV" --index "$INDEX" --split all --batch-size "$BATCH" \
              --max-length "$MAX_T" --mode pack --jobs "$JOBS" --batches -1 --json 2>/dev/null | json batches)
  BATCHES=$((PER_EPOCH * EPOCHS))
fi

ours_sps=() ours_s=() ours_cpu=() ours_wait=() py_sps=() py_s=() py_cpu=()
cat_s=() cat_cpu=() raw_s=() raw_cpu=() pad_s=() pad_cpu=()
for ((r = 0; r < RUNS; r++)); do
  drop_caches
  out=$("$EK" loader-bench --data "$CONV" --index "$INDEX" --split all --batch-size "$BATCH" \
        --max-length "$MAX_T" --mode "$MODE" --jobs "$JOBS" --batches "$BATCHES" --json 2>/dev/null)
  ours_sps+=("$(json samples_per_s <<<"$out")")
  ours_s+=("$(json seconds <<<"$out")")
  ours_cpu+=("$(json cpu_s <<<"$out")")
  ours_wait+=("$(json wait_ms_per_batch <<<"$out")")
  if [ "$PYTHON" = 1 ]; then
    drop_caches
    out=$("$PY" tests/lib/reference_loader.py bench --data "$CONV" --records "$DIR/records" \
          --split all --batch-size "$BATCH" --max-length "$MAX_T" --workers 2 --epochs "$EPOCHS")
    py_sps+=("$(json samples_per_s <<<"$out")")
    py_s+=("$(json seconds <<<"$out")")
    py_cpu+=("$(json cpu_s <<<"$out")")
  else
    py_sps+=(0) py_s+=(0) py_cpu+=(0)
  fi
  drop_caches
  read -r e c <<<"$(timed cat "${PASSES[@]}")"
  cat_s+=("$e") cat_cpu+=("$c")
  drop_caches
  read -r e c <<<"$(timed "$RAWREAD" "${PASSES[@]}")"
  raw_s+=("$e") raw_cpu+=("$c")
  drop_caches
  read -r e c <<<"$(timed "$READPAD" "$MODE" "$BATCH" "$THREADS" "$ROWBYTES" "${PASSES[@]}")"
  pad_s+=("$e") pad_cpu+=("$c")
done

awk -v osps="$(med "${ours_sps[@]}")" -v os="$(med "${ours_s[@]}")" -v oc="$(med "${ours_cpu[@]}")" \
    -v ow="$(med "${ours_wait[@]}")" -v psps="$(med "${py_sps[@]}")" -v ps="$(med "${py_s[@]}")" \
    -v pc="$(med "${py_cpu[@]}")" -v cs="$(med "${cat_s[@]}")" -v cc="$(med "${cat_cpu[@]}")" \
    -v rs="$(med "${raw_s[@]}")" -v rc="$(med "${raw_cpu[@]}")" -v total="$TOTAL" \
    -v ls="$(med "${pad_s[@]}")" -v lc="$(med "${pad_cpu[@]}")" -v mode="$MODE" -v threads="$THREADS" \
    -v n="$NSAMPLES" 'BEGIN {
  printf "%-46s %10s %12s %8s %8s\n", "medians", "samples/s", "MB/s (files)", "wall s", "CPU s"
  printf "%-46s %10.1f %12.1f %8.3f %8.3f   (consumer wait %.2f ms/batch)\n", "eaglekit loader-bench, " mode " mode", osps, total / os / 1e6, os, oc, ow
  if (psps > 0) printf "%-46s %10.1f %12.1f %8.3f %8.3f\n", "Python reference, DataLoader(num_workers=2)", psps, total * psps / n / 1e6, ps, pc
  printf "%-46s %10.1f %12.1f %8.3f %8.3f\n", "copy-and-" (mode == "pack" ? "pack" : "pad") " limit, " threads " thread(s)", n / ls, total / ls / 1e6, ls, lc
  printf "%-46s %10.1f %12.1f %8.3f %8.3f\n", "cat (raw read, 128 KiB buffer)", n / cs, total / cs / 1e6, cs, cc
  printf "%-46s %10.1f %12.1f %8.3f %8.3f\n", "C read loop (each file into one buffer)", n / rs, total / rs / 1e6, rs, rc
  if (psps > 0) printf "loader / Python, samples/s:  %.2fx (target >= 20); CPU per sample: %.2fx less\n", osps / psps, (oc > 0 ? pc / oc : 0)
  printf "limit / loader, wall time:   %.2f (target >= 0.8: the loader at 0.8x the copy-and-pad limit)\n", ls / os
  printf "limit / loader, CPU time:    %.2f (the loader uses %.2fx the CPU of the limit)\n", (oc > 0 ? lc / oc : 0), (lc > 0 ? oc / lc : 0)
  printf "cat / loader, wall | CPU:    %.2f | %.2f\n", cs / os, (oc > 0 ? cc / oc : 0)
  printf "C loop / loader, wall | CPU: %.2f | %.2f\n", rs / os, (oc > 0 ? rc / oc : 0)
}'
