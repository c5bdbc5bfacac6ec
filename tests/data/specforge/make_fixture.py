"""Writes SpecForge 0.2's offline .ckpt records with SpecForge's own layout code.

SpecForge 0.2 (PyPI specforge 0.2.0) names a record's keys per training strategy: each
strategy's registered offline provider holds an OfflineCaptureLayout
(specforge/algorithms/common/providers.py) whose materialize() maps the capture's
input_ids, loss_mask, aux_hidden_states [1, T, k*H] and last_hidden_states [1, T, H] to the
persisted keys (eagle3: aux_hidden_state / hidden_state; dflash, domino: hidden_states
only; dspark: hidden_states + target_last_hidden_states). Its writer,
scripts/prepare_hidden_states.py (not in the wheel, and it needs SGLang on a GPU), then
does torch.save(dict(record), path) (or inside gzip.open(path, "wb") for --compress,
.ckpt.gz). Here the capture is random data and the save is that same call; the layouts
are SpecForge's own. expected/*.safetensors: the record as SpecForge's own reader and
normalizer see it (runtime/data_plane/feature_store.load_feature_file, then
normalize_dspark_offline_sample), batch dimension dropped.

Usage (specforge's dependencies include SGLang and CUDA torch; the layout code needs only torch):
  pip install --no-deps --target .venvs/specforge-0.2.0 specforge==0.2.0
  PYTHONPATH=.venvs/specforge-0.2.0 .venvs/e2e/bin/python tests/data/specforge/make_fixture.py tests/data/specforge
"""
import gzip
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from specforge.algorithms.builtin import builtin_algorithm_registry
from specforge.algorithms.common.dflash_family_data import normalize_dspark_offline_sample
from specforge.runtime.data_plane.feature_store import load_feature_file

out = Path(sys.argv[1])
(out / "expected").mkdir(parents=True, exist_ok=True)
T, K, H = 5, 3, 8
gen = torch.Generator().manual_seed(2)
sources = {
    "input_ids": torch.randint(0, 32, (T,), generator=gen, dtype=torch.int64),
    "loss_mask": torch.tensor([0, 1, 1, 1, 0], dtype=torch.int64),
    "aux_hidden_states": torch.randn(1, T, K * H, generator=gen).to(torch.bfloat16),
    "last_hidden_states": torch.randn(1, T, H, generator=gen).to(torch.bfloat16),
}
registry = builtin_algorithm_registry()
for strategy in ["dspark", "dflash"]:
    layout = registry.resolve(strategy).providers.offline_for("text").capture_layout
    record = layout.materialize(sources)
    torch.save(dict(record), out / f"{strategy}_0.ckpt")
    with gzip.open(out / f"{strategy}_0.ckpt.gz", "wb", compresslevel=6) as f:
        torch.save(dict(record), f)

ready = normalize_dspark_offline_sample(load_feature_file(str(out / "dspark_0.ckpt")), max_len=2048)
save_file({"input_ids": ready["input_ids"][0].contiguous(),
           "loss_mask": ready["loss_mask"][0].contiguous(),
           "aux_hidden_states": ready["hidden_states"][0].contiguous(),
           "hidden_states": ready["target_last_hidden_states"][0].contiguous()},
          str(out / "expected" / "dspark_0.safetensors"))
