#!/usr/bin/python3
"""The CPU figures' claims and floors, for bench/cpu_figures.sh.

Each figure's claim and its floor are written once, in README.md: the comment block
`<!-- cpu-figures floors ... -->` after the CPU speed paragraph, one line per figure,
    NAME | the claim, quoted from the README's text | the floor
A claim that is no longer in the README's text (the figure was changed without its floor) is a
fault; so is a figure below without a line, or a floor that is not a number.

usage: cpu_claims.py check README            print the claims and floors; exit 1 naming faults
       cpu_claims.py summary LOGDIR README   the table of measured figures beside their claims
                                             and floors; exit 1 when one is under its floor (or
                                             missing) or the block has a fault
"""
import re
import sys

# NAME: the benchmark's log under LOGDIR and the pattern of the figure in it.
FIGURES = [
    ("train256", "train256", r"ratio eaglekit / PyTorch: ([0-9.]+)x"),
    ("train1024", "train1024", r"ratio eaglekit / PyTorch: ([0-9.]+)x"),
    ("kernels", "kernels", r"ratio fused CPU kernels / ATen composites: ([0-9.]+)x"),
    ("loader", "loader", r"loader / Python, samples/s: +([0-9.]+)x"),
    ("loader_limit", "loader", r"limit / loader, CPU time: +([0-9.]+)"),
    ("load_adapt", "load", r"eaglekit train +idle +[0-9.]+ +loaded +[0-9.]+ +kept ([0-9.]+)"),
    ("load_ratio", "load", r"kept, eaglekit / PyTorch: ([0-9.]+)x"),
]


def claims(readme):
    """({name: (claim, floor)}, [faults]) from the README's block."""
    text = open(readme, encoding="utf-8").read()
    m = re.search(r"<!-- cpu-figures floors(.*?)-->", text, re.S)
    if not m:
        return {}, [f"{readme}: no <!-- cpu-figures floors ... --> block"]
    prose = " ".join(text.replace(m.group(0), " ").split())
    out, faults = {}, []
    for line in m.group(1).splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) != 3 or not re.fullmatch(r"[a-z0-9_]+", parts[0]):
            continue
        name, claim, floor = parts
        try:
            out[name] = (claim, float(floor))
        except ValueError:
            faults.append(f"{name}: floor '{floor}' is not a number")
            continue
        if " ".join(claim.split()) not in prose:
            faults.append(f"{name}: the claim \"{claim}\" is no longer in {readme}'s text: "
                          "change the claim and its floor together")
    for name, _, _ in FIGURES:
        if name not in out:
            faults.append(f"{name}: no line in {readme}'s cpu-figures floors block")
    return out, faults


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "check":
        got, faults = claims(sys.argv[2])
        for name, (claim, floor) in got.items():
            print(f"cpu_claims: {name}: floor {floor} under the claim \"{claim}\"")
    elif len(sys.argv) == 4 and sys.argv[1] == "summary":
        log, readme = sys.argv[2], sys.argv[3]
        got, faults = claims(readme)
        print(f"\n== summary (medians; claims and floors from {readme}'s cpu-figures block)")
        print(f"{'figure':11} {'measured':>9} {'floor':>6}  holds  claim")
        for name, logname, pattern in FIGURES:
            m = re.search(pattern, open(f"{log}/{logname}").read())
            value = float(m.group(1)) if m else None
            claim, floor = got.get(name, ("(no claim)", float("inf")))
            ok = value is not None and value >= floor
            shown = f"{value:.2f}" if value is not None else "missing"
            print(f"{name:11} {shown:>9} {floor:>6.2f}  {'yes' if ok else 'NO':5}  {claim}")
            if not ok:
                faults.append(f"{name}: {shown} is under its floor {floor}")
        print("attention kernels: see the table above (time and memory of local and fused relative to tiled)")
    else:
        sys.exit(__doc__)
    for f in faults:
        print(f"cpu_claims: {f}", file=sys.stderr)
    return 1 if faults else 0


if __name__ == "__main__":
    sys.exit(main())
