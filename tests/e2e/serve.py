#!/usr/bin/env python3
"""Serves held-out prompts with vLLM (its CPU build), greedy, with or without an EAGLE-3 draft,
and writes the outputs and the engine's own speculative-decoding counters.

Usage: serve.py --base DIR --prompts prompts.json --out result.json
                [--draft DIR [--method eagle3|dflash] [--spec-tokens N] | --speculators DIR]
                [--dtype float32|bfloat16]
       serve.py --runs runs.json --prompts prompts.json
                (runs.json: a list of {"out": FILE, "args": [the options above]}, served one
                after another by engines in this process)

--draft DIR         our export: vLLM is told the method (eagle3, or dflash for a DFlash draft)
                    and the token count
--speculators DIR   a speculators-layout export served by its folder alone: vLLM reads the target
                    and the token count from its config.json (--base is not passed to vLLM)

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): a spawned engine process
imports vLLM a second time, about 20 s of each run's 45 s start on 2 cores. With --runs the
engines come one after another in one process, each deleted before the next (vLLM imported
once; an engine then starts in about 5 s), and each run's counters are the difference of
vLLM's process-wide counters across it. The result: {"outputs": [[token ids]...], "seconds", "spec": {"drafts", "draft_tokens",
"accepted_tokens", "accepted_per_pos", "mean_acceptance_length"} or null}.
"""
import argparse
import json
import os
import sys
import time


def counters(llm):
    """vLLM's spec-decode counters, summed over engines."""
    want = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
    got = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
    per_pos = None
    found = False
    for m in llm.get_metrics():
        if m.name in want:
            got[want[m.name]] += int(m.value)
            found = True
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = [int(v) for v in m.values]
            per_pos = vals if per_pos is None else [a + b for a, b in zip(per_pos, vals)]
    if not found:
        return None
    got["accepted_per_pos"] = per_pos
    got["mean_acceptance_length"] = 1 + got["accepted_tokens"] / got["drafts"] if got["drafts"] else None
    return got


def parser():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base")
    ap.add_argument("--draft")
    ap.add_argument("--speculators")
    ap.add_argument("--method", default="eagle3", choices=["eagle3", "dflash"])
    ap.add_argument("--spec-tokens", type=int, default=3)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--runs", help="a JSON list of {\"out\": FILE, \"args\": [options]}, served in this process")
    return ap


def serve(args, prompts):
    """One engine for `args`, the prompts through it, its result written to args.out."""
    import gc
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    p = prompts
    kw = dict(skip_tokenizer_init=True, dtype=args.dtype, enforce_eager=True, seed=0,
              max_model_len=512, disable_log_stats=False)
    if args.speculators:
        llm_model = args.speculators
    else:
        llm_model = args.base
        if args.draft:
            kw["speculative_config"] = {"method": args.method, "model": args.draft,
                                        "num_speculative_tokens": args.spec_tokens}
    t0 = time.time()
    llm = LLM(model=llm_model, **kw)
    t_load = time.time() - t0
    before = counters(llm)
    eos = json.load(open(os.path.join(args.base or args.speculators, "config.json"))).get("eos_token_id")
    sp = SamplingParams(temperature=0.0, max_tokens=p["max_new_tokens"], detokenize=False,
                        stop_token_ids=[eos] if isinstance(eos, int) else None)
    t1 = time.time()
    outs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in p["prompts"]], sp, use_tqdm=False)
    t_gen = time.time() - t1
    res = {"outputs": [list(o.outputs[0].token_ids) for o in outs], "load_seconds": round(t_load, 1),
           "generate_seconds": round(t_gen, 1), "spec": difference(counters(llm), before),
           "engine": {"model": llm_model, "speculative_config": kw.get("speculative_config"),
                      "dtype": args.dtype, "in_process": True}}
    import vllm
    res["engine"]["vllm"] = vllm.__version__
    with open(args.out, "w") as f:
        json.dump(res, f)
    s = res["spec"]
    print(f"serve: {args.out}: {len(outs)} prompts, {sum(len(o) for o in res['outputs'])} tokens in {t_gen:.1f} s"
          + (f", mean acceptance length {s['mean_acceptance_length']:.3f}" if s and s["drafts"] else "")
          + f" (engine started in {t_load:.1f} s)", file=sys.stderr)
    del llm, outs
    gc.collect()


def difference(after, before):
    """The counters of one run: vLLM's are process-wide, and earlier engines in this process
    added to them."""
    if after is None:
        return None
    if before is None:
        return after
    got = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted_tokens")}
    a, b = after.get("accepted_per_pos"), before.get("accepted_per_pos")
    got["accepted_per_pos"] = a if b is None or a is None else [x - y for x, y in zip(a, b)]
    got["mean_acceptance_length"] = 1 + got["accepted_tokens"] / got["drafts"] if got["drafts"] else None
    return got


def main():
    ap = parser()
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    prompts = json.load(open(args.prompts))
    if args.runs:
        runs = [ap.parse_args(r["args"] + ["--prompts", args.prompts, "--out", r["out"]])
                for r in json.load(open(args.runs))]
    else:
        runs = [args]
    for r in runs:
        if not r.base and not r.speculators:
            ap.error("--base or --speculators is required")
        if not r.out:
            ap.error("--out is required")
    for r in runs:
        serve(r, prompts)


if __name__ == "__main__":
    main()
