#!/usr/bin/env python3
"""Computes each conversation's loss mask with the base's chat template, without running the
model, and writes them as one file that `eaglekit convert --loss-masks FILE` joins to a dump by
conversation id (docs/dump.md). For dumps that carry no loss_mask, as NVIDIA ModelOpt's HF
dumper writes without --answer-only-loss: no re-dump is needed.

Usage: eaglekit_masks.py --base DIR --data IN.jsonl --out MASKS.safetensors --rule modelopt|eaglekit
                         [--chat-template FILE]

--rule (required; the two differ on the tokens they train, docs/dump.md):
  modelopt  ModelOpt 0.47's answer-only-loss rule: the tokens transformers' apply_chat_template
            marks as assistant (return_assistant_tokens_mask) inside the template's
            {% generation %} ... {% endgeneration %} tags, the whole conversation tokenized at
            once without a generation prompt. As ModelOpt does, the template (--chat-template
            FILE, else the base's) first loses ModelOpt's DeepSeek "strip the reasoning before
            </think>" fragment; a template without {% generation %} tags is refused (transformers
            would give every token 0), and so is a slow tokenizer (no char_to_token).
  eaglekit  eaglekit_dump.py's rule: each assistant turn from the end of the prompt that asks for
            it (add_generation_prompt) to the end of the template applied through it.

The file (safetensors; layout in docs/formats.md):
  __metadata__      {"eaglekit": "loss masks by conversation id", "version": "1", "rows": "N",
                     "rule": RULE}
  row_offsets       I64 [N + 1]  row i is [row_offsets[i], row_offsets[i + 1])
  input_ids         I64 [total]  the rows' tokens, back to back (the join checks them)
  loss_mask         U8  [total]  0 or 1
  id_offsets        I64 [N + 1]  row i's conversation id is conversation_ids[id_offsets[i]:...]
  conversation_ids  U8  [bytes]  the ids, UTF-8, back to back

Exit codes: 0 done, 1 bad data (naming FILE:LINE or the id) or a refused template, 2 usage.
"""
import argparse
import json
import os
import re
import struct
import sys
from array import array

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from eaglekit_conversations import DataError, UsageError, atomic_write, read_conversations  # noqa: E402

KIND = "loss masks by conversation id"
# The Jinja fragment ModelOpt 0.47 removes from every chat template before tokenizing (its
# dumpers and LanguageDataCollator): DeepSeek-R1's template drops an answer's reasoning; with it
# removed the reasoning stays in the tokens.
THINK_FRAGMENT = "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
GENERATION_TAG = re.compile(r"\{%-?\s*generation\b")


def log(msg):
    print(f"masks: {msg}", file=sys.stderr, flush=True)


def as_list(x):
    if hasattr(x, "tolist"):
        x = x.tolist()
    if x and isinstance(x[0], list):
        if len(x) != 1:
            raise RuntimeError(f"apply_chat_template returned {len(x)} rows for one conversation")
        x = x[0]
    return [int(v) for v in x]


def modelopt_template(tok, template_file):
    """The template as ModelOpt tokenizes with it; DataError when ModelOpt would refuse it."""
    where = template_file or "the base's chat template"
    template = open(template_file).read() if template_file else tok.chat_template
    if not template:
        raise DataError(f"{where}: no chat template")
    template = template.replace(THINK_FRAGMENT, "")
    if not GENERATION_TAG.search(template):
        raise DataError(f"{where}: --rule modelopt needs {{% generation %}} ... {{% endgeneration %}} tags around "
                        "the assistant's tokens (ModelOpt refuses a template without them: transformers would mark "
                        "no token); pass --chat-template with a tagged copy, or use --rule eaglekit")
    if not getattr(tok, "is_fast", False):
        raise DataError(f"{where}: --rule modelopt needs a fast tokenizer (assistant masks map the tags to tokens "
                        "with char_to_token); this one is not")
    return template


