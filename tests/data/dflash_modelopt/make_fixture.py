#!/usr/bin/env python3
"""Writes fixture.safetensors: a tiny DFlash draft, a batch, anchors, and what NVIDIA ModelOpt
0.47's own code computes from them (DFlashModule from modeling_dflash.py; the noise
embedding, positions, attention mask and loss of HFDFlashModel in hf_dflash.py, called as
unbound methods on a stand-in holding the attributes they read). tests/trainer/test_dflash.cpp
runs eaglekit's DFlash unroll on the same inputs and compares.

Run with the e2e venv (nvidia-modelopt 0.47.0, transformers, torch; scripts/requirements-e2e.txt):
  .venvs/e2e/bin/python tests/data/dflash_modelopt/make_fixture.py tests/data/dflash_modelopt

Tensors (float32 unless said):
  w.NAME                the draft's weights under ModelOpt's export names (fc.weight, ...)
  embed_tokens, lm_head the base's [V, H]
  input_ids [B, L] int64, loss_mask [B, L], hidden_states [B, L, H] (post-norm),
  aux_hidden_states [B, L, k*H]
  anchors [B, N] int64, keep [B, N] uint8
  CASE.loss [1], CASE.acc [1], CASE.g.NAME   for CASE in dpace (ModelOpt's default: D-PACE,
                        alpha 0.5, self-logit distillation), decay (gamma 4, distillation),
                        ce (decay gamma 4, no distillation: cross-entropy of the dumped token)
  causal.loss [1]       the dpace case with the block made causal (ModelOpt's
                        dflash_draft_attention="causal"): a must-fail for the mask
Metadata: the config as JSON.
"""
import json
import os
import sys
import types

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from modelopt.torch.speculative.plugins.hf_dflash import HFDFlashModel
from modelopt.torch.speculative.plugins.modeling_dflash import DFlashModule

H, HEADS, KV, HD, I, V, LAYERS, K, BLOCK, MASK = 32, 4, 2, 8, 48, 40, 2, 3, 4, 39
B, L = 2, 20


def main(out):
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HD,
                      intermediate_size=I, vocab_size=V, num_hidden_layers=LAYERS, rms_norm_eps=1e-6,
                      rope_theta=10000.0, max_position_embeddings=256, hidden_act="silu",
                      attention_bias=False)
    cfg._attn_implementation = "sdpa"
    cfg.block_size = BLOCK
    cfg.target_layer_ids = [1, 3, 5]
    module = DFlashModule(cfg).float()
    # ModelOpt 0.47 builds its rotary embedding lazily as Qwen3RotaryEmbedding(config, device=...),
    # a keyword the pinned transformers no longer takes: build the same class here first.
    module.rotary_emb = Qwen3RotaryEmbedding(config=cfg)
    with torch.no_grad():  # norms away from 1, so a norm left out shows
        for name, p in module.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    embed = torch.nn.Embedding(V, H)
    with torch.no_grad():
        embed.weight.normal_()
    lm_head = torch.randn(V, H)

    input_ids = torch.randint(0, V - 1, (B, L))
    loss_mask = torch.ones(B, L)
    loss_mask[:, :3] = 0           # the prompt
    loss_mask[1, 15:] = 0          # row 1 is padding from 15 on
    input_ids[1, 15:] = 0
    hidden = torch.randn(B, L, H)
    aux = torch.randn(B, L, K * H)
    # Anchors as HFDFlashModel samples them: inside the loss mask, p <= L - BLOCK, ascending,
    # unused columns 0 with keep False. Row 1's last anchor (14) has slots past its mask.
    anchors = torch.tensor([[3, 7, 8, 16], [4, 11, 14, 0]])
    keep = torch.tensor([[True, True, True, True], [True, True, True, False]])

    def run(objective, gamma, distill, attention="bidirectional"):
        stand_in = types.SimpleNamespace(
            dflash_block_size=BLOCK, mask_token_id=MASK, _base_model_embeddings=embed,
            dflash_draft_attention=attention, dflash_loss_objective=objective, dflash_dpace_alpha=0.5,
            dflash_loss_decay_factor=gamma)
        module.zero_grad()
        n_blocks = anchors.shape[1]
        noise = HFDFlashModel._build_noise_embedding(stand_in, input_ids, anchors, keep, n_blocks)
        pos = HFDFlashModel._build_position_ids(stand_in, L, anchors, input_ids.device)
        mask = HFDFlashModel._build_draft_attention_mask(stand_in, L, anchors, keep, n_blocks, torch.float32,
                                                         input_ids.device, window=None)
        out = module(noise_embedding=noise, target_hidden=aux, position_ids=pos, attention_mask=mask)
        logits = out @ lm_head.t()
        base_logits = hidden @ lm_head.t() if distill else None
        loss, acc = HFDFlashModel._compute_loss(stand_in, logits, input_ids, anchors, keep, loss_mask, base_logits)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in module.named_parameters()}
        return loss.detach().reshape(1), torch.tensor([acc]), grads

    tensors = {f"w.{n}": p.detach().clone() for n, p in module.named_parameters()}
    tensors.update(embed_tokens=embed.weight.detach().clone(), lm_head=lm_head, input_ids=input_ids,
                   loss_mask=loss_mask, hidden_states=hidden, aux_hidden_states=aux, anchors=anchors,
                   keep=keep.to(torch.uint8))
    for case, args in {"dpace": ("dpace", 0.0, True), "decay": ("decay", 4.0, True),
                       "ce": ("decay", 4.0, False)}.items():
        loss, acc, grads = run(*args)
        tensors[f"{case}.loss"] = loss
        tensors[f"{case}.acc"] = acc
        for n, g in grads.items():
            tensors[f"{case}.g.{n}"] = g
    tensors["causal.loss"] = run("dpace", 0.0, True, attention="causal")[0]
    meta = {"config": json.dumps({"hidden_size": H, "num_attention_heads": HEADS, "num_key_value_heads": KV,
                                  "head_dim": HD, "intermediate_size": I, "vocab_size": V,
                                  "num_hidden_layers": LAYERS, "num_aux_layers": K, "block_size": BLOCK,
                                  "mask_token_id": MASK, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                                  "target_layer_ids": [1, 3, 5]}),
            "made_by": "tests/data/dflash_modelopt/make_fixture.py with nvidia-modelopt 0.47.0"}
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "fixture.safetensors"), metadata=meta)
    for case in ("dpace", "decay", "ce", "causal"):
        print(case, float(tensors[f"{case}.loss"]))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
