"""Batched sampling: grammar bitmasks, penalties, temperature, top-k / top-p / min-p, per-request seeds, logprobs.

A seeded request draws from its own generator, row by row, so it gets the same tokens whatever else
is in the batch; the other rows draw together from the engine's generator.

Speculative decoding verifies draft tokens here: a request's rows for the positions of its drafts come one after
the other, each row naming the draft token it checks. Every row samples its token as it would without drafts (one
uniform number through the target's inverse CDF), and the draft stands when the sampled token equals it: that is
rejection sampling for a deterministic proposer (q = 1 for its token), accepted with probability p(draft), and a
rejection's token follows p with the draft removed and renormalised. A seeded row draws only while the rows before
it stood, so a seeded request consumes one number per emitted token, with or without drafts.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from strata.outputs import TokenLogprobs
from strata.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One sequence to sample: its parameters, generator and tokens so far (for penalties)."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # with the drafts before this row's position when it verifies one
    # The draft token proposed at this position: the next row (the same sequence, one position on) counts only
    # if this row samples it. None for a row that ends its sequence's rows.
    draft: int | None = None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per row, when logprobs were asked
    emitted: list[bool] | None = None  # with drafts: whether each row's token is emitted (None: every row's)


def top_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k ids and logprobs of each row, and each chosen token's logprob and 1-based rank."""
    chosen_lp = logprobs.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
    rank = (logprobs > chosen_lp.unsqueeze(-1)).sum(-1) + 1
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], chosen[:, None][:, :0])
    return top_ids, top_lp, chosen_lp, rank


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first largest logit (NaN counts as largest, as in torch). On CPU through numpy: torch's argmax
    over one row of 32k logits took 60-80 us, numpy's 8."""
    if logits.device.type == "cpu":
        return torch.from_numpy(logits.numpy().argmax(-1))
    return logits.argmax(-1)


class Sampler:
    def __init__(self, default_generator: torch.Generator) -> None:
        self.default_generator = default_generator

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 grammar: tuple[list[int], torch.Tensor] | None = None,
                 argmax: np.ndarray | None = None) -> SamplerOutput:
        """`grammar`: the rows under a grammar and their token bitmask, applied before anything else (so
        logprobs, penalties and every filter see only the tokens the grammar allows). `argmax`: each row's first
        largest logit when the caller has it (the greedy tokens of logits nothing here changes)."""
        if logits.dtype != torch.float32:  # a no-op .float() alone cost a CPU decode step 40 us
            logits = logits.float()
        if grammar is not None:
            logits, argmax = apply_grammar_bitmask(logits, *grammar), None
        want_logprobs = [r.params.logprobs for r in rows]
        raw_logprobs = logits.log_softmax(-1) if any(k is not None for k in want_logprobs) else None
        if any(r.params.needs_penalties for r in rows):
            logits, argmax = apply_penalties(logits, rows), None
        if any(len(r.output_token_ids) < r.params.min_tokens for r in rows):
            logits, argmax = mask_stop_tokens_before_min(logits, rows), None
        if all(r.params.greedy for r in rows):
            if argmax is not None and raw_logprobs is None:
                tokens = argmax.tolist()
                emitted = emitted_rows(rows, tokens) if any(r.draft is not None for r in rows) else None
                return SamplerOutput(tokens, [None] * len(rows), emitted)
            tokens = greedy(logits) if argmax is None else torch.from_numpy(argmax)
        else:
            tokens = self._sample(logits, rows)
        token_list = tokens.tolist()
        emitted = emitted_rows(rows, token_list) if any(r.draft is not None for r in rows) else None
        if raw_logprobs is None:
            return SamplerOutput(token_list, [None] * len(rows), emitted)
        k = max(x or 0 for x in want_logprobs)
        top_ids, top_lp, chosen_lp, rank = (t.tolist() for t in top_logprobs(raw_logprobs, tokens, k))
        logprobs = [None if want is None else TokenLogprobs(top_ids[i][:want], top_lp[i][:want], chosen_lp[i], rank[i])
                    for i, want in enumerate(want_logprobs)]
        return SamplerOutput(token_list, logprobs, emitted)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        device = logits.device
        temperature = torch.tensor([max(r.params.temperature, 1e-5) for r in rows], device=device)
        # A tiny repetition penalty or temperature overflows logits to +inf, whose softmax is NaN; -inf (a
        # grammar's mask) stays.
        logits = (logits / temperature.unsqueeze(1)).clamp(max=torch.finfo(logits.dtype).max)
        logits = apply_top_k_top_p(logits, rows)
        probs = logits.softmax(-1)
        if any(r.params.min_p > 0 for r in rows):
            min_p = torch.tensor([r.params.min_p for r in rows], device=device)
            cutoff = probs.max(-1, keepdim=True).values * min_p.unsqueeze(1)
            probs = probs.masked_fill(probs < cutoff, 0.0)
        # Inverse-CDF sampling: one uniform number per row (from the row's own generator when seeded);
        # an order of magnitude faster than torch.multinomial over a large vocabulary on CPU.
        uniform = torch.rand(len(rows), 1, generator=self.default_generator, device=device)
        cdf = probs.cumsum(-1)
        sampled = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(1)
        sampled = sampled.clamp_(max=probs.shape[1] - 1)
        if any(r.params.greedy for r in rows):
            is_greedy = torch.tensor([r.params.greedy for r in rows], device=device)
            sampled = torch.where(is_greedy, greedy(logits), sampled)
        if any(r.generator is not None for r in rows):
            _sample_seeded_rows(sampled, cdf, rows)
        return sampled


