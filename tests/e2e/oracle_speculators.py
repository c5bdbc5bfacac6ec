#!/usr/bin/env python3
"""speculators' own EAGLE-3/3.1 model as an oracle for an eaglekit draft.

The speculators package (0.9, .venvs/e2e) loads our speculators-layout export of a draft
(SpeculatorModel.from_pretrained: its Eagle3DraftModel with fc_norm / norm_before_fc /
norm_output / norm_before_residual as the config says, the verifier's embeddings and lm_head
read from the base the export names) and runs its own training forward (all TTT steps, no
gradients, eager attention) on the sequences of `eaglekit collate`'s first batch (--batch: the
file oracle.py wrote, with the same --batch-size and --max-length, pad mode). Against
`eaglekit evaluate --max-batches 1` of our layout of the same draft on the same batch:

- the accuracy of TTT step 0 (speculators' count against eaglekit's ratio times the same
  position count: equal to half a position; from step 1 on speculators' full_acc counts only
  chains right so far, so later steps are reported, and their logits compared through the
  losses);
- the loss of every step: speculators' forward KL (its default loss, kl_div, undecayed) summed
  over the batch's counted positions, against eaglekit's soft cross-entropy sum minus the
  targets' entropy over the same positions (CE = KL + H): 1e-5 of the cross-entropy sum;
- every other loss of `train --loss` (rkl, js, tv, nla, lk-hybrid, ce): speculators' own eager
  loss function (resolve_loss_config) through the same forward, against `evaluate --loss` of
  the same name, per step: 1e-5 relative.

Alignment. eaglekit's position t feeds emb(ids[t + 1]) with the aux hidden state of t and is
scored against the base's distribution of hidden state t + 1, at RoPE position t. speculators
takes its data shifted: input_ids[t], hidden_states[t], verifier_last_hidden_states[t] at
position_ids[t]. So each row of real length m is given to speculators as ids[1:m], aux[0:m-1],
hs[1:m], loss_mask[1:m], positions 0..m-2, one row at a time (document ids 0).

The dumps of the e2e are post-norm (Hugging Face's last hidden state). speculators applies a
frozen verifier norm to verifier_last_hidden_states because the dumps it is written for (vLLM's)
are pre-norm; here that norm is replaced by the identity, which is what eaglekit does for a
post-norm dump (docs/data.md). A pre-norm dump would keep it.

Usage: oracle_speculators.py --eaglekit PATH --data CONV.jsonl --index FILE --base DIR
                             --draft DIR --speculators DIR --batch FILE --out DIR
                             [--batch-size 16] [--max-length 160]
Writes OUT/result.json and prints it; exit 1 when a figure differs beyond its tolerance.
"""
import argparse
import json
import os
import subprocess
import sys

import torch


def speculators_model(folder, base):
    import glob

    from safetensors.torch import load_file
    from speculators import SpeculatorModel, SpeculatorModelConfig
    cfg = SpeculatorModelConfig.from_pretrained(folder)
    # Eager attention: flex attention needs torch.compile, which this CPU oracle does not run.
    cfg.transformer_layer_config._attn_implementation = "eager"
    model = SpeculatorModel.from_pretrained(folder, config=cfg).float()
    # The frozen verifier parts from the base, set here: from_pretrained with a config given
    # left its embeddings and verifier head at their initial values (seen: neither equal to the
    # base's). The draft's own weights are the export's (checked below).
    w = {}
    for f in sorted(glob.glob(os.path.join(base, "*.safetensors"))):
        w.update(load_file(f))
    embed = w["model.embed_tokens.weight"].float()
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"]).float()
    ours = load_file(os.path.join(folder, "model.safetensors"))
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
        rows = torch.arange(model.verifier_lm_head.weight.shape[0])
        if "d2t" in ours:
            rows = rows + ours["d2t"].long()
        model.verifier_lm_head.weight.copy_(head[rows])
    for k, v in ours.items():
        if k in ("d2t", "t2d"):
            continue
        got = model.state_dict().get(k)
        if got is None or not torch.equal(got.float(), v.float()):
            raise SystemExit(f"oracle_speculators: speculators' model does not hold our {k}")
    model.verifier_norm = torch.nn.Identity()  # post-norm dumps (see above)
    model.eval()
    return model, cfg


def run_speculators(model, batch, steps, loss_config=None):
    """Per step: [correct, counted, cond_correct, cond_total, loss_sum] over the batch's rows
    (loss_config None: speculators' default, kl_div)."""
    from speculators.losses import resolve_loss_config
    if loss_config is None:
        # Its eager implementation: the default one is a Triton kernel, which needs a GPU.
        loss_config = resolve_loss_config("kl_div", implementation="eager")
    sums = torch.zeros(steps, 5, dtype=torch.float64)
    ids, mask, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    aux, hs = batch["aux_hidden_states"].float(), batch["hidden_states"].float()
    for b in range(ids.shape[0]):
        m = int(mask[b].sum())
        if m < 2:
            continue
        n = m - 1
        loss_mask = lm[b, 1:m].unsqueeze(0).bool()
        with torch.no_grad():
            _, _, metrics = model(hidden_states=aux[b, 0:n].unsqueeze(0), input_ids=ids[b, 1:m].unsqueeze(0).long(),
                                  document_ids=torch.zeros(1, n, dtype=torch.long), loss_mask=loss_mask,
                                  position_ids=torch.arange(n).unsqueeze(0),
                                  verifier_last_hidden_states=hs[b, 1:m].unsqueeze(0), ttt_steps=steps,
                                  ttt_step_loss_decay=1.0, loss_config=loss_config)
        for s in range(steps):
            counted = float(loss_mask[:, s:].sum())
            # speculators' per-row loss is the masked mean (denominator + 1e-5): back to a sum.
            kl = float(metrics[f"loss_{s}_sum"]) * (counted + 1e-5)
            sums[s] += torch.tensor([float(metrics[f"full_acc_{s}_sum"]), float(metrics[f"full_acc_{s}_total"]),
                                     float(metrics[f"cond_acc_{s}_sum"]), float(metrics[f"cond_acc_{s}_total"]), kl],
                                    dtype=torch.float64)
    return sums


