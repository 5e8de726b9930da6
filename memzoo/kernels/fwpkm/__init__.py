"""Triton kernels of FwPKM (and PKM), each beside the torch reference it must match:

=========================  ===============================================  ==================================
kernel                     what                                             torch reference
=========================  ===============================================  ==================================
:func:`lookup`             (a) sub-key scores (dot / IDW), per-half top-k,  ``memzoo.ops.product_key.lookup``
                           k × k combine, final top-k, fused
:func:`embedding_bag`      (b) Σ_m w V[idx], backward to w and V            ``memzoo.ops.product_key.gather_values``
:func:`segment_sum`        (c) the deterministic sorted-segment reduction   ``segment_sum_reference``; in
                           under FwPKM's value step (÷ N_read per row) and  ``memzoo.ops.fwpkm``:
                           the addressing-loss key gradient                 ``value_step_reference``,
                                                                            ``addressing_key_grad(triton=False)``
=========================  ===============================================  ==================================

Dispatch: FwPKM's ops (``memzoo.ops.fwpkm``) and PKM call these on CUDA tensors
(``memzoo.ops.product_key.kernels``, ``kernels_for``)
unless built with ``triton=False``; the CPU path never imports this package. The tests run every
kernel on CPU under ``TRITON_INTERPRET=1`` (tests/test_kernels_fwpkm.py).
"""

from .bag import embedding_bag
from .lookup import LOOKUP_MAX_K, lookup
from .segment import Segments, segment_sum, segment_sum_reference

__all__ = ["LOOKUP_MAX_K", "Segments", "embedding_bag", "lookup", "segment_sum", "segment_sum_reference"]
