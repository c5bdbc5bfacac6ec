#!/usr/bin/env python3
"""CI's time budget (issue #51): each stage of scripts/test against the budget table in
docs/contributing.md ("CI's budget").

scripts/test appends one line per stage to the file named by EAGLEKIT_CI_STAGES:
    <wall seconds> TAB <CPU seconds> TAB <stage name>
where the CPU seconds are those of the stage's processes (user + system, from bash's `times`),
so a machine loaded by other work, which stretches wall time, barely moves them.

Usage:
  ci_budget.py report STAGES [--table docs/contributing.md] [--budget-minutes 45]
      prints each stage's wall and CPU seconds beside its table figure, the total against the
      budget and the stages that grew most; exits 1, naming them, when a stage's CPU seconds
      are more than twice its table figure (--factor), or when a stage has no row in the table
  ci_budget.py selftest [--table docs/contributing.md]
      the guard on the table's own figures passes, and on each stage's figure doubled (plus
      one second) fails naming that stage; a stage missing from the table fails too
Exit 0 within budget, 1 over it, 2 on usage errors or an unreadable table.
"""
import argparse
import os
import re
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TABLE_START = "<!-- ci-budget-table -->"
TABLE_END = "<!-- /ci-budget-table -->"


def read_table(path):
    """{stage: (wall, cpu)} from the rows between the markers: | stage | wall | CPU | ... |."""
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as e:
        raise SystemExit(f"ci_budget: {path}: {e.strerror}")
    if TABLE_START not in text or TABLE_END not in text:
        raise SystemExit(f"ci_budget: {path}: no budget table (between {TABLE_START} and {TABLE_END})")
    body = text.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0]
    table = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not re.fullmatch(r"[\d,]+", cells[1] or "x") or not re.fullmatch(r"[\d,]+", cells[2] or "x"):
            continue  # the header, its rule, the total
        name = cells[0].strip("`")
        table[name] = (int(cells[1].replace(",", "")), int(cells[2].replace(",", "")))
    if not table:
        raise SystemExit(f"ci_budget: {path}: the budget table has no stage rows")
    return table


def read_stages(path):
    stages = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 3:
                raise SystemExit(f"ci_budget: {path}:{n}: expected 'wall<TAB>cpu<TAB>stage', got {line!r}")
            stages.append((parts[2], float(parts[0]), float(parts[1])))
    return stages


def report(stages, table, budget_minutes, factor, out=sys.stderr):
    """Prints the comparison; returns the list of failures (empty: within budget)."""
    failures = []
    total_wall = sum(w for _, w, _ in stages)
    total_cpu = sum(c for _, _, c in stages)
    print(f"ci budget: {'stage':<42} {'wall s':>7} {'CPU s':>7} {'table CPU':>9} {'x table':>7}", file=out)
    growth = []
    for name, wall, cpu in stages:
        row = table.get(name)
        if row is None:
            failures.append(f"stage '{name}' has no row in the budget table (docs/contributing.md): add its figures")
            print(f"ci budget: {name:<42} {wall:7.0f} {cpu:7.0f} {'none':>9} {'':>7}", file=out)
            continue
        ratio = cpu / row[1] if row[1] > 0 else float("inf") if cpu > 0 else 1.0
        growth.append((ratio, name))
        print(f"ci budget: {name:<42} {wall:7.0f} {cpu:7.0f} {row[1]:9d} {ratio:6.2f}x", file=out)
        # A stage of a few CPU seconds may double on noise alone: the floor is 30 s over its figure.
        if cpu > factor * row[1] and cpu - row[1] > 30:
            failures.append(f"stage '{name}' took {cpu:.0f} CPU s, more than {factor:g}x its budget table figure "
                            f"{row[1]} (docs/contributing.md, \"CI's budget\")")
    print(f"ci budget: total {total_wall:.0f} s wall ({total_wall / 60:.1f} min) against {budget_minutes} min, "
          f"{total_cpu:.0f} CPU s; the table's total {sum(w for w, _ in table.values())} s wall", file=out)
    grown = [f"{n} {r:.2f}x" for r, n in sorted(growth, reverse=True)[:3] if r > 1.0]
    print("ci budget: grew most against the table: " + (", ".join(grown) if grown else "none"), file=out)
    if total_wall > budget_minutes * 60:
        print(f"ci budget: over {budget_minutes} minutes of wall time (a loaded machine stretches it; the CPU "
              f"figures decide)", file=out)
    for f in failures:
        print(f"ci budget: FAIL {f}", file=out)
    return failures


def selftest(table, factor):
    """The guard passes on the table's figures and fails on each planted doubling."""
    sink = open(os.devnull, "w")
    bad = []
    exact = [(n, w, c) for n, (w, c) in table.items()]
    if report(exact, table, 45, factor, out=sink):
        bad.append("the table's own figures fail the guard")
    for i, (name, w, c) in enumerate(exact):
        planted = list(exact)
        planted[i] = (name, 2 * w, 2 * c + 31)
        fails = report(planted, table, 45, factor, out=sink)
        if not any(f"'{name}'" in f for f in fails):
            bad.append(f"a doubling of '{name}' ({c} -> {2 * c + 31} CPU s) passes the guard")
        if any(f"'{name}'" not in f for f in fails):
            bad.append(f"a doubling of '{name}' fails other stages too: {fails}")
    if not report(exact + [("a stage with no row", 1, 1)], table, 45, factor, out=sink):
        bad.append("a stage missing from the table passes the guard")
    # The stages file round trip, as scripts/test writes it.
    with tempfile.NamedTemporaryFile("w", suffix=".tsv", delete=False) as f:
        for name, w, c in exact:
            f.write(f"{w}\t{c}\t{name}\n")
    try:
        if read_stages(f.name) != [(n, float(w), float(c)) for n, w, c in exact]:
            bad.append("the stages file does not read back as written")
    finally:
        os.unlink(f.name)
    for b in bad:
        print(f"ci_budget selftest: FAIL {b}", file=sys.stderr)
    print(f"ci_budget selftest: {len(table)} stages, {'FAILED' if bad else 'every planted doubling fails the guard'}",
          file=sys.stderr)
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["report", "selftest"])
    ap.add_argument("stages", nargs="?")
    ap.add_argument("--table", default=os.path.join(ROOT, "docs", "contributing.md"))
    ap.add_argument("--budget-minutes", type=float, default=45)
    ap.add_argument("--factor", type=float, default=2.0)
    args = ap.parse_args()
    table = read_table(args.table)
    if args.command == "selftest":
        return selftest(table, args.factor)
    if not args.stages:
        ap.error("report needs the stages file (EAGLEKIT_CI_STAGES)")
    return 1 if report(read_stages(args.stages), table, args.budget_minutes, args.factor) else 0


if __name__ == "__main__":
    sys.exit(main())
