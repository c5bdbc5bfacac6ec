#!/usr/bin/python3
"""Writes .pt record files in every variant eaglekit's .pt reader accepts, with torch.save.

Usage: /usr/bin/python3 tests/data/pt/make_variants.py OUT_DIR

The committed copies in tests/data/pt/variants/ were made with Debian's python3-torch 1.13;
tests/formats/test_pt.cpp also reruns this script with the installed torch. Values follow
formulas the C++ test recomputes (T=5 tokens, H=4, k=3 aux layers):
  input_ids[t] = 3 + 7t          hidden[t, h] = (t*H + h) / 2
  aux[t, j]    = -(t*3H + j) / 4  loss_mask[t] = 0 if t % 3 == 1 else 1
All are exact in bf16/fp16. OUT_DIR/variants.json lists, per file, what the reader must
report: the conversation id and the dtypes.
"""
import collections
import json
import os
import sys

import torch

T, H, K = 5, 4, 3


def ids(dtype=torch.int64):
    return (3 + 7 * torch.arange(T)).to(dtype)


def hid(dtype):
    return (torch.arange(T * H, dtype=torch.float64).reshape(T, H) / 2).to(dtype)


def aux(dtype):
    return (-torch.arange(T * K * H, dtype=torch.float64).reshape(T, K * H) / 4).to(dtype)


def mask(dtype=torch.int64):
    m = torch.tensor([0 if t % 3 == 1 else 1 for t in range(T)])
    return m.bool() if dtype == torch.bool else m.to(dtype)


def main(out):
    os.makedirs(out, exist_ok=True)
    manifest = {}

    def save(name, obj, conv_id, ids_dtype, hidden_dtype, loss_mask, **kw):
        torch.save(obj, os.path.join(out, name), **kw)
        manifest[name] = {"conversation_id": conv_id, "ids_dtype": ids_dtype,
                          "hidden_dtype": hidden_dtype, "loss_mask": loss_mask}

    # ModelOpt: a plain dict, bf16, str id.
    save("dict_bf16.pt", {"input_ids": ids(), "hidden_states": hid(torch.bfloat16),
                          "aux_hidden_states": aux(torch.bfloat16), "conversation_id": "conv-a"},
         "conv-a", "int64", "bfloat16", "none")
    # A list holding one dict, fp16, int id, int64 mask.
    save("list_fp16.pt", [{"input_ids": ids(), "hidden_states": hid(torch.float16),
                           "aux_hidden_states": aux(torch.float16), "conversation_id": 17,
                           "loss_mask": mask()}],
         "17", "int64", "float16", "int64")
    # An OrderedDict, fp32, int32 ids.
    save("ordered_fp32.pt", collections.OrderedDict(
        [("conversation_id", "ord"), ("input_ids", ids(torch.int32)),
         ("hidden_states", hid(torch.float32)), ("aux_hidden_states", aux(torch.float32))]),
         "ord", "int32", "float32", "none")
    # SpecForge: singular key names, a leading batch dimension, no id (file stem).
    save("123.ckpt", {"input_ids": ids()[None], "loss_mask": mask()[None],
                      "hidden_state": hid(torch.float32)[None],
                      "aux_hidden_state": aux(torch.float32)[None]},
         "123", "int64", "float32", "int64")
    # hidden_state_features alias, bool mask, int32 ids.
    save("features_bf16.pt", {"input_ids": ids(torch.int32), "hidden_state": hid(torch.bfloat16),
                              "hidden_state_features": aux(torch.bfloat16),
                              "loss_mask": mask(torch.bool), "conversation_id": "feat"},
         "feat", "int32", "bfloat16", "bool")
    # Views: aux and hidden share one storage (non-contiguous rows, hidden at an offset);
    # input_ids is a view with storage offset 2 into a larger storage.
    base = torch.cat([aux(torch.float32), hid(torch.float32)], dim=1)  # [T, 4H]
    big = torch.cat([torch.tensor([99, 98]), ids()])
    save("views_fp32.pt", {"input_ids": big[2:], "hidden_states": base[:, K * H:],
                           "aux_hidden_states": base[:, :K * H], "loss_mask": mask(),
                           "conversation_id": "views"},
         "views", "int64", "float32", "int64")
    # Transposed (column-major) tensors.
    save("transposed_fp16.pt", {"input_ids": ids(),
                                "hidden_states": hid(torch.float16).t().contiguous().t(),
                                "aux_hidden_states": aux(torch.float16).t().contiguous().t(),
                                "loss_mask": mask(torch.bool), "conversation_id": "tr"},
         "tr", "int64", "float16", "bool")
    # Pickle protocols 4 and 5 (FRAME, MEMOIZE, SHORT_BINUNICODE, STACK_GLOBAL).
    rec = {"input_ids": ids(), "hidden_states": hid(torch.bfloat16),
           "aux_hidden_states": aux(torch.bfloat16), "conversation_id": "p4"}
    save("proto4_bf16.pt", rec, "p4", "int64", "bfloat16", "none", pickle_protocol=4)
    rec["conversation_id"] = "p5"
    save("proto5_bf16.pt", rec, "p5", "int64", "bfloat16", "none", pickle_protocol=5)

    with open(os.path.join(out, "variants.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else
         os.path.join(os.path.dirname(os.path.abspath(__file__)), "variants"))
