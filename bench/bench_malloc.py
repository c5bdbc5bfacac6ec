#!/usr/bin/python3
"""Freed memory kept against given back (lib/malloc_policy.h): the same `eaglekit train` run
with eaglekit's default (glibc keeps a step's freed blocks for the next step) and with
EAGLEKIT_MALLOC=libc (glibc's own dynamic thresholds, which return the heap's free top to the
kernel between steps), alternating in every run, on the same dumps, starting draft, batches and
threads. For EAGLE-3 (3 TTT steps) and DFlash (block 4, 32 anchors), the e2e's shapes.

Per run and side: the median tokens/s over the steps after --warmup (eaglekit's own log: data
loading excluded), the median CPU ms per step, and of the whole process (os.wait4): minor page
faults, system CPU seconds and peak resident memory. Prints the medians over runs and the
ratios kept / given back.

Usage: bench/bench_malloc.py [--work e2e-out] [--runs 5] [--steps 20] [--warmup 4] [--threads N]
           [--arch eagle3,dflash]
--work is a finished scripts/e2e folder (its base model, dumps and index).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_cmd(a, arch, out, init=None, steps=None):
    cmd = [a.eaglekit, "train", "--base", os.path.join(a.work, "base"), "--data",
           os.path.join(a.work, "data", "train.jsonl"), "--index", os.path.join(a.work, "train.idx"),
           "--max-length", "160", "--batch-size", "16", "--no-shuffle", "--schedule", "constant", "--lr", "1e-3",
           "--threads", str(a.threads), "--eval-every", "-1", "--log-every", "1", "--no-progress",
           "--no-tensorboard", "--seed", "1", "--out", out, "--max-steps", str(steps or a.steps)]
    if init:
        cmd += ["--init-draft", init]
    elif arch == "dflash":
        cmd += ["--draft-arch", "dflash", "--block-size", "4", "--mask-token-id", "0"]
    else:
        cmd += ["--ttt-steps", "3"]
    if arch == "dflash":
        cmd += ["--dflash-anchors", "32"]
    return cmd


def run_side(a, arch, init, tmp, libc):
    out = tempfile.mkdtemp(dir=tmp)
    env = dict(os.environ)
    env.pop("EAGLEKIT_MALLOC", None)
    for k in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_", "GLIBC_TUNABLES"):
        env.pop(k, None)
    if libc:
        env["EAGLEKIT_MALLOC"] = "libc"
    p = subprocess.Popen(train_cmd(a, arch, out, init=init), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    err = p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        sys.stderr.write(err.decode(errors="replace"))
        sys.exit(f"bench_malloc: eaglekit train ({arch}, {'libc' if libc else 'kept'}) exited {p.returncode}")
    lines = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"tokens_per_s"' in l]
    timed = lines[a.warmup:]
    if not timed:
        sys.exit(f"bench_malloc: {len(lines)} logged steps, none after --warmup {a.warmup}")
    return {"tok_s": statistics.median(x["tokens_per_s"] for x in timed),
            "cpu_ms": statistics.median(x["cpu_ms"] for x in timed),
            "faults": ru.ru_minflt, "sys_s": ru.ru_stime, "rss_mib": ru.ru_maxrss / 1024.0}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=os.path.join(ROOT, "e2e-out"))
    ap.add_argument("--eaglekit", default=os.path.join(ROOT, os.environ.get("EAGLEKIT_BUILD_DIR", "build"), "bin", "eaglekit"))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--threads", type=int, default=min(os.cpu_count() or 1, 2))
    ap.add_argument("--arch", default="eagle3,dflash")
    a = ap.parse_args()
    if not os.path.exists(os.path.join(a.work, "train.idx")):
        sys.exit(f"bench_malloc: {a.work} is not a finished scripts/e2e folder (no train.idx): run scripts/e2e first")
    archs = [x for x in a.arch.split(",") if x]
    for x in archs:
        if x not in ("eagle3", "dflash"):
            sys.exit(f"bench_malloc: --arch takes eagle3 and/or dflash, not {x!r}")
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="eaglekit-bench-malloc.") as tmp:
        inits = {}
        for arch in archs:  # one starting draft per arch, shared by both sides
            init = os.path.join(tmp, "init-" + arch)
            subprocess.run(train_cmd(a, arch, init, steps=1) + ["--export-dtype", "float32"], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            inits[arch] = os.path.join(init, "final")
        print(f"bench_malloc: {', '.join(archs)}; {a.runs} runs x {a.steps} steps ({a.warmup} warm-up) per side, "
              f"batch 16, length 160, {a.threads} threads; load average {load[0]:.1f}", flush=True)
        res = {(arch, side): [] for arch in archs for side in ("kept", "libc")}
        for r in range(a.runs):
            for arch in archs:
                for side in (("kept", "libc") if r % 2 == 0 else ("libc", "kept")):
                    res[(arch, side)].append(run_side(a, arch, inits[arch], tmp, side == "libc"))
                k, g = res[(arch, "kept")][-1], res[(arch, "libc")][-1]
                load.append(os.getloadavg()[0])
                print(f"  run {r + 1} {arch:6s}: kept {k['tok_s']:6.0f} tok/s {k['faults']:8d} faults | "
                      f"given back {g['tok_s']:6.0f} tok/s {g['faults']:8d} faults | load {load[-1]:.1f}", flush=True)
    med = lambda v, key: statistics.median(x[key] for x in v)
    print(f"medians over {a.runs} runs; load average {min(load):.1f} to {max(load):.1f}:")
    for arch in archs:
        for side, title in (("kept", "kept (eaglekit's default)"), ("libc", "given back (EAGLEKIT_MALLOC=libc)")):
            v = res[(arch, side)]
            print(f"  {arch:6s} {title:36s} {med(v, 'tok_s'):7.0f} tokens/s  {med(v, 'cpu_ms'):6.0f} CPU ms/step  "
                  f"{med(v, 'faults'):9.0f} minor faults  {med(v, 'sys_s'):5.2f} s system  "
                  f"peak RSS {med(v, 'rss_mib'):6.0f} MiB")
        k, g = res[(arch, "kept")], res[(arch, "libc")]
        print(f"  {arch:6s} ratio kept / given back: {med(k, 'tok_s') / med(g, 'tok_s'):.2f}x tokens/s, "
              f"{med(g, 'cpu_ms') / med(k, 'cpu_ms'):.2f}x less CPU per step, "
              f"{med(k, 'faults') / med(g, 'faults'):.2f}x the page faults, "
              f"{med(k, 'rss_mib') / med(g, 'rss_mib'):.2f}x the peak memory")


if __name__ == "__main__":
    main()
