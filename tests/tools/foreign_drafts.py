"""Rewrites an eaglekit draft folder in two other trainers' layouts, values unchanged.

Usage: foreign_drafts.py SRC OUT. SRC holds config.json and a float32 model.safetensors as
eaglekit exports them. OUT receives
  eagle3/    the EAGLE authors' published form: pytorch_model.bin (torch.save of a state
             dict with midlayer.* names, d2t, t2d and an embed_tokens.weight the draft does
             not use) and a config.json without aux layer ids, head_dim, target_hidden_size
             or any eaglekit key;
  modelopt/  ModelOpt's HF export: model.safetensors with layers.0.* names, no t2d (and no
             d2t when the draft vocabulary is the whole one), aux ids only under
             eagle_config as layer-output numbers (HF index - 1);
  speculators/  what the speculators library's save_pretrained writes for an Eagle3 draft:
             a config with speculators_model_type, speculators_config (greedy proposal, 5
             tokens, a verifier), transformer_layer_config (the Llama layer), draft_vocab_size,
             norm_before_residual and the aux ids at the top; layers.0.* names, the verifier's
             embed_tokens.weight copied in, d2t/t2d only when the draft vocabulary is reduced;
  specforge/ a SpecForge checkpoint folder: its draft config (draft_vocab_size, no aux ids,
             no head_dim), model.safetensors with midlayer.* but without d2t/t2d (as saved
             before the mapping was loaded), the mapping in vocab_mapping.pt ({"d2t", "t2d"},
             torch.save) and a training_state.pt;
  specforge-bad/  the same with a vocab_mapping.pt whose d2t is another mapping, beside
             weights that hold their own d2t/t2d (must be refused).
The safetensors bytes are read and written here by hand (header length, JSON header, data).
"""
import collections, json, os, struct, sys
import numpy as np
import torch

src, out = sys.argv[1], sys.argv[2]
DT = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "BOOL": np.bool_}
RT = {np.dtype(v): k for k, v in DT.items()}

