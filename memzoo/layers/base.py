"""The MemoryLayer interface: a token mixer whose fast weights are written from the sequence.

Every layer in the zoo is written in one functional core plus a thin stateful shell:

    init_state(batch_size) -> state          the fast weights at their initial value
    read_state(x, state)   -> y              retrieve for every position of x; the state is left as
                                             it is (a layer may note what it read, for stats())
    write_state(x, state)  -> new state      memorize x; returns the new state (see below)

The shell keeps the current state on the module and gives the user-facing verbs:

    reset(batch_size=1)    forget: state back to init_state
    write(x)               memorize x [B, T, D]
    read(x)                retrieve with the current state, no change
    forward(x)             causal mixing: per chunk, read with the memory so far, then write
    state / load_state     the explicit state (a dict of tensors), to carry, save or inspect
    stats()                diagnostics (norms here; layers add slot usage, gates, ...)

A write returns new tensors wherever autograd may need the old ones, so the state is
differentiable: outer (slow-weight) gradients can flow through the writes of a sequence.
A layer may update in place a state tensor that carries no graph (FwPKM's 512² x 512 values:
a write then costs O(rows touched), not O(N)); `state` returns the live tensors, so keep a
snapshot with `{k: v.clone() for k, v in layer.state.items()}`; `load_state` copies. The
backbone calls `detach_state()` where a sequence ends and state is carried on, so the
graph never grows across optimizer steps.

Class attributes (a layer overrides only those that differ from the default):

How it streams and what a "sequence" means to it:

- ``chunk_size``: None for token-recurrent layers (any split point streams exactly);
  an int C for chunk-level layers (read the chunk, then write it; splits on multiples
  of C stream exactly).
- ``inclusive``: False (the default) means forward reads with the memory *so far* and then
  writes, chunk by chunk (FwPKM, LaCT: a chunk never sees its own write). True means
  forward writes each token and then reads it, the usual form of token mixers such as
  linear attention, where position t must see its own value. `read` alone never writes.
- ``per_sequence``: True when the state has a batch dimension and a new sequence starts
  from the initial state (LaCT, linear attention). False when one state is shared across
  the batch and persists across calls (FwPKM and FwMLP as the paper trains them).
- ``lookahead``: True when `write` binds each position's key to the *next* position's value.

Where it sits in a backbone block and what the block hands it (memzoo/backbone/model.py):

- ``site``: one of SITES, in the order a block runs them:
  "before_mixer" (before the token mixer: the FwPKM release), "after_mixer" (the default:
  between the token mixer and the FFN, FwPKM paper Sec. 4.1), "ffn" (replaces the block's
  FFN: PKM), "after_ffn" (on the block's output: FWL "on top of the last layer"). A layer
  may set it per instance (FwPKM's and FwMLP's `before_mixer` option).
- ``default_where``: the positions a bare NAME takes in a layout string ("last" for FWL);
  None = the layout must say NAME@where.
- ``prenorm``: True = the block hands the layer its own RMSNorm'd input; False = the raw
  residual (layers with norms of their own: FwPKM's Eq. 26).
- ``needs_targets``: forward also takes ``targets=`` (the next tokens; FWL).
- ``needs_head``: forward also takes ``head=``: y [B, T, D] -> the LM logits (FWL).
- ``aux_loss``: an auxiliary training loss of the last forward (MoM's load balancing),
  already weighted; set by forward, added to the LM loss by HybridLM.

- ``family``: the family of the write rule, a key of FAMILIES (the leaderboard's column).

What the bench and the cost counter need to know (memzoo/bench, memzoo/flops.py):

- ``bench_cost``: relative CPU cost of the layer's bench runs (the plain backbone is 1.0),
  used to share layers among worker processes.
- ``sparse_params``: names of slow parameters a token reads only a few rows of (PKM's value
  table): Table 2's FLOPs accounting leaves them out.
- ``meta_scalar(x)``: the integer a layer's data-dependent ``.item()`` takes while the FLOPs
  are counted on the meta device (MoM's busiest-memory token count); None = the layer reads
  none.

``name`` is set by @register_layer. What the tests need (small sizes, whether rewriting
improves recall) lives on the test side, in tests/conftest.py.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Callable, ClassVar

import torch
from torch import Tensor, nn

from memzoo.families import FAMILIES  # noqa: F401  (how a layer writes its fast weights: the keys `family` names)
from memzoo.modules.precision import state_precision  # noqa: F401  (layers import it from here too)


class Compiled:
    """`fn` compiled by torch.compile (static shapes, one graph) on first call: for a layer's loop
    of small ops when training on a CPU, where eager ops are bound by dispatch (fused they ran
    1.6-2.5x faster: docs/journal/performance.md). Returns None where it cannot compile (no C++ compiler,
    an unsupported platform); then it warns once and the caller runs `fn` eager: correct, slower.
    Each new shape or option compiles another graph, up to `graphs` for the function."""

    graphs = 64

    def __init__(self, fn: Callable, what: str):
        self.fn, self.what, self.compiled = fn, what, None

    def __call__(self, *args, **kw):
        if self.compiled is None:
            self.compiled = torch.compile(self.fn, dynamic=False, fullgraph=True)
        if self.compiled is False:
            return None
        try:
            with torch._dynamo.config.patch(recompile_limit=self.graphs):
                return self.compiled(*args, **kw)
        except Exception as e:  # noqa: BLE001 (eager is correct, only slower)
            self.compiled = False
            warnings.warn(f"{self.what}: compiling failed ({type(e).__name__}: {e}); running it eager", stacklevel=2)
            return None


def trains_on_cpu(x: Tensor) -> bool:
    """Training (gradients on) on a CPU, outside an enclosing torch.compile: where a layer runs its
    loop through :class:`Compiled`."""
    return x.device.type == "cpu" and torch.is_grad_enabled() and not torch.compiler.is_compiling()


State = dict[str, Tensor]


def head_size(d_model: int, num_heads: int, head_dim: int | None = None) -> int:
    """The size of a head: `head_dim`, or d_model // num_heads when not given; a bad pair is one
    clear error naming the fix."""
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    if head_dim is None:
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}; pass head_dim")
        head_dim = d_model // num_heads
    if head_dim < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim}")
    return head_dim

#: where a block can run a memory layer, in the order it runs them (MemoryLayer.site)
SITES = ("before_mixer", "after_mixer", "ffn", "after_ffn")

class MemoryLayer(nn.Module):
    #: registry name, set by @register_layer
    name: ClassVar[str] = ""
    #: None = token-recurrent; int = chunk-level read-then-write
    chunk_size: int | None = None
    #: True = state per sequence (batch dim, reset at each new sequence); False = shared, persistent
    per_sequence: bool = True
    #: True = forward writes each token/chunk before reading it (token mixers); False = read, then write
    inclusive: ClassVar[bool] = False
    #: True = `write` binds each position's key to the *next* position's value (lookahead)
    lookahead: bool = False
    #: where a backbone block runs the layer: one of SITES (see the module docstring)
    site: str = "after_mixer"
    #: positions of a bare NAME in a layout string ("last", "all", "2,6"); None = NAME@where needed
    default_where: ClassVar[str | None] = None
    #: True = the block gives the layer its own RMSNorm'd input; False = the raw residual
    #: (layers with norms of their own, e.g. FwPKM's Eq. 26)
    prenorm: ClassVar[bool] = True
    #: True = forward needs next-token targets, passed as `forward(x, targets=...)` (FWL)
    needs_targets: ClassVar[bool] = False
    #: True = forward also takes `head=`: y [B, T, D] -> LM logits [B, T, V] (FWL's loss gradients)
    needs_head: ClassVar[bool] = False
    #: an auxiliary training loss of the last forward (e.g. MoM's load balancing), already
    #: weighted; HybridLM adds every layer's to the LM loss. Layers set it in forward.
    aux_loss: Tensor | None = None
    #: relative CPU cost of the layer's bench runs (plain backbone = 1.0); balances bench workers
    bench_cost: ClassVar[float] = 1.5
    #: slow parameters a token reads only a few rows of (PKM's values); Table 2's FLOPs omit them
    sparse_params: ClassVar[tuple[str, ...]] = ()
    #: the family of its write rule, a key of FAMILIES ("" = none given: a user's layer may leave it)
    family: ClassVar[str] = ""
    #: why the write rule cannot be driven by explicit key-value pairs (and how it could be probed), or
    #: None where the layer has the pairs adapter below (`pair_dims`, `pair_inputs`, `write_pairs`,
    #: `read_keys`) that the pairs suite (bench/suites/pairs.py: what a rule holds without training) drives
    no_pairs: ClassVar[str | None] = "no key-value adapter yet"

    def __init__(self, d_model: int):
        super().__init__()
        if d_model < 1:
            raise ValueError(f"d_model must be >= 1, got {d_model}")
        self.d_model = d_model
        self._batch_size = 1
        self._held = None  # an instance attribute from the start: torch.compile guards on where it lives

    # Where the state lives. Per-sequence state is a plain attribute. Shared persistent state
    # (per_sequence=False) lives in buffers named fast_<key>: it moves with .to(), and it is
    # saved and loaded with state_dict / save_pretrained, as a trained FwPKM's memory must be.
    # Such layers call self.reset() at the end of __init__ so the buffers exist from the start.
    @property
    def _state(self) -> State | None:
        if self.per_sequence:
            return self.__dict__.get("_seq_state")
        fast = {n[5:]: b for n, b in self._buffers.items() if n.startswith("fast_")}
        return fast or None

    @_state.setter
    def _state(self, state: State | None) -> None:
        if self.per_sequence:
            self.__dict__["_seq_state"] = state
        elif state is not None:
            for k, v in state.items():
                self._buffers["fast_" + k] = v

    # ---- the functional core every layer implements ------------------------------------
    def init_state(self, batch_size: int) -> State:
        raise NotImplementedError

    def read_state(self, x: Tensor, state: State) -> Tensor:
        raise NotImplementedError

    def write_state(self, x: Tensor, state: State) -> State:
        raise NotImplementedError

    def forward_state(self, x: Tensor, state: State) -> tuple[Tensor, State]:
        """Causal mixing of one call. The default is the definition: per chunk (or token),
        read with the memory so far then write, or write then read if `inclusive`. Layers
        override it with a faster parallel form that must give the same result (the shared
        property suite checks this and streaming)."""
        C = self.chunk_size or 1  # token-recurrent: chunks of one token
        ys = []
        for s in range(0, x.shape[1], C):
            xc = x[:, s : s + C]
            if self.inclusive:
                state = self.write_state(xc, state)
                ys.append(self.read_state(xc, state))
            else:
                ys.append(self.read_state(xc, state))
                state = self.write_state(xc, state)
        if not ys:  # an empty sequence
            return x.new_empty(x.shape[0], 0, self.d_model), state
        return torch.cat(ys, dim=1), state

    # ---- the stateful shell -------------------------------------------------------------
    def reset(self, batch_size: int = 1) -> None:
        """Forget: fast weights back to their initial value (shared layers ignore batch_size)."""
        self._batch_size = batch_size
        self._state = self.init_state(batch_size if self.per_sequence else 1)
        self._drop_held()

    def _current(self, x: Tensor) -> State:
        self._check_input(x)
        if self._state is None:
            self.reset(x.shape[0] if self.per_sequence else 1)
        elif self.per_sequence and x.shape[0] != self._batch_size:
            raise ValueError(
                f"{type(self).__name__} holds state for batch size {self._batch_size} but got a batch "
                f"of {x.shape[0]}; call reset(batch_size={x.shape[0]}) first"
            )
        return self._state

    def _check_input(self, x: Tensor) -> None:
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"{type(self).__name__} expects x of shape [batch, time, {self.d_model}], got {tuple(x.shape)}"
            )
        if not x.is_floating_point():
            raise TypeError(f"{type(self).__name__} expects a floating-point input, got {x.dtype}")
        p = next(self.parameters(), None)
        mismatch = p is not None and (p.device != x.device or (p.dtype != x.dtype and not torch.is_autocast_enabled()))
        if mismatch and p.device.type != "meta":
            raise TypeError(
                f"{type(self).__name__} has parameters of {p.dtype} on {p.device} but got x of {x.dtype} on "
                f"{x.device}; move one to match, e.g. layer.to(x.device, x.dtype)"
            )

    def write(self, x: Tensor) -> None:
        """Memorize x [B, T, D] into the fast weights."""
        self._state = self.write_state(x, self._current(x))

    def read(self, x: Tensor) -> Tensor:
        """Retrieve for every position of x from the current fast weights; no state change."""
        return self.read_state(x, self._current(x))

    def forward(self, x: Tensor) -> Tensor:
        if self._held is not None:
            return self._forward_holding(x)
        y, self._state = self.forward_state(x, self._current(x))
        return y

    # ---- streaming at any split (generation) --------------------------------------------
    #: the inputs of a chunk read but not yet written, while holding (see `hold`); None: not holding
    _held: list[Tensor] | None = None

    def hold(self, on: bool) -> None:
        """Token-by-token streaming for chunk-level read-then-write layers. While holding, a
        call's last partial chunk is read (with the memory as of its chunk's start) but not
        written: the next calls complete it, and it is written once whole. Calls split anywhere
        then give exactly what one call over their concatenation gives, as generation (a prompt,
        then one token per call) needs; without it a layer writes a partial chunk at the end of
        each call, which is exact only for splits on chunk boundaries. Changing the mode first
        writes what is held, as the end of a sequence would. Token-recurrent and inclusive layers
        stream exactly anyway, and a layer that writes from the next tokens (FWL) has none to
        write while decoding: they ignore it."""
        if self._held:
            held, self._held = torch.cat(self._held, dim=1), None
            self._state = self.write_state(held, self._current(held))
        chunked = self.chunk_size is not None and not self.inclusive and not self.needs_targets
        self._held = [] if on and chunked else None

    def _drop_held(self) -> None:
        """A new sequence: what a stream held is forgotten with the rest (holding goes on)."""
        if self._held:
            self._held = []

    def _forward_holding(self, x: Tensor) -> Tensor:
        state, C, held = self._current(x), self.chunk_size, self._held
        n_held, T, pos, ys = sum(h.shape[1] for h in held), x.shape[1], 0, []
        while pos < T:
            if n_held == 0 and T - pos >= C:  # whole chunks: the layer's own forward
                k = (T - pos) // C * C
                y, state = self.forward_state(x[:, pos : pos + k], state)
            else:
                k = min(C - n_held, T - pos)
                y = self.read_state(x[:, pos : pos + k], self.advance_state(state, n_held))
                held.append(x[:, pos : pos + k])
                n_held += k
                if n_held == C:
                    state = self.write_state(torch.cat(held, dim=1), state)
                    held.clear()
                    n_held = 0
            ys.append(y)
            pos += k
        self._state = state
        return torch.cat(ys, dim=1) if ys else x.new_empty(x.shape[0], 0, self.d_model)

    def meta_scalar(self, x: Tensor) -> int | None:
        """The value an integer `.item()` in this layer's forward takes while its FLOPs are
        counted on the meta device (memzoo.flops.step_flops), given the forward's input x:
        a size that depends on the data. None (the default): the layer reads none."""
        return None

    def advance_state(self, state: State, n: int) -> State:
        """The state a read sees after `n` more tokens went by unwritten (inside `one_chunk`).
        The fast weights do not change; layers with positions in their state (LaCT's RoPE)
        move them on."""
        return state

    @contextmanager
    def one_chunk(self):
        """Inside this block the update chunk spans every call: forward only reads, with the
        fast weights as they were on entry, and keeps its inputs; leaving the block writes
        them all as one chunk. The result equals one forward over the concatenated calls
        with chunk_size = their total length (the n-iter NIAH's C = haystack length, FwPKM
        Sec. 4.3), but a caller can stream the calls with bounded activations: only this
        layer's inputs are kept. For chunk-level read-then-write layers only."""
        if self.inclusive or self.chunk_size is None or self.needs_targets:
            raise TypeError(
                f"{type(self).__name__}.one_chunk: only chunk-level read-then-write layers have an update "
                "chunk to stretch (inclusive, token-recurrent and target-reading layers do not)"
            )
        pending: list[Tensor] = []

        def read_and_keep(x: Tensor) -> Tensor:
            seen = sum(p.shape[1] for p in pending)
            pending.append(x.detach())
            return self.read_state(x, self.advance_state(self._current(x), seen))

        self.forward = read_and_keep  # the instance attribute shadows the class's forward
        try:
            yield self
        finally:
            del self.forward
            if pending:
                x, C = torch.cat(pending, dim=1), self.chunk_size
                self.chunk_size = x.shape[1]  # layers whose write steps chunk by chunk take one step
                try:
                    self.write(x)
                finally:
                    self.chunk_size = C

    @property
    def state(self) -> State:
        """The current fast weights (a dict of the live tensors; clone them to keep a snapshot)."""
        if self._state is None:
            self.reset(self._batch_size)
        return dict(self._state)

    def load_state(self, state: State) -> None:
        ref = self.init_state(self._batch_size if self.per_sequence else 1)
        if set(state) != set(ref):
            raise KeyError(f"{type(self).__name__}.load_state expects keys {sorted(ref)}, got {sorted(state)}")
        for k, v in state.items():
            if v.shape[1:] != ref[k].shape[1:] or (not self.per_sequence and v.shape != ref[k].shape):
                raise ValueError(f"state[{k!r}] has shape {tuple(v.shape)}, expected {tuple(ref[k].shape)}")
        if self.per_sequence:
            self._batch_size = next(iter(state.values())).shape[0]
        self._state = {k: v.clone() for k, v in state.items()}  # a copy: later writes may be in place
        self._drop_held()  # what a stream held belongs to the state replaced

    def detach_state(self) -> None:
        """Cut the autograd graph behind the state (called where a sequence ends)."""
        if self._state is not None:
            self._state = {k: v.detach() for k, v in self._state.items()}
        if self._held:
            self._held = [h.detach() for h in self._held]

    # ---- the pairs adapter: the write rule driven by explicit keys and values ---------------------

    def pair_dims(self) -> tuple[int, int, int]:
        """(heads H, key size K, value size V) of one pair as the write rule takes it."""
        raise NotImplementedError(f"{type(self).__name__}: {self.no_pairs}")

    def pair_inputs(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The keys [B, T, H, K] and values [B, T, H, V] the layer's own `write(x)` stores, from a
        reset state: what ties the adapter to the layer (the property suite writes both ways)."""
        raise NotImplementedError(f"{type(self).__name__}: {self.no_pairs}")

    def write_pairs(self, k: Tensor, v: Tensor, x: Tensor | None = None) -> None:
        """Write the n pairs k [B, n, H, K], v [B, n, H, V] into the current state with the layer's
        own write rule (its op), in order and in the layer's own chunks, a pair a token. Its gates and
        step sizes: with `x` [B, n, D], those the layer computes from x (so that ``write_pairs(
        *pair_inputs(x), x)`` stores what ``write(x)`` does); without, the neutral values the layer's
        docstring states (no decay, β = 1, the paper's inner lr, ...)."""
        raise NotImplementedError(f"{type(self).__name__}: {self.no_pairs}")

    def read_keys(self, k: Tensor) -> Tensor:
        """What the memory returns at the keys k [B, n, H, K]: [B, n, H, V]; the state unchanged."""
        raise NotImplementedError(f"{type(self).__name__}: {self.no_pairs}")

    @torch.no_grad()
    def stats(self) -> dict:
        """Diagnostics. The base reports the norm of every fast-weight tensor."""
        return {f"norm/{k}": v.float().norm().item() for k, v in self.state.items()}

    def fast_weight_numel(self) -> int:
        """Size of the fast weights (per sequence for per-sequence layers)."""
        st = self.state
        return sum(v[0].numel() if self.per_sequence else v.numel() for v in st.values())

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, chunk_size={self.chunk_size}, per_sequence={self.per_sequence}"
