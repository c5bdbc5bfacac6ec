#!/usr/bin/env python3
"""The figure users choose a recipe by: the engine's mean acceptance length for each training
setting (EAGLE-3, EAGLE 3.1, a loss, Muon), two seeds each, on the end-to-end check's base and data
(issue #41 item 5; docs/benchmarks.md, "Acceptance by recipe").

Usage: acceptance_table.py --e2e DIR --out DIR [--settings NAME,...] [--seeds 7,8] [--epochs 2]
                           [--eaglekit PATH] [--python PATH]

--e2e DIR is a finished `scripts/e2e` folder (e2e-out/: base/, data/train.jsonl, data/heldout.jsonl,
data/prompts.json, train.idx, heldout.idx, d2t.pt); it is only read. For each setting and seed it
runs, into --out/SETTING/seedN/:

  train     the e2e's recipe (tests/e2e/e2e.py, stage `eaglekit`: --max-length 160 --batch-size 16
            --lr 2e-3 --warmup-steps 20 --ttt-steps 3 --eval-fraction 0.02) with --epochs E (the same
            steps for every setting) and the setting's flags; the wall seconds of the process
  evaluate  `eaglekit evaluate --split all --json` on the held-out dumps: est_ar_cond
  serve     vLLM 0.32 (CPU) through tests/e2e/serve.py, run by --python (default: the e2e venv,
            .venvs/e2e/bin/python), greedy, float32, the held-out prompts, `--draft RUN/final
            --spec-tokens 3`: the engine's mean acceptance length, and whether every output equals
            the base's alone (served once, without a draft, into --out/base/serve.json)

Resumable: a stage whose result file exists is skipped (train: run/final/config.json and
train.json; evaluate: evaluate.json; serve: serve.json); a stage that stopped part way is redone.
A stored training is reused only when its command and the eaglekit binaries (by sha256) are this
run's; else it trains again, saying why, and its evaluation and serving are redone.
At the end it writes --out/results.json and --out/table.md (one row per setting: acceptance per
seed, mean, spread = max - min over the seeds, est_ar_cond per seed, train wall seconds and
median CPU ms per step per seed; results.json adds each run's engine standard error).

Exit 0 when every run finished and every speculative output equals the base's; 1 when a stage
fails (the message names it and the command) or an output differs; 2 on usage errors.
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# name -> (what it is, train flags beyond the common recipe). Priority order: the table fills top down.
SETTINGS = {
    "eagle3": ("EAGLE-3, forward KL, AdamW (the defaults)", []),
    "eagle3.1": ("EAGLE 3.1, forward KL, AdamW", ["--draft-arch", "eagle3.1"]),
    "eagle3-muon": ("EAGLE-3, forward KL, Muon", ["--optimizer", "muon"]),
    "eagle3-tv-ce": ("EAGLE-3, --loss tv:0.9,ce:0.1, AdamW", ["--loss", "tv:0.9,ce:0.1"]),
    "eagle3.1-muon": ("EAGLE 3.1, forward KL, Muon", ["--draft-arch", "eagle3.1", "--optimizer", "muon"]),
    "eagle3.1-tv-ce": ("EAGLE 3.1, --loss tv:0.9,ce:0.1, AdamW",
                       ["--draft-arch", "eagle3.1", "--loss", "tv:0.9,ce:0.1"]),
    "eagle3-lk-hybrid": ("EAGLE-3, --loss lk-hybrid, AdamW", ["--loss", "lk-hybrid"]),
    "eagle3-rkl": ("EAGLE-3, --loss rkl, AdamW", ["--loss", "rkl"]),
}


def fail(msg):
    print(f"acceptance_table: FAILED: {msg}", file=sys.stderr)
    sys.exit(1)


def sh(stage, cmd, log, stdout=None):
    """Runs cmd with stderr (and stdout, unless `stdout` names a file for it) to `log`; exits 1
    naming the stage and the command on a non-zero exit. Returns the wall seconds."""
    print(f"acceptance_table: {stage}: $ {' '.join(cmd)}", file=sys.stderr)
    t0 = time.time()
    with open(log, "w") as f, open(stdout or os.devnull, "w") as o:
        rc = subprocess.run(cmd, stdout=o if stdout else f, stderr=f).returncode
    if rc != 0:
        with open(log) as f:
            tail = f.read()[-2000:]
        fail(f"{stage} exited {rc} (log {log}):\n$ {' '.join(cmd)}\n{tail}")
    return time.time() - t0


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)  # a result file exists only when whole


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--e2e", required=True, help="a finished scripts/e2e folder (read only)")
    ap.add_argument("--out", required=True, help="output folder (reused: finished stages are skipped)")
    ap.add_argument("--settings", default="eagle3,eagle3.1,eagle3-muon,eagle3-tv-ce,eagle3.1-muon",
                    help="comma-separated, in order; known: " + ", ".join(SETTINGS))
    ap.add_argument("--seeds", default="7,8")
    ap.add_argument("--epochs", type=int, default=2, help="training epochs, the same for every setting")
    ap.add_argument("--eaglekit", default=os.path.join(ROOT, "build", "bin", "eaglekit"))
    ap.add_argument("--python", default=os.path.join(ROOT, ".venvs", "e2e", "bin", "python"),
                    help="the Python with vLLM 0.32 (scripts/e2e's venv)")
    args = ap.parse_args()
    settings = [s for s in args.settings.split(",") if s]
    for s in settings:
        if s not in SETTINGS:
            ap.error(f"--settings: unknown {s!r}; known: {', '.join(SETTINGS)}")
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x]
    except ValueError:
        ap.error(f"--seeds {args.seeds!r}: not a list of integers")
    if not seeds or args.epochs < 1:
        ap.error("--seeds needs at least one seed and --epochs at least 1")
    if not os.access(args.eaglekit, os.X_OK):
        ap.error(f"--eaglekit {args.eaglekit}: not an executable (build it: ninja -C build eaglekit)")
    if not os.access(args.python, os.X_OK):
        ap.error(f"--python {args.python}: not an executable (scripts/e2e makes .venvs/e2e)")
    e2e = os.path.abspath(args.e2e)
    need = ["base/config.json", "data/train.jsonl", "data/heldout.jsonl", "data/prompts.json", "train.idx",
            "heldout.idx", "d2t.pt"]
    missing = [p for p in need if not os.path.exists(os.path.join(e2e, p))]
    if missing:
        ap.error(f"--e2e {e2e}: missing {', '.join(missing)} (run scripts/e2e first)")
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    ek, base = args.eaglekit, os.path.join(e2e, "base")
    prompts = os.path.join(e2e, "data", "prompts.json")
    serve = os.path.join(ROOT, "tests", "e2e", "serve.py")

    # The base alone, once: the outputs every speculative run must equal.
    os.makedirs(os.path.join(out, "base"), exist_ok=True)
    base_serve = os.path.join(out, "base", "serve.json")
    if not os.path.exists(base_serve):
        sh("serve base", [args.python, serve, "--base", base, "--prompts", prompts, "--out", base_serve + ".tmp"],
           os.path.join(out, "base", "serve.log"))
        os.replace(base_serve + ".tmp", base_serve)
    ref = json.load(open(base_serve))["outputs"]

    common = ["--hidden-states-norm", "post", "--base", base, "--data", os.path.join(e2e, "data", "train.jsonl"),
              "--index", os.path.join(e2e, "train.idx"), "--d2t", os.path.join(e2e, "d2t.pt"),
              "--max-length", "160", "--batch-size", "16", "--epochs", str(args.epochs), "--lr", "2e-3",
              "--warmup-steps", "20", "--ttt-steps", "3", "--eval-fraction", "0.02", "--no-progress"]
    # The binaries a run was trained with: eaglekit and the eaglekit-torch it runs, by content.
    binaries = {}
    for exe in (ek, os.path.join(os.path.dirname(os.path.abspath(ek)), "eaglekit-torch")):
        if os.path.exists(exe):
            with open(exe, "rb") as f:
                binaries[os.path.basename(exe)] = hashlib.sha256(f.read()).hexdigest()
    results, differ = [], []
    for name in settings:
        flags = SETTINGS[name][1]
        for seed in seeds:
            d = os.path.join(out, name, f"seed{seed}")
            os.makedirs(d, exist_ok=True)
            run = os.path.join(d, "run")
            tag = f"{name} seed {seed}"
            train_json = os.path.join(d, "train.json")
            cmd = [ek, "train", *common, "--seed", str(seed), *flags, "--out", run]
            # A stored run is reused only when it was made by this command and these binaries:
            # otherwise its figures would be labelled with settings it was not trained with.
            stale = None
            if os.path.exists(train_json):
                old = json.load(open(train_json))
                if old.get("command") != cmd:
                    stale = "another command"
                elif old.get("binaries") != binaries:
                    stale = "other eaglekit binaries"
            if stale or not (os.path.exists(train_json) and os.path.exists(os.path.join(run, "final", "config.json"))):
                if stale:
                    print(f"acceptance_table: {tag}: the stored run was made by {stale}; training it again",
                          file=sys.stderr)
                for f in (train_json, os.path.join(d, "evaluate.json"), os.path.join(d, "serve.json")):
                    if os.path.exists(f):
                        os.remove(f)
                shutil.rmtree(run, ignore_errors=True)  # of a run that stopped part way, or a stale one
                secs = sh(f"train {tag}", cmd, os.path.join(d, "train.log"))
                write_json(train_json, {"seconds": round(secs, 1), "command": cmd, "binaries": binaries})
            tr = json.load(open(train_json))
            with open(os.path.join(run, "metrics.jsonl")) as f:
                ms = [json.loads(line) for line in f if line.strip()]
            steps = max((m.get("step", 0) for m in ms), default=None)
            # Process CPU per step (train's cpu_ms, every logged training line): steadier than wall
            # seconds on a shared machine.
            cpu = sorted(m["cpu_ms"] for m in ms if "cpu_ms" in m and m.get("split") != "eval")
            cpu_ms = cpu[len(cpu) // 2] if cpu else None
            ev_json = os.path.join(d, "evaluate.json")
            if not os.path.exists(ev_json):
                sh(f"evaluate {tag}", [ek, "evaluate", "--hidden-states-norm", "post", "--base", base, "--draft",
                                       os.path.join(run, "final"), "--data", os.path.join(e2e, "data", "heldout.jsonl"),
                                       "--index", os.path.join(e2e, "heldout.idx"), "--split", "all", "--json"],
                   os.path.join(d, "evaluate.log"), stdout=ev_json + ".tmp")
                ev = json.load(open(ev_json + ".tmp"))
                write_json(ev_json, ev)
            ev = json.load(open(ev_json))
            sv_json = os.path.join(d, "serve.json")
            if not os.path.exists(sv_json):
                sh(f"serve {tag}", [args.python, serve, "--base", base, "--draft", os.path.join(run, "final"),
                                    "--spec-tokens", "3", "--prompts", prompts, "--out", sv_json + ".tmp"],
                   os.path.join(d, "serve.log"))
                os.replace(sv_json + ".tmp", sv_json)
            sv = json.load(open(sv_json))
            spec = sv["spec"]
            if not spec or not spec.get("drafts"):
                fail(f"serve {tag}: the engine reported no speculative drafts ({sv_json})")
            same = sum(a == b for a, b in zip(sv["outputs"], ref))
            if same != len(ref):
                differ.append(tag)
            # Each draft accepts k of its 3 tokens; accepted_per_pos[j] counts the drafts with k > j,
            # so the counts give k's distribution and the standard error of the mean (drafts taken
            # as independent, which those of one prompt are not quite).
            n, pp = spec["drafts"], spec["accepted_per_pos"] or []
            ks = [(pp[j] - (pp[j + 1] if j + 1 < len(pp) else 0), j + 1) for j in range(len(pp))]
            m1 = sum(c * k for c, k in ks) / n
            var = sum(c * k * k for c, k in ks) / n - m1 * m1
            r = {"setting": name, "what": SETTINGS[name][0], "flags": flags, "seed": seed,
                 "train_seconds": tr["seconds"], "cpu_ms_per_step": cpu_ms, "steps": steps,
                 "mean_acceptance_length": spec["mean_acceptance_length"], "drafts": spec["drafts"], "engine_stderr": (var / n) ** 0.5 if pp else None,
                 "accepted_per_pos": spec["accepted_per_pos"], "est_ar_cond": ev.get("est_ar_cond"),
                 "est_ar": ev.get("est_ar"), "cond_acc": ev.get("cond_acc"),
                 "outputs_identical": f"{same}/{len(ref)}"}
            results.append(r)
            print(f"acceptance_table: {tag}: acceptance {r['mean_acceptance_length']:.3f}, est_ar_cond "
                  f"{r['est_ar_cond']:.3f}, train {r['train_seconds']:.0f} s, {r['steps']} steps, outputs "
                  f"identical {r['outputs_identical']}", file=sys.stderr)

    rows = ["| setting | acceptance, seed " + ", ".join(str(s) for s in seeds) + " | mean | spread | "
            "est_ar_cond, per seed | train s, per seed | CPU ms/step, per seed | steps | outputs = base |",
            "|---|---|---|---|---|---|---|---|---|"]
    table = {}
    for name in settings:
        rs = [r for r in results if r["setting"] == name]
        acc = [r["mean_acceptance_length"] for r in rs]
        mean = sum(acc) / len(acc)
        spread = max(acc) - min(acc)
        table[name] = {"mean": mean, "spread": spread, "runs": rs}
        rows.append(f"| {name} (`{' '.join(SETTINGS[name][1]) or 'defaults'}`) | "
                    + ", ".join(f"{a:.3f}" for a in acc) + f" | {mean:.3f} | {spread:.3f} | "
                    + ", ".join(f"{r['est_ar_cond']:.3f}" for r in rs) + " | "
                    + ", ".join(f"{r['train_seconds']:.0f}" for r in rs) + " | "
                    + ", ".join(f"{r['cpu_ms_per_step']:.0f}" if r["cpu_ms_per_step"] else "-" for r in rs) + " | "
                    + ", ".join(str(r["steps"]) for r in rs) + " | "
                    + ", ".join(r["outputs_identical"] for r in rs) + " |")
    write_json(os.path.join(out, "results.json"), {"epochs": args.epochs, "seeds": seeds, "table": table,
                                                   "e2e": e2e, "eaglekit": ek})
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write("\n".join(rows) + "\n")
    print("\n".join(rows))
    if differ:
        fail("speculative outputs differ from the base's alone: " + ", ".join(differ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
