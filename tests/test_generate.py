"""generate() through transformers' GenerationMixin: the prompt, then one token per call, with the
backbone's cache and the memories' fast weights carried, gives the logits of one forward over the
generated sequence (fla's test of its models), for every registered layer (plugins included).

The prompt (7 tokens) ends inside a chunk of the chunk-level memories (chunk 8 in their test
options): the decoding steps then complete that chunk one token at a time, which is exact only
because generation streams with ``stream=True`` (MemoryLayer.hold). Shared persistent memories
(FwPKM, FwMLP) are put back to their pre-generation fast weights before the reference forward.
"""

from __future__ import annotations

import pytest
import torch

from memzoo.backbone import HybridLM
from memzoo.registry import layer_names
from tests.conftest import TINY_LM, layer_options

PROMPT, NEW = 7, 9


def tiny_lm(layer: str | None) -> HybridLM:
    torch.manual_seed(0)
    layout = "GDN+SWA" + (f" | {layer}@1" if layer else "")
    memory = {layer: layer_options(layer)} if layer else {}
    return HybridLM.from_layout(layout, **{**TINY_LM, "n_layers": 2}, memory=memory).double().eval()


@pytest.mark.parametrize("layer", [None, *layer_names()])
def test_generate_matches_one_forward(layer):
    model = tiny_lm(layer)
    prompt = torch.randint(1, TINY_LM["vocab_size"], (2, PROMPT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model.memory_state()
        out = model.generate(prompt, max_new_tokens=NEW, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        model.load_memory_state(before)
        full = model(out.sequences).logits
    assert out.sequences.shape == (2, PROMPT + NEW)
    # (generate hands its logits out in fp32)
    torch.testing.assert_close(torch.stack(out.logits, 1), full[:, PROMPT - 1 : -1].float(), rtol=1e-6, atol=1e-6)


def test_padding_is_refused():
    model = tiny_lm("fwpkm")
    ids = torch.randint(1, 50, (2, 5))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    with pytest.raises(ValueError, match="padding"):
        model(ids, attention_mask=mask)
    with pytest.raises(ValueError, match="padding"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0)
    model(ids, attention_mask=torch.ones_like(ids))  # all ones: fine


def test_unknown_keyword_arguments_are_errors():
    model = tiny_lm(None)
    ids = torch.randint(1, 50, (1, 5))
    with pytest.raises(TypeError, match="position_idz"):
        model(ids, position_idz=ids)
    with pytest.raises(ValueError, match="position_idz"):
        model.generate(ids, max_new_tokens=2, pad_token_id=0, position_idz=ids)
