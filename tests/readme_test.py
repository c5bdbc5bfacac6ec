#!/usr/bin/python3
"""Runs the README's marked command blocks, so that the README cannot drift from the code.

Usage: readme_test.py MARKDOWN... BIN_DIR [--work DIR] [--keep] [--list]

MARKDOWN: the README and the docs pages that hold marked blocks (docs/commands.md, the
command reference moved out of the README), read in the order given.

A block runs when the line before its ```sh fence is a marker (an HTML comment, invisible
on GitHub):

    <!-- readme-test: WORKSPACE -->
    <!-- readme-test: WORKSPACE; FROM => TO; FROM => TO -->

Blocks of one WORKSPACE run in order (across the files, in the order given), in one folder, each with `bash -e -o pipefail` and
BIN_DIR first on PATH (so `eaglekit` is the built one). Workspaces:

  quick-start  the README's GPU quick start: the same stand-in as below, in its own folder
             (its run/ must not meet the walk-through's).
  stand-in   the README's "Train on your own dumps": the folder is first given what that
             section's commands expect, made by `eaglekit synth` (dumps/, conversations.jsonl
             and a base Llama-3.1-8B-Instruct/ of Llama-3's vocabulary size, 32 layers and a
             small hidden size).
  synthetic  the command reference (docs/commands.md): starts empty; its first block makes
             the data.

FROM => TO replaces text before the block runs, for what the README's own words say was
substituted on the stand-in (the GPU count, the device, the number of steps). A FROM that is
not in the block fails the test: the README changed and the marker must follow.
Blocks without a marker (GPU, vLLM, SGLang, an 8B base) are counted, not run. Prints which
blocks ran and "ran N of M blocks"; exits 1 at the first block that fails, with its output.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

MARK = re.compile(r"^<!-- readme-test: ([a-z-]+)(.*?) -->$")
WORKSPACES = ("quick-start", "stand-in", "synthetic")


def blocks(readme_text):
    """(line number, marker or None, body) of every ```sh block."""
    lines = readme_text.splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```sh":
            start = i
            i += 1
            body = []
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            marker = lines[start - 1] if start > 0 and lines[start - 1].startswith("<!-- readme-test") else None
            out.append((start + 1, marker, "\n".join(body) + "\n"))
        i += 1
    return out


def parse_marker(where, line_no, marker):
    m = MARK.match(marker)
    if not m or m.group(1) not in WORKSPACES:
        sys.exit(f"{where}:{line_no - 1}: bad marker {marker!r}: expected "
                 f"<!-- readme-test: {'|'.join(WORKSPACES)}[; FROM => TO]... -->")
    subs = []
    for part in m.group(2).split(";")[1:]:
        if "=>" not in part:
            sys.exit(f"{where}:{line_no - 1}: bad substitution {part.strip()!r} (FROM => TO)")
        a, b = part.split("=>", 1)
        subs.append((a.strip(), b.strip()))
    return m.group(1), subs


def run(cmd, cwd, env, what):
    r = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", cmd], cwd=cwd, env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        print(f"readme: {what} failed (exit {r.returncode}) in {cwd}:\n{cmd}\n--- stdout:\n{r.stdout}"
              f"\n--- stderr:\n{r.stderr}", file=sys.stderr)
        sys.exit(1)
    return r


def prepare_stand_in(folder, env):
    """What "Train on your own dumps" expects, on synthetic data."""
    run("eaglekit synth --out dumps --conversations 60 --hidden 64 --vocab 128256 --min-tokens 24"
        " --max-tokens 64 --dtype bf16 --seed 7 --jobs 2 --base-out Llama-3.1-8B-Instruct > /dev/null"
        " && mv dumps/conversations.jsonl conversations.jsonl", folder, env, "the stand-in (eaglekit synth)")


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    work = None
    if "--work" in sys.argv:
        work = sys.argv[sys.argv.index("--work") + 1]
        args = [a for a in args if a != work]
    if len(args) < 2:
        sys.exit(__doc__)
    docs, bin_dir = args[:-1], os.path.abspath(args[-1])
    keep = "--keep" in sys.argv
    # (file as printed, line, marker or None, body) of every ```sh block of every file.
    found = []
    root = os.path.commonpath([os.path.dirname(os.path.abspath(d)) for d in docs])
    for d in docs:
        where = os.path.relpath(os.path.abspath(d), root)
        found += [(where, n, m, b) for n, m, b in blocks(open(d).read())]
    marked = [(w, n, m, b) for w, n, m, b in found if m]
    if "--list" in sys.argv:
        for w, n, m, b in found:
            print(f"{w}:{n}: {'runs in ' + parse_marker(w, n, m)[0] if m else 'not run'}: {b.splitlines()[0]}")
        return
    if not os.access(os.path.join(bin_dir, "eaglekit"), os.X_OK):
        sys.exit(f"readme: no eaglekit in {bin_dir}")
    work = work or tempfile.mkdtemp(prefix="eaglekit-readme.")
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""), OMP_WAIT_POLICY="passive")
    folders = {}
    ran = 0
    for where, line_no, marker, body in marked:
        space, subs = parse_marker(where, line_no, marker)
        for a, b in subs:
            if a not in body:
                sys.exit(f"{where}:{line_no}: the marker replaces {a!r}, which the block no longer has; "
                         f"update the marker above the block")
            body = body.replace(a, b)
        if space not in folders:
            folders[space] = os.path.join(work, space)
            os.makedirs(folders[space])
            if space in ("stand-in", "quick-start"):
                prepare_stand_in(folders[space], env)
        first = next(l for l in body.splitlines() if l.strip())
        print(f"readme: {where}:{line_no} ({space}{', ' + str(len(subs)) + ' substitutions' if subs else ''}): "
              f"{first.strip()}", flush=True)
        run(body, folders[space], env, f"the block at {where}:{line_no}")
        ran += 1
    print(f"readme: ran {ran} of {len(found)} command blocks; not run (unmarked: installs, a GPU, vLLM or SGLang):")
    for w, n, m, b in found:
        if not m:
            print(f"readme:   {w}:{n}: {b.splitlines()[0].strip()}")
    for d in docs:
        where = os.path.relpath(os.path.abspath(d), root)
        if not any(w == where for w, _, _, _ in marked):
            sys.exit(f"readme: {where} has no marked block")
    if ran == 0:
        sys.exit("readme: no block is marked")
    if keep:
        print(f"readme: kept {work}")
    else:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
