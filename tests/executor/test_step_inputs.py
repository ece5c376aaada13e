"""A step's tensors and metadata are computed on the host and land on the device in one buffer (one copy)."""
from __future__ import annotations

import numpy as np
import torch

from strata.executor.step import ScheduledRequest
from strata.executor.step_inputs import copy_to_device, decode_arrays, one_transfer, prepare_step, step_arrays


def scheduled(request_id: str, tokens: list[int], computed: int, blocks: list[int], slot: int,
              sample: bool = True) -> ScheduledRequest:
    return ScheduledRequest(request_id, tokens, computed, blocks, sample, slot)


# Decodes first (one token each), then a first prefill chunk and a continued one that does not sample yet.
STEP = [scheduled("d0", [5], 6, [3, 8], 4), scheduled("d1", [6], 9, [0, 7, 5], 5),
        scheduled("p0", [1, 2, 3], 0, [2], 1), scheduled("p1", [7, 8, 9, 10], 5, [6, 1, 9], 0, sample=False)]


def test_every_array_is_a_view_of_one_device_buffer():
    views = one_transfer({"a": np.arange(3), "b": np.ones((2, 2), dtype=np.int32), "c": np.array([True])},
                         torch.device("cpu"))
    assert len({v.untyped_storage().data_ptr() for v in views.values()}) == 1
    assert views["b"].shape == (2, 2) and views["b"].tolist() == [[1, 1], [1, 1]] and views["c"].tolist() == [1]


def test_on_cpu_the_arrays_serve_as_they_are_in_int64():
    a = np.arange(3)
    views = copy_to_device({"a": a, "b": np.ones((2, 2), dtype=np.int32), "c": np.array([True])}, torch.device("cpu"))
    assert views["a"].data_ptr() == a.ctypes.data  # no copy
    assert all(v.dtype == torch.int64 for v in views.values())
    assert views["b"].shape == (2, 2) and views["b"].tolist() == [[1, 1], [1, 1]] and views["c"].tolist() == [1]


def test_triton_step_metadata_matches_the_sequences():
    input_ids, positions, meta = prepare_step(STEP, 4, torch.device("cpu"), "triton", True, [None] * 4)
    attn = meta.attn
    assert input_ids.tolist() == [5, 6, 1, 2, 3, 7, 8, 9, 10]
    assert positions.tolist() == [6, 9, 0, 1, 2, 5, 6, 7, 8]
    assert attn.slot_mapping.tolist() == [34, 21, 8, 9, 10, 5, 6, 7, 36]  # block * 4 + offset
    assert attn.num_decodes == 2 and attn.decode_seq_lens.tolist() == [7, 10]
    assert attn.decode_block_tables.tolist() == [[3, 8, 0], [0, 7, 5]]  # as wide as the longest decode
    assert attn.prefill_query_start.tolist() == [0, 3, 7] and attn.prefill_seq_lens.tolist() == [3, 9]
    assert attn.prefill_block_tables.tolist() == [[2, 0, 0], [6, 1, 9]]
    assert meta.logits_indices.tolist() == [0, 1, 4]  # the continued chunk samples nothing yet
    mamba = meta.mamba
    assert mamba.decode_span == (4, 6) and mamba.fresh_slots.tolist() == [1]
    assert mamba.prefill_slots.tolist() == [1, 0] and mamba.prefill_has_initial_state.tolist() == [False, True]
    chunks = mamba.scan_chunks  # chunks of 16 tokens on CPU: one per prefill sequence
    assert chunks.chunk_start.tolist() == [0, 3] and chunks.chunk_end.tolist() == [3, 7]
    assert chunks.seq_chunks.tolist() == [0, 1, 2]


def test_torch_step_metadata_gathers_continued_contexts():
    _, _, meta = prepare_step(STEP, 4, torch.device("cpu"), "torch", False, [None] * 4)
    first, continued = meta.attn.prefills
    assert first.context_slots is None and (first.query_start, first.query_end) == (2, 5)
    assert continued.context_slots.tolist() == [24, 25, 26, 27, 4, 5, 6, 7, 36]
    assert meta.mamba is None and meta.attn.prefill_block_tables is None
    _, _, shuffled = prepare_step([STEP[1], STEP[0]], 4, torch.device("cpu"), "torch", True, [None] * 2)
    assert shuffled.mamba.decode_span is None  # slots 5, 4 are not ascending


def test_a_decode_only_step_gets_the_general_construction_s_arrays():
    rng = np.random.default_rng(0)
    for trial in range(50):
        requests = []
        for i in range(int(rng.integers(1, 6))):
            computed = int(rng.integers(0, 40))
            blocks = [int(b) for b in rng.permutation(64)[:computed // 4 + 1 + int(rng.integers(0, 3))]]
            requests.append(scheduled(f"r{i}", [int(rng.integers(0, 100))], computed, blocks, i,
                                      sample=bool(rng.integers(0, 4))))
        fast = decode_arrays(requests, 4)
        general = step_arrays(requests, 4, len(requests), False, False, 16)
        assert fast.keys() == general.keys()
        for name in fast:
            assert fast[name].dtype == np.int64 and fast[name].shape == general[name].shape, (trial, name)
            assert np.array_equal(fast[name], general[name]), (trial, name)
