#!/usr/bin/python3
"""A Python port of the reference data path (OfflineSupervisedDataset +
DataCollatorForOffline in ModelOpt's eagle_utils.py), written from its semantics for
eaglekit's loader tests and benchmark. Differences from the reference, on purpose:

- a stored `loss_mask` is used when a record has one (the reference always uses ones;
  eaglekit issue 6 asks for the stored mask), cast to the dtype of input_ids;
- `--shuffle --seed S` permutes the split with eaglekit's documented permutation
  (lib/sampler.h: splitmix64 + Fisher-Yates), so shuffled orders can be compared too;
- the batch is written flat: hidden_states / aux_hidden_states instead of
  base_model_outputs.{base_model_hidden_states, aux_hidden_states}.

Everything else is the reference: records found by a recursive glob of *.pt, matched by
file stem == conversation id (conversation_id, else uuid, else id), conversations
without a record skipped, the first int(n * 0.95) matched samples train, the rest
evaluate; each sample cut to max_length rows; attention_mask = ones_like(input_ids),
labels = full_like(input_ids, -100); the collator pads every per-token tensor with
zeros to exactly max_length and stacks (so labels are 0 on padding).

Commands:
  collate --data CONV --records DIR --batch-size B --max-length L [--split S]
          [--eval-fraction F] [--shuffle --seed S] [--batches N] --out DIR
  compare --data ... (same options) --ours DIR     exit 1 and say where on a mismatch
  bench   --data ... --batch-size B --max-length L [--workers 2] [--batches N]
          prints {"samples_per_s", "bytes_per_s", "batches", "samples", "seconds", "cpu_s"}
  synth   --out DIR --conversations N [--hidden H --aux-layers K --min-tokens A
          --max-tokens B --dtype bfloat16 --ids int64 --seed S --extra E]
          writes DIR/conversations.jsonl (N + E conversations, E without a record) and
          DIR/records/<i % 3>/<id>.pt written by torch.save; every 4th record has a stored
          loss_mask (int64, alternating bool), ids are strings or integers
"""
import argparse
import gc
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

IGNORE_TOKEN_ID = -100
MASK64 = (1 << 64) - 1


def load_conversations(path):
    p = Path(path)
    if p.is_dir():
        out = []
        for f in sorted(p.glob("*.jsonl")):
            with open(f) as fh:
                out.extend(json.loads(line) for line in fh if line.strip())
        return out
    with open(p) as fh:
        if str(p).endswith("jsonl"):
            return [json.loads(line) for line in fh if line.strip()]
        return json.load(fh)


def conversation_id(entry):
    for key in ("conversation_id", "uuid", "id"):
        value = entry.get(key)
        if value is not None:
            return str(value)
    raise ValueError(f"Conversation ID required but not found for entry {entry}")


def matched_entries(conversations, records_dir):
    files = {str(p) for p in Path(records_dir).glob("**/*.pt")}
    by_stem = {Path(f).name[:-3]: f for f in files}
    entries = []
    for entry in conversations:
        path = by_stem.get(conversation_id(entry))
        if path is not None:
            entries.append((entry, path))
    if not entries:
        raise ValueError("no record matched a conversation")
    return entries


def split_entries(entries, split, eval_fraction):
    n_train = int(len(entries) * (1.0 - eval_fraction))
    if split == "train":
        return entries[:n_train]
    if split == "eval":
        return entries[n_train:]
    return entries


def splitmix_permutation(n, seed, epoch):
    """eaglekit's epoch_order (lib/sampler.h)."""
    state = (seed ^ ((0x9E3779B97F4A7C15 * (epoch + 1)) & MASK64)) & MASK64

    def draw():
        nonlocal state
        state = (state + 0x9E3779B97F4A7C15) & MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    order = list(range(n))
    for i in range(n - 1, 0, -1):
        m = i + 1
        rem = (1 << 64) % m
        limit = (1 << 64) - rem
        while True:
            x = draw()
            if rem == 0 or x < limit:
                break
        j = x % m
        order[i], order[j] = order[j], order[i]
    return order


