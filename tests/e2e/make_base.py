#!/usr/bin/env python3
"""Makes the end-to-end check's base model: a small Llama with its own tokenizer, trained on the
CPU on a seeded synthetic language until its greedy continuations follow that language.

Usage: make_base.py OUT [--steps N] [--seed S]

OUT receives an HF model folder (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a chat template, generation_config.json) that transformers and vLLM
load, plus language.json (the generator's tables, so make_data.py draws prompts from the same
language) and train_log.json (loss per logged step, seconds).

The language: 4 topics; each conversation opens with its topic's name, then walks a
second-order Markov chain whose successor distribution depends on (topic, previous word,
word). Greedy continuation therefore depends on the context (not constant) and is a
deterministic function of it (not noise). Everything comes from --seed: no download.
"""
import argparse
import json
import math
import os
import random
import sys
import time

import torch

N_WORDS = 400
N_TOPICS = 4
SUCCESSORS = 4
SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


def build_language(seed):
    rng = random.Random(seed)
    words = set()
    while len(words) < N_WORDS:
        words.add("".join(rng.choice(SYLLABLES) for _ in range(rng.choice([1, 2, 2, 3]))))
    words = sorted(words)
    topics = [f"topic{t}" for t in range(N_TOPICS)]
    # Each word's successor set is shared by the topics; the weights depend on (topic, prev, word),
    # drawn lazily from a hash so the table is implicit.
    succ = {w: rng.sample(range(N_WORDS), SUCCESSORS) for w in range(N_WORDS)}
    return {"seed": seed, "words": words, "topics": topics,
            "successors": [succ[w] for w in range(N_WORDS)]}


def weights(lang, topic, prev, word):
    r = random.Random(hash((lang["seed"], topic, prev, word)) & 0xFFFFFFFF)
    w = [r.random() ** 3 for _ in range(SUCCESSORS)]  # peaked: one successor usually dominates
    s = sum(w)
    return [x / s for x in w]


def walk(lang, rng, topic, length):
    """A topic's walk of `length` words, as word indices."""
    out = [rng.randrange(N_WORDS)]
    prev = -1
    while len(out) < length:
        cur = out[-1]
        nxt = rng.choices(lang["successors"][cur], weights(lang, topic, prev, cur))[0]
        prev = cur
        out.append(nxt)
    return out


def sample_text(lang, rng, prompt_words, answer_words):
    topic = rng.randrange(N_TOPICS)
    seq = walk(lang, rng, topic, prompt_words + answer_words)
    w = lang["words"]
    prompt = lang["topics"][topic] + " " + " ".join(w[i] for i in seq[:prompt_words])
    answer = " ".join(w[i] for i in seq[prompt_words:])
    return prompt, answer


CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}<|end|>"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_tokenizer(lang, rng, out):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    specials = ["<pad>", "<s>", "<|end|>", "<|user|>", "<|assistant|>"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    corpus = [" ".join(sample_text(lang, rng, 12, 36)) for _ in range(3000)]
    # 640 merges' worth: most words become one token, the long ones two or three.
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=640, special_tokens=specials,
                                                        show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|end|>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)
    lang = build_language(args.seed)
    rng = random.Random(args.seed + 1)
    tok = build_tokenizer(lang, rng, args.out)

    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    batch, warmup = 16, 20
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    log, t0 = [], time.time()
    for step in range(args.steps):
        ids = []
        for _ in range(batch):
            p, a = sample_text(lang, rng, rng.randint(6, 12), rng.randint(16, 32))
            ids.append(tok.apply_chat_template([{"role": "user", "content": p},
                                                {"role": "assistant", "content": a}], tokenize=True,
                                               return_dict=False))
        n = max(len(x) for x in ids)
        x = torch.full((batch, n), tok.pad_token_id)
        labels = torch.full((batch, n), -100)
        att = torch.zeros((batch, n), dtype=torch.long)
        for i, s in enumerate(ids):
            x[i, :len(s)] = torch.tensor(s)
            labels[i, :len(s)] = torch.tensor(s)
            att[i, :len(s)] = 1
        loss = model(input_ids=x, attention_mask=att, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 25 == 0 or step == args.steps - 1:
            log.append({"step": step, "loss": round(loss.item(), 4), "seconds": round(time.time() - t0, 1)})
            if sys.stderr.isatty() or os.environ.get("EAGLEKIT_PROGRESS_EVERY"):
                print(f"make_base: step {step} loss {loss.item():.3f} ({time.time() - t0:.0f} s)",
                      file=sys.stderr)
    model.eval()
    model.save_pretrained(args.out, safe_serialization=True)
    with open(os.path.join(args.out, "language.json"), "w") as f:
        json.dump(lang, f)
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump({"steps": args.steps, "batch": batch, "log": log, "seconds": round(time.time() - t0, 1)}, f)
    print(f"make_base: {args.out}: {sum(p.numel() for p in model.parameters())/1e6:.2f} M parameters, "
          f"final loss {log[-1]['loss']}, {time.time() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
