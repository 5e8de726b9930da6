"""memzoo's Triton kernels (installed as ``memzoo.kernels``), each beside the pure-torch
reference it must match. Nothing on the CPU path imports them unless asked to (the layers
dispatch to them on CUDA tensors only); tests run them on CPU under ``TRITON_INTERPRET=1``."""