class OfflineDataset(Dataset):
    """OfflineSupervisedDataset: one torch.load per sample, cut to max_length."""

    def __init__(self, entries, max_length):
        self.entries = entries
        self.max_length = max_length

    def __len__(self):
        return len(self.entries)

    def __getitem__(self, i):
        _, path = self.entries[i]
        data = torch.load(path)
        L = self.max_length
        input_ids = data["input_ids"][:L]
        if data.get("loss_mask") is not None:
            loss_mask = data["loss_mask"][:L].to(input_ids.dtype)
        else:
            loss_mask = torch.ones_like(input_ids)
        return {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "loss_mask": loss_mask,
            "labels": torch.full_like(input_ids, IGNORE_TOKEN_ID),
            "kwargs": {
                "base_model_outputs": {
                    "base_model_hidden_states": data["hidden_states"][:L, :],
                    "aux_hidden_states": data["aux_hidden_states"][:L, :],
                }
            },
        }


def pad1d(t, length):
    if t.shape[0] > length:
        return t[:length]
    return torch.cat((t, torch.zeros(length - t.shape[0], dtype=t.dtype)))


def pad2d(t, length):
    n, dim = t.shape
    if n > length:
        return t[:length, :]
    return torch.cat((t, torch.zeros(length - n, dim, dtype=t.dtype)))


class OfflineCollator:
    """DataCollatorForOffline: zero padding to exactly max_length, then stack."""

    def __init__(self, max_length):
        self.max_length = max_length

    def __call__(self, features):
        L = self.max_length
        batch = {
            key: torch.stack([pad1d(f[key], L) for f in features])
            for key in ("input_ids", "attention_mask", "loss_mask", "labels")
        }
        outs = [f["kwargs"]["base_model_outputs"] for f in features]
        batch["hidden_states"] = torch.stack([pad2d(o["base_model_hidden_states"], L) for o in outs])
        batch["aux_hidden_states"] = torch.stack([pad2d(o["aux_hidden_states"], L) for o in outs])
        return batch


def make_dataset(args):
    entries = matched_entries(load_conversations(args.data), args.records)
    entries = split_entries(entries, args.split, args.eval_fraction)
    if args.shuffle:
        order = splitmix_permutation(len(entries), args.seed, 0)
        entries = [entries[i] for i in order]
    return OfflineDataset(entries, args.max_length)


def batches(args, workers=0):
    ds = make_dataset(args)
    loader = DataLoader(ds, batch_size=args.batch_size, shuffle=False, num_workers=workers,
                        collate_fn=OfflineCollator(args.max_length))
    for n, b in enumerate(loader):
        if args.batches >= 0 and n >= args.batches:
            break
        yield b


def cmd_collate(args):
    os.makedirs(args.out, exist_ok=True)
    n = 0
    for n, b in enumerate(batches(args), start=1):
        torch.save(b, os.path.join(args.out, "batch_%05d.pt" % (n - 1)))
    print(json.dumps({"batches": n}))


def cmd_compare(args):
    n = 0
    problems = []
    for i, ref in enumerate(batches(args)):
        n = i + 1
        path = os.path.join(args.ours, "batch_%05d.pt" % i)
        if not os.path.exists(path):
            problems.append(f"batch {i}: {path} missing")
            break
        ours = torch.load(path)
        for key, want in ref.items():
            got = ours.get(key)
            if got is None:
                problems.append(f"batch {i}: key {key} missing")
            elif got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
                problems.append(f"batch {i} {key}: ours {got.dtype} {tuple(got.shape)}, "
                                f"reference {want.dtype} {tuple(want.shape)}")
            elif not torch.equal(got, want):
                diff = (got != want).nonzero()[0].tolist()
                problems.append(f"batch {i} {key}: values differ, first at {diff}")
    extra = os.path.join(args.ours, "batch_%05d.pt" % n)
    if os.path.exists(extra):
        problems.append(f"ours has more batches than the reference's {n}")
    if problems:
        print("\n".join(problems[:20]))
        sys.exit(1)
    print(json.dumps({"batches": n, "equal": True}))