def modelopt_mask(tok, turns):
    """(input_ids, mask) as ModelOpt 0.47 computes them with answer-only loss."""
    out = tok.apply_chat_template(turns, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                  add_generation_prompt=False)
    ids, mask = as_list(out["input_ids"]), as_list(out["assistant_masks"])
    if len(ids) != len(mask):
        raise RuntimeError(f"assistant_masks holds {len(mask)} tokens, input_ids {len(ids)}")
    return ids, mask


def eaglekit_mask(tok, conv):
    from eaglekit_dump import assistant_mask, token_ids
    ids = token_ids(tok, conv.turns)
    return ids, assistant_mask(tok, conv, ids)


def safetensors_bytes(tensors, metadata):
    header = {"__metadata__": metadata}
    pos = 0
    for name, dtype, a in tensors:
        n = len(a) * a.itemsize
        header[name] = {"dtype": dtype, "shape": [len(a)], "data_offsets": [pos, pos + n]}
        pos += n
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    body = []
    for _, _, a in tensors:
        if sys.byteorder != "little" and a.itemsize > 1:
            a = array(a.typecode, a)
            a.byteswap()
        body.append(a.tobytes())
    return struct.pack("<Q", len(h)) + h + b"".join(body)


def run(args):
    convs = read_conversations(args.data)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.base, trust_remote_code=args.trust_remote_code)
    if args.rule == "modelopt":
        tok.chat_template = modelopt_template(tok, args.chat_template)
    elif args.chat_template:
        tok.chat_template = open(args.chat_template).read()
    offsets, ids_all, mask_all = array("q", [0]), array("q"), array("B")
    id_offsets, id_bytes = array("q", [0]), array("B")
    untrained = []
    for c in convs:
        ids, mask = modelopt_mask(tok, c.turns) if args.rule == "modelopt" else eaglekit_mask(tok, c)
        if any(m not in (0, 1) for m in mask):
            raise RuntimeError(f"{c.where()}: conversation {c.id}: a mask value other than 0 or 1")
        if not any(mask):
            untrained.append(c.id)
        ids_all.extend(ids)
        mask_all.extend(mask)
        offsets.append(len(ids_all))
        id_bytes.frombytes(c.id.encode())
        id_offsets.append(len(id_bytes))
    meta = {"eaglekit": KIND, "version": "1", "rows": str(len(convs)), "rule": args.rule}
    tensors = [("row_offsets", "I64", offsets), ("input_ids", "I64", ids_all), ("loss_mask", "U8", mask_all),
               ("id_offsets", "I64", id_offsets), ("conversation_ids", "U8", id_bytes)]
    atomic_write(args.out, safetensors_bytes(tensors, meta))
    log(f"{args.out}: {len(convs)} conversations, {len(ids_all)} tokens, {sum(mask_all)} in the loss "
        f"(rule {args.rule})")
    if untrained:
        log(f"{len(untrained)} conversations have no token in the loss: {', '.join(untrained[:5])}"
            + (" ..." if len(untrained) > 5 else ""))
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the base's Hugging Face folder or id (its tokenizer and template)")
    ap.add_argument("--data", required=True, help="the conversations: a .jsonl file or a folder of them")
    ap.add_argument("--out", required=True, help="the .safetensors file to write")
    ap.add_argument("--rule", required=True, choices=["modelopt", "eaglekit"],
                    help="which tokens are trained (no default: the two differ)")
    ap.add_argument("--chat-template", help="a Jinja file used instead of the base's template")
    ap.add_argument("--trust-remote-code", action="store_true", help="transformers' trust_remote_code")
    args = ap.parse_args()
    try:
        if args.chat_template and not os.path.isfile(args.chat_template):
            raise UsageError(f"--chat-template {args.chat_template}: no such file")
        return run(args)
    except UsageError as e:
        ap.print_usage(sys.stderr)
        print(f"masks: error: {e}", file=sys.stderr)
        return 2
    except (DataError, RuntimeError, OSError) as e:
        print(f"masks: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
