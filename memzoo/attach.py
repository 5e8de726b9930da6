"""A memzoo memory in the model you already have: attach any registered layer to a Hugging Face
causal LM, train it, save it, generate with it.

    model = AutoModelForCausalLM.from_pretrained("...")
    memzoo.attach(model, "gated_deltanet", at="all", num_heads=4)   # outputs unchanged at insertion
    ...train, model.generate(...), model.save_pretrained(path)
    model = memzoo.attach.from_pretrained(path)                     # the base, then the memories
    memzoo.detach(model)                                             # the plain model again

Design (pure functions; `Attachment` is the thin module that holds one memory in one layer):

- Which layers: the model's decoder layers are the `nn.ModuleList` whose modules are of a class named
  in the model's `_no_split_modules` (transformers' own list of its blocks), else the list of one class
  with `num_hidden_layers` entries. In a layer, the token mixer is the child whose class name says
  Attention (not cross-attention), the FFN the child named mlp/feed_forward or whose class says MLP.
  Found through the model, so any checkpoint of a decoder-only architecture built that way attaches;
  Llama, Mistral, Qwen2 and GPT-2 are tested. Anything else is one error naming what is needed.
- Where, as the backbone's `MemoryLayer.site` says (memzoo/backbone/model.py): "before_mixer" and
  "after_mixer" sit beside the token mixer, reading what it reads (the layer's input norm; a
  `prenorm=False` layer: the raw residual) and adding to its output, so to the residual; "ffn" (PKM)
  sits beside the FFN, reading its normed input (beside, not in place: the pretrained FFN is kept);
  "after_ffn" (FWL) adds to the layer's output through an RMSNorm of its own, and a `needs_head` layer
  gets the model's final norm and LM head (so it must sit on the last layer). Forward hooks on the
  existing modules: the pretrained weights keep their names, the base checkpoint still loads.
- Unchanged at insertion: a memory's output is scaled by a per-channel gate initialised to zeros
  (LayerScale), so a pretrained model starts from its own quality. The gate gets gradients from the
  first step; the memory's own weights once the gate is off zero (as LoRA's zero-initialised B).
- State: a call without a cache, or with a cache memzoo has not written to, starts new sequences
  (per-sequence memories reset to the batch size; shared persistent ones keep their fast weights,
  detached, as HybridLM does). After each call every memory's state (its fast weights and the partial
  chunk it holds back: `MemoryLayer.hold`) is put on the returned transformers `Cache`; a call given that
  cache continues from it. So `generate()` (the prompt, then a token a call) equals one forward.
- Padding: an `attention_mask` with zeros runs each row by itself over its own tokens, from its own
  reset state: pad positions get no memory output and write nothing (a row's state on the cache is its
  own). Exact and slower (a loop over the rows). A shared persistent memory with fast weights (FwPKM,
  FwMLP: one state for the whole batch) refuses padding.
- Save: `config.memzoo_attach` records [{layer, at, options}] and the memories' weights sit under
  `<decoder layer>.memzoo.<i>.` in the state dict, so `save_pretrained` writes both; `from_pretrained`
  loads the base with transformers, attaches as recorded and loads those tensors.
- Training: `memzoo train CONFIG --from PATH --attach LAYER[@AT][:OPTIONS]` runs memzoo's one loop
  (memzoo.train) on `TrainingView`, the attached model seen as a HybridLM (the loss on the stream's targets,
  the shared memories' state kept across evaluations); the base is frozen unless `--train-base`; each
  checkpoint also writes `save_pretrained` to the run's hf/ (`save_trained`).

Not supported: beam search (the cache's reordering does not reorder the memories' states) and
gradient checkpointing of the decoder layers (a recomputed layer would write its memory twice).
"""

from __future__ import annotations

import json
import os
import sys
import types

import torch
from torch import Tensor, nn

from memzoo.layers.base import SITES, MemoryLayer
from memzoo.modules.norm import RMSNorm
from memzoo.registry import build_layer, get_layer

