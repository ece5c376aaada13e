"""Tests of the Triton kernels, run under the interpreter on CPU."""
