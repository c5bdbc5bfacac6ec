#!/usr/bin/env python3
"""Training speed against the reference trainer: `eaglekit train` against NVIDIA ModelOpt's own
offline EAGLE-3 training (its HF Trainer path: mtsp.convert of the HF base, eagle_offline, its
OfflineSupervisedDataset and EagleOfflineDataCollator, transformers' Trainer) on the CPU, on the
same dumps, the same draft (ModelOpt's norm form, so both compute the same function), the same
starting weights, batch, length, TTT steps (3, decay 0.9), AdamW (lr 1e-3 constant, betas 0.9 /
0.999, eps 1e-8, no weight decay, clip 1.0), threads and steps; --runs runs of each, alternating.

Per run and side: the median over the steps after --warmup of tokens/s (tokens = the batch's real,
unpadded tokens; data loading excluded on both sides: eaglekit's step minus its loader wait,
Trainer's time from on_step_begin, after the batch is fetched, to on_step_end), tokens per
CPU-second (the process's CPU time over the same span, every thread; eaglekit's cpu_ms also counts
its loader threads, which favours the Python side; on a loaded machine it moves less than wall
time), and the peak resident memory of the whole process (ru_maxrss of the child). Both in the same sample order
(Trainer's sampler made sequential, eaglekit --no-shuffle), so the step-1 losses are equal up to
float rounding. Prints the medians over runs and the ratios.

Usage: .venvs/e2e/bin/python bench/bench_modelopt.py [--work e2e-out] [--steps 30] [--warmup 3]
           [--runs 3] [--threads N] [--batch-size 16] [--max-length 160]
           [--arch eagle3|dflash] [--block-size 4] [--mask-token-id 0] [--anchors 32] [--no-eager]
           [--eaglekit-before PATH]
--work is a finished scripts/e2e folder (its base model, dumps and index). --threads defaults to
min(nproc, 2). ModelOpt runs eagerly (eagle_use_torch_compile off: Inductor on the CPU compiles
C++ for minutes and is not what its CPU tests run).

--arch dflash: the same for DFlash (docs/dflash.md): `eaglekit train --draft-arch dflash` against
ModelOpt 0.47's HFDFlashModel (mtsp.convert "dflash" of the base loaded as ModelOpt's offline
trainer loads it, load_vlm_or_llm(use_offline_training=True); dflash_offline, its module warm-started
from the shared draft with dflash_init_checkpoint, D-PACE alpha 0.5, self-logit distillation, SDPA
attention) through the same Trainer, data and collator, and a third side, "eager": ModelOpt's same
model and batches in a plain PyTorch loop (forward, backward, clip_grad_norm_, torch.optim.AdamW; no
Trainer), the PyTorch-eager reference of the same maths. The draft: --block-size (4), mask token
--mask-token-id (0), one layer per aux layer of the dumps (3), --anchors blocks per row (32: the e2e's
DFlash recipe; ModelOpt's default is 512). ModelOpt draws its anchors with torch.rand in every
forward; here its sampler is replaced by eaglekit's seeded draw (splitmix64 of --seed 0, the epoch
and the conversation id, computed in the collator, outside the timed step), so all sides train the
same blocks and their step-1 losses agree to float rounding: the count of blocks, hence the work, is
ModelOpt's own either way (min(anchors, most valid anchors of a row - 1)).
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

M64 = (1 << 64) - 1


def splitmix64(state):
    """(new state, draw): trainer/unroll/dflash.cpp's splitmix64."""
    state = (state + 0x9e3779b97f4a7c15) & M64
    z = state
    z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & M64
    z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & M64
    return state, z ^ (z >> 31)


def dflash_row_seed(seed, epoch, conversation_id):
    h = 0xcbf29ce484222325  # FNV-1a of the id
    for ch in conversation_id.encode():
        h = ((h ^ ch) * 0x100000001b3) & M64
    return splitmix64(seed ^ ((epoch * 0xd1b54a32d192ed03) & M64) ^ h)[1]


