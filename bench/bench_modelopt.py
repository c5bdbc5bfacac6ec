#!/usr/bin/env python3
"""Training speed against the reference trainer: `eaglekit train` against NVIDIA ModelOpt's own
offline EAGLE-3 training (its HF Trainer path: mtsp.convert of the HF base, eagle_offline, its
OfflineSupervisedDataset and EagleOfflineDataCollator, transformers' Trainer) on the CPU, on the
same dumps, the same draft (ModelOpt's norm form, so both compute the same function), the same
starting weights, batch, length, TTT steps (3, decay 0.9), AdamW (lr 1e-3 constant, betas 0.9 /
0.999, eps 1e-8, no weight decay, clip 1.0), threads and steps; --runs runs of each, alternating.

Per run and side: the median over the steps after --warmup of tokens/s (tokens = the batch's real,
unpadded tokens; data loading excluded on both sides: eaglekit's step minus its loader wait,
Trainer's time from on_step_begin, after the batch is fetched, to on_step_end), and the peak
resident memory of the whole process (ru_maxrss of the child). Both in the same sample order
(Trainer's sampler made sequential, eaglekit --no-shuffle), so the step-1 losses are equal up to
float rounding. Prints the medians over runs and the ratios.

Usage: .venvs/e2e/bin/python bench/bench_modelopt.py [--work e2e-out] [--steps 30] [--warmup 3]
           [--runs 3] [--threads N] [--batch-size 16] [--max-length 160]
--work is a finished scripts/e2e folder (its base model, dumps and index). --threads defaults to
min(nproc, 2). ModelOpt runs eagerly (eagle_use_torch_compile off: Inductor on the CPU compiles
C++ for minutes and is not what its CPU tests run).
"""
import argparse
import json
import os
import statistics as st
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def child_rss_mb(cmd, env, stdout):
    """Runs cmd; returns (returncode, its peak resident set in MiB)."""
    p = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True)
    _, status, ru = os.wait4(p.pid, 0)
    err = p.stderr.read()
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        sys.stderr.write(err[-3000:])
        raise SystemExit(f"bench_modelopt: {' '.join(cmd[:3])} ... failed with exit {p.returncode}")
    return ru.ru_maxrss / 1024


