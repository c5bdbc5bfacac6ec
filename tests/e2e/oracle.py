#!/usr/bin/env python3
"""The reference trainer's own code as an oracle.

Data: NVIDIA ModelOpt's offline dataset and collator (the nvidia-modelopt package's
modelopt.torch.speculative.eagle.utils, and, when it is there, the reference file
../shared/reference/eagle_utils.py with its make_eagle_supervised_data_module) on the same dumps
as `eaglekit collate`, compared batch for batch, tensor for tensor.

Model (--base and --draft, repeatable): ModelOpt's EAGLE-3 model (mtsp.convert on the HF base,
offline) with the draft's weights loaded, in training mode (all TTT steps) without gradients, on
the first batch; against `eaglekit evaluate --max-batches 1` on the same batch: the loss
(sum_s 0.9^s ce_s) and the accuracy per TTT step.

Export (--speculators DIR): the speculators package's own classes (SpeculatorModelConfig,
SpeculatorModel) load our speculators-layout export: the config class and algorithm they pick,
and every tensor of the export equal to the loaded model's.

Usage: oracle.py --eaglekit PATH --data CONVERSATIONS.jsonl --dumps DIR --index FILE --out DIR
                 [--base DIR --draft DIR [--draft DIR...]] [--speculators DIR]
                 [--batch-size N] [--max-length N] [--reference FILE] [--require-reference]

Prints one JSON object, and writes it to OUT/result.json (the reference file prints on stdout
too): per oracle, the batches and tensors compared, the tensors that are
equal, and each difference named. Exit 1 when a tensor differs that the table of known
differences (KNOWN below) does not name; exit 2 when --require-reference is given and the
reference file is absent (without it, the reference oracle is skipped with a note).
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import types

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from compare import rel_diff, worst  # noqa: E402  tests/compare.py: a NaN is infinitely different

# Differences that are settings, not errors: (oracle, key) -> why.
KNOWN = {
    ("modelopt", "labels"): "ModelOpt 0.47 fills labels with the shifted input_ids; eaglekit, like the "
                            "reference file, writes -100. ModelOpt reads labels only for the base "
                            "model's own loss when the base is trained too (hf_eagle.py); the "
                            "draft's loss uses the base's hidden states",
}


def eaglekit_batches(args):
    """`eaglekit collate`'s batch files, in order (read one at a time by compare: 90 batches of
    this size are about 1 GB in memory)."""
    out = os.path.join(args.out, "eaglekit-collate")
    subprocess.run([args.eaglekit, "collate", "--data", args.data, "--index", args.index, "--out", out,
                    "--batch-size", str(args.batch_size), "--max-length", str(args.max_length),
                    "--mode", "pad", "--split", "train"], check=True, stdout=subprocess.DEVNULL)
    return sorted(glob.glob(os.path.join(out, "batch_*.pt")))


def conversations(path):
    return [json.loads(l) for l in open(path) if l.strip()]


def collated(ds, coll, batch_size):
    """A ModelOpt-style dataset and collator's batches, in order, under eaglekit collate's names."""
    for i in range(0, len(ds), batch_size):
        b = coll([ds[j] for j in range(i, min(i + batch_size, len(ds)))])
        yield {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"], "loss_mask": b["loss_mask"],
               "labels": b["labels"], "hidden_states": b["base_model_outputs"]["base_model_hidden_states"],
               "aux_hidden_states": b["base_model_outputs"]["aux_hidden_states"]}


def modelopt_batches(args, conv):
    """modelopt.torch.speculative.eagle.utils: the dataset over the dumps in conversation order
    (ModelOpt's training script matches by conversation_id and keeps the first 95%)."""
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset
    files = [os.path.join(args.dumps, c["conversation_id"] + ".pt") for c in conv]
    files = [f for f in files if os.path.exists(f)]
    files = files[:int(len(files) * 0.95)]
    ds = OfflineSupervisedDataset(files)
    coll = EagleOfflineDataCollator(train_len=args.max_length)
    return collated(ds, coll, args.batch_size)


def reference_batches(args, ref):
    """The reference file's make_eagle_supervised_data_module (ModelOpt's example trainer's data
    path). It imports modules of ModelOpt's examples folder and a private torch class that torch
    2.13 no longer has, none of which the offline data path calls: those get stand-ins."""
    import torch.distributed.tensor.experimental._attention as A
    if not hasattr(A, "_SDPAMerger"):
        A._SDPAMerger = object
    scripts = types.ModuleType("scripts")
    ar = types.ModuleType("scripts.ar_validate")
    ar.validate_ar = None
    sys.modules.setdefault("scripts", scripts)
    sys.modules.setdefault("scripts.ar_validate", ar)
    sys.path.insert(0, os.path.dirname(ref))
    import eagle_utils
    tok = types.SimpleNamespace(model_max_length=args.max_length)
    data_args = types.SimpleNamespace(data_path=args.data, offline_data_path=args.dumps, vlm_processor=None,
                                      vlm_img_dir=None, lazy_preprocess=True)
    m = eagle_utils.make_eagle_supervised_data_module(tok, data_args, max_length=args.max_length)
    ds, coll = m["train_dataset"], m["data_collator"]
    return collated(ds, coll, args.batch_size)


def load_modelopt(base_dir, draft_dir):
    """ModelOpt's offline EAGLE-3 model (mtsp.convert of the HF base) with our draft's weights."""
    import copy
    import modelopt.torch.speculative as mtsp
    from modelopt.torch.speculative.config import eagle3_default_config
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    base = LlamaForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    dc = json.load(open(os.path.join(draft_dir, "config.json")))
    arch = copy.deepcopy(eagle3_default_config)
    arch.update({"torch_dtype": "float32", "intermediate_size": dc["intermediate_size"],
                 "num_attention_heads": dc["num_attention_heads"], "num_key_value_heads": dc["num_key_value_heads"],
                 "head_dim": dc["head_dim"], "rms_norm_eps": dc["rms_norm_eps"], "rope_theta": dc["rope_theta"],
                 "rope_scaling": {"rope_type": "default", "rope_theta": dc["rope_theta"]},
                 "draft_vocab_size": dc["draft_vocab_size"], "num_hidden_layers": dc["num_hidden_layers"],
                 "eagle_aux_hidden_state_layer_ids": dc["eagle_config"]["eagle_aux_hidden_state_layer_ids"]})
    steps = json.load(open(os.path.join(draft_dir, "train_options.json"))).get("ttt_steps", 3)
    mtsp.convert(base, [("eagle", {"eagle_offline": True, "eagle_use_torch_compile": False, "eagle_ttt_steps": steps,
                                   "eagle_loss_decay_factor": 0.9, "eagle_mix_hidden_states": False,
                                   "eagle_architecture_config": arch})])
    em = base.eagle_module
    weights = {k.replace("midlayer.", "layers.0."): v
               for k, v in load_file(os.path.join(draft_dir, "model.safetensors")).items() if k != "t2d"}
    missing, unexpected = em.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise SystemExit(f"oracle: the draft's weights do not fit ModelOpt's module: missing {missing}, "
                         f"unexpected {unexpected}")
    # ModelOpt 0.47 builds its rotary embedding with a device= argument that transformers 5.19's
    # LlamaRotaryEmbedding no longer takes; built here, the same module, without it.
    em.rotary_emb = LlamaRotaryEmbedding(config=em.config)
    return base, dc


def modelopt_model(base_dir, draft_dir, batch):
    """ModelOpt's EAGLE-3 model over the HF base with our draft's weights: (loss, acc per step)."""
    base, dc = load_modelopt(base_dir, draft_dir)
    base.train()  # all TTT steps (ModelOpt runs one step in eval mode); no dropout in the draft
    with torch.no_grad():
        out = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], loss_mask=batch["loss_mask"],
                   labels=batch["labels"], base_model_outputs={"base_model_hidden_states": batch["hidden_states"],
                                                               "aux_hidden_states": batch["aux_hidden_states"]})
    return out.eagle_loss.item(), [float(a) for a in out.train_acc[0]], bool(dc.get("eaglekit_modelopt_norm"))