#: the config attribute that records the attachments: [{"layer", "at", "options"}]
CONFIG_KEY = "memzoo_attach"
#: the child of a decoder layer that holds its attachments (an nn.ModuleList)
CHILD = "memzoo"
#: the attribute of a transformers Cache that carries the memories' states between calls
STASH = "memzoo_state"
#: the attribute of the model that holds its `_Controller`
OWNER = "_memzoo_attached"
TESTED = "Llama, Mistral, Qwen2 and GPT-2"


def _unsupported(model, why: str) -> TypeError:
    return TypeError(
        f"memzoo.attach: cannot attach to {type(model).__name__}: {why}. Supported: a Hugging Face decoder-only "
        f"causal LM (a transformers PreTrainedModel) whose decoder layers are a ModuleList of modules with an "
        f"attention child and an MLP child, as {TESTED} (tested)"
    )


# ---- finding the parts, through the model itself ------------------------------------------------
def text_config(model):
    c = model.config
    return c.get_text_config() if hasattr(c, "get_text_config") else c


def decoder_layers(model) -> nn.ModuleList:
    """The ModuleList of the model's decoder layers: modules of a class `_no_split_modules` names,
    else the one list of one class with `num_hidden_layers` entries."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise _unsupported(model, "not a transformers PreTrainedModel")
    if getattr(model.config, "is_encoder_decoder", False):
        raise _unsupported(model, "an encoder-decoder model")
    if model.get_output_embeddings() is None:
        raise _unsupported(model, "no LM head (get_output_embeddings() is None)")
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    for ml in lists:
        if all(type(b).__name__ in blocks for b in ml):
            return ml
    n = getattr(text_config(model), "num_hidden_layers", None)
    same = [ml for ml in lists if len(ml) == n and len({type(b) for b in ml}) == 1]
    if len(same) == 1:
        return same[0]
    raise _unsupported(model, "no ModuleList of decoder layers found")


def mixer_of(block: nn.Module) -> nn.Module:
    """The decoder layer's token mixer: its child whose class name says Attention (not cross-attention)."""
    for name, child in block.named_children():
        if "attention" in type(child).__name__.lower() and "cross" not in name.lower() + type(child).__name__.lower():
            return child
    raise TypeError(f"memzoo.attach: decoder layer {type(block).__name__} has no attention child "
                    f"(children: {', '.join(n for n, _ in block.named_children())}); supported: {TESTED}")


def ffn_of(block: nn.Module) -> nn.Module:
    """The decoder layer's FFN: its child named mlp / feed_forward, or whose class name says MLP."""
    for name, child in block.named_children():
        if name in ("mlp", "feed_forward", "ffn") or "mlp" in type(child).__name__.lower():
            return child
    raise TypeError(f"memzoo.attach: decoder layer {type(block).__name__} has no MLP child "
                    f"(children: {', '.join(n for n, _ in block.named_children())}); supported: {TESTED}")


def final_norm(model) -> nn.Module:
    """The norm between the last decoder layer and the LM head: the base model's last child that
    is a norm (Llama's `norm`, GPT-2's `ln_f`)."""
    norms = [c for _, c in model.base_model.named_children() if "norm" in type(c).__name__.lower()]
    if not norms:
        raise _unsupported(model, "no final norm before the LM head (a `needs_head` memory needs it)")
    return norms[-1]


def positions(at, n_layers: int, name: str, default: str | None) -> list[int]:
    """`at` -> decoder layer indices: "all", "last", an int (negative from the end), a list of them, or
    "2,6"; None = the layer's `default_where`."""
    if at is None:
        at = default
        if at is None:
            raise ValueError(f"memzoo.attach({name!r}): say where, e.g. at='all', at='last', at=3 or at=[1, 5]")
    if isinstance(at, str):
        s = at.strip().lower()
        at = list(range(n_layers)) if s == "all" else [n_layers - 1] if s == "last" else s.split(",")
    elif isinstance(at, int):
        at = [at]
    try:
        idx = [int(i) for i in at]
    except (TypeError, ValueError):
        raise ValueError(f"memzoo.attach({name!r}): at={at!r}: expected 'all', 'last', an index or a list") from None
    out = [i + n_layers if i < 0 else i for i in idx]
    bad = [i for i, j in zip(idx, out) if not 0 <= j < n_layers]
    if bad:
        raise ValueError(f"memzoo.attach({name!r}): layer {bad[0]} out of range for {n_layers} decoder layers")
    if len(set(out)) != len(out):
        raise ValueError(f"memzoo.attach({name!r}): at={at!r} repeats a layer")
    return out