def read_st(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    tensors = collections.OrderedDict()
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        tensors[name] = np.frombuffer(data[a:b], dtype=DT[meta["dtype"]]).reshape(meta["shape"]).copy()
    return tensors

def write_st(path, tensors):
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, arr in tensors.items():
        b = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": RT[arr.dtype], "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    hb = json.dumps(header).encode()
    hb += b" " * ((8 - len(hb) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb + b"".join(blobs))

cfg = json.load(open(os.path.join(src, "config.json")))
weights = read_st(os.path.join(src, "model.safetensors"))
ids = cfg["eagle_aux_hidden_state_layer_ids"]
dropped = [k for k in cfg if k.startswith("eaglekit_")] + [
    "eagle_aux_hidden_state_layer_ids", "eagle_config", "num_aux_hidden_states", "target_hidden_size",
    "norm_before_residual"]

# The EAGLE authors' form.
os.makedirs(os.path.join(out, "eagle3"))
c = {k: v for k, v in cfg.items() if k not in dropped + ["head_dim"]}
json.dump(c, open(os.path.join(out, "eagle3", "config.json"), "w"), indent=2)
state = collections.OrderedDict((k, torch.from_numpy(v)) for k, v in weights.items())
state["embed_tokens.weight"] = torch.zeros(cfg["vocab_size"], cfg["hidden_size"])
torch.save(state, os.path.join(out, "eagle3", "pytorch_model.bin"))

# ModelOpt's HF export.
os.makedirs(os.path.join(out, "modelopt"))
c = {k: v for k, v in cfg.items() if k not in dropped}
c["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids], "use_aux_hidden_state": True}
json.dump(c, open(os.path.join(out, "modelopt", "config.json"), "w"), indent=2)
renamed = collections.OrderedDict()
for k, v in weights.items():
    if k == "t2d" or (k == "d2t" and cfg["draft_vocab_size"] == cfg["vocab_size"]):
        continue
    renamed["layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k] = v
write_st(os.path.join(out, "modelopt", "model.safetensors"), renamed)

# The speculators library's Eagle3 layout.
LAYER_KEYS = ["model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "vocab_size",
              "max_position_embeddings", "rope_theta", "rope_scaling", "tie_word_embeddings", "torch_dtype"]
os.makedirs(os.path.join(out, "speculators"))
c = {
    "architectures": ["Eagle3Speculator"],
    "speculators_model_type": "eagle3",
    "speculators_version": "0.3.0",
    "speculators_config": {
        "algorithm": "eagle3",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5, "verifier_accept_k": 1,
                              "accept_tolerance": 0.0}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": "meta-llama/Llama-3.1-8B-Instruct", "architectures": ["LlamaForCausalLM"]},
    },
    "transformer_layer_config": dict({k: cfg[k] for k in LAYER_KEYS}, attention_bias=False, mlp_bias=False,
                                     use_cache=True, initializer_range=0.02),
    "draft_vocab_size": cfg["draft_vocab_size"],
    "norm_before_residual": False,
    "norm_before_fc": False,
    "fc_norm": False,
    "norm_output": False,
    "target_hidden_size": cfg["target_hidden_size"],
    "eagle_aux_hidden_state_layer_ids": ids,
    "embed_requires_grad": False,
}
json.dump(c, open(os.path.join(out, "speculators", "config.json"), "w"), indent=2)
renamed = collections.OrderedDict()
for k, v in weights.items():
    if k in ("d2t", "t2d") and cfg["draft_vocab_size"] == cfg["vocab_size"]:
        continue
    renamed["layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k] = v
renamed["embed_tokens.weight"] = np.full((cfg["vocab_size"], cfg["hidden_size"]), 0.5, dtype=np.float32)
write_st(os.path.join(out, "speculators", "model.safetensors"), renamed)

# A SpecForge checkpoint folder: the mapping beside the weights.
def specforge(name, keep_mapping_in_weights, mapping_d2t):
    os.makedirs(os.path.join(out, name))
    c = {"architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 0, "eos_token_id": 1,
         "hidden_act": "silu", "hidden_size": cfg["hidden_size"], "initializer_range": 0.02,
         "intermediate_size": cfg["intermediate_size"], "max_position_embeddings": cfg["max_position_embeddings"],
         "model_type": "llama", "num_attention_heads": cfg["num_attention_heads"],
         "num_key_value_heads": cfg["num_key_value_heads"], "num_hidden_layers": 1, "pad_token_id": 0,
         "rms_norm_eps": cfg["rms_norm_eps"], "rope_theta": cfg["rope_theta"], "rope_scaling": cfg["rope_scaling"],
         "tie_word_embeddings": False, "torch_dtype": "float32", "use_cache": True,
         "vocab_size": cfg["vocab_size"], "draft_vocab_size": cfg["draft_vocab_size"]}
    assert cfg["head_dim"] * cfg["num_attention_heads"] == cfg["hidden_size"]
    json.dump(c, open(os.path.join(out, name, "config.json"), "w"), indent=2)
    w = collections.OrderedDict((k, v) for k, v in weights.items() if keep_mapping_in_weights or k not in ("d2t", "t2d"))
    write_st(os.path.join(out, name, "model.safetensors"), w)
    d2t = torch.from_numpy(mapping_d2t.copy())
    t2d = torch.zeros(cfg["vocab_size"], dtype=torch.bool)
    t2d[torch.arange(len(d2t)) + d2t] = True
    torch.save({"d2t": d2t, "t2d": t2d}, os.path.join(out, name, "vocab_mapping.pt"))
    torch.save({"epoch": 0, "global_step": 3}, os.path.join(out, name, "training_state.pt"))

specforge("specforge", False, weights["d2t"])
other = weights["d2t"].copy()
i = int(np.argmax(other > 0))  # a draft id mapped away from itself: point it at its own id
other[i] = 0
assert (other != weights["d2t"]).any(), "the test draft's d2t maps every id to itself"
specforge("specforge-bad", True, other)
