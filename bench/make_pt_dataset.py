#!/usr/bin/python3
"""Writes a synthetic ModelOpt-style .pt dataset with torch.save for bench/bench_read.sh.

usage: make_pt_dataset.py DIR FILES HIDDEN MIN_TOKENS MAX_TOKENS
Each file DIR/{id}.pt holds input_ids [T] int64, hidden_states [T, H] and
aux_hidden_states [T, 3H] in bf16, loss_mask [T] int64 and conversation_id; T is uniform in
[MIN_TOKENS, MAX_TOKENS], seeded. Values are random normals (reading speed does not depend
on them).
"""
import os
import sys

import torch


def main(out, files, hidden, lo, hi):
    torch.manual_seed(1)
    os.makedirs(out, exist_ok=True)
    for i in range(files):
        t = int(torch.randint(lo, hi + 1, (1,)))
        conv = "bench-%05d" % i
        torch.save({"input_ids": torch.randint(0, 128000, (t,)),
                    "hidden_states": torch.randn(t, hidden).bfloat16(),
                    "aux_hidden_states": torch.randn(t, 3 * hidden).bfloat16(),
                    "loss_mask": torch.ones(t, dtype=torch.int64),
                    "conversation_id": conv},
                   os.path.join(out, conv + ".pt"))


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:6]))