# ---- one memory in one layer ------------------------------------------------------------------------
class Attachment(nn.Module):
    """One memory in one decoder layer: the layer, a per-channel gate on its output (zeros at
    insertion), an RMSNorm of its own where it reads the layer's output; and its stream's state
    between calls (one state for the batch, or one per row when the batch is padded)."""

    def __init__(self, memory: MemoryLayer, d_model: int, eps: float):
        super().__init__()
        self.memory = memory
        self.gate = nn.Parameter(torch.zeros(d_model))
        self.norm = RMSNorm(d_model, eps) if memory.site == "after_ffn" and memory.prenorm else None
        self.rows: list[dict] | None = None  # per-row snapshots (padded batches), else None
        self.raw: Tensor | None = None  # the layer's input, for a prenorm=False memory

    # the stream: start, snapshot, resume
    def start(self, batch_size: int, per_row: bool) -> None:
        m = self.memory
        m.aux_loss = None
        if per_row:
            if not m.per_sequence and m.init_state(1):
                raise ValueError(
                    f"memzoo.attach: {m.name!r} keeps one persistent state for the whole batch (per_sequence=False), "
                    "so padded rows would write into one another's memory; give prompts of one length, or one at a time"
                )
            self.rows = []
            for _ in range(batch_size):
                m.reset(1)
                m.hold(True)
                self.rows.append(self.snapshot())
            return
        self.rows = None
        if m.per_sequence:
            m.reset(batch_size)
        else:
            m.detach_state()  # continue from the fast weights, not from the last step's graph
        m.hold(True)

    def snapshot(self) -> dict:
        m = self.memory
        st = m._state if m.per_sequence else None
        return {"state": None if st is None else dict(st), "batch": m._batch_size,
                "held": None if m._held is None else list(m._held)}

    def load(self, snap: dict) -> None:
        m = self.memory
        if snap["state"] is not None:
            m._state = dict(snap["state"])
            m._batch_size = snap["batch"]
        m._held = None if snap["held"] is None else list(snap["held"])

    def save(self) -> dict:
        return {"rows": None if self.rows is None else list(self.rows), "one": self.snapshot()}

    def resume(self, saved: dict) -> None:
        self.rows = None if saved["rows"] is None else list(saved["rows"])
        self.load(saved["one"])
        self.memory.aux_loss = None
        self.memory.detach_state()

    # the contribution: gate * memory(x)
    def contribute(self, x: Tensor, targets: Tensor | None, keep: Tensor | None, head=None) -> Tensor:
        """gate · memory(x) [B, T, D]. `keep` [B, T] (padded batches): each row's kept positions run
        by themselves from the row's own state; the others get zeros. `head(y, rows, pos)`: the LM
        logits with y added at the memory's place (needs_head)."""
        m = self.memory
        if self.rows is None:
            kw = {"targets": targets} if m.needs_targets else {}
            if m.needs_head:
                kw["head"] = lambda y: head(y, slice(None), slice(None))
            return self.gate * m(x, **kw)
        one = self.snapshot()
        ys, aux = [], []
        for b in range(x.shape[0]):
            pos = keep[b].nonzero().flatten()
            if pos.numel() == 0:
                ys.append(x.new_zeros(x.shape[1:]))
                continue
            self.load(self.rows[b])
            kw = {"targets": targets[b : b + 1, pos]} if m.needs_targets and targets is not None else {}
            if m.needs_head:
                kw["head"] = lambda y, b=b, pos=pos: head(y, slice(b, b + 1), pos)
            yb = m(x[b : b + 1, pos], **kw)
            if m.aux_loss is not None:
                aux.append(m.aux_loss)
            self.rows[b] = self.snapshot()
            ys.append(x.new_zeros(x.shape[1:]).index_copy(0, pos, yb[0].to(x.dtype)))
        self.load(one)
        m.aux_loss = torch.stack(aux).mean() if aux else None
        return self.gate * torch.stack(ys)

    def extra_repr(self) -> str:
        return f"site={self.memory.site}"


