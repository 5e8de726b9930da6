"""`memzoo generate`: text from a trained model, by transformers' `generate()`.

The model is what `memzoo train` wrote (a HybridLM run, or a Hugging Face model with memories attached:
`--from ... --attach ...`), a bench LM, or a `save_pretrained` directory with its tokenizer named
(:func:`memzoo.inspection.load_any`). `generate()` carries the memories' state on its cache, so each new
token is read with every memory holding what the prompt and the tokens before it wrote
(tests/test_generate.py, tests/test_attach.py). Memories whose fast weights outlive a sequence (FwPKM,
FwMLP) start from their trained fast weights.
"""

from __future__ import annotations


def generate_text(model, tokenizer: str, prompt: str, max_new_tokens: int = 64,
                  temperature: float = 0.0, top_k: int | None = None, seed: int = 0) -> str:
    """The continuation of `prompt` (the new text only): greedy at `temperature` 0, else sampled from the
    softmax at that temperature (over the `top_k` likeliest tokens, when given), seeded."""
    import torch

    from memzoo.data import get_tokenizer

    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {temperature}")
    tok = get_tokenizer(tokenizer)
    ids = tok.encode(prompt)
    if not ids:
        raise ValueError("the prompt is empty after tokenization: give some text with --prompt")
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    sample = temperature > 0
    kw = {"do_sample": True, "temperature": temperature, "top_k": top_k} if sample else {"do_sample": False}
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.eval().generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                    pad_token_id=tok.eos_id, **kw)
    return tok.decode(out[0, len(ids):].tolist())


def cmd_generate(args) -> int:
    from memzoo.inspection import load_any

    model, tokenizer, _ = load_any(args.model, args.tokenizer)
    print(generate_text(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed))
    return 0


def arguments(g) -> None:
    g.add_argument("model", help="a trained model: a `memzoo train` out dir (a HybridLM run, or memories attached "
                                 "with --from/--attach), its ckpt.pt, a bench LM dir, or a save_pretrained dir")
    g.add_argument("--prompt", required=True, help="the text to continue")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sample at it")
    g.add_argument("--top-k", type=int, default=None, help="when sampling: only the k likeliest tokens")
    g.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
    g.add_argument("--tokenizer", help="the tokenizer (byte, mistral, or a tokenizer directory); default: the one "
                                       "the model was trained with (a save_pretrained dir has none recorded)")
