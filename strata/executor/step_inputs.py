"""One step's scheduled sequences -> the flat tensors and metadata of a forward pass.

Everything is computed on the host with numpy and reaches the device in ONE copy, so that a CUDA forward
never waits on the host between layers: no per-layer `.item()`, `.tolist()` or boolean-mask indexing.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from strata.executor.step import ScheduledRequest
from strata.layers.attention import AttentionMetadata, PrefillChunk
from strata.layers.forward_meta import ForwardMeta
from strata.layers.mamba.mixer import MambaBatch

# Chunk length of the Triton SSD scan: tuned on an H200; under the CPU interpreter smaller chunks are faster.
_TRITON_SCAN_CHUNK = {"cuda": 256, "cpu": 16}


def copy_to_device(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """int64 views on `device` of every array, made with one host-to-device transfer; on CPU the arrays
    themselves (slicing one buffer into views cost a decode step 70 us there)."""
    if device.type == "cpu":
        return {name: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for name, a in arrays.items()}
    return one_transfer(arrays, device)


def one_transfer(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """The arrays as int64 views of one buffer on `device`, which reaches it in one (pinned, asynchronous) copy."""
    flat = [np.ascontiguousarray(a, dtype=np.int64).reshape(-1) for a in arrays.values()]
    host = torch.from_numpy(np.concatenate(flat))
    if device.type == "cuda":
        host = host.pin_memory()
    buffer = host.to(device, non_blocking=True)
    views, offset = {}, 0
    for (name, array), part in zip(arrays.items(), flat, strict=True):
        views[name] = buffer[offset:offset + part.size].view(array.shape)
        offset += part.size
    return views


def _scan_chunks(query_start: np.ndarray, chunk_size: int) -> dict[str, np.ndarray]:
    """The Triton scan's chunks of the prefill sequences: none crosses a sequence."""
    starts = [np.arange(a, b, chunk_size) for a, b in zip(query_start[:-1], query_start[1:], strict=True)]
    first = np.concatenate(starts) if starts else np.zeros(0, dtype=np.int64)
    seq_ends = np.repeat(query_start[1:], [len(s) for s in starts])
    return {"chunk_start": first, "chunk_end": np.minimum(first + chunk_size, seq_ends),
            "seq_chunks": np.concatenate([[0], np.cumsum([len(s) for s in starts])])}


def prepare_step(requests: Sequence[ScheduledRequest], block_size: int, device: torch.device, kernels: str,
                 with_mamba: bool, mm_inputs: list) -> tuple[torch.Tensor, torch.Tensor, ForwardMeta]:
    """(input_ids, positions, ForwardMeta) of one step; `requests` come decodes first (see `is_decode_rows`)."""
    triton = kernels == "triton"
    nd = sum(map(is_decode_rows, requests))  # decode requests: numpy's sum of a few values costs more
    if nd == len(requests) and not (triton or with_mamba):
        arrays = decode_arrays(requests, block_size)
    else:
        arrays = step_arrays(requests, block_size, nd, triton, with_mamba, scan_chunk_size(device))
    views = copy_to_device(arrays, device)

    decode_rows = sum(len(s.token_ids) for s in requests[:nd])
    prefills, offset, start = [], 0, decode_rows  # each decode token is one row
    for s in requests[nd:]:
        end, context = start + len(s.token_ids), None
        if not triton and s.num_computed_tokens > 0:
            seq_len = s.num_computed_tokens + len(s.token_ids)
            context = views["context_slots"][offset:offset + seq_len]
            offset += seq_len
        prefills.append(PrefillChunk(start, end, s.num_computed_tokens, context))
        start = end
    attn = AttentionMetadata(views["slot_mapping"], decode_rows, views["decode_block_tables"], views["decode_seq_lens"],
                             prefills, block_size, kernels=kernels,
                             prefill_block_tables=views.get("prefill_block_tables"),
                             prefill_query_start=views.get("prefill_query_start"),
                             prefill_seq_lens=views.get("prefill_seq_lens"))
    mamba = _mamba_batch(arrays, views, nd, kernels, scan_chunk_size(device)) if with_mamba else None
    return views["input_ids"], views["positions"], ForwardMeta(attn, mamba, mm_inputs, views["logits_indices"])


def is_decode_rows(s: ScheduledRequest) -> bool:
    """Whether a request's tokens are decode rows: one token, a verification step's last token and drafts, or a
    catch-up of a few tokens. A row at position p is a decode of context p + 1 through the request's block table;
    the step writes every row's keys and values before attending, so a row sees the ones before it."""
    return len(s.token_ids) == 1 + s.num_draft_tokens or s.catch_up