def dflash_anchors(loss_mask, block_size, num_anchors, seeds):
    """eaglekit's anchors (trainer/unroll/dflash.cpp dflash_anchors) as ModelOpt's sampler returns
    them: ([B, N] positions, [B, N] keep)."""
    import torch
    b, n = loss_mask.shape
    last = max(n - block_size, 0)
    valid = [[p for p in range(0, min(last + 1, n)) if loss_mask[r, p] > 0.5] for r in range(b)]
    cols = min(num_anchors, max(len(v) for v in valid) - 1)
    if cols <= 0:
        return torch.zeros(b, 1, dtype=torch.long), torch.zeros(b, 1, dtype=torch.bool)
    pos, keep = torch.zeros(b, cols, dtype=torch.long), torch.zeros(b, cols, dtype=torch.bool)
    for r, v in enumerate(valid):
        take, state = min(len(v), cols), seeds[r]
        for i in range(take):
            state, z = splitmix64(state)
            j = i + ((z * (len(v) - i)) >> 64)
            v[i], v[j] = v[j], v[i]
        pos[r, :take] = torch.tensor(sorted(v[:take]), dtype=torch.long)
        keep[r, :take] = True
    return pos, keep


def load_modelopt_dflash(a):
    """ModelOpt's offline DFlash model over the base, warm-started from the shared draft."""
    import torch
    import modelopt.torch.speculative as mtsp
    from modelopt.torch.speculative.utils import load_vlm_or_llm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
    dc = json.load(open(os.path.join(a.draft, "config.json")))
    model = load_vlm_or_llm(a.base, use_offline_training=True, dtype=torch.float32)
    arch = {k: dc[k] for k in ("num_hidden_layers", "intermediate_size", "num_attention_heads",
                               "num_key_value_heads", "head_dim", "rms_norm_eps")}
    arch["target_layer_ids"] = dc["dflash_config"]["target_layer_ids"]
    mtsp.convert(model, [("dflash", {"dflash_offline": True, "dflash_block_size": dc["block_size"],
                                     "dflash_num_anchors": a.anchors,
                                     "dflash_mask_token_id": dc["dflash_config"]["mask_token_id"],
                                     "dflash_loss_objective": "dpace", "dflash_dpace_alpha": 0.5,
                                     "dflash_self_logit_distillation": True, "dflash_use_torch_compile": False,
                                     "dflash_init_checkpoint": a.draft, "dflash_architecture_config": arch})])
    # ModelOpt 0.47 builds it lazily as Qwen3RotaryEmbedding(config, device=...), a keyword
    # transformers 5.19 no longer takes: the same class, built without it.
    model.dflash_module.rotary_emb = Qwen3RotaryEmbedding(config=model.dflash_config)
    # eaglekit's anchors, drawn in the collator (outside the timed step) and handed over here.
    queue = []
    model._sample_anchor_positions = lambda seq_len, loss_mask, device: queue.pop(0)
    # eaglekit's metrics.jsonl "loss" is the unweighted mean of the per-position loss over the
    # counted positions; ModelOpt's own _compute_loss gives it with the weighting off (decay, gamma
    # 0). Computed once, on the first step (a warm-up step, not timed), beside the real loss.
    compute = model._compute_loss
    model.unweighted_loss1 = []

    def compute_loss(*args, **kw):
        if not model.unweighted_loss1:
            saved = model.dflash_loss_objective, model.dflash_loss_decay_factor
            model.dflash_loss_objective, model.dflash_loss_decay_factor = "decay", 0.0
            with torch.no_grad():
                model.unweighted_loss1.append(float(compute(*args, **kw)[0]))
            model.dflash_loss_objective, model.dflash_loss_decay_factor = saved
        return compute(*args, **kw)

    model._compute_loss = compute_loss
    return model, dc, queue