def _sample_seeded_rows(sampled: torch.Tensor, cdf: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Seeded rows draw from their own generator, in row order, and only while the rows before them in their
    sequence sampled the draft they verify (a row past a rejected draft emits nothing and must not draw)."""
    standing = True  # the previous row, when it verifies a draft, sampled that draft
    for i, row in enumerate(rows):
        if row.generator is not None and standing:
            u = torch.rand(1, generator=row.generator, device=cdf.device)
            if not row.params.greedy:
                token = torch.searchsorted(cdf[i], u * cdf[i, -1], right=True)
                sampled[i] = token.clamp_(max=cdf.shape[1] - 1)[0]
        standing = row.draft is None or (standing and int(sampled[i]) == row.draft)


def emitted_rows(rows: list[SamplingRow], tokens: list[int]) -> list[bool]:
    """Whether each row's token is emitted: a sequence's first row always, a later row while every row before it
    sampled the draft it verifies."""
    emitted, standing = [], True
    for row, token in zip(rows, tokens, strict=True):
        emitted.append(standing)
        standing = row.draft is None or (standing and token == row.draft)
    return emitted


def apply_grammar_bitmask(logits: torch.Tensor, row_indices: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """Disallowed tokens of the constrained rows get -inf (xgrammar's kernel; it takes float32 on CPU)."""
    import xgrammar as xgr  # here: importing it imports triton, which must not happen before TRITON_INTERPRET is set
    if len(row_indices) == logits.shape[0]:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=logits.shape[1])
        return logits
    index = torch.tensor(row_indices, device=logits.device)
    rows = logits.index_select(0, index)
    xgr.apply_token_bitmask_inplace(rows, bitmask.to(logits.device), vocab_size=logits.shape[1])
    return logits.index_copy_(0, index, rows)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """vLLM's semantics: repetition over prompt and output; presence and frequency over the output."""
    vocab = logits.shape[1]
    logits = logits.clone()
    for i, row in enumerate(rows):
        p = row.params
        if not p.needs_penalties:
            continue
        out_ids = torch.tensor([t for t in row.output_token_ids if t < vocab], dtype=torch.long,
                               device=logits.device)
        counts = torch.zeros(vocab, device=logits.device).index_add_(0, out_ids, torch.ones_like(out_ids,
                                                                                                dtype=torch.float))
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            prompt_ids = torch.tensor([t for t in row.prompt_token_ids if t < vocab], dtype=torch.long,
                                      device=logits.device)
            seen[prompt_ids] = True
            row_logits = logits[i]
            # Below float32's range a penalty would be 0, and -inf (a grammar's mask) * 0 is NaN.
            penalty = max(p.repetition_penalty, torch.finfo(logits.dtype).tiny)
            penalized = torch.where(row_logits > 0, row_logits / penalty, row_logits * penalty)
            logits[i] = torch.where(seen, penalized, row_logits)
        logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return logits


def mask_stop_tokens_before_min(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Before min_tokens are generated, EOS and stop_token_ids cannot be sampled."""
    for i, row in enumerate(rows):
        p = row.params
        if len(row.output_token_ids) < p.min_tokens:
            banned = [t for t in (*p.all_stop_token_ids, *p.stop_token_ids) if t < logits.shape[1]]
            if banned and p.structured_outputs is None:  # a grammar that can only end must be let end
                logits[i, banned] = float("-inf")
    return logits


def apply_top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    use_k = any(r.params.top_k > 0 for r in rows)
    use_p = any(r.params.top_p < 1.0 for r in rows)
    if not (use_k or use_p):
        return logits
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(-1, descending=True)
    if use_k:
        k = torch.tensor([r.params.top_k if r.params.top_k > 0 else vocab for r in rows], device=logits.device)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= k.unsqueeze(1), float("-inf"))
    if use_p:
        top_p = torch.tensor([r.params.top_p for r in rows], device=logits.device)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of strictly better tokens; the best always stays
        sorted_logits = sorted_logits.masked_fill(before > top_p.unsqueeze(1), float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
