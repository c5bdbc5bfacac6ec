#!/usr/bin/env python3
"""Replaces every assistant turn of your conversations with the target model's own answer, so
that the draft learns what the engine will verify (docs/dump.md).

Usage:
  eaglekit_regenerate.py --model DIR --data IN.jsonl --out OUT.jsonl [options]     transformers generate
  eaglekit_regenerate.py --server URL --data IN.jsonl --out OUT.jsonl [options]    a running vLLM (or any
                                                           OpenAI-compatible server): /v1/chat/completions

IN is a .jsonl file or a folder of them (docs/data.md). Each assistant turn is regenerated from
the turns before it, earlier assistant turns already regenerated; a conversation that ends with a
user turn gets an answer appended. System and user turns, ids and other keys are kept. Answers
are stripped of leading and trailing whitespace. Sampling is greedy unless --temperature > 0,
whatever the model's generation_config.json says.

Resumable: OUT is written only when the shard is complete (through OUT.partial, one whole
line per conversation, fsync'd per batch); a rerun skips the ids already in OUT.partial and drops
an unfinished last line. --shard I/N takes the conversations at positions I, I+N, ... (give
each shard its own OUT; a folder of the N outputs is itself a --data for eaglekit).

Exit codes: 0 done, 1 bad data or a failed request (the message names FILE:LINE or the id),
2 usage.
"""
import argparse
import concurrent.futures
import copy
import json
import os
import sys
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from eaglekit_conversations import (DataError, UsageError, conversation_id, parse_shard,  # noqa: E402
                                    read_conversations, shard)

TOKEN_IDS_KEY = "eaglekit_token_ids"


def log(msg):
    print(f"regenerate: {msg}", file=sys.stderr, flush=True)


def output_object(conv, turns, token_ids):
    """The conversation's object with its turns replaced, in its own turn style."""
    obj = copy.deepcopy(conv.obj)
    out = []
    for j, t in enumerate(turns):
        if conv.sharegpt:
            role = {"user": "human", "assistant": "gpt"}.get(t["role"], t["role"])
            src = conv.obj[conv.turn_key][j] if j < len(conv.obj[conv.turn_key]) else {}
            d = {**src, "from": role, "value": t["content"]}
        else:
            src = conv.obj[conv.turn_key][j] if j < len(conv.obj[conv.turn_key]) else {}
            d = {**src, "role": t["role"], "content": t["content"]}
        if token_ids is not None and j in token_ids:
            d[TOKEN_IDS_KEY] = token_ids[j]
        out.append(d)
    obj[conv.turn_key] = out
    return obj


def plan(conv):
    """The indices of the turns to generate: every assistant turn, or one appended after a final
    user turn. Returns (turns with a placeholder appended if needed, [indices])."""
    turns = [dict(t) for t in conv.turns]
    if turns[-1]["role"] == "user":
        turns.append({"role": "assistant", "content": ""})
    return turns, [j for j, t in enumerate(turns) if t["role"] == "assistant"]


class HFBackend:
    def __init__(self, args):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer
        if not sys.stderr.isatty():
            transformers.utils.logging.disable_progress_bar()
        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
        if self.tok.chat_template is None:
            raise DataError(f"{args.model}: the tokenizer has no chat template")
        dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype,
                                                          trust_remote_code=args.trust_remote_code)
        self.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model.to(self.device).eval()
        eos = self.model.generation_config.eos_token_id
        eos = eos if eos is not None else self.tok.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos])
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else min(self.eos)
        self.args = args
        log(f"transformers on {self.device}{' (--device)' if args.device else ' (the default: cuda when present)'}, "
            f"dtype {self.model.dtype} ({'--dtype' if args.dtype != 'auto' else 'the checkpoint own, --dtype auto'}), "
            f"end-of-turn ids {sorted(self.eos)}")

    def generate(self, histories):
        """One answer (text, token ids) per history (a list of turns ending before the answer)."""
        torch, a = self.torch, self.args
        prompts = [self.tok.apply_chat_template(h, add_generation_prompt=True, tokenize=True, return_dict=False)
                   for h in histories]
        n = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), n), self.pad)
        att = torch.zeros((len(prompts), n), dtype=torch.long)
        for j, p in enumerate(prompts):  # left padding
            ids[j, n - len(p):] = torch.tensor(p)
            att[j, n - len(p):] = 1
        kw = {"do_sample": False} if a.temperature == 0 else {"do_sample": True, "temperature": a.temperature,
                                                              "top_p": a.top_p}
        with torch.inference_mode():
            g = self.model.generate(input_ids=ids.to(self.device), attention_mask=att.to(self.device),
                                    max_new_tokens=a.max_new_tokens, pad_token_id=self.pad,
                                    eos_token_id=sorted(self.eos), **kw)
        out = []
        for j in range(len(prompts)):
            t = g[j, n:].tolist()
            end = next((k for k, x in enumerate(t) if x in self.eos), None)
            t = t[:end + 1] if end is not None else t
            text = self.tok.decode([x for x in t if x not in self.eos], skip_special_tokens=True).strip()
            out.append((text, t, end is None))
        return out

    def run(self, convs):
        """Regenerates a batch of conversations together, turn round by turn round."""
        plans = [plan(c) for c in convs]
        ids = [{} for _ in convs]
        truncated = 0
        for r in range(max(len(p[1]) for p in plans)):
            todo = [k for k, p in enumerate(plans) if r < len(p[1])]
            answers = self.generate([plans[k][0][:plans[k][1][r]] for k in todo])
            for k, (text, t, cut) in zip(todo, answers):
                j = plans[k][1][r]
                plans[k][0][j]["content"] = text
                ids[k][j] = t
                truncated += cut
        return [(p[0], i) for p, i in zip(plans, ids)], truncated