def dflash_files_and_collate(a, dc, queue):
    """The first 95% of the dumps in conversation order, and a collate that also draws the batch's
    anchors the way eaglekit does (epoch 0: the runs are shorter than an epoch) from the loss mask
    ModelOpt's forward builds (loss_mask * (labels != -100) * attention_mask)."""
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator
    conv = [json.loads(l) for l in open(a.data) if l.strip()]
    ids = [c["conversation_id"] for c in conv][:int(len(conv) * 0.95)]
    files = [os.path.join(a.dumps, i + ".pt") for i in ids]
    coll = EagleOfflineDataCollator(train_len=a.max_length)
    state = {"next": 0}
    tokens = []

    def collate(features):
        b = coll(features)
        first = state["next"]
        state["next"] += len(features)
        # ModelOpt's offline dataset gives a row's last token the label -100 (EAGLE's shifted
        # labels), which its DFlash forward turns into loss mask 0: the last token is never a
        # block's target or anchor there. eaglekit's loss mask is the dump's (every real token
        # here). DFlash reads labels for nothing else, so they are set to keep every real token.
        b["labels"] = b["input_ids"].masked_fill(b["attention_mask"] == 0, -100)
        lm = b["loss_mask"].float() * (b["labels"] != -100).float() * b["attention_mask"].float()
        seeds = [dflash_row_seed(a.seed, 0, i) for i in ids[first:first + len(features)]]
        queue.append(dflash_anchors(lm, dc["block_size"], a.anchors, seeds))
        tokens.append(int(b["attention_mask"].sum()))
        return b

    return files, collate, tokens


def modelopt_side(a):
    """The child: ModelOpt's offline EAGLE-3 training through transformers' Trainer."""
    import torch
    torch.set_num_threads(a.threads)
    sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
    from oracle import load_modelopt
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset
    from torch.utils.data import SequentialSampler
    from transformers import Trainer, TrainerCallback, TrainingArguments
    if a.arch == "dflash":
        model, dc, queue = load_modelopt_dflash(a)
        files, collate, tokens = dflash_files_and_collate(a, dc, queue)
    else:
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

    times, cpu, losses = [], [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)
            cpu.append(time.process_time() - self.c0)

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
    print(json.dumps({"step_s": times, "cpu_s": cpu, "tokens": tokens[:len(times)], "losses": losses,
                      "unweighted_loss1": getattr(model, "unweighted_loss1", [None])[0]}))


def eager_side(a):
    """The child: ModelOpt's DFlash model in a plain PyTorch loop: the batches collated in memory
    first, then per step forward, backward, clip_grad_norm_ and AdamW (the Trainer's settings)."""
    import torch
    torch.set_num_threads(a.threads)
    from modelopt.torch.speculative.eagle.utils import OfflineSupervisedDataset
    model, dc, queue = load_modelopt_dflash(a)
    files, collate, tokens = dflash_files_and_collate(a, dc, queue)
    ds = OfflineSupervisedDataset(files)
    batches = [collate([ds[j] for j in range(i * a.batch_size, (i + 1) * a.batch_size)]) for i in range(a.steps)]
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    times, cpu, losses = [], [], []
    for b in batches:
        t0, c0 = time.perf_counter(), time.process_time()
        out = model(**b)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        losses.append(out.loss.item())
    print(json.dumps({"step_s": times, "cpu_s": cpu, "tokens": tokens, "losses": losses,
                      "unweighted_loss1": model.unweighted_loss1[0]}))


