"""Triton kernels (installed as ``memzoo.kernels``).

Each kernel lives beside the pure-torch reference in ``memzoo.ops`` that it must match;
nothing here is imported on the CPU path.
"""
