#!/usr/bin/env python3
"""The fast check of tools/python/eaglekit_regenerate.py and eaglekit_dump.py (docs/dump.md):
resuming an interrupted run gives the uninterrupted run's output, shards cover the input once,
the loss mask covers the assistant turns, the server path sends what a vLLM server expects, and
bad input is refused with the file and line named. Runs in the e2e's environment (transformers
is there, not in Debian's python3), on the e2e base; scripts/e2e runs it as its stage dump_tools.

Usage: check_dump_tools.py BASE WORK [--json]     exit 0 all pass, 1 one fails, 2 usage
"""
import argparse
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
REGEN = os.path.join(ROOT, "tools", "python", "eaglekit_regenerate.py")
DUMP = os.path.join(ROOT, "tools", "python", "eaglekit_dump.py")

CONVS = [
    {"conversation_id": "a", "conversations": [{"role": "user", "content": "topic0 gora bibo"},
                                               {"role": "assistant", "content": "an answer to replace"}]},
    {"conversation_id": "b", "conversations": [{"role": "user", "content": "topic1 govi leke"}]},
    {"id": 3, "conversations": [{"from": "human", "value": "topic2 bibo"}, {"from": "gpt", "value": "x"},
                                {"from": "human", "value": "topic3 rusi"}, {"from": "gpt", "value": "y"}]},
    {"uuid": "d", "messages": [{"role": "system", "content": "topic1"}, {"role": "user", "content": "topic1 nazono"}]},
    {"conversation_id": "e", "conversations": [{"role": "user", "content": "topic2 dutego bibini"}]},
]


class Checks:
    def __init__(self):
        self.results = []

    def __call__(self, name, ok, detail=""):
        self.results.append({"check": name, "ok": bool(ok), "detail": detail})
        print(f"check_dump_tools: {'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", file=sys.stderr)