def compare_model(args, draft_dir, batch):
    loss, acc, modelopt_norm = modelopt_model(args.base, draft_dir, batch)
    r = subprocess.run([args.eaglekit, "evaluate", "--hidden-states-norm", "post", "--base", args.base, "--draft", draft_dir, "--data", args.data,
                        "--index", args.index, "--split", "train", "--batch-size", str(args.batch_size),
                        "--max-length", str(args.max_length), "--max-batches", "1", "--json"],
                       check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    ev = json.loads(r.stdout)
    tokens = ev["tokens"]
    res = {"draft": draft_dir, "modelopt_norm": modelopt_norm, "modelopt": {"loss": loss, "acc": acc},
           "eaglekit": {"loss": ev["loss"], "acc": ev["acc"], "tokens": tokens},
           "loss_rel_diff": rel_diff(loss, ev["loss"]),
           # about how many positions' argmax differ (step 0's count of positions for every step)
           "acc_positions_diff": [round(worst(abs(a - b) * tokens), 3) for a, b in zip(acc, ev["acc"])]}
    # float32 sums over the batch's positions and the draft vocabulary: 1e-6 relative is 100x their
    # rounding (measured 7e-9) and below the smallest real difference seen (the norm form with
    # input_layernorm weights within 3% of 1: 2e-6).
    res["same"] = res["loss_rel_diff"] <= 1e-6 and all(d < 0.5 for d in res["acc_positions_diff"])
    return res


def speculators_export(folder):
    """The speculators package's own config and model classes on our speculators export."""
    from importlib.metadata import version

    from safetensors.torch import load_file
    from speculators import SpeculatorModel, SpeculatorModelConfig
    cfg = SpeculatorModelConfig.from_pretrained(folder)
    model = SpeculatorModel.from_pretrained(folder)
    sd = model.state_dict()
    ours = load_file(os.path.join(folder, "model.safetensors"))
    differ = sorted(k for k, v in ours.items() if k not in sd or not torch.equal(sd[k].to(v.dtype), v))
    return {"version": version("speculators"), "config_class": type(cfg).__name__,
            "algorithm": cfg.speculators_config.algorithm, "model_class": type(model).__name__,
            "tensors": len(ours), "differ_or_missing": differ,
            "ok": type(cfg).__name__ == "Eagle3SpeculatorConfig" and not differ}


def compare(name, theirs, ours):
    res = {"batches": 0, "equal": {}, "differ": {}, "unexplained": []}
    n_theirs = 0
    for i, t in enumerate(theirs):
        n_theirs += 1
        if i >= len(ours):
            continue
        o = torch.load(ours[i])
        res["batches"] += 1
        for k, v in t.items():
            same = k in o and o[k].shape == v.shape and o[k].dtype == v.dtype and torch.equal(o[k], v)
            d = res["equal"] if same else res["differ"]
            d[k] = d.get(k, 0) + 1
    if n_theirs != len(ours):
        res["unexplained"].append(f"{n_theirs} batches from {name}, {len(ours)} from eaglekit collate")
    for k in res["differ"]:
        if (name, k) in KNOWN:
            res.setdefault("known", {})[k] = KNOWN[(name, k)]
        else:
            res["unexplained"].append(f"{k} differs in {res['differ'][k]} of {res['batches']} batches")
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eaglekit", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--dumps", required=True)
    ap.add_argument("--index", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=160)
    ap.add_argument("--base", help="HF base folder (for the model oracle)")
    ap.add_argument("--draft", action="append", default=[], help="draft folder for the model oracle (repeatable)")
    ap.add_argument("--speculators", help="a speculators-layout export to load with the speculators package")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--reference", default=os.environ.get(
        "EAGLEKIT_REFERENCE", os.path.join(os.path.dirname(root), "shared", "reference", "eagle_utils.py")))
    ap.add_argument("--require-reference", action="store_true",
                    help="exit 2 when the reference file is absent instead of skipping it (CI: scripts/e2e passes it "
                         "when CI=true, as CI's clone has ../shared beside it)")
    args = ap.parse_args()
    if args.require_reference and not os.path.exists(args.reference):
        print(f"oracle: the reference file {args.reference} is absent, and --require-reference (CI=true) says it must "
              "run: put the reference folder at ../shared/reference beside the clone or set EAGLEKIT_REFERENCE",
              file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    ours = eaglekit_batches(args)
    conv = conversations(args.data)
    result = {"eaglekit_batches": len(ours), "oracles": {}}
    import modelopt
    result["oracles"]["modelopt"] = compare("modelopt", modelopt_batches(args, conv), ours)
    result["oracles"]["modelopt"]["version"] = modelopt.__version__
    if os.path.exists(args.reference):
        result["oracles"]["reference"] = compare("reference", reference_batches(args, args.reference), ours)
        result["oracles"]["reference"]["file"] = args.reference
    else:
        result["reference_skipped"] = f"{args.reference} not found (set EAGLEKIT_REFERENCE)"
    if args.draft and not args.base:
        ap.error("--draft needs --base")
    first = torch.load(ours[0])
    result["model"] = [compare_model(args, d, first) for d in args.draft]
    if args.speculators:
        result["speculators"] = speculators_export(args.speculators)
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    failed = any(o["unexplained"] for o in result["oracles"].values()) or not all(m["same"] for m in result["model"]
                                                                                if m["modelopt_norm"])
    return 1 if failed or not result.get("speculators", {"ok": True})["ok"] else 0


if __name__ == "__main__":
    sys.exit(main())
