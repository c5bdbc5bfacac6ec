"""Rewrites an eaglekit draft folder in two other trainers' layouts, values unchanged.

Usage: foreign_drafts.py SRC OUT. SRC holds config.json and a float32 model.safetensors as
eaglekit exports them. OUT receives
  eagle3/    the EAGLE authors' published form: pytorch_model.bin (torch.save of a state
             dict with midlayer.* names, d2t, t2d and an embed_tokens.weight the draft does
             not use) and a config.json without aux layer ids, head_dim, target_hidden_size
             or any eaglekit key;
  modelopt/  ModelOpt's HF export: model.safetensors with layers.0.* names, no t2d (and no
             d2t when the draft vocabulary is the whole one), aux ids only under
             eagle_config as layer-output numbers (HF index - 1).
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