def cpu_seconds():
    """User + system time of this process and its reaped children (DataLoader workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def cmd_bench(args):
    ds = make_dataset(args)
    # Several epochs keep the workers alive between them, as a training loop would ask.
    loader = DataLoader(ds, batch_size=args.batch_size, shuffle=False, num_workers=args.workers,
                        collate_fn=OfflineCollator(args.max_length),
                        persistent_workers=args.workers > 0 and args.epochs > 1)
    samples = nbytes = nb = 0
    cpu0 = cpu_seconds()
    start = time.perf_counter()
    for _ in range(args.epochs):
        it = iter(loader)
        for b in it:
            if args.batches >= 0 and nb >= args.batches:
                break
            nb += 1
            samples += b["input_ids"].shape[0]
            valid = int(b["attention_mask"].sum())
            per_token = (b["hidden_states"].shape[-1] + b["aux_hidden_states"].shape[-1]) * \
                b["hidden_states"].element_size() + b["input_ids"].element_size()
            nbytes += valid * per_token
    seconds = time.perf_counter() - start
    del it, loader  # shuts the workers down, so that their CPU time is counted
    gc.collect()
    cpu = cpu_seconds() - cpu0
    print(json.dumps({"samples_per_s": samples / seconds, "bytes_per_s": nbytes / seconds,
                      "batches": nb, "samples": samples, "seconds": seconds, "cpu_s": cpu}))


def cmd_synth(args):
    g = torch.Generator().manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    ids_dtype = getattr(torch, args.ids)
    out = Path(args.out)
    lines = []
    for i in range(args.conversations + args.extra):
        # Integer ids for some conversations: the id is compared as its decimal form.
        cid = 1000 + i if i % 5 == 0 else "conv-%04d" % i
        lines.append(json.dumps({"conversation_id": cid,
                                 "conversations": [{"role": "user", "content": "q%d" % i}]}))
        if i >= args.conversations:
            continue
        t = int(torch.randint(args.min_tokens, args.max_tokens + 1, (1,), generator=g))
        h = args.hidden
        rec = {
            "input_ids": torch.randint(0, 32000, (t,), generator=g).to(ids_dtype),
            "hidden_states": torch.randn(t, h, generator=g).to(dtype),
            "aux_hidden_states": (3 * torch.randn(t, args.aux_layers * h, generator=g)).to(dtype),
            "conversation_id": str(cid),
        }
        if i % 4 == 1:
            mask = torch.randint(0, 2, (t,), generator=g)
            rec["loss_mask"] = mask.bool() if i % 8 == 1 else mask
        folder = out / "records" / str(i % 3)
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(rec, folder / ("%s.pt" % cid))
    (out / "conversations.jsonl").write_text("\n".join(lines) + "\n")
    print(json.dumps({"records": args.conversations, "conversations": len(lines)}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=["collate", "compare", "bench", "synth"])
    ap.add_argument("--data")
    ap.add_argument("--records")
    ap.add_argument("--conversations", type=int, default=20)
    ap.add_argument("--extra", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--aux-layers", type=int, default=3)
    ap.add_argument("--min-tokens", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--ids", default="int64")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--split", default="train", choices=["train", "eval", "all"])
    ap.add_argument("--eval-fraction", type=float, default=0.05)
    ap.add_argument("--shuffle", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batches", type=int, default=-1)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out")
    ap.add_argument("--ours")
    args = ap.parse_args()
    torch.set_num_threads(1)
    {"collate": cmd_collate, "compare": cmd_compare, "bench": cmd_bench,
     "synth": cmd_synth}[args.command](args)


if __name__ == "__main__":
    main()
