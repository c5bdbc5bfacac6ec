"""Writes a tiny DeepSpec target cache (version 2) with DeepSpec's own writer.

DeepSpec (github.com/deepseek-ai/DeepSpec, commit afdfa7c9382a3341a3e6f17756dd816da79f132c) is
not on PyPI; this script imports its deepspec/data/target_cache_dataset.py from a checkout and
runs the steps scripts/data/prepare_target_cache.py runs after the target model's forward pass:
one LocalTargetCacheWriter per rank (write_sample), each rank's summary, the global shard map,
the shard renames, finalize_target_cache_index, build_target_cache_manifest and
write_target_cache_manifest. The tensors stand in for the forward pass (random bf16 where
DeepSpec would hand in the hooked layers and AutoModel's last_hidden_state). The expected
values are what DeepSpec's own reader, CacheDataset (numpy over the mmap), returns.

Usage (the e2e venv has torch and numpy; DeepSpec needs nothing else for this module):
  git clone https://github.com/deepseek-ai/DeepSpec DIR && git -C DIR checkout afdfa7c
  PYTHONPATH=DIR .venvs/e2e/bin/python tests/data/deepspec_v2/make_fixture.py tests/data/deepspec_v2

Writes, below OUT:
  cache/manifest.json, cache/samples.idx, cache/shard-0000{0,1,2}.bin
      four samples over two "ranks": rank 0 writes samples 0 and 1 into one shard (so sample
      1's int32 ids start at an offset that is not a multiple of 4), rank 1 writes samples 2
      and 3 with a 1-byte shard limit, one shard each.
  expected/sample_{i}.safetensors
      CacheDataset[i]: input_ids I32 [T], loss_mask U8 [T], target_hidden_states BF16
      [T, 3*8], target_last_hidden_states BF16 [T, 8]
  conversations.jsonl  one conversation per sample, conversation_id = sample_id
"""
import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file

from deepspec.data.target_cache_dataset import (
    CacheDataset,
    LocalCacheWriteSummary,
    atomic_json_dump,
    build_global_target_cache_shard_map,
    build_target_cache_manifest,
    cleanup_target_cache_tmp_dir,
    finalize_target_cache_index,
    load_local_cache_write_summary,
    prepare_target_cache_output_dir,
    rename_local_target_cache_shards,
    write_target_cache_manifest,
    LocalTargetCacheWriter,
)

out = sys.argv[1]
cache = os.path.join(out, "cache")
LAYERS, H, V = [1, 2, 3], 8, 32  # three aux layers; the tests' base has H 8, vocabulary 32
if os.path.exists(cache):
    shutil.rmtree(cache)
prepare_target_cache_output_dir(cache)

gen = torch.Generator().manual_seed(40)
ranks = [(0, [5, 3], 1 << 20), (1, [7, 2], 1)]  # (rank, seq lens, max_shard_bytes)
start = 0
for rank, lens, max_bytes in ranks:
    rank_dir = os.path.join(cache, "_tmp", "rank_%d" % rank)
    os.makedirs(rank_dir, exist_ok=True)
    w = LocalTargetCacheWriter(rank_dir=rank_dir, max_shard_bytes=max_bytes)
    for local, t in enumerate(lens):
        hs = torch.randn(t, len(LAYERS) * H, generator=gen)
        last = torch.randn(t, H, generator=gen)
        loss = (torch.arange(t) >= t // 2).to(torch.uint8)  # the answer's tokens
        w.write_sample(sample_id=local,
                       input_ids=torch.randint(0, V, (t,), generator=gen, dtype=torch.int64),
                       attention_mask=torch.ones(t, dtype=torch.int64), loss_mask=loss,
                       target_hidden_states=hs, target_last_hidden_states=last)
    w.close()
    atomic_json_dump(LocalCacheWriteSummary(global_rank=rank, source_sample_start=start,
                                            source_sample_end=start + len(lens),
                                            num_local_samples=w.num_local_samples,
                                            num_local_shards=len(w.local_shard_files),
                                            local_shard_files=list(w.local_shard_files)).to_json(),
                     os.path.join(rank_dir, "summary.json"))
    start += len(lens)

summaries = [load_local_cache_write_summary(os.path.join(cache, "_tmp", "rank_%d" % r)) for r, _, _ in ranks]
shard_map, shards = build_global_target_cache_shard_map(summaries)
for s in summaries:
    rename_local_target_cache_shards(output_dir=cache, rank_dir=os.path.join(cache, "_tmp", "rank_%d" % s["global_rank"]),
                                     summary=s, shard_map=shard_map)
n = finalize_target_cache_index(output_dir=cache, summaries=summaries, shard_map=shard_map)
write_target_cache_manifest(output_dir=cache, manifest=build_target_cache_manifest(
    num_samples=n, shards=shards, target_layer_ids=LAYERS, hidden_size=H,
    extra_fields={"target_model_name_or_path": "eaglekit-tests/tiny-base", "max_length": 16, "min_loss_tokens": 1,
                  "chat_template": "qwen", "source_jsonl_paths": ["conversations.jsonl"]}))
cleanup_target_cache_tmp_dir(cache)

os.makedirs(os.path.join(out, "expected"), exist_ok=True)
ds = CacheDataset(cache)
with open(os.path.join(out, "conversations.jsonl"), "w") as f:
    for i in range(len(ds)):
        item = ds[i]
        save_file({k: v.contiguous() for k, v in item.items()}, os.path.join(out, "expected", "sample_%d.safetensors" % i))
        f.write(json.dumps({"conversation_id": str(i), "conversations": [{"role": "user", "content": "q%d" % i}]}) + "\n")
        print(i, {k: (str(v.dtype), list(v.shape)) for k, v in item.items()})
ds.close()
print(sorted(os.listdir(cache)))
