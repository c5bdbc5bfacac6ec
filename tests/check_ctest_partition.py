#!/usr/bin/env python3
"""Every doctest case runs in exactly one ctest entry of its binary.

A doctest binary split into several ctest entries (tests/CMakeLists.txt: `*_multiprocess`,
`*_split`) selects its cases with --test-case and --test-case-exclude patterns. A pattern
listed in two entries runs its cases twice (which once cost CI two minutes a stage unseen), and
one listed in neither runs them never. This asks ctest for its entries (`ctest --show-only=json-v1`
in BUILD_DIR) and each entry's binary for the cases that entry selects (`--list-test-cases` with
the entry's own arguments), then fails naming every case selected twice, and every case of a
split binary that no entry selects. A binary with a single entry may leave cases out on
purpose (a build option's exclusions: the sanitizer build's LibTorch commands); those are
listed, not failed.

Usage: check_ctest_partition.py BUILD_DIR
"""
import collections
import json
import subprocess
import sys


def cases(command):
    out = subprocess.run(command + ["--list-test-cases"], capture_output=True, text=True, check=True).stdout
    names = []
    for line in out.splitlines():
        if not line.strip() or line.startswith("[doctest]") or set(line.strip()) <= set("=-"):
            continue
        names.append(line.rstrip())
    return names


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    build = sys.argv[1]
    listing = subprocess.run(["ctest", "--show-only=json-v1"], cwd=build, capture_output=True, text=True, check=True)
    entries = collections.defaultdict(list)  # binary -> [(entry name, args)]
    for t in json.loads(listing.stdout)["tests"]:
        cmd = t.get("command") or []
        if len(cmd) >= 2 and cmd[1] == "--no-intro=true":  # a doctest binary (tests/CMakeLists.txt)
            entries[cmd[0]].append((t["name"], cmd))
    if not entries:
        sys.exit(f"check_ctest_partition: {build} has no doctest entries")
    bad = []
    for binary, ents in sorted(entries.items()):
        everything = cases([binary, "--no-intro=true"])
        where = collections.defaultdict(list)
        for name, cmd in ents:
            for c in cases(cmd):
                where[c].append(name)
        for c in everything:
            if len(where[c]) > 1:
                bad.append(f"{binary}: '{c}' runs in {len(where[c])} entries: {', '.join(where[c])}")
        missing = [c for c in everything if not where[c]]
        if missing and len(ents) > 1:
            bad += [f"{binary}: '{c}' runs in none of {', '.join(n for n, _ in ents)}" for c in missing]
        elif missing:
            print(f"{binary}: {len(missing)} cases left out by this build's options: " + "; ".join(missing))
        print(f"{binary}: {len(everything)} cases over {len(ents)} entries")
    for b in bad:
        print("check_ctest_partition: " + b, file=sys.stderr)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