def target_entropy(model, batch, steps):
    """The entropy of the base's draft-vocabulary distribution, summed over each step's counted
    positions (the same positions and targets as the losses), in float64."""
    ent = torch.zeros(steps, dtype=torch.float64)
    ids, mask, lm, hs = batch["input_ids"], batch["attention_mask"], batch["loss_mask"], batch["hidden_states"]
    with torch.no_grad():
        for b in range(ids.shape[0]):
            m = int(mask[b].sum())
            if m < 2:
                continue
            logits = model.verifier_lm_head(hs[b, 1:m].float()).double()
            h = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
            w = lm[b, 1:m].double()
            for s in range(steps):
                ent[s] += (h[s:] * w[s:]).sum()
    return ent


def evaluate(args, loss):
    r = subprocess.run([args.eaglekit, "evaluate", "--hidden-states-norm", "post", "--base", args.base, "--draft", args.draft, "--data", args.data,
                        "--index", args.index, "--split", "train", "--batch-size", str(args.batch_size),
                        "--max-length", str(args.max_length), "--max-batches", "1", "--loss", loss, "--json"],
                       check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return json.loads(r.stdout)


# eaglekit's --loss names and speculators' (losses/utils.py _EAGER_LOSS_FN_MAP) for the same loss.
LOSSES = {"rkl": "rkl", "js": "jsd", "tv": "tv", "nla": "nla", "lk-hybrid": "lk_hybrid", "ce": "ce"}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for a in ("eaglekit", "data", "index", "base", "draft", "speculators", "batch", "out"):
        ap.add_argument("--" + a, required=True)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=160)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    batch = torch.load(args.batch)
    steps = json.load(open(os.path.join(args.draft, "train_options.json"))).get("ttt_steps", 3)
    model, cfg = speculators_model(args.speculators, args.base)
    theirs = run_speculators(model, batch, steps)
    ent = target_entropy(model, batch, steps)
    ev = evaluate(args, "kl")
    res = {"draft": args.draft, "speculators": args.speculators,
           "norms": {k: bool(getattr(cfg, k, False)) for k in ("fc_norm", "norm_before_fc", "norm_output",
                                                                 "norm_before_residual")},
           "steps": []}
    ok = True
    for s in range(steps):
        correct, counted, cond_correct, cond_total, kl = theirs[s].tolist()
        ours_kl = ev["loss_per_step"][s] * counted - float(ent[s])
        step = {"step": s, "positions": counted,
                "acc": {"speculators": correct / counted, "eaglekit": ev["acc"][s]},
                "acc_positions_diff": abs(correct - ev["acc"][s] * counted),
                "cond_acc": {"speculators": cond_correct / max(cond_total, 1), "eaglekit": ev["cond_acc"][s]},
                "kl_sum": {"speculators": kl, "eaglekit": ours_kl},
                # relative to the cross-entropy sum, the figure both sides compute in float32:
                # the KL is that less the entropy, a difference that loses digits on a good draft
                "kl_rel_diff": abs(kl - ours_kl) / max(abs(ours_kl + float(ent[s])), 1e-30)}
        # float32 sums over ~2000 positions and the draft vocabulary: 1e-5 relative is far
        # above their rounding and far below what a wrong norm or a shifted step gives.
        # Accuracy is compared at step 0 only: from step 1 on speculators' full_acc counts a
        # position only when the chain was right at every step so far (compute_accuracy_single_
        # step ANDs prev_correct in), eaglekit's acc counts it whatever came before; the logits
        # themselves are compared at every step through the losses (equal to 1e-5).
        step["same"] = (s > 0 or step["acc_positions_diff"] < 0.5) and step["kl_rel_diff"] <= 1e-5
        ok &= step["same"]
        res["steps"].append(step)
    # The other losses (train --loss): speculators' own eager loss functions through its model's
    # forward, against evaluate --loss on the same batch, per step (sums over the same positions).
    from speculators.losses import resolve_loss_config
    res["losses"] = {}
    for ours, theirs_name in LOSSES.items():
        t = run_speculators(model, batch, steps, resolve_loss_config(theirs_name, implementation="eager"))
        e = evaluate(args, ours)
        per = []
        for s in range(steps):
            counted, theirs_sum = float(t[s][1]), float(t[s][4])
            ours_sum = e["loss_per_step"][s] * counted
            per.append({"speculators": theirs_sum, "eaglekit": ours_sum,
                        "rel_diff": abs(theirs_sum - ours_sum) / max(abs(ours_sum), 1e-30)})
        same = all(p["rel_diff"] <= 1e-5 for p in per)
        res["losses"][ours] = {"speculators_name": theirs_name, "steps": per, "same": same}
        ok &= same
    res["same"] = ok
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
