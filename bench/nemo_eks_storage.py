#!/usr/bin/python3
"""Bytes per token of a NeMo AutoModel EAGLE-3 cache (full distribution and top k) against its
.eks conversion (`eaglekit convert`, zstd and fp8), on a synthetic cache of a realistic shape.

The cache is written in NeMo 0.7.0's layout (docs/formats.md, "NeMo AutoModel EAGLE-3 offline
cache v2"; the same tensors, dtypes and shapes as its eagle3_cache.write_shard, written here
with torch and the safetensors byte layout by hand): every sample padded to seq_length S,
aux_hidden_states [S, k*H] and target_probs [S, Vd] (or the top k values and int32 indices)
in bf16. Only the values are synthetic:
  - lengths uniform in [S/4, S] (the padding a cache carries depends on this);
  - aux_hidden_states standard normal (no outlier channels: close to the worst case for
    compression, as for eaglekit's own bf16 dumps);
  - target_probs softmax(2 * N(0, 1) + 10 * onehot(a random token)) over Vd, in float32,
    then bf16: a peaked next-token distribution (the top token about 0.5) with a long tail;
    the top k renormalised to sum 1, as NeMo's compress_target_probs stores it.
target_embeddings.safetensors (one per cache, not per token) is not written or counted.

Usage: bench/nemo_eks_storage.py EAGLEKIT_BIN OUT_DIR [--hidden 4096] [--draft-vocab 32000]
       [--seq 1024] [--samples 4] [--topk 64] [--seed 0]
Prints one line per file: its bytes, the real tokens, bytes per token, and the ratio to the
cache it came from.
"""
import argparse
import json
import os
import struct
import subprocess

import torch

ap = argparse.ArgumentParser()
ap.add_argument("eaglekit")
ap.add_argument("out")
ap.add_argument("--hidden", type=int, default=4096)
ap.add_argument("--aux-layers", type=int, default=3)
ap.add_argument("--draft-vocab", type=int, default=32000)
ap.add_argument("--target-vocab", type=int, default=128256)
ap.add_argument("--seq", type=int, default=1024)
ap.add_argument("--samples", type=int, default=4)
ap.add_argument("--shard-size", type=int, default=2)
ap.add_argument("--topk", type=int, default=64)
ap.add_argument("--seed", type=int, default=0)
a = ap.parse_args()

S, H, K, VD, V = a.seq, a.hidden, a.aux_layers, a.draft_vocab, a.target_vocab
g = torch.Generator().manual_seed(a.seed)
lengths = torch.randint(S // 4, S + 1, (a.samples,), generator=g).tolist()
selected = torch.randperm(V, generator=g)[:VD].tolist()

DTYPES = {torch.int64: ("I64", torch.int64), torch.int32: ("I32", torch.int32), torch.bool: ("BOOL", torch.uint8),
          torch.bfloat16: ("BF16", torch.int16)}


def save_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        code, view = DTYPES[t.dtype]
        b = t.contiguous().view(view).numpy().tobytes()
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in blobs:
            f.write(b)


def sample(t):
    """One sample's rows, padded to S, in NeMo's layout (ids and masks shifted left by one)."""
    ids = torch.zeros(S, dtype=torch.int64)
    ids[: t - 1] = torch.randint(0, V, (t - 1,), generator=g)
    attn = torch.zeros(S, dtype=torch.int64)
    attn[:t] = 1
    loss = torch.zeros(S, dtype=torch.int64)
    loss[t // 4 : t - 1] = 1
    aux = torch.zeros(S, K * H, dtype=torch.bfloat16)
    aux[:t] = torch.randn(t, K * H, generator=g).bfloat16()
    logits = 2 * torch.randn(S, VD, generator=g)
    logits[torch.arange(S), torch.randint(0, VD, (S,), generator=g)] += 10
    logits[t - 1 :] = 0  # NeMo's zero-filled shifted logits past the last real target
    probs = torch.softmax(logits, -1)
    pm = (loss.bool() & (probs.argmax(-1) >= 0)).unsqueeze(-1)
    return ids, attn, loss, aux, pm, probs


def write_cache(dirname, topk):
    os.makedirs(dirname, exist_ok=True)
    gen_state = g.get_state()
    for s0 in range(0, a.samples, a.shard_size):
        rows = [sample(t) for t in lengths[s0 : s0 + a.shard_size]]
        stack = [torch.stack([r[i] for r in rows]) for i in range(6)]
        tensors = {"input_ids": stack[0], "attention_mask": stack[1], "loss_mask": stack[2],
                   "aux_hidden_states": stack[3], "position_mask": stack[4]}
        if topk:
            v, i = stack[5].topk(topk, -1)
            tensors["target_probs_values"] = (v / v.sum(-1, keepdim=True)).bfloat16()
            tensors["target_probs_indices"] = i.to(torch.int32)
        else:
            tensors["target_probs"] = stack[5].bfloat16()
        save_safetensors("%s/shard-%06d.safetensors" % (dirname, s0 // a.shard_size), tensors)
    g.set_state(gen_state)  # the top-k cache holds the same samples
    manifest = {"aux_hidden_dim": K * H, "aux_layer_ids": list(range(1, 1 + K)), "draft_vocab_size": VD,
                "dtype": "bf16", "format_version": 2, "num_samples": a.samples, "selected_token_ids": selected,
                "seq_length": S, "shard_size": a.shard_size, "target_probs_topk": topk, "target_vocab_size": V}
    with open(dirname + "/manifest.json", "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)


def size_of(path):
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    return os.path.getsize(path)


tokens = sum(lengths)
print("shape: H %d, k %d, Vd %d, S %d, %d samples of %s tokens (%d), top k %d, bf16" %
      (H, K, VD, S, a.samples, lengths, tokens, a.topk))
print("%-28s %14s %12s %9s" % ("file", "bytes", "bytes/token", "of cache"))
for name, topk in (("full", 0), ("topk", a.topk)):
    cache = os.path.join(a.out, name)
    write_cache(cache, topk)
    base = size_of(cache)
    print("%-28s %14d %12.1f %9s" % (name + " cache (NeMo)", base, base / tokens, "1"))
    for codec in ("zstd", "fp8"):
        eks = os.path.join(a.out, "%s-%s.eks" % (name, codec))
        subprocess.run([a.eaglekit, "convert", cache + "/manifest.json", eks, "--codec", codec], check=True,
                       stdout=subprocess.DEVNULL)
        n = size_of(eks)
        print("%-28s %14d %12.1f %9.3f" % ("%s .eks (%s)" % (name, codec), n, n / tokens, n / base))
