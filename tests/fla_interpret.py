"""Test-only shims that let flash-linear-attention's Triton kernels run on a CPU under Triton's interpreter
(TRITON_INTERPRET=1, which tests/conftest.py sets where CUDA is absent). Never imported by the library.

1. The autotuner benchmarks its configs through a GPU driver, which a CPU has not: each kernel keeps its
   first config (`Autotuner.prune_configs` cut to one: Triton then skips the benchmark).
2. In the interpreter, a kernel's ``for i in range(...)`` binds i to a Python int where fla calls
   ``i.to(tl.int64)``: the loop variable is rebound to an interpreter tensor at the top of each iteration
   (an assignment ``i = i``, which the interpreter's own rewriting turns into ``to_tensor(i)``).

3. The interpreter has no ``tl.gather``: fla's kernels that use it when Triton has it (the DPLR and KDA
   intra-chunk kernels, through ``IS_GATHER_SUPPORTED``) take their other branch, a masked sum.

4. The interpreter multiplies bf16 operands of ``tl.dot`` as their raw uint16 bits (it stores bf16 as uint16
   and ``InterpreterBuilder.create_dot`` widens only fp8): fla's MesaNet reads its bf16 chunk states with
   such a dot. A bf16 operand is widened to fp32 first (exact: its bits shifted into an fp32's high half).

On a CUDA machine none is needed: the same tests run fla's compiled kernels there (`device()`).

`apply()` installs the four and returns None, or returns why they cannot apply here (fla absent, another
Triton whose internals differ), for the tests to skip with that reason.
"""

from __future__ import annotations

import ast
import importlib.util
import os

#: the Triton versions these shims were written against (their internals: autotuner.py, interpreter.py)
TESTED = ("3.7", "3.8", "3.9")


def device() -> str:
    """Where the fla-path tests run: CUDA (fla's kernels compiled, no shims) where present, else the CPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def apply() -> str | None:
    if device() == "cuda":
        return None if importlib.util.find_spec("fla") else "flash-linear-attention is not installed"
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton's interpreter is off (TRITON_INTERPRET=1 is set by tests/conftest.py only without CUDA)"
    if importlib.util.find_spec("fla") is None:
        return "flash-linear-attention is not installed"
    import triton
    from triton.runtime import interpreter
    from triton.runtime.autotuner import Autotuner

    if not triton.__version__.startswith(TESTED):
        return f"the interpreter shims are written for Triton {', '.join(TESTED)}; this is {triton.__version__}"
    if not all(hasattr(o, n) for o, n in ((Autotuner, "prune_configs"), (interpreter, "ASTTransformer"),
                                           (getattr(interpreter, "InterpreterBuilder", None), "create_dot"))):
        return f"Triton {triton.__version__} lacks the internals these shims patch"
    if getattr(Autotuner, "_memzoo_shim", False):
        return None
    prune = Autotuner.prune_configs

    def first_config(self, kwargs):
        return prune(self, kwargs)[:1]

    def visit_For(self, node):
        if isinstance(node.target, ast.Name):
            name = node.target.id
            node.body.insert(0, ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())],
                                           value=ast.Name(id=name, ctx=ast.Load())))
            ast.fix_missing_locations(node)
        self.generic_visit(node)
        return node

    import sys

    import fla  # noqa: F401  (its op modules read IS_GATHER_SUPPORTED when imported)

    for name, mod in list(sys.modules.items()):
        if (name == "fla" or name.startswith("fla.")) and hasattr(mod, "IS_GATHER_SUPPORTED"):
            mod.IS_GATHER_SUPPORTED = False
    import numpy as np
    from triton import language as tl

    dot = interpreter.InterpreterBuilder.create_dot

    def widen(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        return interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, *args):
        return dot(self, widen(a), widen(b), d, *args)

    interpreter.InterpreterBuilder.create_dot = create_dot
    Autotuner.prune_configs = first_config
    Autotuner._memzoo_shim = True
    interpreter.ASTTransformer.visit_For = visit_For
    return None
