"""Tests of strata.kernels.cpu: the C libraries' build, their ABI check and their bindings."""
