"""Writes a speculators 0.9 prepared dataset folder with the producer's own code, and the
loss masks its trainer pairs with each hs_{i}.safetensors.

prepared/ is what `speculators prepare-data` writes for speculator-format rows (input_ids
and loss_mask given, as when the chat template was applied beforehand): the rows go
through speculators.data_generation.preprocessing.build_speculator_training_dataset and
Dataset.save_to_disk, as in speculators/cli/prepare_data.py (the processor, which only
loads from the hub, is None: these rows are not multimodal). prepared/hidden_states/ holds
the records vLLM's own connector wrote for tests/data/speculators_fp8 (bf16/hs_{i}), whose
token_ids are rows 0 and 1's input_ids. Row 2 has no dump (speculators would generate it).
expected/hs_{i}.safetensors: loss_mask as speculators' own ArrowDataset pairs it with
hs_{i} (speculators/train/data.py), for the tests' exact comparison.
loss_masks.safetensors: scripts/speculators/loss_masks.py's output for prepared/.

Usage (the e2e venv has speculators 0.9.0, datasets 5.1.0, hs-connectors 0.9.0, torch):
  .venvs/e2e/bin/python tests/data/speculators_masks/make_fixture.py tests/data/speculators_masks
"""
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from datasets import Dataset
from safetensors.torch import load_file, save_file
from speculators.data_generation.preprocessing import build_speculator_training_dataset
from speculators.train.data import ArrowDataset

out = Path(sys.argv[1])
here = Path(__file__).resolve().parent
fp8 = here.parent / "speculators_fp8" / "bf16"
ids = [load_file(fp8 / f"hs_{i}.safetensors")["token_ids"].tolist() for i in range(2)]
rows = {
    "input_ids": [ids[0], ids[1], [3, 1, 4, 1, 5]],
    "loss_mask": [[0, 0, 1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 0, 1, 1]],
}
prepared = out / "prepared"
shutil.rmtree(prepared, ignore_errors=True)
ds = build_speculator_training_dataset(Dataset.from_dict(rows), None, max_length=2048, num_proc=1)
ds.save_to_disk(str(prepared))
(prepared / "hidden_states").mkdir()
for i in range(2):
    shutil.copyfile(fp8 / f"hs_{i}.safetensors", prepared / "hidden_states" / f"hs_{i}.safetensors")

(out / "expected").mkdir(exist_ok=True)
arrow = ArrowDataset(max_len=2048, datapath=str(prepared), on_missing="raise")
for i in range(2):
    item = arrow[i]
    save_file({"loss_mask": item["loss_mask"].to(torch.uint8).contiguous(),
               "input_ids": item["input_ids"].contiguous()},
              str(out / "expected" / f"hs_{i}.safetensors"))

script = here.parents[2] / "scripts" / "speculators" / "loss_masks.py"
subprocess.run([sys.executable, str(script), str(prepared), str(out / "loss_masks.safetensors")],
               check=True)
