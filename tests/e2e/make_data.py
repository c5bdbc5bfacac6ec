#!/usr/bin/env python3
"""Makes the end-to-end check's data the way users make it: conversations whose answers are the
base's own greedy output, dumped as NVIDIA ModelOpt's HF dumper
(examples/speculative_decoding/collect_hidden_states/compute_hidden_states_hf.py) writes them.

Usage: make_data.py BASE OUT [--train N] [--heldout N] [--seed S]

OUT receives
  train.jsonl, heldout.jsonl      {"conversation_id", "conversations": [user, assistant]}
  dumps/{conversation_id}.pt      the training conversations, as ModelOpt's dumper writes them:
                                  input_ids [T] int64, hidden_states [T,H] (LlamaModel's
                                  last_hidden_state: after the final norm), aux_hidden_states
                                  [T,3H] (HF hidden_states[i] for i in sorted({2, N//2, N-3})),
                                  conversation_id; no loss_mask (the dumper writes none)
  heldout-dumps/{id}.pt           the held-out conversations the same way, plus loss_mask [T]
                                  (ModelOpt's reader takes one): 1 on the answer's tokens, so
                                  evaluate scores exactly the positions an engine drafts at
  prompts.json                    the held-out prompts as token ids (the chat template up to the
                                  assistant's turn) and the base's greedy answers as token ids

The answers come from transformers' greedy generate() in float32, max 64 new tokens.
"""
import argparse
import json
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_base import sample_text, weights  # noqa: E402

MAX_NEW = 64


def generate(model, tok, prompts, batch=64):
    """Greedy answers (token ids, eos included when produced) for chat prompts (token id lists)."""
    out = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        n = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), n), tok.pad_token_id)
        att = torch.zeros((len(chunk), n), dtype=torch.long)
        for j, p in enumerate(chunk):  # left padding
            ids[j, n - len(p):] = torch.tensor(p)
            att[j, n - len(p):] = 1
        with torch.inference_mode():
            g = model.generate(input_ids=ids, attention_mask=att, do_sample=False, max_new_tokens=MAX_NEW,
                               pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        for j in range(len(chunk)):
            a = g[j, n:].tolist()
            if tok.eos_token_id in a:
                a = a[:a.index(tok.eos_token_id) + 1]
            out.append(a)
    return out


def dump(model, tok, entry, path, answer_mask):
    """One conversation as ModelOpt's HF dumper writes it (plus loss_mask when answer_mask)."""
    conv = entry["conversations"]
    input_ids = tok.apply_chat_template(conv, return_tensors="pt", return_dict=False)
    n_layers = model.config.num_hidden_layers
    with torch.inference_mode():
        o = model.model(input_ids=input_ids, output_hidden_states=True)
        hs = o.hidden_states
        assert len(hs) == n_layers + 1
        sel = sorted({2, max(0, n_layers // 2), max(1, n_layers - 3)})
        aux = torch.cat([hs[i].squeeze(0) for i in sel], dim=-1)
        rec = {"input_ids": input_ids.squeeze(0), "hidden_states": o.last_hidden_state.squeeze(0),
               "aux_hidden_states": aux, "conversation_id": entry["conversation_id"]}
    if answer_mask:
        prompt = tok.apply_chat_template(conv[:1], add_generation_prompt=True, tokenize=True, return_dict=False)
        m = torch.zeros_like(rec["input_ids"])
        m[len(prompt):] = 1
        rec["loss_mask"] = m
    tmp = path + ".tmp"
    torch.save(rec, tmp)
    os.replace(tmp, path)
    return sel


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base")
    ap.add_argument("out")
    ap.add_argument("--train", type=int, default=1500)
    ap.add_argument("--heldout", type=int, default=48)
    ap.add_argument("--seed", type=int, default=99)
    args = ap.parse_args()
    from transformers import AutoTokenizer, LlamaForCausalLM
    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(args.base)
    model = LlamaForCausalLM.from_pretrained(args.base, torch_dtype=torch.float32).eval()
    lang = json.load(open(os.path.join(args.base, "language.json")))
    rng = random.Random(args.seed)
    os.makedirs(os.path.join(args.out, "dumps"), exist_ok=True)
    os.makedirs(os.path.join(args.out, "heldout-dumps"), exist_ok=True)
    n = args.train + args.heldout
    users = [sample_text(lang, rng, rng.randint(6, 12), 0)[0] for _ in range(n)]
    prompts = [tok.apply_chat_template([{"role": "user", "content": u}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for u in users]
    answers = generate(model, tok, prompts)
    entries = []
    for i, (u, a) in enumerate(zip(users, answers)):
        text = tok.decode([t for t in a if t != tok.eos_token_id]).strip()
        entries.append({"conversation_id": f"conv-{i:05d}",
                        "conversations": [{"role": "user", "content": u},
                                          {"role": "assistant", "content": text}]})
    split = {"train": entries[:args.train], "heldout": entries[args.train:]}
    for name, rows in split.items():
        with open(os.path.join(args.out, f"{name}.jsonl"), "w") as f:
            for e in rows:
                f.write(json.dumps(e) + "\n")
    for e in split["train"]:
        sel = dump(model, tok, e, os.path.join(args.out, "dumps", e["conversation_id"] + ".pt"), False)
    for e in split["heldout"]:
        dump(model, tok, e, os.path.join(args.out, "heldout-dumps", e["conversation_id"] + ".pt"), True)
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
