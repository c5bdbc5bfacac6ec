#!/usr/bin/python3
"""torch.load side of bench/bench_read.sh: loads every .pt below DIR and touches every byte
of every tensor (a uint8 sum), REPS times; prints "WALL CPU" seconds of each pass, one a
line (CPU = user + system of this process). Import time is not counted.

usage: torch_load_read.py DIR REPS
"""
import os
import sys
import time

import torch


def touch(obj):
    total = 0
    for v in obj.values():
        if isinstance(v, torch.Tensor):
            total += int(v.contiguous().view(-1).view(torch.uint8).sum())
    return total


def main(root, reps):
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".pt"))
    torch.set_num_threads(1)  # our reader is single-threaded too
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        for f in files:
            obj = torch.load(f)
            if isinstance(obj, list):
                obj = obj[0]
            touch(obj)
        print("%.6f %.6f" % (time.perf_counter() - t0, time.process_time() - c0), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
