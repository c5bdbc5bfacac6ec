#!/usr/bin/env python3
"""Runs the target model with transformers over your conversations and writes one record per
conversation in the layout eaglekit reads best (docs/dump.md): OUT/{conversation_id}.pt, a
torch.save'd dict as NVIDIA ModelOpt's HF dumper writes it, plus the loss mask and the norm form:

  input_ids          [T] int64     the chat template applied to the whole conversation
  hidden_states      [T, H]        the base model's last_hidden_state (after its final norm)
  aux_hidden_states  [T, k*H]      HF hidden_states[i] for each aux layer i, concatenated
  loss_mask          [T] int64     1 on the assistant turns' tokens (--loss-mask assistant)
  conversation_id    str
  hidden_states_prenorm  False     the form stated, so eaglekit need not measure it

Usage: eaglekit_dump.py --model DIR --data IN.jsonl --out DIR [options]
       eaglekit_dump.py --model DIR --data IN.jsonl --count-tokens
         (no model is loaded: the tokens the dump would hold, its chat template applied by the
         tokenizer alone, as JSON on stdout; `eaglekit stats --plan-dump` runs it)

The aux layers default to EAGLE-3's sorted({2, N//2, N-3}) for a base of N layers (as ModelOpt's
dumper and eaglekit train derive them); --aux-layers sets others (HF hidden_states indices, 0
the embeddings). The loss mask marks each assistant turn's span: the tokens the chat template
adds for the turn after the prompt that asks for it (add_generation_prompt); a template that
rewrites earlier turns is refused, naming the conversation.

Resumable: each file is written as OUT/ID.pt.tmp and renamed, so a present ID.pt is complete and
a rerun skips it; OUT/dump-shard-I-of-N.json records the settings, and a rerun with other ones
is refused. --shard I/N takes the conversations at positions I, I+N, ... (one process per GPU:
--shard 3/8 --device cuda:3). --eks FILE converts OUT to one .eks shard with `eaglekit convert`
when the dump is done (without --shard).

Exit codes: 0 done, 1 bad data or a runtime error (naming FILE:LINE or the id), 2 usage.
"""
import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from eaglekit_conversations import (DataError, UsageError, atomic_write, parse_shard,  # noqa: E402
                                    read_conversations, shard)


def quiet_transformers():
    """AutoModel leaves the checkpoint's lm_head unused on purpose: no load report, and progress
    bars only on a terminal."""
    import transformers
    transformers.utils.logging.set_verbosity_error()
    if not sys.stderr.isatty():
        transformers.utils.logging.disable_progress_bar()


def log(msg):
    print(f"dump: {msg}", file=sys.stderr, flush=True)