def eaglekit_side(a, out, binary=None):
    arch = (["--dflash-anchors", str(a.anchors), "--seed", str(a.seed)] if a.arch == "dflash" else
            ["--loss-decay", "0.9", "--ttt-steps", "3", "--modelopt-norm", "--allow-unservable"])
    return [binary or a.eaglekit, "train", "--base", a.base, "--data", a.data, "--index", a.index,
            "--init-draft", a.draft, "--max-length", str(a.max_length), "--batch-size", str(a.batch_size), "--no-shuffle",
            "--schedule", "constant", "--lr", "1e-3", "--grad-clip", "1.0", "--weight-decay", "0",
            "--threads", str(a.threads), "--eval-every", "-1",
            "--log-every", "1", "--no-progress", "--no-tensorboard", "--max-steps", str(a.steps),
            "--out", out] + arch


def init_draft(a, w, init, env):
    """The shared starting point: a fresh draft (EAGLE-3 in ModelOpt's norm form, or DFlash),
    saved in float32 before any update."""
    arch = (["--draft-arch", "dflash", "--block-size", str(a.block_size), "--mask-token-id", str(a.mask_token_id),
             "--dflash-anchors", str(a.anchors)] if a.arch == "dflash" else
            ["--ttt-steps", "3", "--modelopt-norm", "--allow-unservable", "--d2t", os.path.join(w, "d2t.pt")])
    subprocess.run([a.eaglekit, "train", "--base", a.base, "--data", a.data, "--index", a.index, "--max-length",
                    str(a.max_length), "--batch-size", str(a.batch_size), "--max-steps", "1", "--lr", "1e-30",
                    "--export-dtype", "float32", "--eval-every", "-1", "--no-progress", "--no-tensorboard",
                    "--seed", "1", "--out", init] + arch,
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)


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
    ap.add_argument("--arch", choices=["eagle3", "dflash"], default="eagle3")
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--mask-token-id", type=int, default=0)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--no-eager", action="store_true", help="dflash: leave out the plain PyTorch loop")
    ap.add_argument("--eaglekit-before", help="another eaglekit binary (an earlier build) as one more side, "
                    "run right after eaglekit's in every run")
    ap.add_argument("--side", choices=["modelopt", "eager"], help=argparse.SUPPRESS)
    for k in ("base", "draft", "data", "dumps", "index", "out"):
        ap.add_argument("--" + k, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.side == "modelopt":
        return modelopt_side(a)
    if a.side == "eager":
        return eager_side(a)
    w = os.path.abspath(a.work)
    a.base, a.data, a.dumps, a.index = (os.path.join(w, "base"), os.path.join(w, "data", "train.jsonl"),
                                        os.path.join(w, "data", "dumps"), os.path.join(w, "train.idx"))
    if not os.path.exists(a.index):
        ap.error(f"--work {w}: no finished scripts/e2e there (run scripts/e2e first)")
    if a.arch == "dflash" and a.max_length % a.block_size:
        ap.error("ModelOpt's DFlash needs --max-length divisible by --block-size")
    bench = os.path.join(w, "bench-modelopt" + ("-dflash" if a.arch == "dflash" else ""))
    subprocess.run(["rm", "-rf", bench], check=True)
    os.makedirs(bench)
    env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "passive"))
    init = os.path.join(bench, "init")
    init_draft(a, w, init, env)
    a.draft = os.path.join(init, "final")
    names = ["eaglekit train", "ModelOpt (HF Trainer)"]
    if a.eaglekit_before:
        names.insert(1, "eaglekit train (before)")
    if a.arch == "dflash" and not a.no_eager:
        names.append("ModelOpt's model, plain loop")
    res = {n: [] for n in names}
    w0 = a.warmup
    what = (f"DFlash block {a.block_size}, {a.anchors} anchors" if a.arch == "dflash" else "EAGLE-3, 3 TTT steps")
    print(f"bench_modelopt: {what}; {a.runs} runs x {a.steps} steps ({w0} warm-up) per side, batch {a.batch_size}, "
          f"length {a.max_length}, {a.threads} threads each; load average {os.getloadavg()[0]:.1f}", file=sys.stderr)
    loads = [os.getloadavg()[0]]
    ek_names = names[:2] if a.eaglekit_before else names[:1]
    for r in range(1, a.runs + 1):
        for name, binary in zip(ek_names, [a.eaglekit, a.eaglekit_before]):
            out = os.path.join(bench, f"ours-{r}" + ("-before" if binary == a.eaglekit_before else ""))
            rss = child_rss_mb(eaglekit_side(a, out, binary), env, subprocess.DEVNULL)
            lines = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if l.strip()]
            lines = [l for l in lines if "split" not in l]
            steps = [l for l in lines if l["step"] > w0]
            res[name].append({"tps": st.median(l["tokens_per_s"] * l["step_ms"] / (l["step_ms"] - l["loader_wait_ms"])
                                               for l in steps),
                              "tpc": st.median(l["tokens_per_s"] * l["step_ms"] / l["cpu_ms"] for l in steps),
                              "rss": rss, "loss1": lines[0]["loss"],
                              "tokens1": lines[0]["tokens_per_s"] * lines[0]["step_ms"] / 1000})
        for name, side in zip(names[len(ek_names):], ["modelopt", "eager"]):
            resf = os.path.join(bench, f"{side}-{r}.json")
            with open(resf, "w") as f:
                rss = child_rss_mb([sys.executable, os.path.abspath(__file__), "--side", side, "--arch", a.arch,
                                    "--base", a.base, "--draft", a.draft, "--data", a.data, "--dumps", a.dumps,
                                    "--out", os.path.join(bench, f"{side}-{r}"), "--steps", str(a.steps),
                                    "--threads", str(a.threads), "--batch-size", str(a.batch_size),
                                    "--max-length", str(a.max_length), "--anchors", str(a.anchors),
                                    "--seed", str(a.seed)], env, f)
            m = json.loads(open(resf).read().strip().splitlines()[-1])
            res[name].append({"tps": st.median(t / s for t, s in list(zip(m["tokens"], m["step_s"]))[w0:]),
                              "tpc": st.median(t / s for t, s in list(zip(m["tokens"], m["cpu_s"]))[w0:]),
                              "rss": rss, "tokens1": m["tokens"][0],
                              "loss1": m["unweighted_loss1"] if a.arch == "dflash" else m["losses"][0]})
        loads.append(os.getloadavg()[0])
        print(f"  run {r}: " + " | ".join(f"{n} {res[n][-1]['tps']:7.0f} tok/s {res[n][-1]['rss']:6.0f} MiB"
                                          for n in names) + f" | load {loads[-1]:.1f}", file=sys.stderr, flush=True)
    med = lambda xs, k: st.median(x[k] for x in xs)
    print(f"medians over {a.runs} runs ({what}), {a.threads} threads each, data loading excluded on all sides; "
          f"load average {min(loads):.1f} to {max(loads):.1f}" +
          (" (step-1 loss: the unweighted mean over the counted positions, eaglekit's metric):" if a.arch == "dflash"
           else ":"))
    for n in names:
        print(f"  {n:30s} {med(res[n], 'tps'):8.0f} tokens/s  (runs {min(x['tps'] for x in res[n]):.0f} to "
              f"{max(x['tps'] for x in res[n]):.0f})  {med(res[n], 'tpc'):7.0f} tokens/CPU-s  peak RSS {med(res[n], 'rss'):6.0f} MiB  "
              f"step-1 loss {res[n][0]['loss1']:.6f}  step-1 tokens {res[n][0]['tokens1']:.0f}")
    for n in names[1:]:
        print(f"  ratio eaglekit / {n}: {med(res[names[0]], 'tps') / med(res[n], 'tps'):.2f}x tokens/s, "
              f"{med(res[names[0]], 'tpc') / med(res[n], 'tpc'):.2f}x tokens/CPU-s, "
              f"{med(res[names[0]], 'rss') / med(res[n], 'rss'):.2f}x peak memory")


if __name__ == "__main__":
    sys.exit(main())
