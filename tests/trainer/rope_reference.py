"""Independent reference for the RoPE variants a draft inherits from its base config.

Written for the tests from the published definitions (the transformers v5 RoPE functions'
formulas, the YaRN and LongRoPE papers, and vLLM's serving choices where transformers
computes per sequence; docs/rope.md), in plain Python floats. It reads the raw config.json
itself, so the C++ parsing is checked too.

argv[1] (or stdin): a JSON list of config objects; stdout: a JSON list, per config either
{"inv_freq": [...], "attention_factor": x, "type": name} or {"error": "..."}.
"""
import json
import math
import sys


def rope_of(config):
    c = config
    if "hidden_size" not in c and isinstance(c.get("text_config"), dict):
        c = c["text_config"]
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    max_pos = c.get("max_position_embeddings", 2048)
    if c.get("rope_parameters") is not None:
        params = c["rope_parameters"]
        if not any(k in params for k in ("rope_type", "type", "rope_theta")):
            params = params["full_attention"]
        theta = params.get("rope_theta", c.get("rope_theta"))
    else:
        params = c.get("rope_scaling") or {}
        theta = c.get("rope_theta", 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    if "mrope_section" in params or params.get("partial_rotary_factor", 1.0) != 1.0:
        return {"error": "unsupported"}

    dim = head_dim
    base_freqs = [1.0 / theta ** (i / dim) for i in range(0, dim, 2)]
    attention = 1.0

    if kind in ("default", "dynamic"):
        # dynamic NTK only rescales beyond max_position_embeddings in transformers, and vLLM's
        # cache over max_position_embeddings * factor works out to the unscaled base.
        inv = base_freqs
    elif kind == "linear":
        inv = [f / params["factor"] for f in base_freqs]
    elif kind == "llama3":
        factor, lo, hi = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old = params["original_max_position_embeddings"]
        inv = []
        for f in base_freqs:
            wavelength = 2 * math.pi / f
            if wavelength < old / hi:
                inv.append(f)
            elif wavelength > old / lo:
                inv.append(f / factor)
            else:
                t = (old / wavelength - lo) / (hi - lo)
                inv.append((1 - t) * f / factor + t * f)
    elif kind == "yarn":
        old = params.get("original_max_position_embeddings") or max_pos
        factor = params.get("factor")
        if factor is None:
            factor = max_pos / old
        fast = params.get("beta_fast") or 32
        slow = params.get("beta_slow") or 1

        def magnitude(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if params.get("attention_factor") is not None:
            attention = params["attention_factor"]
        elif params.get("mscale") and params.get("mscale_all_dim"):
            attention = magnitude(factor, params["mscale"]) / magnitude(factor, params["mscale_all_dim"])
        else:
            attention = magnitude(factor)

        def dim_for(rotations):
            # the dimension index whose wavelength fits `rotations` times into the old context
            return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        lo, hi = dim_for(fast), dim_for(slow)
        if params.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        inv = []
        for i, f in enumerate(base_freqs):
            ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)
            extrapolate = 1.0 - ramp
            inv.append(f / factor * (1 - extrapolate) + f * extrapolate)
    elif kind == "longrope":
        old = params.get("original_max_position_embeddings") or c.get("original_max_position_embeddings")
        use_long = max_pos > old
        ext = params["long_factor"] if use_long else params["short_factor"]
        inv = [f / e for f, e in zip(base_freqs, ext)]
        scale = max_pos / old
        derived = 1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(old))
        own = params.get("long_mscale" if use_long else "short_mscale")
        if params.get("attention_factor") is not None:
            attention = params["attention_factor"]
        elif own is not None:
            attention = own
        else:
            attention = derived
    else:
        return {"error": "unsupported"}
    return {"inv_freq": inv, "attention_factor": attention, "type": kind}


def main():
    if len(sys.argv) > 1:
        with open(sys.argv[1]) as f:
            configs = json.load(f)
    else:
        configs = json.load(sys.stdin)
    out = []
    for c in configs:
        try:
            out.append(rope_of(c))
        except KeyError as e:
            out.append({"error": "missing " + str(e)})
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
