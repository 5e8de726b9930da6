"""Does the attach preset's Llama learn to copy a passage it can see? (issue 81's measured example)
Finding: docs/journal/ppl.md, "the attach preset's Llama does not copy".

Continues a pretrained host (the attach preset's, `<work_dir>/lm/host-<hash>/hf`) or a fresh one ("fresh") on the
preset's recipe with half the windows read twice (memzoo.data.RepeatMix), AdamW at `lr` with 50 warmup steps and a
cosine to a tenth, batch 16 x 256 bytes, and every 250 steps reads 16 sonnets (held out of training) of 128 bytes
twice in one sequence: the loss of the first reading, of the second, and the gain. An LM that copies predicts the
second reading far better (the standard preset's attention control does: docs/journal/ppl.md).

    python -m research.attach_copy runs/bench/attach/lm/host-<hash>/hf 3000 3e-3
"""

from __future__ import annotations

import math
import sys
import time

import torch
import torch.nn.functional as F


def main(src: str, steps: int, lr0: float) -> None:
    import transformers as tf

    from memzoo.config import ModelConfig, RunConfig, TrainConfig
    from memzoo.data import get_tokenizer, load_corpus, tokenize_corpus
    from memzoo.train import prepare_data

    torch.manual_seed(0)
    torch.set_num_threads(1)
    if src == "fresh":
        m = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=257,
                                               max_position_embeddings=512))
    else:
        m = tf.AutoModelForCausalLM.from_pretrained(src)
    tc = TrainConfig.from_dict({"corpus": "shakespeare", "tokenizer": "byte", "seq_len": 256, "batch_size": 16,
                                "steps": steps, "seed": 0})
    stream, _, _ = prepare_data(RunConfig(ModelConfig.from_dict({"vocab_size": 257}), tc), leave_out=("Sonnets",),
                                repeat_mix=0.5)
    docs = [d[:128] for d in tokenize_corpus(load_corpus("sonnets"), get_tokenizer("byte")) if d.numel() > 129][:16]

    def readings() -> tuple[float, float]:
        m.eval()
        a = b = 0.0
        with torch.no_grad():
            for p in docs:
                x = torch.cat([p, p])[None]
                ce = F.cross_entropy(m(input_ids=x).logits[0, :-1], x[0, 1:], reduction="none")
                a, b = a + ce[:127].mean().item(), b + ce[128:].mean().item()
        m.train()
        return a / len(docs), b / len(docs)

    opt = torch.optim.AdamW(m.parameters(), lr=lr0, weight_decay=0.1, betas=(0.9, 0.95))
    t0 = time.time()
    for i in range(steps + 1):
        if i % 250 == 0:
            first, second = readings()
            print(f"step {i} first {first:.3f} second {second:.3f} gain {first - second:+.3f} ({time.time() - t0:.0f}s)",
                  flush=True)
        if i == steps:
            break
        for g in opt.param_groups:
            g["lr"] = lr0 * min(1.0, (i + 1) / 50) * (0.1 + 0.45 * (1 + math.cos(math.pi * i / steps)))
        x, y = stream.batch(1500 + i, 16)  # the batches after the preset's pretraining
        loss = F.cross_entropy(m(input_ids=x).logits.flatten(0, 1), y.flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
