"""Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1): paged attention, KV write, Mamba2 conv/scan/update."""
