"""Tests of strata.kernels (a package, so that test modules may share names with those of other folders)."""
