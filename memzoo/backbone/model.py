"""HybridLM: one backbone for every layout, as a Hugging Face causal LM.

Block i (pre-norm residual, Qwen3-Next style; Sec. 4.1 of the FwPKM paper):

    h = h + Mixer_i(RMSNorm(h))                 GDN, SWA or FA (the layout's A+B at 3:1); NONE: no mixer
    h = h + Mem(RMSNorm(h))   for each memory   inserted between the mixer and the FFN
    h = h + FFN_i(RMSNorm(h))                   SwiGLU, or PKM where the layout puts one

Embeddings are tied to the output head (this is what reproduces Table 2's parameter counts):
`output_head(h) = E · RMSNorm(h)`.

Where a memory sits in its block is its `site` (memzoo.layers.base.SITES): "after_mixer",
between the mixer and the FFN (the default); "before_mixer" (the FwPKM release); "ffn", in
place of the block's FFN (PKM); "after_ffn", on the block's output (FWL "on top of the last
layer"). What a memory is handed besides its input:

- `needs_targets`: `targets=` the next-token targets (targets[b, t] = input_ids[b, t+1],
  -100 = ignore; None when the caller gives none, e.g. generation).
- `needs_head` (FWL): `head=` a callable y [B, T, D] -> logits [B, T, V], the LM logits if
  the layer's output y is added to the residual at its place: `output_head(h + y)`. Everything
  after such a layer must be position-wise, so it must sit "after_ffn" in the last block
  and be the last memory there (checked when the model is built). A layer uses it to
  differentiate each position's own LM loss (e.g. FWL's per-position gradients, Eq. 2).

Streaming and memory: a call with `cache=None` starts new sequences: per-sequence memory
layers are reset, shared persistent ones (FwPKM as in the paper) keep their fast weights
but detach them from the previous step's graph. A call with the `cache` returned by the
previous call (use_cache=True) continues the same sequences: exactly for splits on the
memories' chunk boundaries, and at any split with `stream=True` (chunk-level memories then
hold a partial chunk back until later calls complete it: MemoryLayer.hold). `generate()`
(transformers' GenerationMixin) streams so: the prompt, then one token per call, gives the
logits of one forward over the whole (tests/test_generate.py).

Padding: the GDN state and the memories' fast weights would absorb pad tokens, so an
`attention_mask` with zeros is refused (batch prompts of one length, or one at a time).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.utils import ModelOutput

from memzoo.backbone.attention import GatedAttention
from memzoo.backbone.ffn import SwiGLU
from memzoo.modules.norm import RMSNorm
from memzoo.backbone.gdn import GDNMixer
from memzoo.layout import parse_layout
from memzoo.config import ModelConfig
from memzoo.layers.base import SITES, MemoryLayer
from memzoo.registry import build_layer


class MemzooConfig(PretrainedConfig):
    """Hugging Face config: the fields of `memzoo.config.ModelConfig`, flat."""

    model_type = "memzoo"

    def __init__(self, **kwargs):
        fields = ModelConfig.__dataclass_fields__
        own = {k: kwargs.pop(k) for k in list(kwargs) if k in fields}
        mc = ModelConfig.from_dict(own)
        for k, v in mc.to_dict().items():
            setattr(self, k, v)
        kwargs.setdefault("tie_word_embeddings", True)
        super().__init__(**kwargs)

    def to_model_config(self) -> ModelConfig:
        return ModelConfig.from_dict({k: getattr(self, k) for k in ModelConfig.__dataclass_fields__})

    @classmethod
    def from_model_config(cls, mc: ModelConfig) -> "MemzooConfig":
        return cls(**mc.to_dict())


class NoMixer(nn.Module):
    """Mixes nothing: a block of "NONE" is its FFN (and memories) alone. A backbone of them sees
    each token by itself, the toys' negative control."""

    def forward(self, x: Tensor, cache: dict | None = None) -> tuple[Tensor, dict]:
        return torch.zeros_like(x), {}


def build_mixer(kind: str, c: ModelConfig) -> nn.Module:
    if kind == "NONE":
        return NoMixer()
    if kind == "GDN":
        return GDNMixer(c.d_model, c.gdn_heads, c.gdn_head_dim, c.gdn_conv, c.gdn_chunk, c.norm_eps)
    window = {"FA": None, "SWA": c.window, "FA-pSWA": c.window}[kind]
    p = c.p_window if kind == "FA-pSWA" else 1.0
    return GatedAttention(
        c.d_model, c.attn_heads, c.attn_kv_heads, c.attn_head_dim, window, p, c.rope_theta, c.norm_eps, c.attn_conv
    )


