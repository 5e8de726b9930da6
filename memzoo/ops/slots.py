"""What a product-key lookup returns (:func:`memzoo.ops.product_key.lookup` and its Triton kernel,
:func:`memzoo.kernels.fwpkm.lookup`): a module of its own, so that the kernel and the torch op share
it without importing each other."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class Lookup(NamedTuple):
    scores: Tensor  # [..., H, k] scores of the retrieved slots, s¹_a + s²_b (Eq. 31), best first
    index: Tensor  # [..., H, k] slot ids in [0, n²): row * n + col
    sub_scores: Tensor  # [..., H, 2, k] raw scores of each half's top-k sub-keys (Eq. 28)
    sub_index: Tensor  # [..., H, 2, k] ids of each half's top-k sub-keys (Eq. 29)
    pair: Tensor  # [..., H, k] which (a, b) of the k × k grid each slot is: a * k + b
