#!/usr/bin/python3
"""The competitor of bench/bench_train.sh: the same EAGLE-3 draft, TTT unroll, loss,
AdamW and gradient clipping as `eaglekit train`, written the way Python trainers
(SpecForge, ModelOpt) write it in PyTorch: block-0 attention as one masked matmul, the
later TTT blocks as one diagonal dot product each (O(L^2 + L*S)), float32.

It starts from the same draft folder (config.json + model.safetensors, as eaglekit
exports it), reads the same records in the same order (reference order, the first
floor((1 - eval_fraction) * n) conversations), pads them to --max-length as the reference
collator does, and times --steps optimizer steps with the batches already in memory (no
data loading is timed here; bench_train.sh subtracts eaglekit's loader wait likewise).
Per step it records wall time and process CPU time (time.process_time: every thread).
Prints one JSON object: {"tokens_per_s_median", "step_s_median", "cpu_s_median",
"tokens_per_cpu_s_median", "losses": [...], "tokens", "threads"}; medians leave out the
first --warmup steps.

usage: bench_train.py --data JSONL --records DIR --draft DIR --base DIR --max-length L
                      --batch-size B --steps N --threads T --lr LR [--ttt-steps 3]
                      [--eval-fraction 0.05] [--grad-clip 1.0] [--warmup 2]
"""
import argparse
import glob
import json
import math
import os
import statistics
import struct
import sys
import time

