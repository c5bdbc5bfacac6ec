#!/usr/bin/env python3
"""The check of tools/python/eaglekit_masks.py (docs/dump.md): its --rule modelopt masks equal,
token for token, the masks NVIDIA ModelOpt 0.47's own functions compute (the streaming dataset's
_tokenize_with_loss_mask, as its dumpers with --answer-only-loss, and LanguageDataCollator with
answer_only_loss) on the given conversations and a few multi-turn ones, for two {% generation %}
taggings of the base's template; and it states where ModelOpt's mask and eaglekit_dump.py's
differ. Runs in the e2e's environment (transformers and nvidia-modelopt are there); scripts/e2e
runs it on the e2e base and its training conversations as its stage `masks`.

Usage: check_masks.py BASE CONVERSATIONS.jsonl WORK [--json]   exit 0 all pass, 1 one fails, 2 usage
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tools", "python"))
MASKS = os.path.join(ROOT, "tools", "python", "eaglekit_masks.py")

# Multi-turn, a system turn, ShareGPT turns: what the e2e's single-turn data lacks.
MULTI = [
    {"conversation_id": "m1", "conversations": [
        {"role": "system", "content": "topic1"}, {"role": "user", "content": "topic2 bibo"},
        {"role": "assistant", "content": "gora bibo rusi"}, {"role": "user", "content": "topic3 rusi"},
        {"role": "assistant", "content": "nazono leke"}]},
    {"id": 7, "conversations": [{"from": "human", "value": "topic0 govi"}, {"from": "gpt", "value": "dutego"},
                                {"from": "human", "value": "topic1 leke"}, {"from": "gpt", "value": ""}]},
    {"uuid": "u", "messages": [{"role": "user", "content": "topic2 bibini"}]},
]


class Checks:
    def __init__(self):
        self.results = []

    def __call__(self, name, ok, detail=""):
        self.results.append({"check": name, "ok": bool(ok), "detail": detail})
        print(f"check_masks: {'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", file=sys.stderr)


def sh(*cmd):
    r = subprocess.run([sys.executable, MASKS, *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return r.returncode, r.stderr


def read_sidecar(path):
    """{conversation id: (input_ids, mask)} and the metadata of an eaglekit_masks.py file."""
    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        meta = f.metadata()
        t = {k: f.get_tensor(k).tolist() for k in f.keys()}
    names = bytes(t["conversation_ids"])
    out = {}
    for i in range(len(t["row_offsets"]) - 1):
        b, e = t["row_offsets"][i], t["row_offsets"][i + 1]
        cid = names[t["id_offsets"][i]:t["id_offsets"][i + 1]].decode()
        out[cid] = (t["input_ids"][b:e], t["loss_mask"][b:e])
    return out, meta


def tagged_templates(template):
    """Two taggings of a template that renders each turn as `<|ROLE|> CONTENT<|end|>` (the e2e
    base's): the assistant's content only, and its content with the end-of-turn token."""
    body = "{{ m['content'] }}<|end|>"
    if body not in template:
        raise RuntimeError(f"the base's template has no {body!r} to tag: {template!r}")
    a = "{% if m['role'] == 'assistant' %}"
    return {
        "content": template.replace(body, a + "{% generation %}{{ m['content'] }}{% endgeneration %}<|end|>"
                                    "{% else %}" + body + "{% endif %}"),
        "content and <|end|>": template.replace(body, a + "{% generation %}" + body + "{% endgeneration %}"
                                                "{% else %}" + body + "{% endif %}"),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base")
    ap.add_argument("conversations")
    ap.add_argument("work")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    check = Checks()
    try:
        run(args, check)
    except Exception as e:  # a check that cannot go on is a failure, reported with the others
        import traceback
        traceback.print_exc()
        check("the check ran to its end", False, f"stopped: {e!r}")
    failed = [c for c in check.results if not c["ok"]]
    if args.json:
        print(json.dumps(check.results, indent=1))
    print(f"check_masks: {len(check.results) - len(failed)} of {len(check.results)} checks passed", file=sys.stderr)
    return 1 if failed else 0


def run(args, check):
    import torch
    from transformers import AutoTokenizer
    from modelopt.torch.speculative.plugins.hf_streaming_dataset import _tokenize_with_loss_mask
    from modelopt.torch.utils.plugins.transformers_dataset import LanguageDataCollator
    from eaglekit_conversations import read_conversations

    w = args.work
    shutil.rmtree(w, ignore_errors=True)
    os.makedirs(w)
    p = lambda *x: os.path.join(w, *x)  # noqa: E731
    with open(p("multi.jsonl"), "w") as f:
        for row in MULTI:
            f.write(json.dumps(row) + "\n")
    convs = read_conversations(args.conversations) + read_conversations(p("multi.jsonl"))
    with open(p("all.jsonl"), "w") as f:
        for c in convs:
            f.write(json.dumps({"conversation_id": c.id, "conversations": c.turns}) + "\n")
    tok = AutoTokenizer.from_pretrained(args.base)
    untagged = tok.chat_template

    rc, _ = sh("--help")
    rc2, err2 = sh("--base", args.base, "--data", p("all.jsonl"), "--out", p("x.safetensors"))
    check("--help exits 0; no --rule is a usage error (exit 2)", rc == 0 and rc2 == 2 and "--rule" in err2,
          f"exit {rc} and {rc2}")
    rc, err = sh("--base", args.base, "--data", p("all.jsonl"), "--out", p("x.safetensors"), "--rule", "modelopt")
    try:
        _tokenize_with_loss_mask(tok, convs[0].turns, True)
        theirs = "accepted"
    except RuntimeError as e:
        theirs = "refused" if "generation" in str(e) else repr(e)
    check("--rule modelopt refuses a template without {% generation %} tags, as ModelOpt does (exit 1)",
          rc == 1 and "{% generation %}" in err and theirs == "refused" and not os.path.exists(p("x.safetensors")),
          f"exit {rc}, ModelOpt {theirs}")

    rc, err = sh("--base", args.base, "--data", p("all.jsonl"), "--out", p("eaglekit.safetensors"), "--rule", "eaglekit")
    ours_ek, meta = read_sidecar(p("eaglekit.safetensors")) if rc == 0 else ({}, {})
    check("--rule eaglekit writes one row per conversation", rc == 0 and sorted(ours_ek) == sorted(c.id for c in convs)
          and meta == {"eaglekit": "loss masks by conversation id", "version": "1", "rows": str(len(convs)),
                       "rule": "eaglekit"}, f"exit {rc}, {len(ours_ek)} rows")
    for name, template in tagged_templates(untagged).items():
        path = p(f"tagged-{len(name)}.jinja")
        with open(path, "w") as f:
            f.write(template)
        out = p(f"modelopt-{len(name)}.safetensors")
        rc, err = sh("--base", args.base, "--data", p("all.jsonl"), "--out", out, "--rule", "modelopt",
                     "--chat-template", path)
        ours, meta = read_sidecar(out) if rc == 0 else ({}, {})
        tok.chat_template = template
        collator = LanguageDataCollator(tok, train_len=4096, chat_template=template, answer_only_loss=True)
        differ, ones, compared = [], 0, 0
        for c in convs:
            ids, mask = _tokenize_with_loss_mask(tok, c.turns, True)
            ref = (ids[0].tolist(), mask.tolist())
            batch = collator._process_chat_sample([c.turns])
            n = int(batch["attention_mask"][0].sum())
            ref2 = (batch["input_ids"][0, :n].tolist(), batch["assistant_masks"][0, :n].tolist())
            got = ours.get(c.id)
            compared += got is not None
            if got != ref or ref2 != ref:
                differ.append(c.id)
            ones += sum(ref[1])
        check(f"--rule modelopt (tags around the assistant's {name}) equals ModelOpt's own masks token for token",
              rc == 0 and compared == len(convs) and not differ and meta.get("rule") == "modelopt" and ones > 0,
              f"exit {rc}, {compared} conversations, {ones} tokens in the loss"
              + (f", differ: {differ[:5]}" if differ else ""))
        # Where ModelOpt's mask and eaglekit_dump.py's differ: counted by token, either way.
        only_ek, only_mo, turns, empty = {}, 0, 0, 0
        for c in convs:
            ids, m_ek = ours_ek.get(c.id, ([], []))
            m_mo = ours.get(c.id, ([], []))[1]
            if len(m_ek) != len(m_mo):
                only_mo = -1
                break
            for k, (a, b) in enumerate(zip(m_ek, m_mo)):
                if a > b:
                    t = tok.convert_ids_to_tokens(ids[k])
                    only_ek[t] = only_ek.get(t, 0) + 1
                only_mo += b > a
            turns += sum(t["role"] == "assistant" for t in c.turns)
            empty += sum(t["role"] == "assistant" and not t["content"] for t in c.turns)
        # The template's space after <|assistant|> is its own token only before an empty answer
        # (elsewhere it is part of the answer's first token, which both count).
        want = {"<|end|>": turns, "\u2581": empty} if name == "content" else {"\u2581": empty}
        check(f"with the {name} tagged, eaglekit's mask is ModelOpt's plus "
              + ("each assistant turn's <|end|> and " if name == "content" else "")
              + "the space token of an empty answer",
              only_ek == want and only_mo == 0 and empty == 1,
              f"eaglekit only: {only_ek}, ModelOpt only: {only_mo} tokens; {turns} assistant turns, {empty} empty")
    tok.chat_template = untagged


if __name__ == "__main__":
    sys.exit(main())
