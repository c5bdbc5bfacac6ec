#!/usr/bin/env python3
"""What FP8 hidden-state dumps cost in acceptance (issue #40 item 5): the same training dumps
stored as bf16 and as FP8, a draft trained on each with the end-to-end check's recipe and seed,
evaluated on the same held-out dumps and served by vLLM on the same prompts.

Usage: .venvs/e2e/bin/python bench/bench_fp8_acceptance.py [--work e2e-out] [--out DIR]
           [--sides bf16,fp8,eks-fp8] [--seeds 7] [--epochs 2] [--eaglekit PATH] [--json]

--work is a finished scripts/e2e folder (its base, data/train.jsonl, data/dumps/*.pt,
data/heldout.jsonl, heldout.idx, d2t.pt, data/prompts.json); it is only read. Into --out
(default: WORK/bench-fp8), from the e2e's training dumps (ModelOpt-style .pt, float32: the
base's three aux layers and its post-norm last layer), row i of data/train.jsonl becoming
hs_{i}.safetensors in speculators' stacked layout ([T, 3 + 1, H], token_ids [T]), as vLLM's
hidden-state connectors write it from the tensors they are handed (in bf16, a bf16 model's dtype):

  bf16     vLLM 0.32's ExampleHiddenStatesConnector._write_tensors (the bf16 file)
  fp8      hs-connectors 0.9.0's FP8HiddenStatesConnector._write_tensors (speculators' FP8
           file: float8_e4m3fn states, one float32 scale amax/448 per token over its 4 x H values)
  eks-fp8  `eaglekit convert` of the e2e's .pt dumps to one .eks shard with --codec fp8
           (eaglekit's own FP8 codec: a float32 scale per token for hidden and for aux
           separately). Not of the bf16 set: convert writes the pre-norm form the stacked layout
           implies into the .eks as a stated form, which --hidden-states-norm post then no longer
           overrides (these states are post-norm); the .pt records state none
  f32      the e2e's own .pt dumps as they are (its train.idx), for reference

The producers' functions are called, not copied (the same calls as
tests/data/speculators_fp8/make_fixture.py). Each set is indexed; then for each side and seed:

  train     tests/e2e/e2e.py's train_cmd: the e2e's EAGLE-3 recipe (--hidden-states-norm post,
            batch 16, length 160, lr 2e-3, 20 warm-up steps, TTT 3, eval fraction 0.02, its d2t.pt)
            with --seed and --epochs (default 2, the e2e's); hs_{i} records find their
            conversation by row, as the e2e's by id, so every side trains the same samples
  evaluate  e2e.py's evaluate_cmd: `eaglekit evaluate --split all` on the e2e's held-out dumps
            (float32, the same for every side): loss, per-step accuracy, est_ar, est_ar_cond
  serve     tests/e2e/serve.py with e2e.py's serve_args (vLLM CPU, greedy, float32, 3 speculative
            tokens, the held-out prompts): mean acceptance length, and how many outputs equal the
            base's alone (WORK/serve-base.json when there, else served once into --out)

Stages whose result file exists are reused (a side's run: DIR/eE/SIDE/seedN/). Prints, per side,
the bytes per token of its dump set (every file of the set over its tokens) and the ratio to
bf16, the evaluate figures, the engine's acceptance per seed (mean, spread, standard error from
its per-position counts) and the outputs equal to the base's; writes DIR/eE/results.json and
DIR/eE/table.md; for the hs sets also the relative RMS error of their states against the
float32 originals, per layer (every 15th record; "state error"). Progress goes to stderr. Exit 0
when everything ran and every speculative output equals the base's (greedy speculative decoding
must be exact), 1 when a stage fails or an output differs, 2 on usage errors.
"""
import argparse
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
import e2e  # noqa: E402  (train_cmd, evaluate_cmd, serve_args, Run)

SIDES = {
    "bf16": "vLLM's connector, bf16",
    "fp8": "hs-connectors FP8 (speculators)",
    "eks-fp8": "eaglekit .eks --codec fp8",
    "f32": "the e2e's .pt, float32",
}


def log(msg):
    print(f"bench_fp8: {msg}", file=sys.stderr, flush=True)


def write_json(path, obj):
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)  # a result file exists only when whole


class Done:
    """Stands in for the CUDA event the connectors wait on: the tensors are already on the CPU."""

    def synchronize(self):
        pass


