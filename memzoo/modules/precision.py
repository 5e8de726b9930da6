"""The precision of fast-weight math: at least fp32 (fp64 stays fp64, for the reference checks),
whatever the slow weights' or the inputs' dtype, and the same under bf16 autocast."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import Tensor


def compute_dtype(*ts: Tensor | None) -> torch.dtype:
    """fp32, or the widest dtype among the given tensors where that is wider (fp64 in the checks)."""
    dt = torch.float32
    for t in ts:
        if t is not None:
            dt = torch.promote_types(dt, t.dtype)
    return dt


def state_precision(device: torch.device):
    """A context in which a layer's fast-weight math runs in the state's own dtype (>= fp32):
    autocast off where the device has it (not on meta, where FLOPs are counted). Under bf16
    autocast a matmul of fp32 fast weights would return bf16, and the state would be bf16 from
    its first update on."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return nullcontext()