class ServerBackend:
    def __init__(self, args):
        self.base = args.server.rstrip("/")
        if self.base.endswith("/v1"):
            self.base = self.base[:-3]
        self.args = args
        self.name = args.served_model or self.only_model()
        log(f"server {self.base}/v1/chat/completions, model {self.name!r}"
            f"{'' if args.served_model else ' (the only one /v1/models lists)'}")

    def request(self, path, body=None):
        req = urllib.request.Request(self.base + path, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        if os.environ.get("OPENAI_API_KEY"):
            req.add_header("Authorization", "Bearer " + os.environ["OPENAI_API_KEY"])
        try:
            with urllib.request.urlopen(req, timeout=self.args.timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{self.base}{path}: HTTP {e.code}: {e.read()[:500].decode(errors='replace')}") from None
        except (urllib.error.URLError, OSError) as e:
            raise RuntimeError(f"{self.base}{path}: {e}") from None

    def only_model(self):
        names = [m["id"] for m in self.request("/v1/models").get("data", [])]
        if len(names) != 1:
            raise UsageError(f"{self.base}/v1/models lists {names}: pass --served-model NAME")
        return names[0]

    def one(self, conv):
        turns, todo = plan(conv)
        cut = 0
        for j in todo:
            body = {"model": self.name, "messages": turns[:j], "max_tokens": self.args.max_new_tokens,
                    "temperature": self.args.temperature}
            if self.args.temperature > 0:
                body["top_p"] = self.args.top_p
            try:
                r = self.request("/v1/chat/completions", body)
                choice = r["choices"][0]
                text = choice["message"]["content"]
            except (KeyError, IndexError, TypeError) as e:
                raise RuntimeError(f"conversation {conv.id} ({conv.where()}), turn {j}: "
                                   f"an unexpected response ({e!r})") from None
            except RuntimeError as e:
                raise RuntimeError(f"conversation {conv.id} ({conv.where()}), turn {j}: {e}") from None
            turns[j]["content"] = (text or "").strip()
            cut += choice.get("finish_reason") == "length"
        return turns, cut

    def run(self, convs):
        with concurrent.futures.ThreadPoolExecutor(self.args.concurrency) as ex:
            res = list(ex.map(self.one, convs))
        return [(t, None) for t, _ in res], sum(c for _, c in res)


def done_ids(partial):
    """Ids already in OUT.partial; cuts an unfinished or unreadable last line off the file."""
    if not os.path.exists(partial):
        return set()
    with open(partial, "rb") as f:
        data = f.read()
    keep = data.rfind(b"\n") + 1
    ids = set()
    for n, line in enumerate(data[:keep].splitlines(), 1):
        try:
            obj = json.loads(line)
            ids.add(conversation_id(obj, f"{partial}:{n}"))
        except (json.JSONDecodeError, AttributeError, DataError):
            raise DataError(f"{partial}:{n}: not a conversation this program wrote; remove the file to start over")
    if keep != len(data):
        log(f"{partial}: dropping an unfinished last line ({len(data) - keep} bytes) of an interrupted run")
        with open(partial, "r+b") as f:
            f.truncate(keep)
    return ids


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="the target's Hugging Face folder or id (transformers generate)")
    src.add_argument("--server", help="a running OpenAI-compatible server, e.g. http://localhost:8000 (vllm serve)")
    ap.add_argument("--data", required=True, help="the conversations: a .jsonl file or a folder of them")
    ap.add_argument("--out", required=True, help="the output .jsonl (written whole at the end; see above)")
    ap.add_argument("--max-new-tokens", type=int, required=True,
                    help="the most tokens an answer may take (required: it decides how many answers are cut)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampling")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling with --temperature > 0 (default 1.0)")
    ap.add_argument("--shard", default="0/1", help="I/N: this process takes positions I, I+N, ... (default 0/1)")
    ap.add_argument("--batch-size", type=int, default=16,
                    help="conversations generated together (transformers; default 16)")
    ap.add_argument("--device", help="transformers: e.g. cuda:1 (default: cuda when present, else cpu)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                    help="transformers: the model's dtype (default auto: the checkpoint's own)")
    ap.add_argument("--trust-remote-code", action="store_true", help="transformers' trust_remote_code")
    ap.add_argument("--token-ids", action="store_true",
                    help=f"transformers: also store each regenerated turn's generated token ids (end-of-turn "
                         f"included) as {TOKEN_IDS_KEY!r} in that turn")
    ap.add_argument("--served-model", help="--server: the model name (default: the only one /v1/models lists)")
    ap.add_argument("--concurrency", type=int, default=16, help="--server: requests in flight (default 16)")
    ap.add_argument("--timeout", type=float, default=600, help="--server: seconds per request (default 600)")
    args = ap.parse_args()
    try:
        i, n = parse_shard(args.shard)
        if args.max_new_tokens < 1 or args.batch_size < 1 or args.concurrency < 1:
            raise UsageError("--max-new-tokens, --batch-size and --concurrency must be at least 1")
        if args.temperature < 0 or not 0 < args.top_p <= 1:
            raise UsageError("--temperature must be >= 0 and --top-p in (0, 1]")
        if args.token_ids and args.server:
            raise UsageError("--token-ids needs --model (a chat completion returns text)")
        return run(args, i, n)
    except UsageError as e:
        ap.print_usage(sys.stderr)
        print(f"regenerate: error: {e}", file=sys.stderr)
        return 2
    except (DataError, RuntimeError, OSError) as e:
        print(f"regenerate: error: {e}", file=sys.stderr)
        return 1


def run(args, i, n):
    convs = shard(read_conversations(args.data), i, n)
    partial = args.out + ".partial"
    if os.path.dirname(args.out):
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
    if os.path.exists(args.out):
        have = {str(c.id) for c in read_conversations(args.out)}
        missing = [c.id for c in convs if c.id not in have]
        if missing:
            raise DataError(f"{args.out} exists without the conversation {missing[0]!r} of shard {i}/{n} "
                            f"({len(missing)} missing): another input? Remove it to regenerate")
        log(f"{args.out} is complete ({len(have)} conversations): nothing to do")
        return 0
    done = done_ids(partial)
    todo = [c for c in convs if c.id not in done]
    log(f"{len(convs)} conversations in shard {i}/{n}; {len(convs) - len(todo)} already in {partial}, "
        f"{len(todo)} to do; {'greedy' if args.temperature == 0 else f'temperature {args.temperature}, top-p {args.top_p}'}"
        f", at most {args.max_new_tokens} new tokens")
    backend = HFBackend(args) if args.model else ServerBackend(args)
    step = args.batch_size if args.model else args.concurrency * 4
    truncated = 0
    tty = sys.stderr.isatty()
    with open(partial, "ab") as f:
        for b in range(0, len(todo), step):
            chunk = todo[b:b + step]
            res, cut = backend.run(chunk)
            truncated += cut
            for c, (turns, ids) in zip(chunk, res):
                f.write((json.dumps(output_object(c, turns, ids), ensure_ascii=False) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())
            if tty:
                print(f"\rregenerate: {b + len(chunk)} / {len(todo)}", end="", file=sys.stderr, flush=True)
    if tty:
        print(file=sys.stderr)
    # Checked before the rename: every id of the shard once.
    written = read_conversations(partial)
    if sorted(c.id for c in written) != sorted(c.id for c in convs):
        raise DataError(f"{partial}: holds {len(written)} conversations, shard {i}/{n} has {len(convs)}; "
                        f"remove it to start over")
    os.replace(partial, args.out)
    log(f"wrote {args.out}: {len(convs)} conversations; {truncated} answers stopped at --max-new-tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