def eagle3_aux_layers(n_layers):
    """EAGLE-3's default aux layers for a base of n_layers (HF hidden_states indices)."""
    return sorted({2, max(0, n_layers // 2), max(1, n_layers - 3)})


def parse_aux(text, n_layers):
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:
        raise UsageError(f"--aux-layers {text}: expected comma-separated integers, e.g. 2,16,29") from None
    bad = [i for i in ids if not 0 <= i <= n_layers]
    if bad or len(set(ids)) != len(ids):
        raise UsageError(f"--aux-layers {text}: expected distinct indices in 0..{n_layers} "
                         f"(HF hidden_states of a base of {n_layers} layers)")
    return ids


def safe_name(conv):
    if "/" in conv.id or "\\" in conv.id or conv.id in (".", "..") or "\0" in conv.id:
        raise DataError(f"{conv.where()}: the id {conv.id!r} cannot name a file")
    return conv.id + ".pt"


def token_ids(tok, turns, **kw):
    ids = tok.apply_chat_template(turns, tokenize=True, return_dict=False, **kw)
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return list(ids)


def assistant_mask(tok, conv, ids):
    """1 on every assistant turn's tokens: from the end of the prompt asking for the turn to the
    end of the template applied through it."""
    mask = [0] * len(ids)
    for j, t in enumerate(conv.turns):
        if t["role"] != "assistant":
            continue
        start = token_ids(tok, conv.turns[:j], add_generation_prompt=True) if j else []
        end = token_ids(tok, conv.turns[:j + 1])
        for part, what in ((start, "the prompt before it"), (end, "the conversation through it")):
            if ids[:len(part)] != part:
                raise DataError(f"{conv.where()}: conversation {conv.id}, turn {j}: the chat template applied to "
                                f"{what} is not a prefix of the whole conversation's tokens, so the assistant "
                                f"span is unknown; pass --loss-mask none to dump without a mask")
        for k in range(len(start), len(end)):
            mask[k] = 1
    return mask


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the target's Hugging Face folder or id")
    ap.add_argument("--data", required=True, help="the conversations: a .jsonl file or a folder of them")
    ap.add_argument("--out", help="the folder that receives {conversation_id}.pt (required but with --count-tokens)")
    ap.add_argument("--count-tokens", action="store_true",
                    help="print {\"conversations\", \"tokens\"} of --data as the dump would tokenize them (the chat "
                         "template applied by the tokenizer; no model loaded) and stop")
    ap.add_argument("--aux-layers", help="comma-separated HF hidden_states indices "
                                         "(default: EAGLE-3's sorted({2, N//2, N-3}))")
    ap.add_argument("--loss-mask", choices=["assistant", "none"], default="assistant",
                    help="assistant: 1 on the assistant turns (default); none: no loss_mask key, as ModelOpt's "
                         "HF dumper writes (eaglekit then trains every token)")
    ap.add_argument("--max-length", type=int,
                    help="skip (and list) conversations longer than this many tokens (default: dump all)")
    ap.add_argument("--shard", default="0/1", help="I/N: this process takes positions I, I+N, ... (default 0/1)")
    ap.add_argument("--device", help="e.g. cuda:3 (default: cuda when present, else cpu)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                    help="the model's and the dump's dtype (default auto: the checkpoint's own)")
    ap.add_argument("--trust-remote-code", action="store_true", help="transformers' trust_remote_code")
    ap.add_argument("--eks", help="when done, also write this .eks shard of OUT with eaglekit convert")
    ap.add_argument("--eks-codec", choices=["zstd", "fp8"], default="zstd",
                    help="--eks: lossless zstd (default) or fp8 (lossy: docs/formats.md)")
    ap.add_argument("--eaglekit", default="eaglekit", help="--eks: the eaglekit binary (default: on PATH)")
    args = ap.parse_args()
    try:
        if args.count_tokens:
            return count_tokens(args)
        if not args.out:
            raise UsageError("--out is required (or --count-tokens)")
        i, n = parse_shard(args.shard)
        if args.eks and n > 1:
            raise UsageError("--eks with --shard: run `eaglekit convert OUT FILE.eks` once after every shard is done")
        if args.max_length is not None and args.max_length < 1:
            raise UsageError("--max-length must be at least 1")
        return run(args, i, n)
    except UsageError as e:
        ap.print_usage(sys.stderr)
        print(f"dump: error: {e}", file=sys.stderr)
        return 2
    except (DataError, RuntimeError, OSError) as e:
        print(f"dump: error: {e}", file=sys.stderr)
        return 1


def count_tokens(args):
    """The tokens of every conversation of --data, as run() would tokenize them."""
    convs = read_conversations(args.data)
    try:
        quiet_transformers()
        from transformers import AutoTokenizer
    except ImportError as e:
        raise RuntimeError(f"--count-tokens needs transformers ({e}): pip install -r "
                           f"scripts/requirements-dump.txt into this Python ({sys.executable})") from None
    tok = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    if tok.chat_template is None:
        raise DataError(f"{args.model}: the tokenizer has no chat template")
    total = sum(len(token_ids(tok, c.turns)) for c in convs)
    print(json.dumps({"conversations": len(convs), "tokens": total, "model": args.model}))
    return 0


def run(args, i, n):
    convs = shard(read_conversations(args.data), i, n)
    names = [safe_name(c) for c in convs]
    import torch
    from transformers import AutoConfig, AutoModel, AutoTokenizer
    cfg = AutoConfig.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    cfg = getattr(cfg, "text_config", None) or cfg
    n_layers = cfg.num_hidden_layers
    if args.aux_layers:
        aux = parse_aux(args.aux_layers, n_layers)
        aux_how = "--aux-layers"
    else:
        aux = eagle3_aux_layers(n_layers)
        aux_how = f"EAGLE-3's default sorted({{2, N//2, N-3}}) for N = {n_layers}"
    settings = {"model": args.model, "aux_hidden_state_indices": aux, "loss_mask": args.loss_mask,
                "dtype": args.dtype, "max_length": args.max_length, "hidden_states_prenorm": False,
                "shard": f"{i}/{n}"}
    os.makedirs(args.out, exist_ok=True)
    manifest = os.path.join(args.out, f"dump-shard-{i}-of-{n}.json")
    if os.path.exists(manifest):
        with open(manifest) as f:
            old = json.load(f).get("settings")
        if old != settings:
            diff = ", ".join(f"{k} {old.get(k)!r} then, {v!r} now" for k, v in settings.items() if old.get(k) != v)
            raise DataError(f"{manifest}: {args.out} was dumped with other settings ({diff}); "
                            f"pass the same ones or another --out")
    # Written before the first record, so that an interrupted run's settings are known too.
    atomic_write(manifest, json.dumps({"settings": settings, "complete": False}, indent=1).encode())
    done = [os.path.exists(os.path.join(args.out, p)) for p in names]
    todo = [(c, p) for c, p, d in zip(convs, names, done) if not d]
    log(f"{len(convs)} conversations in shard {i}/{n}; {sum(done)} already in {args.out}, {len(todo)} to do")
    log(f"aux layers {aux} ({aux_how}); hidden_states after the final norm (stated: hidden_states_prenorm "
        f"False); loss mask: {args.loss_mask}")

    if not todo:
        return finish(args, manifest, settings, convs, [], i, n)
    quiet_transformers()
    tok = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    if tok.chat_template is None:
        raise DataError(f"{args.model}: the tokenizer has no chat template")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModel.from_pretrained(args.model, dtype=dtype, trust_remote_code=args.trust_remote_code)
    model.to(device).eval()
    log(f"on {device}{' (--device)' if args.device else ' (the default: cuda when present)'}, dtype {model.dtype}"
        f"{' (--dtype)' if args.dtype != 'auto' else ' (the checkpoint own, --dtype auto)'}")
    skipped = []
    tty = sys.stderr.isatty()
    for k, (c, name) in enumerate(todo):
        ids = token_ids(tok, c.turns)
        if args.max_length is not None and len(ids) > args.max_length:
            skipped.append(c.id)
            continue
        mask = assistant_mask(tok, c, ids) if args.loss_mask == "assistant" else None
        with torch.inference_mode():
            o = model(input_ids=torch.tensor([ids], device=device), output_hidden_states=True)
            hs = o.hidden_states
            if len(hs) != n_layers + 1:
                raise RuntimeError(f"{args.model}: {len(hs)} hidden states for a base of {n_layers} layers "
                                   f"(expected {n_layers + 1})")
            rec = {"input_ids": torch.tensor(ids, dtype=torch.int64),
                   "hidden_states": o.last_hidden_state[0].cpu(),
                   "aux_hidden_states": torch.cat([hs[a][0] for a in aux], dim=-1).cpu(),
                   "conversation_id": c.id, "hidden_states_prenorm": False}
        if mask is not None:
            rec["loss_mask"] = torch.tensor(mask, dtype=torch.int64)
        path = os.path.join(args.out, name)
        torch.save(rec, path + ".tmp")
        with open(path + ".tmp", "rb") as f:
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
        if tty:
            print(f"\rdump: {k + 1} / {len(todo)}", end="", file=sys.stderr, flush=True)
    if tty:
        print(file=sys.stderr)
    return finish(args, manifest, settings, convs, skipped, i, n)


def finish(args, manifest, settings, convs, skipped, i, n):
    if skipped:
        log(f"skipped {len(skipped)} conversations longer than --max-length {args.max_length}: "
            f"{', '.join(skipped[:10])}{' ...' if len(skipped) > 10 else ''}")
    atomic_write(manifest, json.dumps({"settings": settings, "complete": True, "conversations": len(convs),
                                       "dumped": len(convs) - len(skipped), "skipped": skipped}, indent=1).encode())
    log(f"{args.out}: {len(convs) - len(skipped)} records of shard {i}/{n}")
    if args.eks:
        cmd = [args.eaglekit, "convert", args.out, args.eks, "--format", "eks", "--codec", args.eks_codec]
        log("$ " + " ".join(cmd))
        try:
            r = subprocess.run(cmd)
        except OSError as e:
            raise RuntimeError(f"--eaglekit {args.eaglekit}: {e}") from None
        if r.returncode != 0:
            raise RuntimeError(f"eaglekit convert exited {r.returncode}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
