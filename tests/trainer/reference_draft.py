#!/usr/bin/python3
"""Independent reference for eaglekit's EAGLE-3 draft with training-time test.

Written from docs/draft.md, docs/ttt.md and docs/export.md only, in the most literal form:
torch.roll for the rolls, the TTT mask built entry by entry from the rule of docs/ttt.md (the
mask), the loss sliced as docs/ttt.md (loss per step) writes it. It reads what eaglekit wrote (an exported draft folder, a base model folder,
a batch, eaglekit's gradients and metrics), recomputes everything in float64 and prints one
JSON object per case with the largest relative differences.

usage: reference_draft.py MANIFEST.json
MANIFEST: {"cases": [{"name", "base", "draft", "batch", "cpp_grads", "cpp_metrics",
                      "steps", "decay"}]}
"""
import json
import math
import os
import struct
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from compare import json_number, rel_diff, tensor_rel_diff, worst_key, worst_of  # noqa: E402  tests/compare.py

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


def read_safetensors(path):
    """A minimal safetensors reader: u64 header length, JSON header, raw little-endian data."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    data = raw[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = DTYPES[info["dtype"]]
        buf = bytearray(data[begin:end])
        t = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
        out[name] = t.reshape(info["shape"]).clone()
    return out, header.get("__metadata__", {})


def rms_norm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def inv_freq(cfg):
    d = cfg["head_dim"]
    theta = cfg["rope_theta"]
    freqs = [1.0 / theta ** (2 * i / d) for i in range(d // 2)]
    rs = cfg.get("rope_scaling")
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        out = []
        for f in freqs:
            wavelen = 2 * math.pi / f
            if wavelen < old / high:
                out.append(f)
            elif wavelen > old / low:
                out.append(f / factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                out.append((1 - smooth) * f / factor + smooth * f)
        freqs = out
    return torch.tensor(freqs, dtype=torch.float64)


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def allowed(L, s, q, j):
    """The rule of docs/ttt.md (the mask), term by term."""
    if j <= q - s:
        return True
    return any(j == i * L + q - (s - i) and j >= i * L for i in range(1, s + 1))


def forward(cfg, w, base, batch, steps, decay):
    f64 = torch.float64
    B, L = batch["input_ids"].shape
    H, nh, nkv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    modelopt = cfg.get("eaglekit_modelopt_norm", False)
    ids = batch["input_ids"].long()
    am = batch["attention_mask"]
    lm = batch["loss_mask"].to(f64)
    hs = batch["hidden_states"].to(f64)
    aux = batch["aux_hidden_states"].to(f64)
    d2t = w["d2t"].long()
    draft_ids = torch.arange(d2t.shape[0]) + d2t

    emb = base["embed"][torch.roll(ids, -1, dims=1)]
    key_valid = torch.roll(am, -1, dims=1) != 0
    target_logits = hs @ base["lm_head"][draft_ids].T  # map: the draft columns of lm_head(hs)
    p = torch.softmax(target_logits, -1)

    ang = torch.outer(torch.arange(L, dtype=f64), inv_freq(cfg))
    cos = torch.cat([ang, ang], -1).cos()
    sin = torch.cat([ang, ang], -1).sin()

    def proj(x, name):
        return x @ w[name].T

    # docs/draft.md: one layer is "midlayer"; a deeper draft names them layers.0 .. layers.N-1,
    # layer 0 on cat(emb, h), the others plain Llama layers on the previous layer's output.
    n_layers = cfg.get("num_hidden_layers", 1)
    prefix = ["midlayer."] if n_layers == 1 else ["layers.%d." % i for i in range(n_layers)]
    h = proj(aux, "fc.weight")
    emb_n = rms_norm(emb, w[prefix[0] + "input_layernorm.weight"], eps)
    ks, vs = [[] for _ in prefix], [[] for _ in prefix]
    losses, correct, mask_sums, cond_correct, cond_total = [], [], [], [], []
    chain_right = []  # per step: [B, L-1-s] bool, masked-and-right, indexed by chain start u
    prev = None
    for s in range(steps):
        if s > 0:
            h = torch.roll(prev, 1, dims=1)
        out = h
        for li, P in enumerate(prefix):
            inp = out
            if li == 0:
                hin = rms_norm(inp, w[P + "input_layernorm.weight"], eps) if modelopt else inp
                x = torch.cat([emb_n, rms_norm(hin, w[P + "hidden_norm.weight"], eps)], -1)
            else:
                x = rms_norm(inp, w[P + "input_layernorm.weight"], eps)
            q = proj(x, P + "self_attn.q_proj.weight").view(B, L, nh, hd).transpose(1, 2)
            k = proj(x, P + "self_attn.k_proj.weight").view(B, L, nkv, hd).transpose(1, 2)
            v = proj(x, P + "self_attn.v_proj.weight").view(B, L, nkv, hd).transpose(1, 2)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            ks[li].append(k)
            vs[li].append(v)
            K = torch.cat(ks[li], 2).repeat_interleave(nh // nkv, dim=1)
            V = torch.cat(vs[li], 2).repeat_interleave(nh // nkv, dim=1)
            m = torch.tensor([[allowed(L, s, qi, j) for j in range(L * (s + 1))] for qi in range(L)])
            m = m.unsqueeze(0) & key_valid.repeat(1, s + 1).unsqueeze(1)  # [B, L, L(s+1)]
            scores = (q @ K.transpose(-1, -2)) / math.sqrt(hd)
            scores = scores.masked_fill(~m.unsqueeze(1), -1e30)
            attn = torch.softmax(scores, -1) @ V
            o = proj(attn.transpose(1, 2).reshape(B, L, nh * hd), P + "self_attn.o_proj.weight")
            r = inp + o
            y = rms_norm(r, w[P + "post_attention_layernorm.weight"], eps)
            mlp = proj(torch.nn.functional.silu(proj(y, P + "mlp.gate_proj.weight")) *
                       proj(y, P + "mlp.up_proj.weight"), P + "mlp.down_proj.weight")
            out = r + mlp
        logits = proj(rms_norm(out, w["norm.weight"], eps), "lm_head.weight")

        logp = torch.log_softmax(logits, -1)[:, s:L - 1]
        ps = p[:, 1 + s:]
        ms = lm[:, 1 + s:]
        losses.append(-(ms * (ps * logp).sum(-1)).sum() / (ms.sum() + 1e-5))
        right = (logits[:, s:L - 1].argmax(-1) == target_logits[:, 1 + s:].argmax(-1)) & (ms > 0)
        correct.append(int(right.sum()))
        mask_sums.append(float(ms.sum()))
        ok = torch.ones_like(right)
        for j in range(s):  # chain u at step j is column u of the step-j slices
            ok &= chain_right[j][:, :L - 1 - s]
        cond_total.append(int((ok & (ms > 0)).sum()))
        cond_correct.append(int((ok & right).sum()))
        chain_right.append(right)
        prev = out
    total = sum(decay ** s * l for s, l in enumerate(losses))
    return total, losses, correct, mask_sums, cond_correct, cond_total


def run_case(case):
    with open(case["draft"] + "/config.json") as f:
        cfg = json.load(f)
    weights, _ = read_safetensors(case["draft"] + "/model.safetensors")
    base_w, _ = read_safetensors(case["base"] + "/model.safetensors")
    base = {"embed": base_w["model.embed_tokens.weight"].to(torch.float64)}
    base["lm_head"] = base_w["lm_head.weight"].to(torch.float64) if "lm_head.weight" in base_w else base["embed"]
    batch, _ = read_safetensors(case["batch"])
    w = {}
    for name, t in weights.items():
        if t.is_floating_point():
            w[name] = t.to(torch.float64).requires_grad_(True)
        else:
            w[name] = t
    total, losses, correct, mask_sums, cond_correct, cond_total = forward(
        cfg, w, base, batch, case["steps"], case["decay"])
    total.backward()

    cpp_grads, _ = read_safetensors(case["cpp_grads"])
    with open(case["cpp_metrics"]) as f:
        cpp = json.load(f)
    # A NaN anywhere counts as infinitely different (tests/compare.py).
    grad_rel = {name: tensor_rel_diff(cpp_grads[name], w[name].grad) for name in cpp_grads}
    worst = worst_key(grad_rel)
    acc = [c / m if m else 0.0 for c, m in zip(correct, mask_sums)]
    cond = [c / t if t else 0.0 for c, t in zip(cond_correct, cond_total)]
    return {
        "name": case["name"],
        "loss": float(total),
        "loss_rel": json_number(rel_diff(cpp["loss"], float(total))),
        "loss_per_step_rel": json_number(worst_of(rel_diff(a, float(b)) for a, b in zip(cpp["loss_per_step"], losses))),
        "acc": acc,
        "acc_equal": cpp["acc"] == acc,
        "cond_acc": cond,
        "cond_acc_equal": cpp["cond_acc"] == cond,
        "correct_equal": cpp["correct"] == correct and cpp["cond_correct"] == cond_correct and
                         cpp["cond_total"] == cond_total,
        "mask_sum_equal": cpp["mask_sum"] == mask_sums,
        "grad_rel_max": json_number(grad_rel[worst]),
        "grad_rel_worst": worst,
        "grads_compared": len(grad_rel),
        "grads_expected": sum(1 for t in w.values() if t.is_floating_point()),
    }


def main():
    with open(sys.argv[1]) as f:
        manifest = json.load(f)
    print(json.dumps({"cases": [run_case(c) for c in manifest["cases"]]}))


if __name__ == "__main__":
    main()