class _Controller:
    """What an attached model keeps besides its modules: the records, the hooks, the current call."""

    def __init__(self):
        self.atts: list[Attachment] = []
        self.handles: list = []
        self.labels: Tensor | None = None
        self.call: dict = {}


def _tensor_arg(args, kwargs, name: str, i: int):
    return kwargs[name] if name in kwargs else args[i] if len(args) > i else None


def _cache_of(out):
    from transformers.cache_utils import Cache

    for v in (out.values() if isinstance(out, dict) else out if isinstance(out, tuple) else ()):
        if isinstance(v, Cache):
            return v
    return None


def _install_model_hooks(model, ctl: _Controller) -> None:
    """The hooks that open and close a call: on the causal LM (labels in, auxiliary losses out) and
    on its base model (start or resume the streams; put their states on the returned cache)."""
    base = model.base_model

    def lm_pre(module, args, kwargs):
        ctl.labels = kwargs.get("labels")

    def lm_post(module, args, kwargs, out):
        ctl.labels = None
        aux = [a.memory.aux_loss for a in ctl.atts if a.memory.aux_loss is not None]
        if aux and isinstance(out, dict) and out.get("loss") is not None:
            out["loss"] = out["loss"] + torch.stack(aux).sum()
        return out

    def base_pre(module, args, kwargs):
        ids = _tensor_arg(args, kwargs, "input_ids", 0)
        x = ids if ids is not None else kwargs.get("inputs_embeds")
        B, T = x.shape[:2]
        mask = kwargs.get("attention_mask")  # (transformers' causal LMs call their base model by keyword)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        saved = getattr(cache, STASH, None) if cache is not None else None
        padded = torch.is_tensor(mask) and mask.dim() == 2 and not bool(mask.bool().all())
        if saved is None or len(saved) != len(ctl.atts):
            for a in ctl.atts:
                a.start(B, padded)
        else:
            for a, s in zip(ctl.atts, saved):
                a.resume(s)
        per_row = any(a.rows is not None for a in ctl.atts)
        keep = None
        if per_row:
            keep = mask[:, -T:].bool() if torch.is_tensor(mask) and mask.dim() == 2 else x.new_ones(B, T, dtype=torch.bool)
        targets = None
        if ctl.labels is not None and ids is not None:  # the memories' targets: the next tokens (HybridLM's)
            targets = torch.cat([ids[:, 1:], ids.new_full((B, 1), -100)], 1)
        ctl.call = {"keep": keep, "targets": targets}

    def base_post(module, args, kwargs, out):
        cache = _cache_of(out)
        if cache is not None:
            setattr(cache, STASH, [a.save() for a in ctl.atts])
        for a in ctl.atts:
            a.raw = None
        ctl.call = {}
        return out

    ctl.handles += [
        model.register_forward_pre_hook(lm_pre, with_kwargs=True),
        model.register_forward_hook(lm_post, with_kwargs=True),
        base.register_forward_pre_hook(base_pre, with_kwargs=True),
        base.register_forward_hook(base_post, with_kwargs=True),
    ]


def _add(out, y: Tensor):
    return (out[0] + y, *out[1:]) if isinstance(out, tuple) else out + y