class Block(nn.Module):
    def __init__(self, c: ModelConfig, kind: str, memory_names: list[str]):
        super().__init__()
        self.kind = kind
        self.mixer_norm = RMSNorm(c.d_model, c.norm_eps)
        self.mixer = build_mixer(kind, c)
        mems = [build_layer(n, c.d_model, **c.memory.get(n, {})) for n in memory_names]
        for m in mems:
            if m.site not in SITES:
                raise ValueError(f"memory layer {m.name!r} has site {m.site!r}; expected one of {', '.join(SITES)}")
        ffn_mem = [m for m in mems if m.site == "ffn"]
        self.mems = nn.ModuleList([m for m in mems if m.site != "ffn"])
        self.mem_norms = nn.ModuleList(
            [RMSNorm(c.d_model, c.norm_eps) if m.prenorm else nn.Identity() for m in self.mems]
        )
        self.ffn_norm = RMSNorm(c.d_model, c.norm_eps)
        self.ffn = ffn_mem[0] if ffn_mem else SwiGLU(c.d_model, c.ffn_dim)

    def memories(self) -> list[MemoryLayer]:
        return [*self.mems, *([self.ffn] if isinstance(self.ffn, MemoryLayer) else [])]

    def _memories(self, h: Tensor, targets: Tensor | None, site: str, head=None) -> Tensor:
        for norm, mem in zip(self.mem_norms, self.mems):
            if mem.site != site:
                continue
            x = norm(h) if mem.prenorm else h
            kw = {"targets": targets} if mem.needs_targets else {}
            if mem.needs_head:
                kw["head"] = lambda y, h=h: head(h + y)  # the LM logits with y added here
            h = h + mem(x, **kw)
        return h

    def forward(self, h: Tensor, cache: dict | None, targets: Tensor | None, head=None) -> tuple[Tensor, dict]:
        """`head` (h -> logits) is given to the last block only: it feeds `needs_head` memories."""
        h = self._memories(h, targets, "before_mixer")
        y, cache = self.mixer(self.mixer_norm(h), cache)
        h = self._memories(h + y, targets, "after_mixer")
        h = h + self.ffn(self.ffn_norm(h))
        return self._memories(h, targets, "after_ffn", head), cache


@dataclass
class MemzooOutput(ModelOutput):
    loss: Tensor | None = None  # LM loss + the memories' auxiliary losses
    logits: Tensor | None = None
    cache: list | None = None
    aux_loss: Tensor | None = None  # the auxiliary part of `loss`


