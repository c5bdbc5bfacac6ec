"""What vLLM and SGLang load from an exported draft, by their loaders' rules.

Written from reading the engines' code (docs/export.md names the files and commits); no
engine is imported. For one draft folder and one engine it builds the parameters the
engine's EAGLE-3 model has (names, shapes) from the config as that engine reads it, maps
every tensor name of model.safetensors the way its load_weights does, and checks that every
parameter its forward uses is loaded from the file with the right shape, that no name is
unknown, and that the config values the engine reads equal ours.

Usage:
  engine_loaders.py check DRAFT --engine ENGINE --ours OURS --base BASE [--speculative-tokens S]
      DRAFT: an eaglekit export or a speculators export; OURS: the eaglekit export of the
      same draft (the reference values); BASE: the target model folder. Prints a JSON
      report; exit 0 when the engine serves the draft as trained, 1 with the reason.
  engine_loaders.py rename SRC DST OLD NEW
      copies the draft folder SRC to DST with tensor OLD renamed NEW (a must-fail case).

ENGINE:
  vllm          llama_eagle3.py as of PR 54598's base: fc input = target_hidden_size *
                (num_aux_hidden_states, else len(eagle_config ids), else 3)
  vllm-fc3      older llama_eagle3.py (commit 00bd1493): fc input = target_hidden_size * 3
  sglang        llama_eagle3.py with additional_layers (commit 03d5a777): fc input =
                target_hidden_size * 3, midlayer + additional_layers.{j}, unknown names skipped
  sglang-aux    the same with the fc width of SGLang PR 24663 (num_aux_hidden_states, else
                len(eagle_config ids), else 3)
  sglang-1layer llama_eagle3.py before multi-layer support (commit d737979c): refuses
                num_hidden_layers != 1
"""
import json, os, shutil, struct, sys


class Refused(Exception):
    """The engine stops with an error (loud: the user sees it)."""


def header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    return {name: (meta["dtype"], list(meta["shape"])) for name, meta in h.items()}


def load_json(path):
    with open(path) as f:
        return json.load(f)


# ---- config reading --------------------------------------------------------------------

def vllm_hf_config(raw):
    """The hf_config vLLM builds: the flat config as is, or the speculators translation
    (transformers_utils/configs/speculators: transformer_layer_config plus the eagle3
    updater's top-level keys; norm_before_residual defaults to true there)."""
    if "speculators_model_type" not in raw:
        return dict(raw), None
    if raw["speculators_model_type"] != "eagle3":
        raise Refused("speculators_model_type %r is not eagle3" % raw["speculators_model_type"])
    spec = raw["speculators_config"]
    tokens = spec["proposal_methods"][0]["speculative_tokens"]  # KeyError: vLLM's "Invalid speculators config"
    verifier = spec["verifier"]["name_or_path"]
    cfg = dict(raw["transformer_layer_config"])
    cfg["draft_vocab_size"] = raw.get("draft_vocab_size")
    if raw.get("target_hidden_size") is not None:
        cfg["target_hidden_size"] = raw["target_hidden_size"]
    cfg["norm_before_residual"] = raw.get("norm_before_residual", True)
    cfg["architectures"] = ["Eagle3LlamaForCausalLM"]
    if raw.get("eagle_aux_hidden_state_layer_ids"):
        cfg["eagle_aux_hidden_state_layer_ids"] = raw["eagle_aux_hidden_state_layer_ids"]
    cfg.setdefault("num_lookahead_tokens", tokens)
    return cfg, {"method": raw["speculators_model_type"], "num_speculative_tokens": tokens, "target": verifier}


def fc_width(cfg, engine):
    ht = cfg.get("target_hidden_size", cfg["hidden_size"])
    if engine in ("vllm-fc3", "sglang", "sglang-1layer"):
        return ht * 3
    k = cfg.get("num_aux_hidden_states")
    if k is None:
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        k = len(ids) if ids else 3
    return ht * k


# ---- the engines' parameters -----------------------------------------------------------