def _install_layer_hooks(model, ctl: _Controller, block: nn.Module, att: Attachment) -> None:
    m = att.memory

    def call():
        return ctl.call.get("targets"), ctl.call.get("keep")

    def raw_pre(module, args, kwargs):
        att.raw = _tensor_arg(args, kwargs, "hidden_states", 0)

    def beside(module, args, kwargs, out):  # beside the mixer or the FFN: reads the sublayer's input
        x = _tensor_arg(args, kwargs, "hidden_states", 0)
        if x is None:
            x = _tensor_arg(args, kwargs, "x", 0)
        if not m.prenorm and att.raw is not None:
            x = att.raw
        targets, keep = call()
        return _add(out, att.contribute(x, targets, keep))

    def on_output(module, args, kwargs, out):  # on the layer's output (after_ffn)
        h = out[0] if isinstance(out, tuple) else out
        x = att.norm(h) if att.norm is not None else h
        head = None
        if m.needs_head:
            norm, lm = final_norm(model), model.get_output_embeddings()

            def head(y, rows, pos):
                return lm(norm(h[rows][:, pos] + att.gate * y))

        targets, keep = call()
        return _add(out, att.contribute(x, targets, keep, head))

    if m.site == "after_ffn":
        ctl.handles.append(block.register_forward_hook(on_output, with_kwargs=True))
        return
    if not m.prenorm:
        ctl.handles.append(block.register_forward_pre_hook(raw_pre, with_kwargs=True))
    where = ffn_of(block) if m.site == "ffn" else mixer_of(block)
    ctl.handles.append(where.register_forward_hook(beside, with_kwargs=True))


def _hook_all(model, ctl: _Controller) -> None:
    for h in ctl.handles:
        h.remove()
    ctl.handles = []
    _install_model_hooks(model, ctl)
    blocks = decoder_layers(model)
    for block in blocks:
        for att in getattr(block, CHILD, ()):
            _install_layer_hooks(model, ctl, block, att)


# ---- the verbs ------------------------------------------------------------------------------------
def attach(model, layer: str, at=None, **options):
    """Insert the registered memory layer `layer` (built by `build_layer(layer, hidden_size, **options)`)
    into the decoder layers `at` ("all", "last", an index, a list, "2,6"; default: the layer's
    `default_where`) of a transformers causal LM, in place; returns the model. The model's outputs are
    unchanged until the memories' gates move off zero. Recorded in `model.config.memzoo_attach`."""
    blocks = decoder_layers(model)
    cls = get_layer(layer)
    try:
        json.dumps(options)
    except TypeError as e:
        raise TypeError(f"memzoo.attach({layer!r}): options must be JSON values (they are saved in the config): {e}") from None
    idx = positions(at, len(blocks), cls.name, cls.default_where)
    tc = text_config(model)
    d = tc.hidden_size
    eps = next((float(getattr(tc, k)) for k in ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_eps")
                if getattr(tc, k, None) is not None), 1e-5)
    atts = []
    for i in idx:
        block = blocks[i]
        mem = build_layer(cls.name, d, **options)
        if mem.site not in SITES:
            raise ValueError(f"memory layer {mem.name!r} has site {mem.site!r}; expected one of {', '.join(SITES)}")
        if mem.site == "ffn":
            ffn_of(block)
        elif mem.site != "after_ffn":
            mixer_of(block)
        existing = list(getattr(block, CHILD, ()))
        if mem.needs_head and i != len(blocks) - 1:
            raise ValueError(f"memzoo.attach: {mem.name!r} reads the LM head, so it must sit on the last decoder "
                             f"layer ({len(blocks) - 1}, at='last'), not {i}")
        if mem.site == "after_ffn" and any(a.memory.needs_head for a in existing):
            raise ValueError(f"memzoo.attach: layer {i}'s output already feeds a memory that reads the LM head; "
                             f"{mem.name!r} would sit after it")
        ref = next((p for p in block.parameters() if p.is_floating_point()), None)
        att = Attachment(mem, d, eps)
        if ref is not None:
            att.to(ref.device, ref.dtype)
        atts.append((block, att))
    ctl = getattr(model, OWNER, None)
    if ctl is None:
        ctl = _Controller()
        model.__dict__[OWNER] = ctl  # a plain attribute, not a submodule
    for block, att in atts:
        if not hasattr(block, CHILD):
            block.add_module(CHILD, nn.ModuleList())
        getattr(block, CHILD).append(att)
    ctl.atts = [a for b in blocks for a in getattr(b, CHILD, ())]
    _hook_all(model, ctl)
    record = [*(getattr(model.config, CONFIG_KEY, None) or []), {"layer": cls.name, "at": idx, "options": options}]
    setattr(model.config, CONFIG_KEY, record)
    return model


