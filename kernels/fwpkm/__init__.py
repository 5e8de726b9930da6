"""Triton kernels of FwPKM (and PKM), each beside the torch reference it must match:

=========================  ===============================================  ==================================
kernel                     what                                             torch reference
=========================  ===============================================  ==================================
:func:`lookup`             (a) sub-key scores (dot / IDW), per-half top-k,  ``memzoo.ops.product_key.lookup``
                           k × k combine, final top-k, fused
:func:`embedding_bag`      (b) Σ_m w V[idx], backward to w and V            ``memzoo.ops.product_key.gather_values``
:func:`segment_sum`        (c) the deterministic sorted-segment reduction   ``segment_sum_reference``; in FwPKM
                           under FwPKM's value step (÷ N_read per row) and  ``FwPKM._update`` / ``_key_grad``
                           the addressing-loss key gradient                 with ``triton=False``
=========================  ===============================================  ==================================

Dispatch: FwPKM and PKM call these on CUDA tensors (``memzoo.ops.product_key.kernels_for``)
unless built with ``triton=False``; the CPU path never imports this package. The tests run every
kernel on CPU under ``TRITON_INTERPRET=1`` (tests/test_kernels_fwpkm.py).
"""

from .bag import embedding_bag
from .lookup import LOOKUP_MAX_K, lookup
from .segment import Segments, segment_sum, segment_sum_reference

__all__ = ["LOOKUP_MAX_K", "Segments", "embedding_bag", "lookup", "segment_sum", "segment_sum_reference"]
