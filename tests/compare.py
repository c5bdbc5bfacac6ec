#!/usr/bin/python3
"""How the Python oracles measure "how different" two computations are: the Python side of
tests/compare.h. A NaN counts as infinitely different: Python's max() keeps a NaN only when it
comes first (NaN > x and x > NaN are both false), so max(values) or max(d, key=d.get) passes a
NaN gradient in any tensor but the first. Every maximum of a difference in
tests/trainer/reference_draft.py and tests/e2e/oracle.py goes through worst_of / worst_key.

JSON: json.dumps writes +inf as `Infinity`, which is not JSON (nlohmann refuses to parse it);
json_number() writes it as the largest double, which no bound passes.

Run as a script, it tests itself (ctest `compare_py`): NaNs planted after the first position.
"""
import math
import sys

INF = float("inf")
LARGEST = sys.float_info.max


def worst(x):
    """x as a badness: a NaN is +inf."""
    x = float(x)
    return INF if math.isnan(x) else x


def worst_of(values):
    """The largest of values (0 for none); a NaN anywhere makes it +inf."""
    out = 0.0
    for v in values:
        out = max(out, worst(v))
    return out


def worst_key(table):
    """The key of the largest value of a dict; a NaN value counts as +inf."""
    if not table:
        raise ValueError("worst_key: nothing to compare")
    return max(table, key=lambda k: worst(table[k]))


def rel_diff(a, b):
    """|a - b| / |b| (|b| floored at 1e-12); +inf for a NaN on either side or unequal infinities."""
    a, b = float(a), float(b)
    if math.isnan(a) or math.isnan(b):
        return INF
    if a == b:
        return 0.0
    return worst(abs(a - b) / max(abs(b), 1e-12))


def tensor_rel_diff(a, b):
    """max |a - b| / max |b| of two torch tensors in float64; +inf for a NaN in either."""
    a = a.double()
    b = b.double()
    scale = float(b.abs().max())  # torch's max propagates a NaN
    if math.isnan(scale):
        return INF
    return worst(float((a - b).abs().max()) / max(scale, 1e-30))


def json_number(x):
    """x for json.dumps read by nlohmann: +-inf and NaN as the largest double."""
    x = float(x)
    return x if math.isfinite(x) else LARGEST


def self_test():
    nan = float("nan")
    failures = []

    def check(what, ok):
        print(("ok   " if ok else "FAIL ") + what)
        if not ok:
            failures.append(what)

    check("plain max() skips a NaN after the first value (why this module exists)", max([0.1, nan, 0.2]) == 0.2)
    for pos in (1, 2):
        values = [0.1, 0.3, 0.2]
        values[pos] = nan
        check(f"worst_of: a NaN at position {pos} is +inf", worst_of(values) == INF)
        table = dict(zip("abc", values))
        check(f"worst_key: a NaN at position {pos} is the worst", worst_key(table) == "abc"[pos])
    check("worst_of: finite values give their maximum", worst_of([0.1, 0.3, 0.2]) == 0.3)
    check("rel_diff: NaN on either side is +inf", rel_diff(nan, 1) == INF and rel_diff(1, nan) == INF)
    check("rel_diff: unequal infinities are +inf, equal ones 0", rel_diff(INF, -INF) == INF and rel_diff(INF, INF) == 0)
    check("rel_diff: 1.5 against 1 is 0.5", rel_diff(1.5, 1.0) == 0.5)
    check("json_number: +inf is the largest double", json_number(INF) == LARGEST and json_number(0.5) == 0.5)
    try:
        import torch
    except ImportError:
        check("torch is importable for tensor_rel_diff", False)
    else:
        t = torch.tensor([1.0, -2.0, 3.0, 4.0])
        check("tensor_rel_diff: equal tensors give 0", tensor_rel_diff(t, t) == 0)
        for pos in (1, 3):
            bad = t.clone()
            bad[pos] = nan
            check(f"tensor_rel_diff: a NaN at element {pos} is +inf on either side",
                  tensor_rel_diff(bad, t) == INF and tensor_rel_diff(t, bad) == INF)
        grads = {"first": tensor_rel_diff(t, t), "second": tensor_rel_diff(bad, t), "third": 1e-7}
        check("a NaN gradient in a tensor past the first is the worst", worst_key(grads) == "second")
    print(f"compare.py: {len(failures)} of the checks failed" if failures else "compare.py: all checks pass")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(self_test())
