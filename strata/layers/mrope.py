"""A step's M-RoPE positions (Qwen2-VL's multimodal rotary): rows inside a prompt's images get their (temporal,
height, width) positions, every other row index + the request's delta on all three. Built on the host from what
the requests carry (`mrope_positions`, `mrope_delta`), so decode steps stay plain one-row positions."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def step_positions(spans: Sequence[tuple[int, int]], mm_inputs: Sequence[object], positions: torch.Tensor
                   ) -> torch.Tensor:
    """The step's rotary positions: `positions` itself when no request has M-RoPE positions, else [T] (each row
    shifted by its request's delta) when every row's three positions agree, else [3, T].

    `spans`: each request's (first token index, tokens this step), in the order of the step's rows."""
    tables = [getattr(m, "mrope_positions", None) for m in mm_inputs]
    if all(t is None for t in tables):
        return positions
    rows = []
    for (start, n), table, mm in zip(spans, tables, mm_inputs, strict=True):
        index = np.arange(start, start + n, dtype=np.int64)
        if table is None:
            rows.append(np.broadcast_to(index, (3, n)))
            continue
        block = np.repeat((index + mm.mrope_delta)[None], 3, axis=0)
        inside = index < table.shape[1]
        if inside.any():
            block[:, inside] = table[:, index[inside]]
        rows.append(block)
    out = np.concatenate(rows, axis=1)
    if np.array_equal(out[0], out[1]) and np.array_equal(out[0], out[2]):
        out = out[0]
    return torch.from_numpy(np.ascontiguousarray(out)).to(positions.device)