import torch
import torch.nn.functional as F

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    data = raw[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        buf = bytearray(data[b:e])
        dtype = DTYPES[info["dtype"]]
        t = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
        out[name] = t.reshape(info["shape"]).clone()
    return out


def rms_norm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class Draft(torch.nn.Module):
    def __init__(self, cfg, weights):
        super().__init__()
        self.cfg = cfg
        self.p = torch.nn.ParameterDict()
        for name, t in weights.items():
            if t.is_floating_point():
                self.p[name.replace(".", "__")] = torch.nn.Parameter(t.float().clone())
        self.d2t = weights["d2t"].long()

    def w(self, name):
        return self.p[name.replace(".", "__")]


def ttt_loss(model, base_embed, target_head, batch, steps, decay, masks):
    cfg = model.cfg
    H, nh, nkv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    ids, am, lm, hs, aux = batch
    B, L = ids.shape
    w = model.w
    with torch.no_grad():
        emb = F.embedding(torch.roll(ids, -1, 1), base_embed)
        key_valid = torch.roll(am, -1, 1) != 0
        target_logits = hs @ target_head.T
        p = torch.softmax(target_logits, -1)
        target_arg = target_logits.argmax(-1)
    cos, sin = masks["cos"], masks["sin"]

    def rope(x):
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    h = F.linear(aux, w("fc.weight"))
    emb_n = rms_norm(emb, w("midlayer.input_layernorm.weight"), eps)
    ks, vs = [], []
    total = 0.0
    losses = []
    prev = None
    scale = 1.0 / math.sqrt(hd)
    rep = nh // nkv
    for s in range(steps):
        if s > 0:
            h = torch.roll(prev, 1, 1)
        x = torch.cat([emb_n, rms_norm(h, w("midlayer.hidden_norm.weight"), eps)], -1)
        q = rope(F.linear(x, w("midlayer.self_attn.q_proj.weight")).view(B, L, nh, hd).transpose(1, 2))
        k = rope(F.linear(x, w("midlayer.self_attn.k_proj.weight")).view(B, L, nkv, hd).transpose(1, 2))
        v = F.linear(x, w("midlayer.self_attn.v_proj.weight")).view(B, L, nkv, hd).transpose(1, 2)
        k = k.repeat_interleave(rep, 1)
        v = v.repeat_interleave(rep, 1)
        ks.append(k)
        vs.append(v)
        # block 0: j <= q - s, and the key real
        allowed0 = masks["tril"][s].unsqueeze(0) & key_valid[:, None, :]  # [B, L, L]
        scores = [(q @ ks[0].transpose(-1, -2) * scale).masked_fill(~allowed0[:, None], -1e30)]
        diag_v = []
        for i in range(1, s + 1):  # block i: the one key q - (s - i)
            d = s - i
            kd = torch.roll(ks[i], d, 2)
            vd = torch.roll(vs[i], d, 2)
            ok = masks["pos"].unsqueeze(0) >= d
            ok = ok & torch.roll(key_valid, d, 1)
            sc = (q * kd).sum(-1) * scale
            scores.append(sc.masked_fill(~ok[:, None], -1e30).unsqueeze(-1))
            diag_v.append(vd)
        att = torch.softmax(torch.cat(scores, -1), -1)
        out = att[..., :L] @ vs[0]
        for n, vd in enumerate(diag_v):
            out = out + att[..., L + n:L + n + 1] * vd
        o = F.linear(out.transpose(1, 2).reshape(B, L, nh * hd), w("midlayer.self_attn.o_proj.weight"))
        r = h + o
        y = rms_norm(r, w("midlayer.post_attention_layernorm.weight"), eps)
        mlp = F.linear(F.silu(F.linear(y, w("midlayer.mlp.gate_proj.weight"))) * F.linear(y, w("midlayer.mlp.up_proj.weight")),
                       w("midlayer.mlp.down_proj.weight"))
        out = r + mlp
        logits = F.linear(rms_norm(out, w("norm.weight"), eps), w("lm_head.weight"))
        logp = torch.log_softmax(logits, -1)[:, s:L - 1]
        m = lm[:, 1 + s:]
        loss_s = -(m * (p[:, 1 + s:] * logp).sum(-1)).sum() / (m.sum() + 1e-5)
        losses.append(loss_s)
        total = total + decay ** s * loss_s
        prev = out
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--records", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--base", required=True)
    ap.add_argument("--max-length", type=int, required=True)
    ap.add_argument("--batch-size", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--eval-fraction", type=float, default=0.05)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the medians")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    with open(a.draft + "/config.json") as f:
        cfg = json.load(f)
    model = Draft(cfg, read_safetensors(a.draft + "/model.safetensors"))
    base = read_safetensors(a.base + "/model.safetensors")
    embed = base["model.embed_tokens.weight"].float()
    lm_head = base.get("lm_head.weight", base["model.embed_tokens.weight"]).float()
    target_head = lm_head[torch.arange(model.d2t.shape[0]) + model.d2t]

    ids = []
    with open(a.data) as f:
        for line in f:
            if line.strip():
                ids.append(str(json.loads(line)["conversation_id"]))
    paths = {os.path.splitext(os.path.basename(p))[0]: p
             for p in glob.glob(os.path.join(a.records, "**", "*.pt"), recursive=True)}
    ids = [i for i in ids if i in paths]
    ids = ids[:int(math.floor((1 - a.eval_fraction) * len(ids)))]

    L, Bsz = a.max_length, a.batch_size
    batches = []
    pos = 0
    while len(batches) < a.steps:
        chunk = [ids[(pos + r) % len(ids)] for r in range(Bsz)]
        pos += Bsz
        recs = [torch.load(paths[c]) for c in chunk]
        Hd = recs[0]["hidden_states"].shape[-1]
        Ka = recs[0]["aux_hidden_states"].shape[-1]
        t_ids = torch.zeros(Bsz, L, dtype=torch.long)
        t_am = torch.zeros(Bsz, L)
        t_lm = torch.zeros(Bsz, L)
        t_hs = torch.zeros(Bsz, L, Hd)
        t_aux = torch.zeros(Bsz, L, Ka)
        for r, rec in enumerate(recs):
            n = min(L, rec["input_ids"].shape[0])
            t_ids[r, :n] = rec["input_ids"][:n]
            t_am[r, :n] = 1
            t_lm[r, :n] = rec["loss_mask"][:n].float() if "loss_mask" in rec else 1
            t_hs[r, :n] = rec["hidden_states"][:n].float()
            t_aux[r, :n] = rec["aux_hidden_states"][:n].float()
        batches.append((t_ids, t_am, t_lm, t_hs, t_aux))

    hd = cfg["head_dim"]
    half = torch.arange(0, hd, 2, dtype=torch.float64) / hd
    inv = 1.0 / (cfg["rope_theta"] ** half)
    ang = torch.outer(torch.arange(L, dtype=torch.float64), inv)
    posr = torch.arange(L)
    masks = {
        "cos": torch.cat([ang, ang], -1).cos().float(),
        "sin": torch.cat([ang, ang], -1).sin().float(),
        "tril": [posr[None, :] <= posr[:, None] - s for s in range(a.ttt_steps)],
        "pos": posr,
    }
    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.0}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.999), eps=1e-8)
    times, cpus, losses, tokens = [], [], [], []
    for b in batches:
        t0 = time.perf_counter()
        c0 = time.process_time()
        opt.zero_grad(set_to_none=True)
        loss = ttt_loss(model, embed, target_head, b, a.ttt_steps, 0.9, masks)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, a.grad_clip)
        opt.step()
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        losses.append(float(loss))
        tokens.append(float(b[1].sum()))
    w = a.warmup if len(times) > a.warmup else 0
    tps = [n / t for n, t in zip(tokens[w:], times[w:])]
    tpc = [n / c for n, c in zip(tokens[w:], cpus[w:])]
    print(json.dumps({"tokens_per_s_median": statistics.median(tps), "step_s_median": statistics.median(times[w:]),
                      "cpu_s_median": statistics.median(cpus[w:]), "tokens_per_cpu_s_median": statistics.median(tpc),
                      "losses": losses, "tokens": sum(tokens), "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    sys.exit(main())
