"""Quantized linear weights: the canonical weight-only layout and kernels, and the checkpoint formats read into it."""