def decode_arrays(requests: Sequence[ScheduledRequest], block_size: int) -> dict[str, np.ndarray]:
    """`step_arrays` of a step of decode rows only (plain-torch attention, no Mamba state), built with a few Python
    and numpy calls: at batch 1 the general construction's two dozen numpy calls cost a CPU decode step 0.3 ms once
    the weights had streamed through the caches."""
    if any(len(s.token_ids) > 1 for s in requests):  # a row per token: a request's rows share its block table
        rows = [(s, s.num_computed_tokens + j) for s in requests for j in range(len(s.token_ids))]
    else:
        rows = [(s, s.num_computed_tokens) for s in requests]
    positions = [p for _, p in rows]
    width = -(-(max(positions) + 1) // block_size)  # blocks of the longest sequence
    tables = np.zeros((len(rows), width), dtype=np.int64)
    for i, (s, _) in enumerate(rows):
        ids = s.block_ids[:width]
        tables[i, :len(ids)] = ids
    slots = [s.block_ids[p // block_size] * block_size + p % block_size for s, p in rows]
    positions = np.array(positions, dtype=np.int64)
    return {"input_ids": np.array([t for s in requests for t in s.token_ids], dtype=np.int64), "positions": positions,
            "slot_mapping": np.array(slots, dtype=np.int64), "decode_block_tables": tables,
            "decode_seq_lens": positions + 1,
            "logits_indices": _sampled_rows(requests)}


def _sampled_rows(requests: Sequence[ScheduledRequest]) -> np.ndarray:
    """The rows of a step of decode rows whose logits are sampled: each sampling request's last 1 + drafts."""
    rows, start = [], 0
    for s in requests:
        end = start + len(s.token_ids)
        if s.sample:
            rows.extend(range(end - 1 - s.num_draft_tokens, end))
        start = end
    return np.array(rows, dtype=np.int64)


def step_arrays(requests: Sequence[ScheduledRequest], block_size: int, nd: int, triton: bool, with_mamba: bool,
                chunk_size: int) -> dict[str, np.ndarray]:
    """The step's flat int64 arrays: tokens, positions, KV slots, block tables, and what prefills and Mamba layers
    need; the first `nd` requests are decode rows (one row per token, see `is_decode_rows`)."""
    lens = np.array([len(s.token_ids) for s in requests], dtype=np.int64)
    starts = np.array([s.num_computed_tokens for s in requests], dtype=np.int64)
    positions = np.concatenate([np.arange(a, a + n) for a, n in zip(starts, lens, strict=True)])
    tables = np.zeros((len(requests), max(len(s.block_ids) for s in requests)), dtype=np.int64)
    for i, s in enumerate(requests):
        tables[i, : len(s.block_ids)] = s.block_ids
    query_start = np.concatenate([[0], np.cumsum(lens)])
    seq_lens = starts + lens
    slot_of = lambda rows, pos: tables[rows, pos // block_size] * block_size + pos % block_size
    arrays = {
        "input_ids": np.fromiter((t for s in requests for t in s.token_ids), dtype=np.int64, count=int(lens.sum())),
        "positions": positions,
        "slot_mapping": slot_of(np.repeat(np.arange(len(requests)), lens), positions),
        "decode_block_tables": tables[np.repeat(np.arange(nd), lens[:nd]),
                                      :-(-int(seq_lens[:nd].max(initial=0)) // block_size)],
        "decode_seq_lens": positions[:int(lens[:nd].sum())] + 1,
        "logits_indices": _logits_rows(requests, query_start),
    }
    continued = [i for i in range(nd, len(requests)) if starts[i] > 0]
    if triton:
        arrays["prefill_block_tables"] = tables[nd:, :-(-int(seq_lens[nd:].max(initial=0)) // block_size)]
        arrays["prefill_query_start"] = query_start[nd:] - query_start[nd]
        arrays["prefill_seq_lens"] = seq_lens[nd:]
    elif continued:  # the plain-torch path gathers each continued chunk's context through its slots
        arrays["context_slots"] = np.concatenate([slot_of(i, np.arange(seq_lens[i])) for i in continued])
    if with_mamba:
        slots = np.array([s.state_slot for s in requests], dtype=np.int64)
        arrays.update(state_slots=slots, fresh_slots=slots[starts == 0],
                      mamba_query_start=query_start[nd:] - query_start[nd], has_initial_state=starts[nd:] > 0)
        if triton:
            arrays.update(_scan_chunks(arrays["mamba_query_start"], chunk_size))
    return arrays


def _logits_rows(requests: Sequence[ScheduledRequest], query_start: np.ndarray) -> np.ndarray:
    """Rows whose logits are sampled: each sampling request's last row, and before it the rows of the positions
    its draft tokens are verified at."""
    ends = query_start[1:]
    if not any(s.num_draft_tokens for s in requests):
        return ends[np.array([s.sample for s in requests], dtype=bool)] - 1
    return np.concatenate([np.arange(end - 1 - s.num_draft_tokens, end)
                           for s, end in zip(requests, ends, strict=True) if s.sample] or [np.zeros(0, np.int64)])


def scan_chunk_size(device: torch.device) -> int:
    return _TRITON_SCAN_CHUNK["cuda" if device.type == "cuda" else "cpu"]


def _mamba_batch(arrays: dict[str, np.ndarray], views: dict[str, torch.Tensor], nd: int, kernels: str,
                 chunk_size: int) -> MambaBatch:
    slots = arrays["state_slots"][:nd]
    consecutive = nd > 0 and np.array_equal(slots, np.arange(slots[0], slots[0] + nd))
    chunks = None
    if kernels == "triton":
        # Imported on first use: Triton decides at import whether its kernels run in the CPU interpreter.
        from strata.kernels.triton.ssd import ScanChunks

        chunks = ScanChunks(chunk_size, len(arrays["chunk_start"]),
                            views["mamba_query_start"], views["chunk_start"], views["chunk_end"],
                            views["seq_chunks"])
    return MambaBatch(
        num_decodes=nd, decode_slots=views["state_slots"][:nd], prefill_slots=views["state_slots"][nd:],
        prefill_query_start=views["mamba_query_start"],
        fresh_slots=views["fresh_slots"] if arrays["fresh_slots"].size else None,
        decode_span=(int(slots[0]), int(slots[0]) + nd) if consecutive else None,
        kernels=kernels, prefill_has_initial_state=views["has_initial_state"].bool(), scan_chunks=chunks)