def sh(*cmd):
    r = subprocess.run([sys.executable, *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return r.returncode, r.stderr


def last_role(row):
    last = (row.get("conversations") or row.get("messages"))[-1]
    return last.get("role", last.get("from"))


def write_jsonl(path, rows, raw_lines=()):
    with open(path, "w") as f:
        for e in rows:
            f.write(json.dumps(e) + "\n")
        for line in raw_lines:
            f.write(line + "\n")


def records(folder):
    return {f: torch.load(os.path.join(folder, f)) for f in sorted(os.listdir(folder)) if f.endswith(".pt")}


def same_records(a, b):
    if a.keys() != b.keys():
        return False
    for k in a:
        if a[k].keys() != b[k].keys():
            return False
        for key, v in a[k].items():
            if isinstance(v, torch.Tensor) and not torch.equal(v, b[k][key]):
                return False
            if not isinstance(v, torch.Tensor) and v != b[k][key]:
                return False
    return True


class FakeServer(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible server's two endpoints: the answer is a function of the messages, and
    the conversation whose first message is 'FAIL' gets HTTP 500 while `fail` is set."""
    requests = []
    fail = True

    def log_message(self, *a):
        pass

    def reply(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.reply(200, {"object": "list", "data": [{"id": "the-base", "object": "model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeServer.requests.append(body)
        msgs = body["messages"]
        if FakeServer.fail and msgs[0]["content"] == "FAIL":
            return self.reply(500, {"error": "planted failure"})
        text = f" answer {len(msgs)} to {msgs[-1]['content']} "
        self.reply(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                      "finish_reason": "stop"}]})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base")
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
    print(f"check_dump_tools: {len(check.results) - len(failed)} of {len(check.results)} checks passed",
          file=sys.stderr)
    return 1 if failed else 0


def run(args, check):
    w = args.work
    shutil.rmtree(w, ignore_errors=True)
    os.makedirs(w)
    p = lambda *x: os.path.join(w, *x)  # noqa: E731
    base = args.base

    # The pins: requirements-dump.txt is the e2e environment's versions, line for line.
    e2e = set(open(os.path.join(ROOT, "scripts", "requirements-e2e.txt")).read().split())
    pins = [x for x in open(os.path.join(ROOT, "scripts", "requirements-dump.txt")).read().split("\n")
            if x and not x.startswith("#")]
    check("requirements-dump.txt pins the e2e environment's versions", pins and all(x in e2e for x in pins),
          ", ".join(x for x in pins if x not in e2e) or f"{len(pins)} pins")

    # Usage and refusals.
    rc, _ = sh(REGEN, "--help")
    rc2, _ = sh(DUMP, "--help")
    check("--help exits 0", rc == 0 and rc2 == 0, f"regenerate {rc}, dump {rc2}")
    write_jsonl(p("in.jsonl"), CONVS)
    rc, err = sh(REGEN, "--model", base, "--data", p("in.jsonl"), "--out", p("x.jsonl"), "--max-new-tokens", "8",
                 "--shard", "2/2")
    rc2, err2 = sh(DUMP, "--model", base, "--data", p("in.jsonl"), "--out", p("x"), "--aux-layers", "2,99")
    check("a bad --shard or --aux-layers is a usage error (exit 2)", rc == 2 and rc2 == 2 and "--aux-layers" in err2,
          f"exit {rc} and {rc2}")
    for name, raw in (("not JSON", '{"conversation_id": "z", "conversations": ['),
                      ("no id", '{"conversations": [{"role": "user", "content": "q"}]}'),
                      ("a repeated id", json.dumps(CONVS[0])),
                      ("an unknown role", '{"id": "r", "conversations": [{"role": "robot", "content": "q"}]}')):
        write_jsonl(p("bad.jsonl"), CONVS, [raw])
        line = f"{p('bad.jsonl')}:{len(CONVS) + 1}:"
        rc, err = sh(REGEN, "--model", base, "--data", p("bad.jsonl"), "--out", p("x.jsonl"), "--max-new-tokens", "8")
        rc2, err2 = sh(DUMP, "--model", base, "--data", p("bad.jsonl"), "--out", p("x"))
        check(f"a bad line ({name}) is refused naming FILE:LINE (exit 1)",
              rc == 1 and rc2 == 1 and line in err and line in err2 and not os.path.exists(p("x.jsonl")),
              f"exit {rc} and {rc2}; {err.strip().splitlines()[-1] if err.strip() else ''}")

    # regenerate with transformers: uninterrupted, then interrupted after two whole lines and
    # half of the third, then resumed.
    common = ["--model", base, "--max-new-tokens", "24", "--dtype", "float32", "--batch-size", "2"]
    rc, err = sh(REGEN, *common, "--data", p("in.jsonl"), "--out", p("ref.jsonl"))
    ref = open(p("ref.jsonl")).read() if rc == 0 else ""
    rows = [json.loads(x) for x in ref.splitlines()]
    multi = rows[2]["conversations"] if len(rows) == 5 else []
    check("regenerate replaces every assistant turn and answers a final user turn, keeping ids, keys and style",
          rc == 0 and [r.get("conversation_id", r.get("id", r.get("uuid"))) for r in rows] == ["a", "b", 3, "d", "e"]
          and rows[0]["conversations"][1]["content"] != "an answer to replace"
          and all(last_role(r) in ("assistant", "gpt") for r in rows)
          and [t["from"] for t in multi] == ["human", "gpt", "human", "gpt"] and multi[1]["value"] != "x"
          and multi[3]["value"] != "y" and rows[3]["messages"][0] == {"role": "system", "content": "topic1"},
          f"exit {rc}" + ("" if rc == 0 else ": " + err[-300:]))
    lines = ref.splitlines(keepends=True)
    with open(p("res.jsonl.partial"), "w") as f:
        f.write(lines[0] + lines[1] + lines[2][:len(lines[2]) // 2])
    rc, err = sh(REGEN, *common, "--data", p("in.jsonl"), "--out", p("res.jsonl"))
    check("regenerate resumed after an interruption equals the uninterrupted run",
          rc == 0 and open(p("res.jsonl")).read() == ref and "2 already" in err and "unfinished last line" in err
          and not os.path.exists(p("res.jsonl.partial")), f"exit {rc}")
    before = os.stat(p("ref.jsonl")).st_mtime_ns if os.path.exists(p("ref.jsonl")) else None
    rc, err = sh(REGEN, *common, "--data", p("in.jsonl"), "--out", p("ref.jsonl"))
    check("regenerate with its output complete does nothing", rc == 0 and "nothing to do" in err
          and os.stat(p("ref.jsonl")).st_mtime_ns == before, f"exit {rc}")
    os.makedirs(p("shards"))
    for k in (0, 1):
        sh(REGEN, *common, "--data", p("in.jsonl"), "--out", p("shards", f"part-{k}.jsonl"), "--shard", f"{k}/2")
    got = []
    for k in (0, 1):
        if os.path.exists(p("shards", f"part-{k}.jsonl")):
            got += open(p("shards", f"part-{k}.jsonl")).read().splitlines()
    got.sort()
    check("regenerate --shard 0/2 and 1/2 give the unsharded lines once each", got == sorted(ref.splitlines()),
          f"{len(got)} lines")

    # regenerate against an OpenAI-compatible server (a stand-in with vLLM's two endpoints).
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    sconvs = CONVS + [{"conversation_id": "f", "conversations": [{"role": "user", "content": "FAIL"}]},
                      {"conversation_id": "g", "conversations": [{"role": "user", "content": "last"}]}]
    write_jsonl(p("sin.jsonl"), sconvs)
    srv_args = ["--server", url, "--data", p("sin.jsonl"), "--out", p("srv.jsonl"), "--max-new-tokens", "32",
                "--concurrency", "1"]
    rc, err = sh(REGEN, *srv_args)
    partial = open(p("srv.jsonl.partial")).read().splitlines() if os.path.exists(p("srv.jsonl.partial")) else []
    check("regenerate --server: a failed request exits 1 naming the conversation, keeping what is done",
          rc == 1 and "conversation f" in err and "HTTP 500" in err and not os.path.exists(p("srv.jsonl"))
          and len(partial) == 4, f"exit {rc}, {len(partial)} lines kept")
    FakeServer.fail = False
    first = list(FakeServer.requests)
    FakeServer.requests.clear()
    rc, err = sh(REGEN, *srv_args)
    out = [json.loads(x) for x in open(p("srv.jsonl"))] if rc == 0 else []
    reqs = FakeServer.requests
    check("regenerate --server resumes, asking /v1/chat/completions greedily for the rest only",
          rc == 0 and len(out) == 7 and len(reqs) == 3 and [r["messages"][-1]["content"] for r in reqs] ==
          ["topic2 dutego bibini", "FAIL", "last"]
          and all(r["model"] == "the-base" and r["temperature"] == 0 and r["max_tokens"] == 32 for r in reqs),
          f"exit {rc}, {len(reqs)} requests on the resume")
    later = [r for r in first if r["messages"][-1]["content"] == "topic3 rusi"]
    m3 = out[2]["conversations"] if len(out) == 7 else []
    check("regenerate --server: a later turn's request carries the earlier regenerated answer",
          len(later) == 1 and later[0]["messages"] == [{"role": "user", "content": "topic2 bibo"},
                                                       {"role": "assistant", "content": "answer 1 to topic2 bibo"},
                                                       {"role": "user", "content": "topic3 rusi"}]
          and [t["value"] for t in m3[1::2]] == ["answer 1 to topic2 bibo", "answer 3 to topic3 rusi"],
          json.dumps(later)[:300])
    srv.shutdown()

    # dump: uninterrupted, then interrupted (one record done, a half-written temporary of
    # another), then resumed; the shards; a changed setting refused.
    write_jsonl(p("regen.jsonl"), rows)
    dcommon = ["--model", base, "--data", p("regen.jsonl"), "--dtype", "float32"]
    rc, err = sh(DUMP, *dcommon, "--out", p("dref"))
    ref_recs = records(p("dref")) if rc == 0 else {}
    check("dump writes one record per conversation, stating the aux layers it used",
          rc == 0 and sorted(ref_recs) == ["3.pt", "a.pt", "b.pt", "d.pt", "e.pt"]
          and "aux layers [2, 4, 5] (EAGLE-3's default" in err, f"exit {rc}")
    r3 = ref_recs.get("3.pt", {})
    ids, mask = r3.get("input_ids"), r3.get("loss_mask")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(base)
    masked = tok.decode(ids[mask.bool()]) if ids is not None and mask is not None else ""
    a1, a2 = multi[1]["value"] if multi else "?", multi[3]["value"] if multi else "?"
    unmasked = tok.decode(ids[~mask.bool()]) if mask is not None else ""
    check("dump's loss mask is 1 on exactly the assistant turns (two of them)",
          a1 in masked and a2 in masked and "topic2 bibo" not in masked and "topic3 rusi" in unmasked
          and r3.get("hidden_states_prenorm") is False
          and r3["aux_hidden_states"].shape[1] == 3 * r3["hidden_states"].shape[1], f"masked {int(mask.sum()) if mask is not None else '?'} of "
                                         f"{len(ids) if ids is not None else '?'} tokens")
    os.makedirs(p("dres"))
    shutil.copy(p("dref", "a.pt"), p("dres", "a.pt"))
    with open(p("dref", "b.pt"), "rb") as f, open(p("dres", "b.pt.tmp"), "wb") as g:
        g.write(f.read()[:1000])
    rc, err = sh(DUMP, *dcommon, "--out", p("dres"))
    check("dump resumed after an interruption skips the done records and equals the uninterrupted run",
          rc == 0 and "1 already" in err and "4 to do" in err and same_records(records(p("dres")), ref_recs)
          and not [f for f in os.listdir(p("dres")) if f.endswith(".tmp")], f"exit {rc}")
    for k in (0, 1):
        sh(DUMP, *dcommon, "--out", p("dshards"), "--shard", f"{k}/2")
    check("dump --shard 0/2 and 1/2 write the unsharded records once each",
          os.path.isdir(p("dshards")) and same_records(records(p("dshards")), ref_recs))
    rc, err = sh(DUMP, *dcommon, "--out", p("dres"), "--loss-mask", "none")
    check("dump into a folder dumped with other settings is refused (exit 1)",
          rc == 1 and "other settings" in err and "loss_mask 'assistant' then, 'none' now" in err, f"exit {rc}")


if __name__ == "__main__":
    sys.exit(main())
