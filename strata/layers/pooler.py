"""Pooling of packed hidden states into one vector per sequence (mean, CLS, last token), and normalization."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def pool(hidden: torch.Tensor, seq_lens: torch.Tensor, mode: str) -> torch.Tensor:
    """[T, H] hidden states of sequences packed back to back (lengths `seq_lens` [B]) -> [B, H]."""
    ends = torch.cumsum(seq_lens, 0)
    starts = ends - seq_lens
    if mode == "cls":
        return hidden[starts]
    if mode == "last":
        return hidden[ends - 1]
    if mode == "mean":
        # Summed in float32: a long sequence's mean in half precision loses digits.
        rows = torch.repeat_interleave(torch.arange(seq_lens.shape[0], device=hidden.device), seq_lens)
        sums = torch.zeros(seq_lens.shape[0], hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, rows, hidden.float())
        return (sums / seq_lens[:, None].float()).to(hidden.dtype)
    raise ValueError(f"pooling mode {mode!r} is not one of mean, cls, last")


def normalize(x: torch.Tensor) -> torch.Tensor:
    """L2-normalized rows, as sentence-transformers' Normalize module computes them."""
    return F.normalize(x.float(), p=2, dim=-1).to(x.dtype)


def activate(logits: torch.Tensor, activation: str) -> torch.Tensor:
    """A classifier's logits [B, labels] -> scores: softmax, sigmoid, tanh or identity (float32)."""
    logits = logits.float()
    if activation == "softmax":
        return torch.softmax(logits, dim=-1)
    if activation == "sigmoid":
        return torch.sigmoid(logits)
    if activation == "tanh":
        return torch.tanh(logits)
    if activation == "identity":
        return logits
    raise ValueError(f"activation {activation!r} is not one of softmax, sigmoid, tanh, identity")
