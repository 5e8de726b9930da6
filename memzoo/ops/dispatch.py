"""Which implementation of a recurrence runs: memzoo's chunked torch path or flash-linear-attention's
chunk kernel. One rule for every op that has an fla kernel (the gated delta rule, linear attention
with a decay per head or per key channel, the DPLR delta rule):

- ``backend="auto"``: fla's kernel on a CUDA tensor where it can run (:func:`fla_unusable`), else the
  torch path; on CUDA the fallback is said once, with its reason (a warning per op and reason).
- ``"torch"``: the torch path, anywhere.
- ``"fla"``: fla's kernel, or an error saying why it cannot run. On a CPU it runs only under Triton's
  interpreter (``TRITON_INTERPRET=1``, slowly: the tests check the glue this way, at small shapes).

An op whose call falls outside what fla's kernel covers (a decay on the value axis, a chunk-size
choice of its own) passes the reason as `unsupported`, and keeps the torch path under "auto".
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings

import torch
from torch import Tensor

BACKENDS = ("auto", "torch", "fla")


def interpreting() -> bool:
    """Triton's interpreter is on (``TRITON_INTERPRET=1``): its kernels run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def fla_unusable(device_index: int | None = None) -> str | None:
    """Why fla's chunk kernels cannot serve "auto" on this CUDA device, or None where they can: fla
    not installed, or a Hopper GPU with Triton in [3.4, 3.7.1), where fla refuses the gated
    backward (it computes it wrong there: fla #640)."""
    if importlib.util.find_spec("fla") is None:
        return "flash-linear-attention is not installed"
    import triton
    from packaging.version import Version

    tv = Version(triton.__version__.split("+")[0])
    if torch.cuda.get_device_capability(device_index)[0] == 9 and Version("3.4") <= tv < Version("3.7.1"):
        return f"Triton {triton.__version__} on a Hopper GPU (fla's gated backward needs >= 3.7.1)"
    return None


def use_fla(op: str, x: Tensor, backend: str, unsupported: str | None = None) -> bool:
    """Whether `op` runs fla's kernel on tensors like `x` under `backend` (the module docstring's rule);
    `unsupported`: why fla's kernel does not cover this call, or None."""
    if backend not in BACKENDS:
        raise ValueError(f"{op}: unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend == "torch":
        return False
    if x.dtype == torch.float64:
        unsupported = unsupported or "fp64 tensors (fla's kernels compute in fp32 at most)"
    if x.is_cuda:
        why = unsupported or fla_unusable(x.device.index)
    elif backend == "fla" and interpreting():
        why = unsupported or ("flash-linear-attention is not installed" if importlib.util.find_spec("fla") is None
                              else None)
    else:
        why = "a CPU tensor (fla's kernels are Triton's; on a CPU only under TRITON_INTERPRET=1)"
    if backend == "fla":
        if why:
            raise RuntimeError(f"{op}(backend='fla') cannot run fla's kernel: {why}; use backend='torch' or 'auto'")
        return True
    if why and x.is_cuda:  # shown once per op and reason (warnings' default filter)
        warnings.warn(f"{op}: the torch path on CUDA, not fla's kernel: {why}", stacklevel=3)
    return not why
