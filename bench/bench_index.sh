#!/usr/bin/env bash
# Index benchmark, one run each on the same data:
#   (a) start-up of the reference (eagle_utils.py): recursive glob of *.pt and a stem -> path
#       map, in Debian's /usr/bin/python3; it opens no file, so it knows nothing of them;
#   (b) `eaglekit index DIR --out X --full`: walks, detects formats by magic bytes and reads
#       every record's header (ids, shapes, dtypes) into an index file;
#   (c) the same `eaglekit index` again, incremental (every file unchanged: stat only);
#   (d) loading the index of (b) (mmap + checksum + hashing every id), median of 5, vs (a);
#   (e) loading an index of --load-entries entries (synthesized directly, as if that many files
#       had been indexed): mmap + header + checksum, then hashing every id (what matching
#       does) and find() of random ids.
# Data: --files small .pt records (T=16, H=64, bf16; ~20 KiB each) in nested folders, page
# cache warm (the generator just wrote them, and (a) runs first and reads the directories).
#
# usage: bench/bench_index.sh [--files N] [--load-entries M] [--jobs J] [--dir DIR] [--keep]
#   defaults: 100000 files, 1000000 entries, all cores.
# The build dir is $EAGLEKIT_BUILD_DIR (default build/); eaglekit and bench_index are built
# if missing.
set -euo pipefail
cd "$(dirname "$0")/.."

FILES=100000 LOAD=1000000 JOBS=0 DIR="" KEEP=0
while [ $# -gt 0 ]; do
  case "$1" in
    --files) FILES=$2; shift 2 ;;
    --load-entries) LOAD=$2; shift 2 ;;
    --jobs) JOBS=$2; shift 2 ;;
    --dir) DIR=$2; KEEP=1; shift 2 ;;
    --keep) KEEP=1; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "bench_index.sh: unknown option $1" >&2; exit 2 ;;
  esac
done

PY=/usr/bin/python3
BUILD=${EAGLEKIT_BUILD_DIR:-build}
if [ ! -x "$BUILD/bin/bench_index" ] || [ ! -x "$BUILD/bin/eaglekit" ]; then
  [ -f "$BUILD/build.ninja" ] || cmake -S . -B "$BUILD" -G Ninja >/dev/null
  ninja -C "$BUILD" bench_index eaglekit >/dev/null
fi

if [ -z "$DIR" ]; then DIR=$(mktemp -d /tmp/eaglekit-bench-index.XXXXXX); fi
cleanup() { if [ "$KEEP" = 0 ]; then rm -rf "$DIR"; fi; }
trap cleanup EXIT
DATA="$DIR/data"
INDEX="$DIR/data.ekidx"

if [ -z "$(find "$DATA" -name '*.pt' -print -quit 2>/dev/null)" ]; then
  echo "generating $FILES .pt files in $DATA" >&2
  "$BUILD/bin/bench_index" gen "$DATA" "$FILES" >/dev/null
fi
echo "cores: $(nproc), load average: $(cut -d' ' -f1-3 /proc/loadavg)"

# (a) the reference's start-up, verbatim in substance (make_eagle_supervised_data_module).
py_out=$("$PY" - "$DATA" <<'EOF'
import sys, time
from pathlib import Path
t0, c0 = time.perf_counter(), time.process_time()
p = Path(sys.argv[1])
all_files = {str(x) for x in p.glob("*.pt")}
all_files |= {str(x) for x in p.glob("**/*.pt")}
conv_id_to_file = {}
for pt_path in all_files:
    name = Path(pt_path).name
    if name.endswith(".pt"):
        conv_id_to_file[name[:-3]] = pt_path
print(len(conv_id_to_file), f"{time.perf_counter() - t0:.6f}", f"{time.process_time() - c0:.6f}")
EOF
)
read -r py_n py_s py_cpu <<< "$py_out"