class HybridLM(PreTrainedModel, GenerationMixin):
    config_class = MemzooConfig
    base_model_prefix = "memzoo"
    main_input_name = "input_ids"
    _supports_cache_class = False

    def __init__(self, config: MemzooConfig | ModelConfig):
        if isinstance(config, ModelConfig):
            config = MemzooConfig.from_model_config(config)
        super().__init__(config)
        c = config.to_model_config()
        self.layout = parse_layout(c.layout, c.n_layers)
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        self.blocks = nn.ModuleList(
            [Block(c, kind, self.layout.memories_at(i)) for i, kind in enumerate(self.layout.mixers)]
        )
        self.norm = RMSNorm(c.d_model, c.norm_eps)
        nn.init.normal_(self.embed.weight, std=0.02)
        self._check_head_users()
        self.post_init()

    def _check_head_users(self) -> None:
        """A `needs_head` memory must have only position-wise work between it and the logits."""
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            top = [m for m in block.mems if m.site == "after_ffn"]
            for m in block.mems:
                if m.needs_head and (i != last or not top or top[-1] is not m):
                    where = f"layer {i}" if i != last else "a place followed by other memories"
                    raise ValueError(
                        f"memory layer {m.name!r} reads the LM head, so it must sit on top of the last block "
                        f"(the last memory there), but the layout puts it at {where}; write "
                        f"'{m.name}' or '{m.name}@last' and no other memory after it on that layer"
                    )

    @classmethod
    def from_layout(cls, layout: str, **overrides) -> "HybridLM":
        """`HybridLM.from_layout("GDN+SWA | FwPKM@2,6,10", d_model=256, n_layers=4, ...)`."""
        return cls(ModelConfig.from_dict({"layout": layout, **overrides}))

    def _init_weights(self, module):
        # every module initialises itself in __init__; weights loaded by from_pretrained overwrite it
        pass

    def get_input_embeddings(self):
        return self.embed

    def set_input_embeddings(self, value):
        self.embed = value

    def memories(self) -> list[MemoryLayer]:
        return [m for b in self.blocks for m in b.memories()]

    def output_head(self, h: Tensor) -> Tensor:
        """Logits from the last residual stream: final RMSNorm, then the tied embedding."""
        return F.linear(self.norm(h), self.embed.weight)

    def memory_state(self, persistent_only: bool = False) -> list[dict | None]:
        """A copy of every memory layer's fast weights, in `memories()` order. With
        `persistent_only`, None for per-sequence layers: only what outlives a sequence."""
        return [
            None if persistent_only and m.per_sequence else {k: v.clone() for k, v in m.state.items()}
            for m in self.memories()
        ]

    def load_memory_state(self, states: list[dict | None]) -> None:
        """Put back a `memory_state()`; a layer whose entry is None goes back to its initial
        fast weights (a new sequence starts from them anyway)."""
        for m, st in zip(self.memories(), states, strict=True):
            m.load_state(st) if st is not None else m.reset()

    def forward(
        self,
        input_ids: Tensor,
        targets: Tensor | None = None,
        labels: Tensor | None = None,
        cache: list | None = None,
        use_cache: bool = False,
        keep_memory: bool = False,
        stream: bool = False,
        attention_mask: Tensor | None = None,
        return_dict: bool | None = None,
    ) -> MemzooOutput:
        """targets[b, t] is what the loss asks at position t (-100 = ignore): in an LM the token
        after input_ids[b, t]. A memory that learns from its own losses (`needs_targets`: FWL)
        gets the sequence's next tokens instead, given targets (without, it only reads): the
        paper's x_{t+1}, also where the task's loss is only on some positions (MQAR's queries).
        `labels` is the Hugging Face form (same positions as input_ids, shifted here).
        `keep_memory=True` carries every memory layer's fast weights on from the previous call even where the
        backbone starts new sequences (cache=None): the PPL protocol of fast weights carried
        across a document's consecutive sequences (FwPKM Sec. 4.2). `stream=True` (with
        use_cache): the calls of a stream may split anywhere (module docstring); it is set by
        the call that starts the sequences (cache=None). `attention_mask`: all ones, or an
        error (no padding). `return_dict` is accepted for Hugging Face callers (the output is
        always a MemzooOutput)."""
        if input_ids.dtype not in (torch.long, torch.int):
            raise TypeError(f"input_ids must be integer token ids, got {input_ids.dtype}")
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("memzoo models take no padding: the recurrent state and the memories' fast weights "
                             "would absorb pad tokens; give prompts of one length, or one at a time")
        B = input_ids.shape[0]
        if targets is None and labels is not None:
            targets = F.pad(labels[:, 1:], (0, 1), value=-100)
        for m in self.memories():
            m.aux_loss = None
            if cache is None and m.per_sequence and not keep_memory:
                m.reset(B)  # a new sequence
            else:
                m.detach_state()  # continue from the fast weights, not from the last step's graph
            if cache is None:
                m.hold(stream and use_cache)
        # the call's last successor is its target's (in an LM the stream's next token)
        mem_targets = None if targets is None else torch.cat([input_ids[:, 1:], targets[:, -1:].to(input_ids.dtype)], 1)
        h = self.embed(input_ids)
        new_cache = []
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            h, c = block(h, None if cache is None else cache[i], mem_targets, self.output_head if i == last else None)
            new_cache.append(c)
        logits = self.output_head(h)
        loss = aux = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
            parts = [m.aux_loss for m in self.memories() if m.aux_loss is not None]
            if parts:
                aux = torch.stack(parts).sum()
                loss = loss + aux
        return MemzooOutput(loss=loss, logits=logits, cache=new_cache if use_cache else None, aux_loss=aux)

    # ---- generation (transformers' GenerationMixin drives these) ------------------------
    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the cache is the model's own (per block: GDN state, KV cache), made by forward

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs: dict, *args, **kwargs) -> dict:
        """Carry the cache to the next call by our own name: transformers before 5.2x looks for it
        only as `past_key_values`, `cache_params`, ... (not `cache`), and would re-run the whole
        sequence every step, writing the prompt into a persistent memory again."""
        model_kwargs = super()._update_model_kwargs_for_generation(outputs, model_kwargs, *args, **kwargs)
        model_kwargs["cache"] = outputs.cache
        return model_kwargs

    def prepare_inputs_for_generation(self, input_ids: Tensor, cache: list | None = None,
                                      attention_mask: Tensor | None = None, **_generation_state) -> dict:
        """The prompt on the first call, then only the newest token: the backbone's cache and
        the memories' fast weights carry the rest (`stream`: exact at any split).
        (GenerationMixin's own bookkeeping arguments are not the model's and are dropped.)"""
        if cache is not None:
            input_ids = input_ids[:, -1:]
        return {"input_ids": input_ids, "cache": cache, "use_cache": True, "stream": True,
                "attention_mask": attention_mask}


AutoConfig.register("memzoo", MemzooConfig)
AutoModelForCausalLM.register(MemzooConfig, HybridLM)


def count_params(mc: ModelConfig) -> int:
    """Parameters of a model built on the meta device (no memory is allocated), counting the
    shared fast weights of persistent memories (FwPKM's keys and values) as the paper's
    Table 2 does; per-sequence fast weights are activations, not parameters."""
    with torch.device("meta"):
        model = HybridLM(mc)
    fast = sum(m.fast_weight_numel() for m in model.memories() if not m.per_sequence)
    return sum(p.numel() for p in model.parameters()) + fast