def modelopt_side(a):
    """The child: ModelOpt's offline EAGLE-3 training through transformers' Trainer."""
    import torch
    torch.set_num_threads(a.threads)
    sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
    from oracle import load_modelopt
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset
    from torch.utils.data import SequentialSampler
    from transformers import Trainer, TrainerCallback, TrainingArguments
    model, _ = load_modelopt(a.base, a.draft)
    conv = [json.loads(l) for l in open(a.data) if l.strip()]
    files = [os.path.join(a.dumps, c["conversation_id"] + ".pt") for c in conv]
    files = files[:int(len(files) * 0.95)]
    coll = EagleOfflineDataCollator(train_len=a.max_length)
    tokens = []

    def collate(features):
        b = coll(features)
        tokens.append(int(b["attention_mask"].sum()))
        return b

    times, losses = [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    class SequentialTrainer(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    targs = TrainingArguments(output_dir=a.out, per_device_train_batch_size=a.batch_size, max_steps=a.steps,
                              learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                              adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
                              use_cpu=True, dataloader_num_workers=0, report_to=[], save_strategy="no",
                              logging_steps=1, remove_unused_columns=False, seed=0, disable_tqdm=True)
    tr = SequentialTrainer(model=model, args=targs, train_dataset=OfflineSupervisedDataset(files),
                           data_collator=collate, callbacks=[Timer()])
    tr.train()
    print(json.dumps({"step_s": times, "tokens": tokens[:len(times)], "losses": losses}))


def eaglekit_side(a, out):
    return [a.eaglekit, "train", "--base", a.base, "--data", a.data, "--index", a.index, "--init-draft", a.draft,
           "--max-length", str(a.max_length), "--batch-size", str(a.batch_size), "--no-shuffle",
           "--schedule", "constant", "--lr", "1e-3", "--grad-clip", "1.0", "--weight-decay", "0",
           "--loss-decay", "0.9", "--ttt-steps", "3", "--threads", str(a.threads), "--eval-every", "-1",
           "--log-every", "1", "--no-progress", "--no-tensorboard", "--max-steps", str(a.steps),
           "--modelopt-norm", "--allow-unservable", "--out", out]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=os.path.join(ROOT, "e2e-out"))
    ap.add_argument("--eaglekit", default=os.path.join(ROOT, os.environ.get("EAGLEKIT_BUILD_DIR", "build"), "bin", "eaglekit"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=min(os.cpu_count() or 1, 2))
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=160)
    ap.add_argument("--side", choices=["modelopt"], help=argparse.SUPPRESS)
    for k in ("base", "draft", "data", "dumps", "index", "out"):
        ap.add_argument("--" + k, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.side == "modelopt":
        return modelopt_side(a)
    w = os.path.abspath(a.work)
    a.base, a.data, a.dumps, a.index = (os.path.join(w, "base"), os.path.join(w, "data", "train.jsonl"),
                                        os.path.join(w, "data", "dumps"), os.path.join(w, "train.idx"))
    if not os.path.exists(a.index):
        ap.error(f"--work {w}: no finished scripts/e2e there (run scripts/e2e first)")
    bench = os.path.join(w, "bench-modelopt")
    subprocess.run(["rm", "-rf", bench], check=True)
    os.makedirs(bench)
    env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "passive"))
    # The shared starting point: a fresh draft in ModelOpt's form, saved before any update.
    init = os.path.join(bench, "init")
    subprocess.run([a.eaglekit, "train", "--base", a.base, "--data", a.data, "--index", a.index, "--max-length",
                    str(a.max_length), "--batch-size", str(a.batch_size), "--max-steps", "1", "--lr", "1e-30",
                    "--ttt-steps", "3", "--modelopt-norm", "--allow-unservable", "--export-dtype", "float32",
                    "--d2t", os.path.join(w, "d2t.pt"),
                    "--eval-every", "-1", "--no-progress", "--no-tensorboard", "--seed", "1", "--out", init],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    a.draft = os.path.join(init, "final")
    ours, theirs = [], []
    w0 = a.warmup
    print(f"bench_modelopt: {a.runs} runs x {a.steps} steps ({w0} warm-up) per side, batch {a.batch_size}, "
          f"length {a.max_length}, {a.threads} threads each", file=sys.stderr)
    for r in range(1, a.runs + 1):
        out = os.path.join(bench, f"ours-{r}")
        rss = child_rss_mb(eaglekit_side(a, out), env, subprocess.DEVNULL)
        lines = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if l.strip()]
        lines = [l for l in lines if "split" not in l]
        steps = [l for l in lines if l["step"] > w0]
        ours.append({"tps": st.median(l["tokens_per_s"] * l["step_ms"] / (l["step_ms"] - l["loader_wait_ms"])
                                      for l in steps),
                     "rss": rss, "loss1": lines[0]["loss"]})
        res = os.path.join(bench, f"modelopt-{r}.json")
        with open(res, "w") as f:
            rss = child_rss_mb([sys.executable, os.path.abspath(__file__), "--side", "modelopt", "--base", a.base,
                                "--draft", a.draft, "--data", a.data, "--dumps", a.dumps, "--out",
                                os.path.join(bench, f"modelopt-{r}"), "--steps", str(a.steps), "--threads",
                                str(a.threads), "--batch-size", str(a.batch_size), "--max-length", str(a.max_length)],
                               env, f)
        m = json.loads(open(res).read().strip().splitlines()[-1])
        theirs.append({"tps": st.median(t / s for t, s in list(zip(m["tokens"], m["step_s"]))[w0:]),
                       "rss": rss, "loss1": m["losses"][0]})
        print(f"  run {r}: eaglekit {ours[-1]['tps']:7.0f} tok/s {ours[-1]['rss']:6.0f} MiB | ModelOpt "
              f"{theirs[-1]['tps']:7.0f} tok/s {theirs[-1]['rss']:6.0f} MiB", file=sys.stderr)
    med = lambda xs, k: st.median(x[k] for x in xs)
    print(f"medians over {a.runs} runs, {a.threads} threads each, data loading excluded on both sides:")
    print(f"  eaglekit train          {med(ours, 'tps'):8.0f} tokens/s  peak RSS {med(ours, 'rss'):6.0f} MiB  "
          f"step-1 loss {ours[0]['loss1']:.6f}")
    print(f"  ModelOpt (HF Trainer)   {med(theirs, 'tps'):8.0f} tokens/s  peak RSS {med(theirs, 'rss'):6.0f} MiB  "
          f"step-1 loss {theirs[0]['loss1']:.6f}")
    print(f"  ratio eaglekit / ModelOpt: {med(ours, 'tps') / med(theirs, 'tps'):.2f}x tokens/s, "
          f"{med(ours, 'rss') / med(theirs, 'rss'):.2f}x peak memory")


if __name__ == "__main__":
    sys.exit(main())
