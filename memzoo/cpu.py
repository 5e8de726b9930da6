"""Process-wide CPU tuning for training, and bf16 matrix products in fp32 where a CPU's bf16 GEMM is
the slower (an Intel Xeon whose AMX the hypervisor hides): used by :func:`memzoo.train.make_step`
and the bench's workers. What each gained: docs/journal/performance.md."""

from __future__ import annotations

import functools
import math
import time

import torch


def tune_cpu() -> None:
    """Process-wide settings for training on a CPU (cheap, and harmless on CUDA):

    * subnormal floats are flushed to zero: GDN's strong decays make them, ~10x slower on x86;
    * with glibc, freed blocks of up to 32 MiB stay in the heap (``mallopt``: an mmap threshold of
      32 MiB and 256 MiB kept at the heap's top) instead of going back to the OS, which made every
      step fault in its activations' pages afresh (measured: docs/journal/performance.md).
    """
    import ctypes

    torch.set_flush_denormal(True)
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own symbols, libc's among them
    except (OSError, AttributeError, TypeError):  # no mallopt (macOS, Windows): nothing to set
        return
    mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD
    mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD (glibc's maximum on 64-bit)


@functools.cache
def cpu_bf16_gemm_is_slow() -> bool:
    """Whether this CPU multiplies bf16 matrices more slowly than fp32 ones: timed once per process
    on one thread, at the standard toys' FFN shape (4096 x 128 by 128 x 384), the two alternating,
    the fastest of 10 each, in the thread's CPU time (wall time is not enough: on a shared
    2-core machine a neighbour process's time slices land in whole ~4 ms steps on a 3-5 ms product,
    and flipped the answer in one call of four).

    oneDNN's bf16 GEMM is fast where the CPU has AMX tiles, and bf16 training was the faster on the
    AMD EPYC of the published toy rows (fp32 1.3x slower); on an Intel Xeon whose AMX the hypervisor
    hides, its ``avx512_bf16`` path is 1.4-3.4x slower than its fp32 one at the toys' shapes
    (docs/journal/performance.md). There :func:`make_step` multiplies bf16 operands
    in fp32."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the product runs on this thread, whose CPU time is measured
    try:
        a, b = torch.randn(4096, 128), torch.randn(128, 384)
        pairs = ((a.bfloat16(), b.bfloat16()), (a, b))
        best = [math.inf, math.inf]
        for i in range(22):
            x, y = pairs[i % 2]
            t = time.thread_time()
            x @ y
            if i >= 2:  # the first of each builds oneDNN's kernel
                best[i % 2] = min(best[i % 2], time.thread_time() - t)
    finally:
        torch.set_num_threads(threads)
    return best[0] > 1.25 * best[1]  # the margin pays for the casts


def _bf16_gemms_in_fp32_pass():
    """:class:`Bf16GemmsInFp32`, defined on first use: inductor is imported only for compiled steps."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    aten, prims = torch.ops.aten, torch.ops.prims
    gemms = (aten.mm.default, aten.addmm.default)
    views = (aten.permute.default, aten.t.default, aten.transpose.int, aten.view.default, aten._unsafe_view.default)

    class Bf16GemmsInFp32(CustomGraphPass):
        """An inductor post-grad pass: each matrix product of two bf16 CPU matrices (mm, addmm: bf16
        autocast's linear layers and 2-d einsums, forward and backward) becomes the fp32 product of
        the same operands, cast to bf16. Batched products (bmm, baddbmm: chunked attention, the
        fast-weight reads and writes) stay in bf16: rewriting them too made no step faster
        (docs/journal/performance.md), and together with the
        GDN mixer's bmm it made inductor save garbage for FwMLP's backward (two bf16
        copies of its per-sequence fast weights, saved for the backward of its chunked reads, held
        fp32-like bit patterns; gradients NaN from Ba's task's first step at 27 tokens; neither
        bmm nor baddbmm alone, nor any fusion or buffer-reuse setting, did it; not isolated
        further). Where the operands are bf16 tensors this is
        bf16 autocast's arithmetic: the product of two bf16 numbers is exact in fp32, and oneDNN's
        bf16 GEMM also sums in fp32 and rounds the result to bf16; only the order of the sums can
        differ, as it does between two CPUs (``test_bf16_gemms_in_fp32_pass_keeps_bf16_autocast_arithmetic``).
        The casts fuse into the kernels around the product, and there inductor drops a rounding
        to bf16 between two fused ops, as it does between any two (``emulate_precision_casts``,
        off by default): an operand computed in the same kernel, or the product read by one, is
        then used unrounded, in fp32, as are the other intermediates of compiled bf16 training.
        An operand that is a view of a bf16 tensor is that view of the tensor's one fp32 copy
        (``test_bf16_gemms_in_fp32_pass_widens_a_tensor_once_for_all_its_views``): with a copy per
        view, a linear layer's output gradient, read as is and transposed, was written twice in
        fp32 (SwiGLU's backward kernel stored four [4096, 384] fp32 buffers holding two tensors).
        One copy made the standard MQAR step faster with bit-identical losses (docs/journal/performance.md)."""

        def __call__(self, graph: torch.fx.Graph) -> None:
            from torch._guards import detect_fake_mode

            widened = {}  # one fp32 copy of each operand, however many products read it

            def wide(a: torch.fx.Node) -> torch.fx.Node:
                """a in fp32, inserted before the first product that reads it (it dominates the later
                ones). A view of a bf16 tensor (a transpose: the weight gradient's operand) becomes the
                same view of its base's fp32 copy: one fp32 buffer for the tensor and its views, not one
                per view (the backward of a linear layer reads its output gradient twice, as is and
                transposed)."""
                if a not in widened:
                    src = a.args[0] if a.op == "call_function" and a.target in views else None
                    if isinstance(src, torch.fx.Node) and src.meta["val"].dtype == torch.bfloat16:
                        a32 = graph.call_function(a.target, (wide(src), *a.args[1:]), dict(a.kwargs))
                        a32.meta["val"] = a.target(src.meta["val"].float(), *a.args[1:], **a.kwargs)
                    else:
                        a32 = graph.call_function(prims.convert_element_type.default, (a, torch.float32))
                        a32.meta["val"] = a.meta["val"].float()
                    widened[a] = a32
                return widened[a]

            for node in list(graph.nodes):
                val = node.meta.get("val")
                if (node.op != "call_function" or node.target not in gemms or not isinstance(val, torch.Tensor)
                        or val.dtype != torch.bfloat16 or val.device.type != "cpu"):
                    continue
                with graph.inserting_before(node), detect_fake_mode([val]):
                    args = [wide(a) if isinstance(a, torch.fx.Node) else a for a in node.args]
                    prod = graph.call_function(node.target, tuple(args), dict(node.kwargs))
                    prod.meta["val"] = node.target(*[a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args],
                                                   **node.kwargs)
                    out = graph.call_function(prims.convert_element_type.default, (prod, torch.bfloat16))
                    out.meta["val"] = val
                node.replace_all_uses_with(out)
                graph.erase_node(node)

        def uuid(self) -> bytes:  # inductor's cache key: a changed pass must not reuse old compiled code
            from torch._inductor.custom_graph_pass import get_hash_for_files

            return get_hash_for_files((__file__,))

    return Bf16GemmsInFp32()
