"""Mamba2 kernels in plain torch: causal conv1d with state (`causal_conv1d`), chunked SSD scan for prefill
(`ssd`), single-token state update for decode (`state_update`)."""
from __future__ import annotations
