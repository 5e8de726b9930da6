"""Files memzoo writes and checkpoints it reads.

* Every file is written atomically (:func:`atomic_open`): into a temporary file in the same
  directory, flushed and fsynced, then renamed over the target with ``os.replace``. A kill or
  a full disk mid-write leaves the previous file (or none), never a truncated one.
* Checkpoints are read with :func:`load_tensors`, which never runs code: ``torch.load`` with
  ``weights_only=True`` accepts tensors and plain containers of numbers and strings only; any
  other pickle is refused with a one-line error.
* A parameter whose layout changed is read from older checkpoints by :func:`load_transposed`.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from contextlib import contextmanager
from pathlib import Path

_UMASK = os.umask(0)
os.umask(_UMASK)


@contextmanager
def atomic_open(path: str | Path, mode: str = "w"):
    """``open(path, mode)`` for writing ("w" or "wb") whose file appears only complete."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the file open()'s usual mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str) -> Path:
    with atomic_open(path, "w") as f:
        f.write(text)
    return Path(path)


def torch_save(obj, path: str | Path) -> Path:
    import torch

    with atomic_open(path, "wb") as f:
        torch.save(obj, f)
    return Path(path)


def save_figure(fig, path: str | Path, **kwargs) -> Path:
    """``fig.savefig(path, **kwargs)`` atomically (pass ``format=``: the temporary name has no suffix)."""
    with atomic_open(path, "wb") as f:
        fig.savefig(f, **kwargs)
    return Path(path)


def ensure_writable_dir(path: str | Path) -> Path:
    """Create directory `path` and check that a file can be written in it, so that an unwritable
    output fails at once, before any work whose results it would lose."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        raise OSError(f"cannot write to {path}: {e.strerror or e}") from None
    return path


def load_tensors(path: str | Path, map_location="cpu"):
    """``torch.load(path, weights_only=True)``: tensors and plain containers only, never code.
    A pickle holding anything else is refused (ValueError, one line); nothing in it runs."""
    import torch

    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message: a preamble, then the line naming what the pickle asked for
        lines = [ln.strip() for ln in str(e).split("WeightsUnpickler error:")[-1].splitlines() if ln.strip()]
        named = [ln for ln in lines if "GLOBAL" in ln.upper() or "unsupported" in ln.lower()]
        why = (named or lines or ["unsupported content"])[0].split(". Please")[0]
        raise ValueError(f"refusing to load {path}: it is not a plain-tensor checkpoint ({why})") from None
    except (RuntimeError, KeyError, EOFError) as e:
        first = str(e).strip().split("\n")[0]
        raise ValueError(f"cannot read {path}: damaged, or not a torch checkpoint ({type(e).__name__}: {first})") from None


def load_transposed(state_dict: dict, key: str, shape) -> None:
    """For a module's ``_load_from_state_dict``: a 2-D parameter of `shape` that checkpoints saved
    written before 4e287eb hold transposed (with unit dimensions, as conv1d's [C, 1, c]): the tensor
    under `key`, if it is in that old layout, is replaced by its transpose in place. (Short
    convolutions and LaCT's q/k affine store their weights so that the channels run contiguously:
    memzoo.modules.conv says why.)"""
    w = state_dict.get(key)
    rows, cols = shape
    if w is not None and tuple(w.shape) != (rows, cols) and tuple(d for d in w.shape if d != 1) == (cols, rows):
        state_dict[key] = w.reshape(cols, rows).t()