def write_sets(work, dumps, want):
    """Row i of train.jsonl -> hs_{i}.safetensors in bf16/ and fp8/, through the producers' own
    writers. Returns {"records", "tokens"}."""
    import torch
    from hs_connectors.fp8_hidden_states_connector import FP8HiddenStatesConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
    )
    writers = {"bf16": ExampleHiddenStatesConnector._write_tensors, "fp8": FP8HiddenStatesConnector._write_tensors}
    writers = {k: v for k, v in writers.items() if k in want}
    for k in writers:
        shutil.rmtree(os.path.join(dumps, k), ignore_errors=True)
        os.makedirs(os.path.join(dumps, k))
    ids = [json.loads(l)["conversation_id"] for l in open(os.path.join(work, "data", "train.jsonl")) if l.strip()]
    tokens = 0
    for i, cid in enumerate(ids):
        src = os.path.join(work, "data", "dumps", cid + ".pt")
        if not os.path.exists(src):
            raise SystemExit(f"bench_fp8: {src}: no dump for row {i} of train.jsonl (hs_{i} would be another row's)")
        d = torch.load(src, weights_only=True)
        hs, aux = d["hidden_states"], d["aux_hidden_states"]
        t, h = hs.shape
        # speculators' stacked layout: the aux layers in order, then the last layer.
        stacked = torch.cat([aux.reshape(t, -1, h), hs.reshape(t, 1, h)], dim=1).to(torch.bfloat16).contiguous()
        rec = {"hidden_states": stacked, "token_ids": d["input_ids"].to(torch.int64).reshape(t)}
        for k, w in writers.items():
            w(dict(rec), Done(), os.path.join(dumps, k, f"hs_{i}.safetensors"), None)
        tokens += t
        if (i + 1) % 500 == 0:
            log(f"  {i + 1} of {len(ids)} records written")
    return {"records": len(ids), "tokens": tokens}


def round_trip_error(work, dumps, sides, every=15):
    """Per layer (the aux layers, then the last), the relative RMS error of each hs set's states
    against the e2e's float32 originals, read back as the producers read them (FP8 through
    hs_connectors' dequantize_fp8_tensor, to float32), on every `every`-th row."""
    import torch
    from hs_connectors.fp8_utils import SCALES_KEY, dequantize_fp8_tensor
    from safetensors.torch import load_file
    ids = [json.loads(l)["conversation_id"] for l in open(os.path.join(work, "data", "train.jsonl")) if l.strip()]
    num = {s: 0 for s in sides}
    den = 0
    for i in range(0, len(ids), every):
        d = torch.load(os.path.join(work, "data", "dumps", ids[i] + ".pt"), weights_only=True)
        t, h = d["hidden_states"].shape
        x = torch.cat([d["aux_hidden_states"].reshape(t, -1, h), d["hidden_states"].reshape(t, 1, h)], dim=1).double()
        den = den + x.pow(2).sum(dim=(0, 2))
        for s in sides:
            f = load_file(os.path.join(dumps, s, f"hs_{i}.safetensors"))
            y = (dequantize_fp8_tensor(f["hidden_states"], f[SCALES_KEY], torch.float32) if SCALES_KEY in f
                 else f["hidden_states"].float()).double()
            num[s] = num[s] + (y - x).pow(2).sum(dim=(0, 2))
    return {s: [float(v) for v in (num[s] / den).sqrt()] for s in sides}


def set_bytes(paths):
    return sum(os.path.getsize(p) for p in paths)


