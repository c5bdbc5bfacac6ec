#!/usr/bin/python3
"""The competitor of bench/bench_train.sh: the same EAGLE-3 draft (or EAGLE 3.1's, as the
draft's config.json says: fc_norm, norm_before_fc, norm_output, norm_before_residual), TTT unroll, loss,
AdamW and gradient clipping as `eaglekit train`, written the way Python trainers
(SpecForge, ModelOpt) write it in PyTorch: block-0 attention as one masked matmul, the
later TTT blocks as one diagonal dot product each (O(L^2 + L*S)), float32.

It starts from the same draft folder (config.json + model.safetensors, as eaglekit
exports it), reads the same records in the same order (reference order, the first
floor((1 - eval_fraction) * n) conversations), pads them to --max-length as the reference
collator does, and times --steps optimizer steps with the batches already in memory (no
data loading is timed here; bench_train.sh subtracts eaglekit's loader wait likewise).
Per step it records wall time and process CPU time (time.process_time: every thread).
Prints one JSON object: {"tokens_per_s_median", "step_s_median", "tokens_per_s_overall" (all
timed tokens over all timed seconds: on a loaded machine a few stalled steps that the median
hides), "cpu_s_median",
"tokens_per_cpu_s_median", "losses": [...], "tokens", "threads"}; medians leave out the
first --warmup steps.

usage: bench_train.py --data JSONL --records DIR --draft DIR --base DIR --max-length L
                      --batch-size B --steps N --threads T --lr LR [--ttt-steps 3]
                      [--eval-fraction 0.05] [--grad-clip 1.0] [--warmup 2]

--synthetic (bench/bench_long_context.sh): no files; the draft, base and batches of
bench/bench_long_context.cpp's header (the same seeded draws, so eaglekit and this script
train the same model on the same rows), one JSON line per --lengths entry, each length from
the initial weights with a fresh AdamW, --steps timed steps after --warmup (fewer past
--max-seconds). --device cpu|cuda[:N], --dtype fp32|bf16 (autocast, weights fp32),
--attention matmul (the masked matmul above) or sdpa (one
torch.nn.functional.scaled_dot_product_attention call per step over the concatenated blocks
with the full TTT mask, as SpecForge's sdpa backend does; torch >= 2.0, else the matmul path
is used and "attention_used" says so). Peak memory: torch.cuda.max_memory_allocated on CUDA,
the growth of peak RSS (VmHWM, reset per length) on the CPU. A length that runs out of
memory reports "status": "oom".

usage: bench_train.py --synthetic --lengths L1,L2 [--batch-size 1] [--ttt-steps 7]
                      [--hidden 256] [--heads 4] [--kv-heads 1] [--head-dim 64]
                      [--intermediate 768] [--vocab 2048] [--draft-vocab 1024]
                      [--aux-layers 3] [--rope-theta 500000] [--device cpu] [--dtype fp32]
                      [--attention matmul|sdpa] [--steps 3] [--warmup 1] [--max-seconds 60]
                      [--threads 0] [--seed 1] [--lr 1e-4]
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


def has_sdpa():
    return hasattr(F, "scaled_dot_product_attention")


def ttt_loss(model, base_embed, target_head, batch, steps, decay, masks, attention="matmul"):
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
        p = torch.softmax(target_logits.float(), -1)
        target_arg = target_logits.argmax(-1)
    cos, sin = masks["cos"], masks["sin"]

    def rope(x):
        half = x.shape[-1] // 2
        # In float32 and back to x's dtype (bf16 under autocast), as eaglekit's apply_rope.
        return (x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin).to(x.dtype)

    # EAGLE 3.1's norms on the fc input (docs/draft.md): one over all of it, or one per aux layer.
    if cfg.get("norm_before_fc"):
        aux = rms_norm(aux, w("input_norm.weight"), eps)
    if cfg.get("fc_norm"):
        k = cfg["num_aux_hidden_states"]
        aux = torch.cat([rms_norm(c, w(f"fc_norm.{i}.weight"), eps) for i, c in enumerate(aux.chunk(k, -1))], -1)
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
        posr = masks["pos"]
        allowed0 = (posr[None, :] <= posr[:, None] - s).unsqueeze(0) & key_valid[:, None, :]  # [B, L, L]
        if attention == "sdpa":
            # One fused call over the s + 1 concatenated blocks and the full mask of docs/ttt.md
            # (block i >= 1: the one key q - (s - i)).
            allowed = [allowed0]
            for i in range(1, s + 1):
                d = s - i
                allowed.append((posr[None, :] == posr[:, None] - d).unsqueeze(0) & key_valid[:, None, :])
            out = F.scaled_dot_product_attention(q, torch.cat(ks, 2), torch.cat(vs, 2),
                                                 attn_mask=torch.cat(allowed, -1)[:, None])
            prev = block_rest(model, out, h, B, L, nh, hd, eps)
            normed = rms_norm(prev, w("norm.weight"), eps)
            logits = F.linear(normed, w("lm_head.weight"))
            if cfg.get("norm_output"):  # EAGLE 3.1: the next step takes the final norm's output
                prev = normed
            logp = torch.log_softmax(logits.float(), -1)[:, s:L - 1]
            m = lm[:, 1 + s:]
            loss_s = -(m * (p[:, 1 + s:] * logp).sum(-1)).sum() / (m.sum() + 1e-5)
            total = total + decay ** s * loss_s
            continue
        scores = [(q @ ks[0].transpose(-1, -2) * scale).masked_fill(~allowed0[:, None], -1e30)]
        diag_v = []
        for i in range(1, s + 1):  # block i: the one key q - (s - i)
            d = s - i
            kd = torch.roll(ks[i], d, 2)
            vd = torch.roll(vs[i], d, 2)
            ok = masks["pos"].unsqueeze(0) >= d
            ok = ok & torch.roll(key_valid, d, 1)
            sc = (q.float() * kd.float()).sum(-1) * scale  # float32, as eaglekit's chain scores
            scores.append(sc.masked_fill(~ok[:, None], -1e30).unsqueeze(-1))
            diag_v.append(vd)
        att = torch.softmax(torch.cat(scores, -1).float(), -1).to(vs[0].dtype)
        out = att[..., :L] @ vs[0]
        for n, vd in enumerate(diag_v):
            out = out + att[..., L + n:L + n + 1] * vd
        out = block_rest(model, out, h, B, L, nh, hd, eps)
        normed = rms_norm(out, w("norm.weight"), eps)
        logits = F.linear(normed, w("lm_head.weight"))
        logp = torch.log_softmax(logits.float(), -1)[:, s:L - 1]
        m = lm[:, 1 + s:]
        loss_s = -(m * (p[:, 1 + s:] * logp).sum(-1)).sum() / (m.sum() + 1e-5)
        losses.append(loss_s)
        total = total + decay ** s * loss_s
        prev = normed if cfg.get("norm_output") else out
    return total


def block_rest(model, attn, h, B, L, nh, hd, eps):
    """o_proj + residual, then the MLP block: the layer's output."""
    w = model.w
    o = F.linear(attn.transpose(1, 2).reshape(B, L, nh * hd), w("midlayer.self_attn.o_proj.weight"))
    if model.cfg.get("norm_before_residual"):
        h = rms_norm(h, w("midlayer.hidden_norm.weight"), model.cfg["rms_norm_eps"])
    r = h + o
    y = rms_norm(r, w("midlayer.post_attention_layernorm.weight"), eps)
    mlp = F.linear(F.silu(F.linear(y, w("midlayer.mlp.gate_proj.weight"))) * F.linear(y, w("midlayer.mlp.up_proj.weight")),
                   w("midlayer.mlp.down_proj.weight"))
    return r + mlp


