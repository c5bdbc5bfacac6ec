"""Writes speculators' FP8 hidden-state records with the producers' own code.

The files are what vLLM's hidden-state extraction writes through hs_connectors'
FP8HiddenStatesConnector (speculators PR 1028, published as the PyPI package
hs-connectors 0.9.0): its _write_tensors, the step that quantises and saves, is called here
on the CPU with the tensors vLLM's connector hands it ({"hidden_states": [T, L, H] in the
model's dtype, "token_ids": int64 [T]}). The same tensors also go through vLLM's own
ExampleHiddenStatesConnector._write_tensors (the bf16 file it would have written), and the
expected values come from the producer's own reader, hs_connectors.transfer.FP8Transfer,
dequantising to float32.

Usage (the e2e venv has vLLM 0.32 and torch; hs-connectors needs only torch and safetensors):
  pip install --no-deps --target DIR hs-connectors==0.9.0
  PYTHONPATH=DIR .venvs/e2e/bin/python tests/data/speculators_fp8/make_fixture.py tests/data/speculators_fp8

Writes, below OUT:
  dump/hs_{i}.safetensors      the FP8 records (hidden_states F8_E4M3 [T, 3, 8],
                               hidden_states_scales F32 [T, 1, 1], token_ids I64 [T])
  bf16/hs_{i}.safetensors      the same tensors as vLLM's own connector writes them (BF16)
  expected/hs_{i}.safetensors  FP8Transfer's float32 dequantisation (hidden_states [T, 3, 8])
  conversations.jsonl          one conversation per record, matched by row (hs_{i} is row i)
"""
import json
import os
import sys
from pathlib import Path

import torch
from hs_connectors.fp8_hidden_states_connector import FP8HiddenStatesConnector
from hs_connectors.transfer import FP8Transfer
from safetensors.torch import load_file, save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
)

out = sys.argv[1]
L, H, V = 3, 8, 32  # two aux layers and the last one; the tests' base has H 8, vocabulary 32


class Done:
    """Stands in for the CUDA event the connector waits on: the copy is already on the CPU."""

    def synchronize(self):
        pass


gen = torch.Generator().manual_seed(40)
records = []
for i, t in enumerate([6, 4]):
    hs = torch.randn(t, L, H, generator=gen)
    # Tokens of very different sizes (pre-norm states grow with depth and vary by token),
    # so that per-token scales differ by orders of magnitude; record 1 has an all-zero token.
    hs = hs * torch.logspace(-2, 2, t).reshape(t, 1, 1)
    hs[:, 1] *= 3.0
    if i == 1:
        hs[2] = 0.0
    records.append({"hidden_states": hs.to(torch.bfloat16),
                    "token_ids": torch.randint(0, V, (t,), generator=gen, dtype=torch.int64)})

for sub in ["dump", "bf16", "expected"]:
    os.makedirs(os.path.join(out, sub), exist_ok=True)
reader = FP8Transfer(Path(out) / "dump", dequantize_dtype=torch.float32)
with open(os.path.join(out, "conversations.jsonl"), "w") as f:
    for i, rec in enumerate(records):
        name = "hs_%d.safetensors" % i
        FP8HiddenStatesConnector._write_tensors(dict(rec), Done(), os.path.join(out, "dump", name), None)
        ExampleHiddenStatesConnector._write_tensors(dict(rec), Done(), os.path.join(out, "bf16", name), None)
        got = reader.get_cached(i)
        save_file({"hidden_states": got["hidden_states"].contiguous(), "token_ids": got["token_ids"]},
                  os.path.join(out, "expected", name))
        f.write(json.dumps({"conversation_id": "fp8-%d" % i,
                            "conversations": [{"role": "user", "content": "q%d" % i}]}) + "\n")
        back = load_file(os.path.join(out, "dump", name))
        print(name, {k: (str(v.dtype), list(v.shape)) for k, v in back.items()})