now() { date +%s.%N; }
calc() { awk "BEGIN { printf \"%.9f\", $1 }"; }
json_get() { "$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$1" "$2"; }
# Runs a command with its stdout going to $1; prints its user+sys CPU seconds (bash `time`).
cpu_of() {
  local out=$1; shift
  { TIMEFORMAT="%U %S"; time "$@" > "$out"; } 2>&1 | awk '{ printf "%.3f", $1 + $2 }'
}
start_cpu=$(cpu_of /dev/null "$BUILD/bin/eaglekit" --version)
# (b) full index, (c) incremental with nothing changed
full_cpu=$(cpu_of "$DIR/full.json" "$BUILD/bin/eaglekit" index "$DATA" --out "$INDEX" --full --jobs "$JOBS" --json)
incr_cpu=$(cpu_of "$DIR/incr.json" "$BUILD/bin/eaglekit" index "$DATA" --out "$INDEX" --jobs "$JOBS" --json)
ek_n=$(json_get "$DIR/full.json" records)
unchanged=$(json_get "$DIR/incr.json" unchanged_files)
# In-process wall times, like the Python figure (which excludes interpreter start-up); CPU
# times without the process start-up, measured by `eaglekit --version` (about 10 ms since
# eaglekit links no LibTorch; it was 0.8 CPU-s before).
full_s=$(json_get "$DIR/full.json" seconds)
incr_s=$(json_get "$DIR/incr.json" seconds)
full_cpu=$(calc "$full_cpu - $start_cpu")
incr_cpu=$(calc "$incr_cpu - $start_cpu")

# (d) index load at scale
load_out=$("$BUILD/bin/bench_index" load "$LOAD" 5)
get() { echo "$load_out" | awk -v k="$1" '$1 == k { print $2 }'; }

printf "\n== indexing %s small .pt files in nested folders (one run each, warm cache) ==\n" "$FILES"
printf "%-50s %8s %9s %11s %9s\n" "" "records" "wall s" "records/s" "CPU s"
printf "%-50s %8s %9.3f %11.0f %9.3f\n" "python reference start-up (glob + stem map)" "$py_n" "$py_s" "$(calc "$py_n / $py_s")" "$py_cpu"
printf "%-50s %8s %9.3f %11.0f %9.3f\n" "eaglekit index --full (reads every header)" "$ek_n" "$full_s" "$(calc "$ek_n / $full_s")" "$full_cpu"
printf "%-50s %8s %9.3f %11.0f %9.3f\n" "eaglekit index, incremental ($unchanged unchanged)" "$ek_n" "$incr_s" "$(calc "$ek_n / $incr_s")" "$incr_cpu"
printf "time ratio vs python glob: full index %.2fx (CPU %.2fx), incremental %.2fx (CPU %.2fx)\n" \
  "$(calc "$full_s / $py_s")" "$(calc "$full_cpu / $py_cpu")" "$(calc "$incr_s / $py_s")" "$(calc "$incr_cpu / $py_cpu")"
printf "(eaglekit figures include writing the %s-byte index; each eaglekit process also spends\n" "$(stat -c %s "$INDEX")"
printf " %.3f CPU s starting up (LibTorch), not counted above)\n" "$start_cpu"

printf "\n== index load, %s entries (%s bytes), median of 5 ==\n" "$(get load_entries)" "$(get load_file_bytes)"
printf "load (mmap + header + checksum):   %.4f s\n" "$(get load_seconds_median)"
printf "hash every id (matching):          %.4f s\n" "$(get load_hash_all_ids_seconds_median)"
printf "find(id), sorted-id table:         %.2f us\n" "$(get load_find_microseconds_median)"
printf "write (from memory):               %.3f s\n" "$(get load_write_seconds)"
open_out=$("$BUILD/bin/bench_index" open "$INDEX")
open_s=$(echo "$open_out" | awk '$1 == "open_seconds_median" { print $2 }')
printf "\n== start-up on the %s files: load their index + hash every id, vs python glob ==\n" "$FILES"
printf "eaglekit %.4f s, python %.3f s: %.0fx faster\n" "$open_s" "$py_s" "$(calc "$py_s / $open_s")"