def attn_params(prefix, cfg, width):
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads", nh)
    d = cfg.get("head_dim", h // nh)
    return {
        prefix + "self_attn.qkv_proj.weight": {"q": [nh * d, width], "k": [nkv * d, width], "v": [nkv * d, width]},
        prefix + "self_attn.o_proj.weight": [h, nh * d],
    }


def mlp_params(prefix, cfg):
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    return {prefix + "mlp.gate_up_proj.weight": {0: [i, h], 1: [i, h]}, prefix + "mlp.down_proj.weight": [h, i]}


def vllm_model(cfg, engine):
    """Eagle3LlamaForCausalLM's parameters -> shape (or shard -> shape); the set its
    forward never reads; and what is shared with the target instead of loaded."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    vd = cfg.get("draft_vocab_size") or v
    p = {"model.embed_tokens.weight": [v, h]}
    unused = set()
    for i in range(cfg["num_hidden_layers"]):
        pre = "model.layers.%d." % i
        p.update(attn_params(pre, cfg, 2 * h if i == 0 else h))
        p.update(mlp_params(pre, cfg))
        for norm in ("input_layernorm", "post_attention_layernorm", "hidden_norm"):
            p[pre + norm + ".weight"] = [h]
        if i > 0:
            unused.add(pre + "hidden_norm.weight")  # built for every layer, read by layer 0 only
    use_aux = (cfg.get("eagle_config") or {}).get("use_aux_hidden_state", True)
    if use_aux:
        p["model.fc.weight"] = [h, fc_width(cfg, engine)]
    p["model.norm.weight"] = [h]
    p["lm_head.weight"] = [vd, h]
    p["draft_id_to_target_id"] = [vd]
    return p, unused


def sglang_model(cfg, engine):
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    n = cfg["num_hidden_layers"]
    if engine == "sglang-1layer" and n != 1:
        raise Refused("EAGLE3 currently only supports 1 layer (num_hidden_layers %d)" % n)
    p = {"model.embed_tokens.weight": [v, h], "model.fc.weight": [h, fc_width(cfg, engine)]}
    pre = "model.midlayer."
    p.update(attn_params(pre, cfg, 2 * h))
    p.update(mlp_params(pre, cfg))
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        p[pre + norm + ".weight"] = [h]
    for j in range(n - 1):  # BasicDecoderLayer: input_layernorm is None, hidden_norm instead
        pre = "model.additional_layers.%d." % j
        p.update(attn_params(pre, cfg, h))
        p.update(mlp_params(pre, cfg))
        for norm in ("hidden_norm", "post_attention_layernorm"):
            p[pre + norm + ".weight"] = [h]
    p["model.norm.weight"] = [h]
    if cfg.get("tie_word_embeddings"):
        raise Refused("tie_word_embeddings: true makes SGLang use the target's embedding as lm_head")
    if cfg.get("draft_vocab_size") is None:
        raise Refused("no draft_vocab_size: SGLang loads the target's lm_head instead of the draft's")
    p["lm_head.weight"] = [cfg["draft_vocab_size"], h]
    return p, set()


STACKED = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
           (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]


class Loader:
    def __init__(self, params):
        self.params = params
        self.loaded = {}  # param -> set of shards (None for a whole tensor)
        self.dropped = []  # file names the engine skipped without a word

    def load(self, param, shape, shard=None, origin=""):
        want = self.params[param] if shard is None else self.params[param][shard]
        if list(shape) != list(want):
            raise Refused("%s -> %s%s: shape %s, the engine's parameter is %s" %
                          (origin, param, "" if shard is None else "[%s]" % shard, shape, want))
        self.loaded.setdefault(param, set()).add(shard)

    def complete(self, param):
        want = self.params[param]
        got = self.loaded.get(param, set())
        return got == set(want.keys()) if isinstance(want, dict) else None in got


def vllm_load(tensors, params):
    """Eagle3LlamaForCausalLM.load_weights + AutoWeightsLoader + LlamaModel.load_weights."""
    ld = Loader(params)
    for name, (dtype, shape) in tensors.items():
        orig = name
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        if name.startswith("model."):
            inner = name[len("model."):]
            if "midlayer." in inner:
                inner = inner.replace("midlayer.", "layers.0.")
            for param, weight, shard in STACKED:
                if weight in inner:
                    full = "model." + inner.replace(weight, param)
                    if full not in params:
                        raise Refused("%s: no parameter %s in the draft model (KeyError)" % (orig, full))
                    ld.load(full, shape, shard, orig)
                    break
            else:
                full = "model." + inner
                if full not in params:
                    raise Refused("%s: no parameter %s in the draft model (KeyError)" % (orig, full))
                ld.load(full, shape, None, orig)
        else:
            if name not in params:
                raise Refused("%s: there is no module or parameter named %s" % (orig, name))
            ld.load(name, shape, None, orig)
    return ld


def sglang_load(tensors, params):
    """LlamaForCausalLMEagle3.load_weights: d2t -> hot_token_id, t2d skipped, a name that
    matches no parameter (with or without model.) is skipped silently."""
    ld = Loader(params)
    hot = None
    for name, (dtype, shape) in tensors.items():
        orig = name
        if "d2t" in name:
            hot = shape
            continue
        if "t2d" in name:
            continue
        for param, weight, shard in STACKED:
            if weight in name:
                name = name.replace(weight, param)
                full = name if name in params else "model." + name
                if full in params:
                    ld.load(full, shape, shard, orig)
                else:
                    ld.dropped.append(orig)
                break
        else:
            full = name if name in params else "model." + name
            if full in params:
                ld.load(full, shape, None, orig)
            else:
                ld.dropped.append(orig)
    return ld, hot


# ---- the check -------------------------------------------------------------------------

def check(draft, engine, ours_dir, base_dir, tokens):
    raw = load_json(os.path.join(draft, "config.json"))
    ours = load_json(os.path.join(ours_dir, "config.json"))
    base = load_json(os.path.join(base_dir, "config.json"))
    tensors = header(os.path.join(draft, "model.safetensors"))
    report = {"engine": engine, "draft": draft}
    problems = []

    if engine.startswith("vllm"):
        cfg, spec = vllm_hf_config(raw)
        if cfg.get("architectures", [None])[0] not in ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"):
            raise Refused("architectures %s is no EAGLE-3 Llama draft" % cfg.get("architectures"))
        params, unused = vllm_model(cfg, engine)
        ld = vllm_load(tensors, params)
        shared = {"model.embed_tokens.weight"} if not any("embed_tokens" in t for t in tensors) else set()
        # draft_id_to_target_id starts at zeros: without a d2t it is the identity map.
        identity = {"draft_id_to_target_id"} if cfg.get("draft_vocab_size", cfg["vocab_size"]) in (None, cfg["vocab_size"]) else set()
        aux_ids = cfg.get("eagle_aux_hidden_state_layer_ids")
        report["speculative_config"] = spec
        if spec is not None:
            if tokens is not None and spec["num_speculative_tokens"] != tokens:
                problems.append("num_speculative_tokens %s, expected %s" % (spec["num_speculative_tokens"], tokens))
        if cfg.get("norm_before_residual", False) is not False:
            problems.append("norm_before_residual is %s: vLLM would compute the other first-layer form"
                            % cfg.get("norm_before_residual"))
        report["dtype"] = base.get("torch_dtype")  # vLLM runs the draft in the target's dtype
    else:
        if "speculators_model_type" in raw:
            raise Refused("architectures %s: SGLang has no speculators-format loader" % raw.get("architectures"))
        cfg = dict(raw)
        params, unused = sglang_model(cfg, engine)
        ld, hot = sglang_load(tensors, params)
        shared = {"model.embed_tokens.weight"} if not any("embed_tokens" in t for t in tensors) else set()
        identity = set()
        if hot is None and cfg["draft_vocab_size"] != cfg["vocab_size"]:
            problems.append("no d2t: SGLang has no hot-token map for a reduced draft vocabulary")
        nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        aux_ids = [i + 1 for i in nested] if nested is not None else None
        # --dtype auto: the config's torch_dtype, float32 served as float16.
        d = cfg.get("torch_dtype", "float16")
        report["dtype"] = "float16" if d == "float32" else d
        report["d2t_rows"] = hot

    random = sorted(p for p in params if not ld.complete(p) and p not in unused | shared | identity)
    report.update({
        "parameters": len(params),
        "loaded": sorted(p for p in params if ld.complete(p)),
        "shared_with_target": sorted(shared),
        "unused_by_forward": sorted(unused),
        "left_random": random,
        "dropped": sorted(ld.dropped),
    })
    if random:
        problems.append("left random (never loaded): " + ", ".join(random))
    if ld.dropped:
        problems.append("skipped without an error: " + ", ".join(sorted(ld.dropped)))

    # The config values the engine reads, against ours.
    vd_engine = cfg.get("draft_vocab_size") or cfg["vocab_size"]
    fc_file = tensors.get("fc.weight", (None, [None, None]))[1][1]
    read = {
        "hidden_size": cfg["hidden_size"],
        "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
        "head_dim": cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]),
        "num_hidden_layers": cfg["num_hidden_layers"],
        "draft_vocab_size": vd_engine,
        "fc_input": fc_width(cfg, engine),
        "aux_layer_ids": aux_ids,
        "rope_theta": cfg.get("rope_theta", 10000.0),
        "rope_scaling": cfg.get("rope_scaling"),
        "rms_norm_eps": cfg.get("rms_norm_eps"),
    }
    expected = {
        "hidden_size": ours["hidden_size"],
        "num_attention_heads": ours["num_attention_heads"],
        "num_key_value_heads": ours["num_key_value_heads"],
        "head_dim": ours["head_dim"],
        "num_hidden_layers": ours["num_hidden_layers"],
        "draft_vocab_size": ours["draft_vocab_size"],
        "fc_input": ours["eaglekit_num_aux_layers"] * ours["target_hidden_size"],
        "aux_layer_ids": ours["eagle_aux_hidden_state_layer_ids"],
        "rope_theta": ours["rope_theta"],
        "rope_scaling": ours["rope_scaling"],
        "rms_norm_eps": ours["rms_norm_eps"],
    }
    report["config_read"] = read
    for key, want in expected.items():
        if read[key] != want:
            problems.append("%s: the engine reads %s, ours is %s" % (key, read[key], want))
    if fc_file != expected["fc_input"]:
        problems.append("fc.weight in the file has %s input columns, ours %s" % (fc_file, expected["fc_input"]))
    if report["dtype"] != base.get("torch_dtype", "bfloat16"):
        problems.append("served as %s, the base is %s" % (report["dtype"], base.get("torch_dtype")))
    report["problems"] = problems
    return report


def main(argv):
    if argv[:1] == ["rename"]:
        src, dst, old, new = argv[1:5]
        shutil.copytree(src, dst)
        path = os.path.join(dst, "model.safetensors")
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            h = json.loads(f.read(n))
            data = f.read()
        if old not in h:
            sys.exit("rename: %s has no tensor %s" % (src, old))
        h = {(new if k == old else k): v for k, v in h.items()}
        hb = json.dumps(h).encode()
        hb += b" " * ((8 - len(hb) % 8) % 8)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(hb)) + hb + data)
        return 0
    if argv[:1] != ["check"]:
        sys.exit(__doc__)
    draft = argv[1]
    opts = dict(zip(argv[2::2], argv[3::2]))
    tokens = int(opts["--speculative-tokens"]) if "--speculative-tokens" in opts else None
    try:
        report = check(draft, opts["--engine"], opts["--ours"], opts["--base"], tokens)
    except Refused as e:
        print(json.dumps({"engine": opts["--engine"], "draft": draft, "refused": str(e)}))
        print("%s refuses %s: %s" % (opts["--engine"], draft, e), file=sys.stderr)
        return 1
    print(json.dumps(report))
    if report["problems"]:
        print("%s does not serve %s as trained: %s" % (opts["--engine"], draft, "; ".join(report["problems"])),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
