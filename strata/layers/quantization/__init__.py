"""Quantized weights: the packed layout and kernels (weight_only), and the checkpoint formats that fill it."""