def attachments(model) -> list[Attachment]:
    """The model's attachments, in decoder-layer order."""
    ctl = getattr(model, OWNER, None)
    return list(ctl.atts) if ctl else []


def memories(model) -> list[MemoryLayer]:
    """The attached memory layers, in decoder-layer order."""
    return [a.memory for a in attachments(model)]


def detach(model):
    """Remove every attached memory, its hooks and its record: the plain model again (in place; returned)."""
    ctl = model.__dict__.pop(OWNER, None)
    if ctl is not None:
        for h in ctl.handles:
            h.remove()
    for block in decoder_layers(model):
        if hasattr(block, CHILD):
            delattr(block, CHILD)
    if hasattr(model.config, CONFIG_KEY):
        delattr(model.config, CONFIG_KEY)
    return model


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        raise FileNotFoundError(f"memzoo.attach.from_pretrained: no safetensors weights in {path}")
    return [single]


def from_pretrained(path: str, **kwargs):
    """Load a model saved with its attachments: the base through
    `AutoModelForCausalLM.from_pretrained(path, **kwargs)` (which skips the memories' tensors), then
    `attach` as `config.memzoo_attach` records, then the memories' tensors from the same safetensors."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    specs = getattr(AutoConfig.from_pretrained(path), CONFIG_KEY, None)
    if not specs:
        raise ValueError(f"memzoo.attach.from_pretrained: {path} records no attached memory (config.{CONFIG_KEY})")
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the base loader reports the memories' tensors as unexpected
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    finally:
        hf_logging.set_verbosity(level)
    setattr(model.config, CONFIG_KEY, [])
    for s in specs:
        attach(model, s["layer"], at=s["at"], **s["options"])
    own = {k: v for k, v in model.state_dict().items() if f".{CHILD}." in k}
    found = {}
    for f in _weight_files(path):
        with safe_open(f, framework="pt") as st:
            for k in st.keys():
                if k in own:
                    found[k] = st.get_tensor(k)
    missing = sorted(set(own) - set(found))
    if missing:
        raise KeyError(f"memzoo.attach.from_pretrained: {path} lacks the attached memories' tensors {missing[:5]}")
    with torch.no_grad():
        for k, v in found.items():
            own[k].copy_(v)
    return model


# ---- memzoo's training loop on an attached model (`memzoo train CONFIG --from PATH --attach SPEC`) -----
#: the directory of a run's out dir where `memzoo train --from` writes the model, loadable by `from_pretrained`
SAVED = "hf"


def parse_spec(spec: str) -> tuple[str, str | None, dict]:
    """`LAYER[@AT][:OPTIONS]` -> (layer, at, options) for :func:`attach`: AT as `attach` takes it ("all",
    "last", "1", "0,2"; absent: the layer's default place), OPTIONS a column of zoo_configs/sizes.yaml
    (cpu, test, toys: the layer's row there) or comma-separated key=value, each value read as YAML
    ("fwpkm@1:cpu", "gated_deltanet@all:num_heads=2,head_dim=16")."""
    import yaml

    from memzoo.config import sized_options

    head, _, opts = spec.partition(":")
    layer, _, at = head.partition("@")
    if not layer.strip():
        raise ValueError(f"--attach {spec!r}: expected LAYER[@AT][:OPTIONS], e.g. fwpkm@1:cpu")
    layer = get_layer(layer.strip()).name  # an unknown name: the registry's did-you-mean
    opts = opts.strip()
    if not opts:
        options = {}
    elif "=" not in opts:
        options = sized_options(layer, opts, f"--attach {spec!r}")
    else:
        options = {}
        for item in opts.split(","):
            k, eq, v = item.partition("=")
            if not eq or not k.strip():
                raise ValueError(f"--attach {spec!r}: options are key=value pairs separated by commas, got {item!r}")
            options[k.strip()] = yaml.safe_load(v)
    return layer, (at.strip() or None), options


class TrainingView(nn.Module):
    """An attached causal LM as memzoo's training loop sees a HybridLM (memzoo.train): ``forward(x,
    targets)`` returns ``.loss`` (next-token cross-entropy on `targets`, the stream's shifted tokens, plus the
    memories' auxiliary losses) and ``.logits``; ``memory_state`` / ``load_memory_state`` keep the shared
    persistent memories' fast weights across an evaluation. `train_base`: the pretrained weights train
    too; else only the memories, their gates and the base's LoRA adapters where :func:`add_lora` put some
    (the base frozen, as an adapter's)."""

    def __init__(self, lm: nn.Module, train_base: bool = False):
        super().__init__()
        self.lm = lm
        if not train_base:  # the memories, their gates and any LoRA adapters (add_lora) train
            own = {id(p) for a in attachments(lm) for p in a.parameters()} | {id(p) for p in lora_parameters(lm)}
            for p in lm.parameters():
                p.requires_grad_(id(p) in own)

    def forward(self, x: Tensor, targets: Tensor | None = None, keep_memory: bool = False, use_cache: bool = False,
                cache=None):
        """As `HybridLM.forward`: `keep_memory` continues every memory from the state it holds (the last
        call's, or what `load_memory_state` put back) while the model's own layers start empty; `use_cache`
        returns the transformers cache (its KV and the memories' states), and `cache` continues from one."""
        from memzoo.backbone.model import MemzooOutput

        mems = memories(self.lm)
        kw: dict = {"use_cache": False}
        if cache is not None or keep_memory or use_cache:
            from transformers import DynamicCache

            if cache is None:
                cache = DynamicCache()
                if keep_memory:  # the attachments resume from what their memories hold now
                    setattr(cache, STASH, [{"rows": None, "one": a.snapshot()} for a in attachments(self.lm)])
            kw = {"past_key_values": cache, "use_cache": True}
        # labels only open the memories' targets (FWL's); the loss is taken here, on the stream's targets
        out = self.lm(input_ids=x, labels=x if any(m.needs_targets for m in mems) else None, **kw)
        parts = [m.aux_loss for m in mems if m.aux_loss is not None]
        aux = torch.stack(parts).sum() if parts else None
        loss = None
        if targets is not None:
            loss = nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
            loss = loss if aux is None else loss + aux
        return MemzooOutput(loss=loss, logits=out.logits, cache=out.past_key_values if use_cache else None, aux_loss=aux)

    def memories(self) -> list[MemoryLayer]:
        return memories(self.lm)

    def memory_state(self, persistent_only: bool = False) -> list[dict | None]:
        return memory_state(self.lm, persistent_only)

    def load_memory_state(self, states: list[dict | None]) -> None:
        load_memory_state(self.lm, states)


def memory_state(model, persistent_only: bool = False) -> list[dict | None]:
    """A copy of every attached memory's fast weights (`HybridLM.memory_state`'s, for an attached model);
    with `persistent_only`, None for the per-sequence ones: only what outlives a call."""
    return [None if persistent_only and m.per_sequence else {k: v.clone() for k, v in m.state.items()}
            for m in memories(model)]


def load_memory_state(model, states: list[dict | None]) -> None:
    """Put back a :func:`memory_state`; None: the memory's initial fast weights."""
    for m, st in zip(memories(model), states, strict=True):
        m.load_state(st) if st is not None else m.reset()


def saved_model_dir(path) -> str | None:
    """Where `path` (a `memzoo train --from` out dir, or a `save_pretrained` directory) holds an attached
    model that :func:`from_pretrained` loads, or None when it holds none."""
    from pathlib import Path

    for d in (Path(path) / SAVED, Path(path)):
        cfg = d / "config.json"
        if cfg.is_file() and json.loads(cfg.read_text()).get(CONFIG_KEY):
            return str(d)
    return None


def for_training(path: str, specs: list[str], train_base: bool = False, lora: int | None = None) -> TrainingView:
    """The causal LM at `path` (a local directory or a Hub name; `from_pretrained` in fp32), with a memory
    attached per spec (:func:`parse_spec`), as the training loop takes it. What trains: the memories
    (default), everything (`train_base`), or the memories and rank-`lora` adapters on the base's attention
    (:func:`add_lora`). No spec: the model itself, fine-tuned whole or by LoRA (the plain arm of a
    comparison; its hf/ loads with transformers alone)."""
    from transformers import AutoModelForCausalLM

    if train_base and lora:
        raise ValueError("--train-base trains every weight and --lora only adapters on a frozen base: give one")
    if not specs and not (train_base or lora):
        raise ValueError("--from needs --attach LAYER[@AT][:OPTIONS] (the memory to train), or --train-base or "
                         "--lora RANK to fine-tune the model itself")
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for spec in specs:
        layer, at, options = parse_spec(spec)
        attach(lm, layer, at=at, **options)
    if lora:
        add_lora(lm, lora)
    return TrainingView(lm, train_base)


def add_lora(lm: nn.Module, rank: int, alpha: float | None = None) -> list[str]:
    """LoRA (Hu et al. 2021, arXiv 2106.09685: W + (α/r) B A, B zero at the start, so the outputs are
    unchanged) on the base model's attention projections, through peft: the modules peft targets for the
    model's architecture (Llama's q_proj and v_proj, GPT-2's c_attn), the memories' own layers excluded.
    α defaults to 2r. Returns the adapted modules' names."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as TARGETS
    except ImportError as e:
        raise ImportError("--lora trains through peft: pip install 'memzoo[lora]'") from e
    if rank < 1:
        raise ValueError(f"--lora: the rank must be at least 1, got {rank}")
    kind = text_config(lm).model_type
    if kind not in TARGETS:
        raise ValueError(f"--lora: peft names no attention projections for model type {kind!r}")
    mine = [n for n, m in lm.named_modules() if isinstance(m, Attachment)]
    names = [n for n, _ in lm.named_modules() if n.rsplit(".", 1)[-1] in TARGETS[kind]
             and not any(n.startswith(p + ".") for p in mine)]
    cfg = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, lora_dropout=0.0, target_modules=names)
    inject_adapter_in_model(cfg, lm)
    return names


def lora_parameters(lm: nn.Module) -> list[nn.Parameter]:
    """The LoRA adapters' weights (:func:`add_lora`), none where there are none."""
    return [p for n, p in lm.named_parameters() if ".lora_" in n]


def merged_state_dict(lm: nn.Module) -> dict[str, Tensor]:
    """The model's state dict with each LoRA adapter merged into its base layer (W + (α/r) B A under the
    layer's own name), so that the saved model loads without peft."""
    from peft.tuners.lora import LoraLayer

    sd = lm.state_dict()
    for name, mod in lm.named_modules():
        if not isinstance(mod, LoraLayer):
            continue
        for k in [k for k in sd if k.startswith(f"{name}.lora_")]:
            del sd[k]
        for k, v in mod.get_base_layer().state_dict().items():
            sd.pop(f"{name}.base_layer.{k}")
            sd[f"{name}.{k}"] = v
        delta = sum(mod.get_delta_weight(a) for a in mod.active_adapters)
        sd[f"{name}.weight"] = (mod.get_base_layer().weight + delta).detach()
    return sd


def save_trained(view: TrainingView, path: str, out) -> None:
    """Write the attached model to `out` / SAVED with `save_pretrained` (LoRA adapters merged into their
    layers; and the base's tokenizer, where `path` has one), so that :func:`from_pretrained` reloads it. Atomic as the run's other files: written
    beside, then renamed over the old copy."""
    import shutil
    from pathlib import Path

    out = Path(out)
    new, old, dst = out / f".{SAVED}.new", out / f".{SAVED}.old", out / SAVED
    for d in (new, old):
        shutil.rmtree(d, ignore_errors=True)
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the training's own bar is on screen
    try:
        adapted = bool(lora_parameters(view.lm))
        view.lm.save_pretrained(new, state_dict=merged_state_dict(view.lm) if adapted else None)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(path).save_pretrained(new)
    except (OSError, ValueError, TypeError):  # the base has no tokenizer: the run used the config's
        pass
    if dst.exists():
        dst.rename(old)
    new.rename(dst)
    shutil.rmtree(old, ignore_errors=True)


class _CallableModule(types.ModuleType):
    """`memzoo.attach` names both this module and its function (`import memzoo.attach` binds the
    module there): calling the module calls the function."""

    def __call__(self, *args, **kwargs):
        return attach(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
