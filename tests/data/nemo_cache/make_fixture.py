"""Writes two tiny NeMo AutoModel EAGLE-3 offline caches with NeMo's own producer code.

nemo-automodel 0.7.0 (PyPI wheel sha256 37b8397a73c17e4a8bffd0cd3becc0507abecc1ebfea3b3eb6468eed57ba6674) is imported, not
copied. Its full installation pulls CUDA-only extras (torchao, ...); the modules this script
uses need only torch, safetensors and transformers, so the unzipped wheel goes on PYTHONPATH.
precompute_eagle3.py imports NeMo's model and tokenizer loaders at the top, which reach
torchao; the script stands those two names in with transformers' Auto classes before the
import (they are never called here) so that precompute_eagle3._compute_batch_cache, the
function its _run hands each batch to, is NeMo's own.

What runs, per cache: a tiny random LlamaForCausalLM (4 layers, H 8, vocabulary 32) as the
target inside NeMo's HFEagle3TargetModel (aux layers 0, 1, 2) -> generate_batch ->
precompute_eagle3._compute_batch_cache -> offline_cache.write_cache_shards with
eagle3_cache.write_shard; the draft vocabulary from eagle3.build_eagle3_token_mapping; the
manifest with eagle3_cache.write_manifest holding the keys precompute_eagle3._run records;
eagle3_cache.write_target_embeddings. The samples are right-padded to seq_length 8 as NeMo's
collator pads them. Expected values come from NeMo's reader, CachedEagle3Dataset.

Usage:
  .venvs/e2e/bin/python -m pip download nemo-automodel==0.7.0 --no-deps -d /tmp/nemo
  unzip -q /tmp/nemo/nemo_automodel-0.7.0-py3-none-any.whl -d /tmp/nemo/pkg
  PYTHONPATH=/tmp/nemo/pkg .venvs/e2e/bin/python tests/data/nemo_cache/make_fixture.py tests/data/nemo_cache

Writes, below OUT:
  lossless/   manifest.json (target_probs_topk 0, dtype bf16, shard_size 2), shard-00000{0,1,2}.safetensors
              (5 samples: 2 + 2 + 1), target_embeddings.safetensors
  topk/       the same samples with target_probs_topk 4, dtype fp32, shard_size 4 (2 shards)
  expected/{lossless,topk}_sample_{i}.safetensors
              CachedEagle3Dataset[i]: input_ids, attention_mask, loss_mask I64 [8], aux_hidden_states
              [8, 24], position_mask BOOL [8, 1], target_probs [8, 16] (top-k: scattered to full width)
  conversations.jsonl  one conversation per sample, conversation_id = the sample index
"""
import json
import os
import shutil
import sys
import types

import torch
import transformers
from safetensors.torch import save_file

# precompute_eagle3 imports these two loaders at module level; they are not used below.
stub = types.ModuleType("nemo_automodel._transformers")
stub.NeMoAutoModelForCausalLM = transformers.AutoModelForCausalLM
stub_tok = types.ModuleType("nemo_automodel._transformers.auto_tokenizer")
stub_tok.NeMoAutoTokenizer = transformers.AutoTokenizer
sys.modules.setdefault("nemo_automodel._transformers", stub)
sys.modules.setdefault("nemo_automodel._transformers.auto_tokenizer", stub_tok)

import nemo_automodel  # noqa: E402
from nemo_automodel.components.datasets.llm import eagle3_cache  # noqa: E402
from nemo_automodel.components.datasets.llm.eagle3 import build_eagle3_token_mapping  # noqa: E402
from nemo_automodel.components.datasets.llm.offline_cache import write_cache_shards  # noqa: E402
from nemo_automodel.components.speculative import precompute_eagle3  # noqa: E402
from nemo_automodel.components.speculative.eagle.target import HFEagle3TargetModel  # noqa: E402

assert nemo_automodel.__version__ == "0.7.0", nemo_automodel.__version__

out = sys.argv[1]
S, H, V, VD, LAYERS = 8, 8, 32, 16, [0, 1, 2]
torch.manual_seed(40)
cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=16, num_hidden_layers=4,
                               num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
model = transformers.LlamaForCausalLM(cfg).eval()
target = HFEagle3TargetModel(model, aux_layer_ids=LAYERS)

# Five conversations' tokens and loss masks (1 on the "assistant" tokens), lengths 5..8.
lengths = [5, 8, 6, 7, 5]
samples = []
for n, length in enumerate(lengths):
    ids = torch.randint(1, V, (length,)).tolist()
    loss = [0] * 2 + [1] * (length - 2)
    pad = S - length
    samples.append({"input_ids": torch.tensor(ids + [0] * pad), "attention_mask": torch.tensor([1] * length + [0] * pad),
                    "loss_mask": torch.tensor(loss + [0] * pad)})


def loader(batch_size):
    return torch.utils.data.DataLoader(samples, batch_size=batch_size, shuffle=False)


selected_ids, selected_mask = build_eagle3_token_mapping(loader(2), target_vocab_size=V, draft_vocab_size=VD,
                                                         special_token_ids=[0])


def write(name, topk, dtype, shard_size, batch_size):
    cache = os.path.join(out, name)
    if os.path.exists(cache):
        shutil.rmtree(cache)
    os.makedirs(cache)
    eagle3_cache.write_target_embeddings(cache, model.get_input_embeddings().weight)
    manifest = {
        "target_model": "tiny-random-llama (make_fixture.py)", "target_vocab_size": V,
        "draft_vocab_size": int(selected_ids.numel()), "seq_length": S, "dtype": dtype,
        "num_samples": len(samples), "shard_size": shard_size, "target_probs_topk": topk,
        "aux_hidden_dim": H * len(LAYERS), "aux_layer_ids": LAYERS, "selected_token_ids": selected_ids.tolist(),
        "input_data": "conversations.jsonl", "split": None, "shuffle_seed": 42,
        "mask_reasoning_content": False, "mask_generation_prompt": False,
    }
    eagle3_cache.write_manifest(cache, manifest)

    def compute(batch):
        with torch.no_grad():
            tb = target.generate_batch(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                       loss_mask=batch["loss_mask"])
            return precompute_eagle3._compute_batch_cache(tb, selected_ids, selected_mask,
                                                          eagle3_cache.DTYPE_MAP[dtype], topk)

    import logging
    write_cache_shards(dataloader=loader(batch_size), output_dir=cache, shard_size=shard_size, start_shard_index=0,
                       compute_batch=compute, write_shard_fn=eagle3_cache.write_shard,
                       logger=logging.getLogger("make_fixture"))
    ds = eagle3_cache.CachedEagle3Dataset(cache)
    os.makedirs(os.path.join(out, "expected"), exist_ok=True)
    for i in range(len(ds)):
        item = {k: v.contiguous() for k, v in ds[i].items()}
        save_file(item, os.path.join(out, "expected", "%s_sample_%d.safetensors" % (name, i)))


write("lossless", 0, "bf16", 2, 2)
write("topk", 4, "fp32", 4, 2)
with open(os.path.join(out, "conversations.jsonl"), "w") as f:
    for i in range(len(samples)):
        f.write(json.dumps({"conversation_id": str(i), "conversations": [
            {"role": "user", "content": "question %d" % i}, {"role": "assistant", "content": "answer %d" % i}]}) + "\n")
print("wrote", out)
