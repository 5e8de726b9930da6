"""lm-evaluation-harness for memzoo models: the registered model ``memzoo`` (an ``HFLM`` subclass,
as flash-linear-attention's evals/harness.py), and lm_eval's own command line with it registered
(``pip install 'memzoo[eval]'``):

    python -m memzoo.harness --model memzoo --model_args pretrained=runs/tiny-gdn-fwpkm --tasks wikitext
    python -m memzoo.harness --model memzoo --model_args pretrained=runs/x,device=cuda --tasks lambada_openai

(``lm_eval`` itself cannot load a model it does not ship: this is that command with ``memzoo``
registered. From Python, ``import memzoo.harness`` then ``lm_eval.simple_evaluate(model="memzoo",
...)``.) ``pretrained`` is what ``memzoo train`` wrote (its out dir or ``ckpt.pt``), a bench LM dir,
or a ``save_pretrained`` dir (then give ``tokenizer=``, a memzoo tokenizer name: byte, mistral, or a
local Hugging Face tokenizer); the tokenizer the model was trained with is used otherwise. A Hugging Face
model with memories attached (``memzoo train --from ... --attach ...``'s out dir) loads through
``memzoo.attach.from_pretrained`` and reads perplexity tasks with lm_eval's own rolling windows.

What differs from a Hugging Face model, and why:

- Memories whose fast weights persist across sequences (FwPKM, FwMLP as the paper trains them)
  start every request from the trained fast weights: one request never reads another's writes.
- ``loglikelihood_rolling`` (perplexity tasks) reads a document as the PPL suite does (FwPKM Sec.
  4.2): consecutive windows of ``max_length`` tokens, batch 1, the backbone starting each window
  empty and every memory's fast weights carried from the document's earlier windows.
- Batch size 1: the backbone's recurrent state and the memories would absorb pad tokens, so
  requests are never padded together (the model refuses padding).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizer

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ImportError as e:  # an extra: the rest of memzoo does not need it
    raise ImportError("memzoo.harness needs lm-evaluation-harness: pip install 'memzoo[eval]'") from e

from memzoo.backbone.model import HybridLM
from memzoo.data import get_tokenizer
from memzoo.inspection import load_any as load


class MemzooTokenizer(PreTrainedTokenizer):
    """A memzoo tokenizer (memzoo.data.tokenizers) behind Hugging Face's tokenizer interface, for
    lm-eval: tokens are the ids' decimal strings, EOS is the end-of-text token; no BOS."""

    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, name: str, **kwargs):
        self.inner = get_tokenizer(name)
        eos = str(self.inner.eos_id)
        super().__init__(eos_token=eos, pad_token=eos, name_or_path=name, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def get_vocab(self) -> dict[str, int]:
        return {str(i): i for i in range(self.inner.vocab_size)}

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return [str(i) for i in self.inner.encode(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return int(token)

    def _convert_id_to_token(self, index: int) -> str:
        return str(index)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self.inner.decode([int(t) for t in tokens])

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple:
        return ()


@register_model("memzoo")
class MemzooLM(HFLM):
    """``lm_eval --model memzoo``: a memzoo HybridLM, or a Hugging Face model with memories attached (see the
    module docstring)."""

    def __init__(self, pretrained: str | HybridLM, tokenizer: str | None = None, device: str = "auto",
                 max_length: int | None = None, batch_size: int | str = 1, **kwargs):
        from memzoo.train import resolve_device

        device = resolve_device(device or "auto")  # a clear error for an absent device
        if str(batch_size) != "1":
            raise ValueError("memzoo models evaluate with batch_size 1 (no padding: the recurrent state and the "
                             "memories would absorb pad tokens)")
        if isinstance(pretrained, HybridLM):
            model, seq_len = pretrained, None
            if tokenizer is None:
                raise ValueError("a HybridLM instance needs tokenizer=<memzoo tokenizer name>")
        else:
            model, tokenizer, seq_len = load(pretrained, tokenizer)
        super().__init__(pretrained=model.to(device).eval(), tokenizer=MemzooTokenizer(tokenizer), backend="causal",
                         max_length=max_length or seq_len or 4096, batch_size=1, **kwargs)
        self._trained = self._memory_state()  # every request starts from these

    def _memory_state(self) -> list:
        from memzoo import attach

        m = self.model
        return m.memory_state(persistent_only=True) if isinstance(m, HybridLM) else attach.memory_state(m, True)

    def _fresh(self) -> None:
        from memzoo import attach

        m = self.model
        m.load_memory_state(self._trained) if isinstance(m, HybridLM) else attach.load_memory_state(m, self._trained)

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        self._fresh()
        return super()._model_call(inps, attn_mask, labels)

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        self._fresh()
        return super()._model_generate(context, max_length, stop, **generation_kwargs)

    @torch.no_grad()
    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document: the prefix token, then its tokens, in windows of max_length read in
        order with the memories carried (keep_memory) and the backbone starting each window empty,
        every token after the prefix scored once (the PPL suite's carried reading)."""
        from tqdm.auto import tqdm

        if not isinstance(self.model, HybridLM):  # an attached model: lm_eval's rolling windows, each from fresh memories
            return super().loglikelihood_rolling(requests, disable_tqdm)
        out, L = [], self.max_length
        for req in tqdm(requests, disable=disable_tqdm or self.rank != 0, desc="loglikelihood_rolling"):
            (text,) = req.args
            ids = torch.tensor([self.prefix_token_id, *self.tok_encode(text, add_special_tokens=False)],
                               device=self.device)
            self._fresh()
            total = 0.0
            for s in range(0, ids.numel() - 1, L):
                x, y = ids[s : s + L], ids[s + 1 : s + L + 1]
                x = x[: y.numel()]
                with torch.autocast(self.device.type, self.mixed_precision_dtype or torch.float32,
                                    enabled=self.mixed_precision_dtype is not None):
                    logits = self.model(x[None], keep_memory=s > 0).logits[0]
                total -= F.cross_entropy(logits.float(), y, reduction="sum").item()
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return out


def main() -> None:
    """lm_eval's command line, with the ``memzoo`` model registered (and ``--device`` defaulting to
    the CPU where CUDA is absent, where lm_eval's own default is cuda:0)."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    if not any(a == "--device" or a.startswith("--device=") for a in sys.argv) and not torch.cuda.is_available():
        sys.argv += ["--device", "cpu"]
    try:
        cli_evaluate()
    except (ValueError, KeyError, OSError) as e:  # a wrong path, task or argument: one line (MEMZOO_DEBUG: the traceback)
        if "MEMZOO_DEBUG" in os.environ:
            raise
        print(f"memzoo.harness: error: {' '.join(str(e).split())}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
