"""Tests of strata.kernels: a package, so that test modules may share names with those of other folders, and not
named `kernels`, which would shadow the Hugging Face package transformers imports."""