def engine_stats(spec):
    """The engine's mean acceptance length and its standard error from the per-position counts
    (accepted_per_pos[j] counts the drafts that accepted more than j tokens; drafts taken as
    independent)."""
    n, pp = spec["drafts"], spec.get("accepted_per_pos") or []
    if not pp:
        return spec["mean_acceptance_length"], None
    ks = [(pp[j] - (pp[j + 1] if j + 1 < len(pp) else 0), j + 1) for j in range(len(pp))]
    m1 = sum(c * k for c, k in ks) / n
    var = sum(c * k * k for c, k in ks) / n - m1 * m1
    return spec["mean_acceptance_length"], (var / n) ** 0.5


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=os.path.join(ROOT, "e2e-out"), help="a finished scripts/e2e folder (read only)")
    ap.add_argument("--out", help="output folder (default: WORK/bench-fp8; finished stages are reused)")
    ap.add_argument("--sides", default="bf16,fp8,eks-fp8", help="comma-separated, in order; known: " + ", ".join(SIDES))
    ap.add_argument("--seeds", default=str(e2e.SEED), help="comma-separated training seeds (default: the e2e's)")
    ap.add_argument("--epochs", type=int, default=e2e.EPOCHS, help="training epochs (default: the e2e's)")
    ap.add_argument("--eaglekit", default=os.path.join(ROOT, os.environ.get("EAGLEKIT_BUILD_DIR", "build"), "bin", "eaglekit"))
    ap.add_argument("--json", action="store_true", help="print results.json on stdout")
    a = ap.parse_args()
    sides = [s for s in a.sides.split(",") if s]
    bad = [s for s in sides if s not in SIDES]
    if bad or not sides:
        ap.error(f"--sides: unknown {', '.join(bad) or '(none)'}; known: {', '.join(SIDES)}")
    try:
        seeds = [int(x) for x in a.seeds.split(",") if x]
    except ValueError:
        ap.error(f"--seeds {a.seeds!r}: not a list of integers")
    if not seeds or a.epochs < 1:
        ap.error("--seeds needs at least one seed and --epochs at least 1")
    if not os.access(a.eaglekit, os.X_OK):
        ap.error(f"--eaglekit {a.eaglekit}: not an executable (build it: ninja -C build eaglekit)")
    work = os.path.abspath(a.work)
    need = ["base/config.json", "data/train.jsonl", "data/dumps", "data/heldout.jsonl", "data/prompts.json",
            "train.idx", "heldout.idx", "d2t.pt"]
    missing = [p for p in need if not os.path.exists(os.path.join(work, p))]
    if missing:
        ap.error(f"--work {work}: missing {', '.join(missing)} (run scripts/e2e first)")
    out = os.path.abspath(a.out or os.path.join(work, "bench-fp8"))
    dumps = os.path.join(out, "dumps")
    os.makedirs(dumps, exist_ok=True)
    r = e2e.Run(argparse.Namespace(work=out))  # its sh: the command to stderr, exit 1 when it fails
    ek, py, base = a.eaglekit, sys.executable, os.path.join(work, "base")
    data, d2t = os.path.join(work, "data", "train.jsonl"), os.path.join(work, "d2t.pt")
    loads = [os.getloadavg()[0]]
    t_start = time.time()
    log(f"sides {', '.join(sides)}; seeds {', '.join(map(str, seeds))}; {a.epochs} epochs; work {work}; out {out}; "
        f"load average {loads[0]:.1f}")

    # 1. The dump sets, and an index of each.
    sets = {}
    marker = os.path.join(dumps, "written.json")
    hs_sides = [s for s in ("bf16", "fp8") if s in sides]
    prev = json.load(open(marker)) if os.path.exists(marker) else {}
    if hs_sides and not all(s in prev.get("sides", []) for s in hs_sides):
        log(f"writing {', '.join(hs_sides)} hs_{{i}}.safetensors from {os.path.join(work, 'data', 'dumps')}")
        t0 = time.time()
        prev = dict(write_sets(work, dumps, hs_sides), sides=hs_sides)
        write_json(marker, prev)
        log(f"  {prev['records']} records, {prev['tokens']} tokens in {time.time() - t0:.0f} s")
    tokens = prev.get("tokens")
    for s in sides:
        if s == "f32":
            files = sorted(glob.glob(os.path.join(work, "data", "dumps", "*.pt")))
            sets[s] = {"files": files, "index": os.path.join(work, "train.idx")}
            if tokens is None:
                import torch
                tokens = sum(torch.load(f, weights_only=True)["input_ids"].numel() for f in files)
            continue
        if s == "eks-fp8":
            eks = os.path.join(dumps, "eks-fp8", "train.eks")
            if not os.path.exists(eks):
                shutil.rmtree(os.path.dirname(eks), ignore_errors=True)
                os.makedirs(os.path.dirname(eks))
                r.sh([ek, "convert", os.path.join(work, "data", "dumps"), eks + ".part", "--format", "eks",
                      "--codec", "fp8"])
                os.replace(eks + ".part", eks)
            files = [eks]
        else:
            files = sorted(glob.glob(os.path.join(dumps, s, "hs_*.safetensors")))
        idx = os.path.join(dumps, s + ".idx")
        if not os.path.exists(idx):
            r.sh([ek, "index", os.path.dirname(files[0]), "--out", idx + ".part"])
            os.replace(idx + ".part", idx)
        sets[s] = {"files": files, "index": idx}
    for s in sides:
        sets[s]["bytes"] = set_bytes(sets[s]["files"])
        sets[s]["bytes_per_token"] = sets[s]["bytes"] / tokens
        log(f"{s}: {len(sets[s]['files'])} files, {sets[s]['bytes']} bytes, "
            f"{sets[s]['bytes_per_token']:.1f} bytes a token")

    err_json = os.path.join(dumps, "round_trip_error.json")
    if hs_sides and not os.path.exists(err_json):
        write_json(err_json, round_trip_error(work, dumps, hs_sides))
    errors = json.load(open(err_json)) if hs_sides else {}
    for s, e in errors.items():
        log(f"{s}: relative RMS error against the float32 dumps, per layer (aux..., last): "
            + ", ".join(f"{100 * v:.2f}%" for v in e))

    # 2. The base alone: the outputs every speculative run must equal.
    prompts, serve = os.path.join(work, "data", "prompts.json"), os.path.join(ROOT, "tests", "e2e", "serve.py")
    base_serve = os.path.join(work, "serve-base.json")
    if not os.path.exists(base_serve):
        base_serve = os.path.join(out, "serve-base.json")
        if not os.path.exists(base_serve):
            r.sh([py, serve, *e2e.serve_args(base, None), "--prompts", prompts, "--out", base_serve + ".tmp"])
            os.replace(base_serve + ".tmp", base_serve)
    ref = json.load(open(base_serve))["outputs"]

    # 3. Train, evaluate and serve each side and seed.
    runs = os.path.join(out, f"e{a.epochs}")
    results = {s: [] for s in sides}
    for seed in seeds:
        for s in sides:
            d = os.path.join(runs, s, f"seed{seed}")
            os.makedirs(d, exist_ok=True)
            run, tag = os.path.join(d, "run"), f"{s} seed {seed}"
            train_json = os.path.join(d, "train.json")
            if not (os.path.exists(train_json) and os.path.exists(os.path.join(run, "final", "config.json"))):
                shutil.rmtree(run, ignore_errors=True)  # of a run that stopped part way
                cmd = e2e.train_cmd(ek, base, data, sets[s]["index"], d2t, run, seed=seed, epochs=a.epochs)
                log(f"train {tag}")
                t0 = time.time()
                r.sh(cmd)
                write_json(train_json, {"seconds": round(time.time() - t0, 1), "command": cmd,
                                        "load_after": os.getloadavg()[0]})
                loads.append(os.getloadavg()[0])
            tr = json.load(open(train_json))
            if tr.get("load_after") is not None:
                loads.append(tr["load_after"])  # a reused run's load too
            ms = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl")) if l.strip()]
            train_lines = [m for m in ms if m.get("split") != "eval"]
            cpu = sorted(m["cpu_ms"] for m in train_lines if "cpu_ms" in m)
            ev_json = os.path.join(d, "evaluate.json")
            if not os.path.exists(ev_json):
                r.sh(e2e.evaluate_cmd(ek, base, os.path.join(run, "final"), os.path.join(work, "data", "heldout.jsonl"),
                                      os.path.join(work, "heldout.idx")), out=ev_json + ".tmp")
                os.replace(ev_json + ".tmp", ev_json)
            ev = json.load(open(ev_json))
            sv_json = os.path.join(d, "serve.json")
            if not os.path.exists(sv_json):
                log(f"serve {tag}")
                r.sh([py, serve, *e2e.serve_args(base, os.path.join(run, "final")), "--prompts", prompts,
                      "--out", sv_json + ".tmp"])
                os.replace(sv_json + ".tmp", sv_json)
                loads.append(os.getloadavg()[0])
            sv = json.load(open(sv_json))
            if not sv["spec"] or not sv["spec"].get("drafts"):
                raise SystemExit(f"bench_fp8: serve {tag}: the engine reported no speculative drafts ({sv_json})")
            acc, se = engine_stats(sv["spec"])
            same = sum(x == y for x, y in zip(sv["outputs"], ref))
            res = {"seed": seed, "train_seconds": tr["seconds"], "steps": max(m["step"] for m in train_lines),
                   "first_loss": train_lines[0]["loss"], "cpu_ms_per_step": cpu[len(cpu) // 2] if cpu else None,
                   "eval_loss": ev["loss"], "acc": ev["acc"], "est_ar": ev["est_ar"], "est_ar_cond": ev.get("est_ar_cond"),
                   "mean_acceptance_length": acc, "engine_stderr": se, "drafts": sv["spec"]["drafts"],
                   "accepted_per_pos": sv["spec"]["accepted_per_pos"], "outputs_identical": same, "prompts": len(ref)}
            results[s].append(res)
            log(f"{tag}: eval loss {res['eval_loss']:.4f}, acc {', '.join(f'{x:.4f}' for x in res['acc'])}, est_ar "
                f"{res['est_ar']:.3f}, acceptance {acc:.3f}, outputs = base {same}/{len(ref)}, train "
                f"{res['train_seconds']:.0f} s ({res['steps']} steps, step-1 loss {res['first_loss']:.6f})")

    # 4. The table.
    loads.append(os.getloadavg()[0])
    mean = lambda xs: sum(xs) / len(xs)
    ref_side = "bf16" if "bf16" in sides else sides[0]
    per = lambda k, s, f="{:.3f}": ", ".join(f.format(x[k]) for x in results[s])
    rows = [f"| dumps | bytes/token | vs {ref_side} | eval loss | acc per step (TTT 1-3) | est_ar | est_ar_cond | "
            "acceptance | mean | spread | engine s.e. | outputs = base | train s | state error |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    summary = {}
    for s in sides:
        rs = results[s]
        accs = [x["mean_acceptance_length"] for x in rs]
        summary[s] = {"what": SIDES[s], "bytes": sets[s]["bytes"], "bytes_per_token": sets[s]["bytes_per_token"],
                      "bytes_ratio": sets[s]["bytes"] / sets[ref_side]["bytes"], "acceptance_mean": mean(accs),
                      "acceptance_spread": max(accs) - min(accs), "round_trip_error": errors.get(s), "runs": rs}
        rows.append(f"| {s} ({SIDES[s]}) | {sets[s]['bytes_per_token']:.1f} | {summary[s]['bytes_ratio']:.3f} | "
                    f"{per('eval_loss', s, '{:.4f}')} | "
                    + "; ".join("/".join(f"{v:.4f}" for v in x["acc"]) for x in rs)
                    + f" | {per('est_ar', s)} | {per('est_ar_cond', s)} | {per('mean_acceptance_length', s)} | "
                    f"{mean(accs):.3f} | {max(accs) - min(accs):.3f} | "
                    + ", ".join(f"{x['engine_stderr']:.3f}" if x["engine_stderr"] else "-" for x in rs)
                    + " | " + ", ".join(f"{x['outputs_identical']}/{x['prompts']}" for x in rs)
                    + f" | {per('train_seconds', s, '{:.0f}')} | "
                    + ("/".join(f"{100 * v:.2f}%" for v in errors[s]) if s in errors else "-") + " |")
    lines = []
    for s in sides:
        if s == ref_side:
            continue
        d_acc = [x["mean_acceptance_length"] - y["mean_acceptance_length"] for x, y in zip(results[s], results[ref_side])]
        d_est = [x["est_ar_cond"] - y["est_ar_cond"] for x, y in zip(results[s], results[ref_side])]
        lines.append(f"{s} against {ref_side}, per seed: bytes x{summary[s]['bytes_ratio']:.3f}, acceptance "
                     + ", ".join(f"{v:+.3f}" for v in d_acc) + " (ratio "
                     + ", ".join(f"{x['mean_acceptance_length'] / y['mean_acceptance_length']:.3f}"
                                 for x, y in zip(results[s], results[ref_side]))
                     + "), est_ar_cond " + ", ".join(f"{v:+.3f}" for v in d_est))
    cpu_model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    machine = (f"{cpu_model}, {os.cpu_count()} CPUs, {platform.system()}; load average {min(loads):.1f} to "
               f"{max(loads):.1f}; {time.time() - t_start:.0f} s this run")
    head = (f"{a.epochs} epochs, seeds {', '.join(map(str, seeds))}, {tokens} training tokens, "
            f"{len(ref)} held-out prompts; {machine}")
    write_json(os.path.join(runs, "results.json"), {"epochs": a.epochs, "seeds": seeds, "tokens": tokens,
                                                    "machine": machine, "eaglekit": ek, "work": work,
                                                    "base_serve": base_serve, "sides": summary,
                                                    "argv": sys.argv})
    with open(os.path.join(runs, "table.md"), "w") as f:
        f.write(head + "\n\n" + "\n".join(rows) + "\n\n" + "\n".join(lines) + "\n")
    print(head + "\n\n" + "\n".join(rows) + "\n\n" + "\n".join(lines), file=sys.stderr)
    if a.json:
        print(json.dumps(json.load(open(os.path.join(runs, "results.json"))), indent=1))
    differ = [f"{s} seed {x['seed']}" for s in sides for x in results[s] if x["outputs_identical"] != x["prompts"]]
    if differ:
        log("FAILED: speculative outputs differ from the base's alone: " + ", ".join(differ))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
