"""NeMo AutoModel 0.7.0's own TTT loss inputs and values on the two fixture caches, for
tests/trainer/test_nemo_train.cpp ("nemo train: the stored targets and weights give NeMo's own
loss ...").

For each cache (lossless, topk) the samples come from NeMo's reader, CachedEagle3Dataset, stacked
as its collator would (all are right-padded to seq_length 8 already). Random draft logits
[5, 8, 16] (seeded) stand in for the draft's output at every TTT step. For TTT steps k = 0, 1, 2
the targets and masks are rolled exactly as Eagle3TrainerModule.forward rolls them (NeMo's own
_shift_left_with_zero, applied k times to target_probs and position_mask), and NeMo's own
masked_soft_cross_entropy gives the step's loss; the logits at slot j stand for the chain that
starts at position j. nemo-automodel is imported, not copied (the wheel unzipped on PYTHONPATH,
as make_fixture.py says); on CPU masked_soft_cross_entropy takes its PyTorch path.

Usage:
  PYTHONPATH=/tmp/nemo/pkg .venvs/e2e/bin/python tests/data/nemo_cache/make_loss_fixture.py tests/data/nemo_cache

Writes OUT/expected/{lossless,topk}_soft_ce.safetensors: logits F32 [5, 8, 16], loss F32 [3] (one
per TTT step).
"""
import os
import sys

import torch
from safetensors.torch import save_file

import nemo_automodel  # noqa: E402
from nemo_automodel.components.datasets.llm import eagle3_cache  # noqa: E402
from nemo_automodel.components.loss.soft_ce import masked_soft_cross_entropy  # noqa: E402
from nemo_automodel.components.speculative.eagle.core import _shift_left_with_zero  # noqa: E402

assert nemo_automodel.__version__ == "0.7.0", nemo_automodel.__version__

out = sys.argv[1]
torch.manual_seed(4040)
for name in ("lossless", "topk"):
    ds = eagle3_cache.CachedEagle3Dataset(os.path.join(out, name))
    items = [ds[i] for i in range(len(ds))]
    target_probs = torch.stack([it["target_probs"] for it in items])
    position_mask = torch.stack([it["position_mask"] for it in items])
    logits = torch.randn(target_probs.shape, dtype=torch.float32) * 2
    losses = []
    cur_probs, cur_mask = target_probs, position_mask
    for step in range(3):
        losses.append(masked_soft_cross_entropy(logits=logits, target_probs=cur_probs, position_mask=cur_mask))
        cur_probs = _shift_left_with_zero(cur_probs)
        cur_mask = _shift_left_with_zero(cur_mask)
    save_file({"logits": logits.contiguous(), "loss": torch.stack(losses).float().contiguous()},
              os.path.join(out, "expected", "%s_soft_ce.safetensors" % name))
print("wrote", out)
