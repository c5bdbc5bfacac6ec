"""Writes one small dataset three times, as three producers lay out their dumps.

Usage: make_producer_dumps.py OUT. OUT receives conversations.jsonl (12 conversations,
ids conv-0 .. conv-11), expected_padding.json (SpecForge record -> padding tokens) and
  specforge/rows_0-2000/data_{i}.ckpt  torch.save dicts named by row, batch dims of 1, each
                                       pair padded to the longer one with loss_mask 0;
  trtllm/dp_{rank}_{iter}.pt           a list of one dict keeping the id under "id", file
                                       names in another order than the conversations;
  speculators/hs_{i}.safetensors       token_ids [T], hidden_states [T, 4, H] (the three
                                       aux layers, then the last), written byte by byte.
Widths: H 32, k 3, vocabulary 48 (the tests' synthetic base has the same).
"""
import json, os, struct, sys
import numpy as np
import torch
out = sys.argv[1]
H, K, V, N = 32, 3, 48, 12
rng = np.random.default_rng(5)
convs = []
records = []
for i in range(N):
    t = int(rng.integers(10, 24))
    ids = rng.integers(0, V, size=t).astype(np.int64)
    hs = rng.standard_normal((t, H)).astype(np.float32)
    aux = rng.standard_normal((t, K * H)).astype(np.float32)
    mask = np.ones(t, dtype=np.int64)
    mask[:2] = 0
    records.append((ids, hs, aux, mask))
    convs.append({"conversation_id": "conv-%d" % i, "conversations": [{"role": "user", "content": "q%d" % i}]})
with open(os.path.join(out, "conversations.jsonl"), "w") as f:
    for c in convs:
        f.write(json.dumps(c) + "\n")
# SpecForge: rows of 2000, batch dims of 1, pairs padded to the longer one (loss_mask 0 there).
sf = os.path.join(out, "specforge", "rows_0-2000")
os.makedirs(sf)
padding = {}
for i in range(N):
    ids, hs, aux, mask = records[i]
    mate = records[i ^ 1]
    L = max(len(ids), len(mate[0]))
    pad = L - len(ids)
    if pad:
        padding["data_%d" % i] = pad
    p_ids = np.concatenate([ids, np.zeros(pad, dtype=np.int64)])
    p_mask = np.concatenate([mask, np.zeros(pad, dtype=np.int64)])
    p_hs = np.concatenate([hs, np.zeros((pad, H), dtype=np.float32)])
    p_aux = np.concatenate([aux, np.zeros((pad, K * H), dtype=np.float32)])
    torch.save({"input_ids": torch.from_numpy(p_ids), "loss_mask": torch.from_numpy(p_mask),
                "hidden_state": torch.from_numpy(p_hs).to(torch.bfloat16).unsqueeze(0),
                "aux_hidden_state": torch.from_numpy(p_aux).to(torch.bfloat16).unsqueeze(0)},
               os.path.join(sf, "data_%d.ckpt" % i))
# What the padding is, for the tests to compare stats/validate against: record -> tokens.
with open(os.path.join(out, "expected_padding.json"), "w") as f:
    json.dump(padding, f)
# TensorRT-LLM: the id inside, files named by rank and iteration in another order.
trt = os.path.join(out, "trtllm")
os.makedirs(trt)
for i in range(N):
    ids, hs, aux, mask = records[i]
    torch.save([{"id": "conv-%d" % i, "input_ids": torch.from_numpy(ids),
                 "hidden_state": torch.from_numpy(hs), "aux_hidden_states": torch.from_numpy(aux)}],
               os.path.join(trt, "dp_%d_%d.pt" % (i % 2, (N - i) * 7)))
# vLLM / speculators: token_ids [T], hidden_states [T, K+1, H] (aux layers, then the last).
hsd = os.path.join(out, "speculators")
os.makedirs(hsd)
for i in range(N):
    ids, hs, aux, mask = records[i]
    t = len(ids)
    stacked = np.concatenate([aux.reshape(t, K, H), hs.reshape(t, 1, H)], axis=1).astype(np.float32)
    blobs = [("token_ids", "I64", [t], ids.tobytes()), ("hidden_states", "F32", [t, K + 1, H], stacked.tobytes())]
    header, off = {}, 0
    for name, dt, shape, b in blobs:
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(b)]}
        off += len(b)
    hb = json.dumps(header).encode()
    hb += b" " * ((8 - len(hb) % 8) % 8)
    with open(os.path.join(hsd, "hs_%d.safetensors" % i), "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb + b"".join(b for _, _, _, b in blobs))
