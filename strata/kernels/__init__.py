"""Compute kernels chosen by the engine option `kernels`; each has a torch reference it must match."""
