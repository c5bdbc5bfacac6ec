#!/usr/bin/env python3
"""Makes the end-to-end check's data the way users make it, with eaglekit's own two programs
(docs/dump.md): tools/python/eaglekit_regenerate.py replaces the answers with the base's greedy
output, tools/python/eaglekit_dump.py dumps the hidden states.

Usage: make_data.py BASE OUT [--train N] [--heldout N] [--seed S]

OUT receives
  prompts.jsonl                   the prompts drawn from the base's language (one user turn each)
  regenerated.jsonl               eaglekit_regenerate.py's output: each with the base's greedy
                                  answer (transformers generate, float32, at most 64 new tokens)
                                  and its token ids (--token-ids)
  train.jsonl, heldout.jsonl      {"conversation_id", "conversations": [user, assistant]}
  dumps/{conversation_id}.pt      the training conversations, by eaglekit_dump.py --loss-mask none:
                                  as ModelOpt's HF dumper writes them (input_ids [T] int64,
                                  hidden_states [T,H] LlamaModel's last_hidden_state (post-norm),
                                  aux_hidden_states [T,3H] HF hidden_states[i] for i in
                                  sorted({2, N//2, N-3}), conversation_id; no loss_mask, so that
                                  ModelOpt's dataset with its default settings is the oracle),
                                  plus hidden_states_prenorm False
  heldout-dumps/{id}.pt           the held-out conversations by eaglekit_dump.py's default: the same
                                  plus loss_mask [T], 1 on the answer's tokens, so evaluate scores
                                  exactly the positions an engine drafts at
  prompts.json                    the held-out prompts as token ids (the chat template up to the
                                  assistant's turn) and the base's greedy answers as token ids
"""
import argparse
import json
import os
import random
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_base import sample_text, weights  # noqa: E402

MAX_NEW = 64
TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools", "python")


def run(*cmd):
    cmd = [sys.executable, *cmd]
    print("make_data: $ " + " ".join(cmd), file=sys.stderr, flush=True)
    r = subprocess.run(cmd)
    if r.returncode != 0:
        raise SystemExit(f"make_data: {os.path.basename(cmd[1])} exited {r.returncode}")


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for e in rows:
            f.write(json.dumps(e) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base")
    ap.add_argument("out")
    ap.add_argument("--train", type=int, default=1500)
    ap.add_argument("--heldout", type=int, default=48)
    ap.add_argument("--seed", type=int, default=99)
    args = ap.parse_args()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.base)
    lang = json.load(open(os.path.join(args.base, "language.json")))
    rng = random.Random(args.seed)
    os.makedirs(args.out, exist_ok=True)
    n = args.train + args.heldout
    users = [sample_text(lang, rng, rng.randint(6, 12), 0)[0] for _ in range(n)]
    write_jsonl(os.path.join(args.out, "prompts.jsonl"),
                [{"conversation_id": f"conv-{i:05d}", "conversations": [{"role": "user", "content": u}]}
                 for i, u in enumerate(users)])
    regen = os.path.join(args.out, "regenerated.jsonl")
    run(os.path.join(TOOLS, "eaglekit_regenerate.py"), "--model", args.base, "--data",
        os.path.join(args.out, "prompts.jsonl"), "--out", regen, "--max-new-tokens", str(MAX_NEW),
        "--dtype", "float32", "--batch-size", "64", "--token-ids")
    with open(regen) as f:
        rows = [json.loads(line) for line in f]
    if [r["conversation_id"] for r in rows] != [f"conv-{i:05d}" for i in range(n)]:
        raise SystemExit(f"make_data: {regen}: not the {n} prompts in their order")
    prompts = [tok.apply_chat_template([{"role": "user", "content": u}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for u in users]
    answers = [r["conversations"][1].pop("eaglekit_token_ids") for r in rows]
    entries = rows
    split = {"train": entries[:args.train], "heldout": entries[args.train:]}
    for name, part in split.items():
        write_jsonl(os.path.join(args.out, f"{name}.jsonl"), part)
    run(os.path.join(TOOLS, "eaglekit_dump.py"), "--model", args.base, "--data", os.path.join(args.out, "train.jsonl"),
        "--out", os.path.join(args.out, "dumps"), "--dtype", "float32", "--loss-mask", "none")
    run(os.path.join(TOOLS, "eaglekit_dump.py"), "--model", args.base, "--data",
        os.path.join(args.out, "heldout.jsonl"), "--out", os.path.join(args.out, "heldout-dumps"), "--dtype", "float32")
    with open(os.path.join(args.out, "dumps", "dump-shard-0-of-1.json")) as f:
        sel = json.load(f)["settings"]["aux_hidden_state_indices"]
    # The dumped token ids of an answer can differ from the generated ones when decode -> encode
    # does not round-trip; count it, the engine check uses the generated ids.
    roundtrip = 0
    for p, a, e in zip(prompts[args.train:], answers[args.train:], split["heldout"]):
        ids = tok.apply_chat_template(e["conversations"], tokenize=True, return_dict=False)
        roundtrip += ids[len(p):len(p) + len(a)] == a
    # How well the greedy answers follow the language: the share of answer words that are the
    # most likely successor of the two words before them in the topic the prompt names (1 in 4 if
    # it picked among the successors at random), and of those that are a successor at all (by
    # chance: 4 in 400).
    index = {w: i for i, w in enumerate(lang["words"])}
    follow = valid = total = 0
    for e in entries:
        u = e["conversations"][0]["content"].split()
        topic = lang["topics"].index(u[0])
        seq = [index.get(w, -1) for w in u[1:] + e["conversations"][1]["content"].split()]
        for j in range(len(u) - 1, len(seq)):
            prev, cur = (seq[j - 2] if j >= 2 else -1), seq[j - 1]
            if cur < 0:
                continue
            w = weights(lang, topic, prev, cur)
            best = lang["successors"][cur][max(range(len(w)), key=w.__getitem__)]
            follow += seq[j] == best
            valid += seq[j] in lang["successors"][cur]
            total += 1
    lengths = [len(a) for a in answers]
    distinct = len({tuple(a) for a in answers})
    with open(os.path.join(args.out, "prompts.json"), "w") as f:
        json.dump({"prompts": prompts[args.train:], "answers": answers[args.train:],
                   "ids": [e["conversation_id"] for e in split["heldout"]], "max_new_tokens": MAX_NEW}, f)
    summary = {"train": args.train, "heldout": args.heldout, "aux_hidden_state_indices": sel,
               "answer_tokens_mean": sum(lengths) / len(lengths), "distinct_answers": distinct,
               "answers_ending_in_eos": sum(tok.eos_token_id in a for a in answers),
               "heldout_roundtrip_exact": roundtrip,
               "answer_words_a_successor": round(valid / max(total, 1), 4),
               "answer_words_most_likely_successor": round(follow / max(total, 1), 4)}
    with open(os.path.join(args.out, "data.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print("make_data:", json.dumps(summary), file=sys.stderr)


if __name__ == "__main__":
    main()
