#!/usr/bin/python3
"""Checks that every test docs/testing.md's coverage table names exists.

Usage: check_testing_table.py DOC CMAKELISTS TEST_BINARY...

In the table under "## Which test covers each promise", each `code span` of the "covered by"
column that starts like a doctest case name (lowercase words, then ": ") is read as a prefix
of the real name in which "..." stands for any text (`train cli: --resume continues exactly
...`). It must match a case that one of the test binaries lists (--list-test-cases). A span
right after the word "ctest" (ctest `crash_consistency`) must be an add_test NAME of
CMAKELISTS; a span that starts with "tests/" or "scripts/" is a path (a glob, relative to the
repository root) that must exist. Other spans (options, fields) are not names.
A row whose promise (first cell) says "(LibTorch 2.x)" names cases that only a build against
LibTorch >= 2.5 has (the fused kernels): they are checked when --torch2 is given (CMake gives
it for such a build) and skipped, counted, otherwise.
Prints what it checked; exits 1 naming every name that matches nothing.
"""
import glob
import os
import re
import subprocess
import sys


def table_cells(doc_text):
    """The "covered by" cell of every row of the coverage table, with its line number."""
    lines = doc_text.splitlines()
    try:
        start = next(i for i, l in enumerate(lines) if l.startswith("## Which test covers each promise"))
    except StopIteration:
        sys.exit("check_testing_table: no '## Which test covers each promise' section")
    cells = []
    for i in range(start + 1, len(lines)):
        line = lines[i]
        if line.startswith("## "):
            break
        if not line.startswith("|") or line.startswith("|---") or line.startswith("| promise"):
            continue
        # The cell separator is a '|' outside code spans.
        parts, cur, in_code, j = [], "", False, 0
        while j < len(line):
            c = line[j]
            if c == "\\" and j + 1 < len(line) and line[j + 1] == "`":
                cur += "\\`"
                j += 2
                continue
            if c == "`":
                in_code = not in_code
            if c == "|" and not in_code:
                parts.append(cur)
                cur = ""
            else:
                cur += c
            j += 1
        parts.append(cur)
        cells.append((i + 1, parts[2] if len(parts) > 2 else "", parts[1] if len(parts) > 1 else ""))
    return cells


def code_spans(cell):
    """The `spans` of a cell; \\` inside a span is a literal backtick."""
    spans, j = [], 0
    while True:
        a = cell.find("`", j)
        if a < 0:
            return spans
        k = a + 1
        text = ""
        while k < len(cell) and cell[k] != "`":
            if cell[k] == "\\" and k + 1 < len(cell) and cell[k + 1] == "`":
                text += "`"
                k += 2
                continue
            text += cell[k]
            k += 1
        spans.append(text)
        j = k + 1


def test_cases(binary):
    # --no-skip: cases registered with doctest's skip (a CUDA case without a device) exist too.
    r = subprocess.run([binary, "--list-test-cases", "--no-skip=true", "--no-intro=true", "--no-version=true"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"check_testing_table: {binary} --list-test-cases exited {r.returncode}: {r.stderr}")
    names = []
    for l in r.stdout.splitlines():
        if not l.strip() or l.startswith("[doctest]") or set(l.strip()) <= set("=-"):
            continue
        names.append(l.rstrip())
    return names


def main():
    args = sys.argv[1:]
    torch2 = "--torch2" in args
    args = [a for a in args if a != "--torch2"]
    if len(args) < 3:
        sys.exit(__doc__)
    doc, cmakelists, binaries = args[0], args[1], args[2:]
    root = os.path.dirname(os.path.dirname(os.path.abspath(cmakelists)))
    cases = [n for b in binaries for n in test_cases(b)]
    ctest_names = set(re.findall(r"add_test\(NAME\s+([A-Za-z0-9_]+)", open(cmakelists).read()))
    cells = table_cells(open(doc).read())
    if not cells:
        sys.exit(f"check_testing_table: {doc}: the coverage table has no rows")
    bad, checked = [], {"case": 0, "path": 0, "ctest": 0, "skipped": 0}
    for line_no, cell, promise in cells:
        only_torch2 = "(LibTorch 2.x)" in promise
        ctest_spans = set(code_spans(" ".join(re.findall(r"\bctest (`[^`]+`)", cell))))
        for span in code_spans(cell):
            if span in ctest_spans:
                checked["ctest"] += 1
                if span not in ctest_names:
                    bad.append(f"{doc}:{line_no}: `{span}` is no ctest entry of {cmakelists}")
            elif re.match(r"[a-z][a-z_0-9 ]*: ", span):
                pieces = [re.escape(p.strip()) for p in span.split("...")]
                pattern = re.compile(r"\s*.*?\s*".join(pieces).rstrip())
                if only_torch2 and not torch2:
                    checked["skipped"] += 1
                    continue
                checked["case"] += 1
                if not any(pattern.match(c) for c in cases):
                    bad.append(f"{doc}:{line_no}: no test case matches `{span}`")
            elif span.startswith(("tests/", "scripts/")):
                checked["path"] += 1
                if not glob.glob(os.path.join(root, span)):
                    bad.append(f"{doc}:{line_no}: no file matches `{span}`")
    print(f"check_testing_table: {len(cells)} rows; {checked['case']} test case names against "
          f"{len(cases)} cases of {len(binaries)} binaries, {checked['path']} paths, {checked['ctest']} ctest entries"
          + (f"; {checked['skipped']} names of LibTorch 2.x rows not checked (a build without the fused kernels)"
             if checked["skipped"] else ""))
    for b in bad:
        print(b, file=sys.stderr)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
