"""Reading conversations JSONL, sharding and atomic writes for eaglekit_regenerate.py and
eaglekit_dump.py (docs/dump.md). Standard library only.

A conversation is one JSON object per line (blank lines skipped) of a `.jsonl` file, or of
every `*.jsonl` directly in a folder, in byte order of the names: the form `eaglekit` reads
(docs/data.md). Its id is the first present, non-null of `conversation_id`, `uuid`, `id`
(an integer by its decimal digits); its turns are `conversations` or `messages`, each
`{"role", "content"}` or ShareGPT's `{"from", "value"}` (human, gpt, system).
"""
import json
import os

ID_KEYS = ("conversation_id", "uuid", "id")
TURN_KEYS = ("conversations", "messages")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}
ROLES = ("system", "user", "assistant", "tool")


class DataError(Exception):
    """Bad input data; the message names the file and line."""


class UsageError(Exception):
    """A bad command line."""


class Conversation:
    """One conversation: where it came from, its object as read, its id and its turns."""

    def __init__(self, path, line, obj, cid, turn_key, turns):
        self.path, self.line, self.obj, self.id = path, line, obj, cid
        self.turn_key = turn_key    # "conversations" or "messages"
        self.turns = turns          # [{"role", "content"}], normalized
        self.sharegpt = bool(obj[turn_key]) and "from" in obj[turn_key][0]

    def where(self):
        return f"{self.path}:{self.line}"


def input_files(path):
    if os.path.isdir(path):
        files = sorted(f for f in os.listdir(path) if f.endswith(".jsonl"))
        if not files:
            raise DataError(f"{path}: a folder without any *.jsonl file")
        return [os.path.join(path, f) for f in files]
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file or folder")
    return [path]


def conversation_id(obj, where):
    for k in ID_KEYS:
        v = obj.get(k)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (str, int)):
            raise DataError(f"{where}: {k} is a {type(v).__name__}, expected a string or an integer")
        v = str(v)
        if not v:
            raise DataError(f"{where}: {k} is an empty string")
        return v
    raise DataError(f"{where}: no conversation id (none of {', '.join(ID_KEYS)})")


def normalize_turns(obj, where):
    key = next((k for k in TURN_KEYS if k in obj), None)
    if key is None or not isinstance(obj[key], list) or not obj[key]:
        raise DataError(f"{where}: no turns (a non-empty list under {' or '.join(TURN_KEYS)})")
    turns = []
    for j, t in enumerate(obj[key]):
        if isinstance(t, dict) and "role" in t and "content" in t:
            role, content = t["role"], t["content"]
        elif isinstance(t, dict) and "from" in t and "value" in t:
            role, content = SHAREGPT_ROLES.get(t["from"], t["from"]), t["value"]
        else:
            raise DataError(f"{where}: {key}[{j}] is neither {{role, content}} nor {{from, value}}")
        if role not in ROLES:
            raise DataError(f"{where}: {key}[{j}] has the role {role!r}, expected one of {', '.join(ROLES)}"
                            f" (or ShareGPT's {', '.join(SHAREGPT_ROLES)})")
        if not isinstance(content, str):
            raise DataError(f"{where}: {key}[{j}]'s content is a {type(content).__name__}, expected a string")
        turns.append({"role": role, "content": content})
    return key, turns


def read_conversations(path):
    """Every conversation of `path` in order; DataError on a bad line or a repeated id."""
    out, seen = [], {}
    for f in input_files(path):
        with open(f, "rb") as fh:
            for n, raw in enumerate(fh, 1):
                where = f"{f}:{n}"
                if not raw.strip():
                    continue
                try:
                    obj = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise DataError(f"{where}: not JSON ({e})") from None
                if not isinstance(obj, dict):
                    raise DataError(f"{where}: a JSON {type(obj).__name__}, expected an object")
                cid = conversation_id(obj, where)
                if cid in seen:
                    raise DataError(f"{where}: the id {cid!r} again (first at {seen[cid]})")
                seen[cid] = where
                key, turns = normalize_turns(obj, where)
                out.append(Conversation(f, n, obj, cid, key, turns))
    return out


def parse_shard(text):
    """'i/n' -> (i, n), 0 <= i < n; UsageError otherwise."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise UsageError(f"--shard {text}: expected I/N, e.g. 0/4") from None
    if n < 1 or not 0 <= i < n:
        raise UsageError(f"--shard {text}: expected 0 <= I < N")
    return i, n


def shard(items, i, n):
    """The items whose position in the input is i modulo n."""
    return [c for k, c in enumerate(items) if k % n == i]


def atomic_write(path, data):
    """Writes bytes to path through path.tmp, fsync and rename: path is whole or absent."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