def status_kib(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return -1


def reset_peak_rss():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def is_oom(e):
    oom_type = getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(e, oom_type):
        return True
    m = str(e)
    return isinstance(e, (RuntimeError, MemoryError)) and ("out of memory" in m or "can't allocate" in m)


def synthetic(a):
    """bench_long_context.sh's competitor: the draws of bench/bench_long_context.cpp's header."""
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    H, nh, nkv, hd, I = a.hidden, a.heads, a.kv_heads, a.head_dim, a.intermediate
    V, Vd, k = a.vocab, a.draft_vocab, a.aux_layers
    attention_used = a.attention
    if a.attention == "sdpa" and not has_sdpa():
        attention_used = "matmul: torch %s has no SDPA" % torch.__version__

    def seeded(index, shape):
        torch.manual_seed(a.seed * 1000 + index)
        return torch.randn(shape, dtype=torch.float32, device=dev) * (0.1 if 3 <= index <= 5 else 0.02)

    embed = seeded(0, (V, H))
    lm_head = seeded(1, (V, H))
    weights = {
        "fc.weight": seeded(2, (H, k * H)),
        "midlayer.self_attn.q_proj.weight": seeded(3, (nh * hd, 2 * H)),
        "midlayer.self_attn.k_proj.weight": seeded(4, (nkv * hd, 2 * H)),
        "midlayer.self_attn.v_proj.weight": seeded(5, (nkv * hd, 2 * H)),
        "midlayer.self_attn.o_proj.weight": seeded(6, (H, nh * hd)),
        "midlayer.mlp.gate_proj.weight": seeded(7, (I, H)),
        "midlayer.mlp.up_proj.weight": seeded(8, (I, H)),
        "midlayer.mlp.down_proj.weight": seeded(9, (H, I)),
        "midlayer.input_layernorm.weight": torch.ones(H, device=dev),
        "midlayer.hidden_norm.weight": torch.ones(H, device=dev),
        "midlayer.post_attention_layernorm.weight": torch.ones(H, device=dev),
        "norm.weight": torch.ones(H, device=dev),
        "lm_head.weight": lm_head[:Vd] * (2.0 / (0.02 * math.sqrt(H))),
        "d2t": torch.zeros(Vd, dtype=torch.long),
    }
    cfg = {"hidden_size": H, "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd,
           "rms_norm_eps": 1e-5, "rope_theta": a.rope_theta}
    model = Draft(cfg, weights)
    initial = {n: t.detach().clone() for n, t in model.p.items()}
    target_head = lm_head[:Vd]
    params = list(model.parameters())
    for L in [int(x) for x in a.lengths.split(",")]:
        rec = {"length": L}
        try:
            with torch.no_grad():
                for n, t in model.p.items():
                    t.copy_(initial[n])
            torch.manual_seed(a.seed * 1000 + 100 + L)
            B = a.batch_size
            ids = torch.randint(V, (B, L), device=dev)
            target_ids = torch.randint(V, (B, L), device=dev)
            aux = torch.cat([F.embedding(torch.randint(V, (B, L), device=dev), embed) / 0.02 for _ in range(k)], -1)
            hs_all = F.embedding(target_ids, lm_head) * (8.0 / (H * 0.02 * 0.02))
            am = torch.ones(B, L, device=dev)
            batch = (ids, am, am, hs_all, aux)
            half = torch.arange(0, hd, 2, dtype=torch.float64) / hd
            inv = 1.0 / (a.rope_theta ** half)
            ang = torch.outer(torch.arange(L, dtype=torch.float64), inv)
            masks = {"cos": torch.cat([ang, ang], -1).cos().float().to(dev),
                     "sin": torch.cat([ang, ang], -1).sin().float().to(dev),
                     "pos": torch.arange(L, device=dev)}
            opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
            else:
                reset_peak_rss()
                rss0 = status_kib("VmRSS")
            losses, times, timed = [], [], 0.0
            for i in range(a.warmup + a.steps):
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                if a.dtype == "bf16":
                    with torch.autocast(device_type=dev.type, dtype=torch.bfloat16):
                        loss = ttt_loss(model, embed, target_head, batch, a.ttt_steps, 0.9, masks, a.attention
                                        if attention_used == a.attention else "matmul")
                else:
                    loss = ttt_loss(model, embed, target_head, batch, a.ttt_steps, 0.9, masks, a.attention
                                    if attention_used == a.attention else "matmul")
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                dt = time.perf_counter() - t0
                losses.append(float(loss))
                if i >= a.warmup:
                    times.append(dt)
                    timed += dt
                    if timed > a.max_seconds:
                        break
                elif dt > a.max_seconds:
                    times.append(dt)
                    break
            med = sorted(times)[len(times) // 2]
            rec.update({"status": "ok", "first_loss": losses[0], "losses": losses, "step_s": times,
                        "step_s_median": med, "tokens": float(B * L), "tokens_per_s_median": B * L / med})
            if dev.type == "cuda":
                rec.update({"peak_bytes": torch.cuda.max_memory_allocated(dev), "peak_kind": "cuda_max_allocated",
                            "rss_peak_delta_bytes": -1})
            else:
                rec.update({"peak_bytes": -1, "peak_kind": "none",
                            "rss_peak_delta_bytes": (status_kib("VmHWM") - rss0) * 1024})
        except Exception as e:  # noqa: BLE001 - an OOM is a result; anything else is re-raised
            if not is_oom(e):
                raise
            rec["status"] = "oom"
        batch = aux = hs_all = opt = loss = masks = None  # noqa: F841 - freed before the next length
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        rec.update({"attention": a.attention, "attention_used": attention_used, "device": a.device, "dtype": a.dtype,
                    "ttt_steps": a.ttt_steps, "batch_size": a.batch_size, "threads": torch.get_num_threads(),
                    "torch": torch.__version__})
        print(json.dumps(rec), flush=True)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--synthetic", action="store_true", help="bench_long_context.sh's mode (see the module doc)")
    ap.add_argument("--data")
    ap.add_argument("--records")
    ap.add_argument("--draft")
    ap.add_argument("--base")
    ap.add_argument("--max-length", type=int)
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--ttt-steps", type=int)
    ap.add_argument("--eval-fraction", type=float, default=0.05)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--warmup", type=int, help="steps left out of the medians (default 2; --synthetic 1)")
    ap.add_argument("--lengths", help="--synthetic: row lengths, comma-separated")
    for name, default in (("hidden", 256), ("heads", 4), ("kv-heads", 1), ("head-dim", 64), ("intermediate", 768),
                          ("vocab", 2048), ("draft-vocab", 1024), ("aux-layers", 3), ("seed", 1)):
        ap.add_argument("--" + name, type=int, default=default, help="--synthetic: default %d" % default)
    ap.add_argument("--rope-theta", type=float, default=500000.0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--attention", choices=("matmul", "sdpa"), default="matmul")
    ap.add_argument("--max-seconds", type=float, default=60.0)
    a = ap.parse_args()
    if a.synthetic:
        if not a.lengths:
            ap.error("--synthetic needs --lengths")
        a.batch_size = a.batch_size or 1
        a.steps = a.steps or 3
        a.threads = a.threads or 0
        a.ttt_steps = a.ttt_steps or 7
        a.warmup = 1 if a.warmup is None else a.warmup
        return synthetic(a)
    missing = [n for n in ("data", "records", "draft", "base", "max_length", "batch_size", "steps", "threads", "lr")
               if getattr(a, n) is None]
    if missing:
        ap.error("the following arguments are required: " + ", ".join("--" + m.replace("_", "-") for m in missing))
    a.ttt_steps = a.ttt_steps or 3
    a.warmup = 2 if a.warmup is None else a.warmup
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
                      "tokens_per_s_overall": sum(tokens[w:]) / sum(times[w:]),
                      "cpu_s_median": statistics.median(cpus[w:]), "tokens_per_cpu_s_median": statistics.median(tpc),
                      "losses": losses, "tokens": sum(tokens), "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    sys.exit(main())
