"""The sampler against plain reference computations of each rule."""
from __future__ import annotations

import numpy as np
import torch

from strata.layers.sampler import Sampler, SamplingRow, apply_penalties, apply_top_k_top_p, greedy
from strata.sampling_params import SamplingParams


def row(**kw) -> SamplingRow:
    seed = kw.pop("seed", None)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    prompt = kw.pop("prompt", [])
    output = kw.pop("output", [])
    return SamplingRow(SamplingParams(**kw), gen, prompt, output)


def sampler() -> Sampler:
    return Sampler(torch.Generator().manual_seed(0))


def test_greedy_takes_the_argmax():
    logits = torch.randn(4, 50)
    out = sampler()(logits, [row(temperature=0)] * 4)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_greedy_takes_the_first_maximum_nan_first_on_any_view_of_the_logits():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [1.0, float("nan"), 5.0, float("nan")], [0.0, -1.0, 0.0, 0.0]])
    assert greedy(logits).tolist() == logits.argmax(-1).tolist() == [1, 1, 0]
    padded = torch.randn(3, 70)
    assert greedy(padded[:, :64]).tolist() == padded[:, :64].argmax(-1).tolist()  # a view past the vocabulary
    assert greedy(padded.bfloat16().float()).dtype == torch.int64


def test_greedy_rows_beside_sampled_ones_take_the_argmax():
    logits = torch.randn(3, 40)
    out = sampler()(logits, [row(temperature=0), row(temperature=1.0), row(temperature=0)])
    assert [out.token_ids[0], out.token_ids[2]] == logits.argmax(-1)[[0, 2]].tolist()


def test_top_k_keeps_only_the_k_best():
    logits = torch.randn(1, 30)
    masked = apply_top_k_top_p(logits.clone(), [row(top_k=5)])
    kept = torch.isfinite(masked[0]).nonzero().flatten().tolist()
    assert sorted(kept) == sorted(logits[0].topk(5).indices.tolist())


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    masked = apply_top_k_top_p(logits.clone(), [row(top_p=0.7)])
    assert torch.isfinite(masked[0]).tolist() == [True, True, False, False]
    masked = apply_top_k_top_p(logits.clone(), [row(top_p=0.1)])
    assert torch.isfinite(masked[0]).tolist() == [True, False, False, False]


def test_min_p_excludes_unlikely_tokens_from_samples():
    logits = torch.log(torch.tensor([[0.6, 0.35, 0.05]]))
    s = sampler()
    tokens = {s(logits, [row(min_p=0.2)]).token_ids[0] for _ in range(200)}
    assert tokens == {0, 1}


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1])
    s = sampler()
    counts = torch.zeros(3)
    for _ in range(2000):
        counts[s(probs.log().unsqueeze(0), [row()]).token_ids[0]] += 1
    assert torch.allclose(counts / 2000, probs, atol=0.04)


def test_seeded_row_is_independent_of_its_neighbours():
    logits = torch.randn(3, 100)
    a = sampler()(logits, [row(seed=5), row(), row()]).token_ids[0]
    b = sampler()(logits[:1], [row(seed=5)]).token_ids[0]
    c = Sampler(torch.Generator().manual_seed(123))(logits[[0, 2]], [row(seed=5), row(seed=9)]).token_ids[0]
    assert a == b == c


def test_penalties_follow_vllm_semantics():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    r = row(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, prompt=[0], output=[1, 1, 3])
    out = apply_penalties(logits, [r])[0]
    # token 0: seen in prompt, positive -> /2; token 1: output twice, negative -> *2, -0.5*2 - 0.25
    expected = torch.tensor([1.0, -4.0 - 1.0 - 0.25, 1.0, 0.25 - 0.5 - 0.25])
    assert torch.allclose(out, expected)


def test_stop_tokens_are_masked_until_min_tokens():
    logits = torch.tensor([[0.0, 10.0, 0.0]])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    out = sampler()(logits.clone(), [SamplingRow(params, None, [], [5])])
    assert out.token_ids[0] != 1
    out = sampler()(logits.clone(), [SamplingRow(params, None, [], [5, 6])])
    assert out.token_ids[0] == 1


def test_logprobs_are_raw_with_rank_of_the_sampled_token():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0]])
    out = sampler()(logits, [row(temperature=0, logprobs=2)])
    top_ids, top_lps, token_lp, rank = out.logprobs[0]
    ref = logits.log_softmax(-1)[0]
    assert top_ids == [0, 2] and rank == 1
    assert abs(top_lps[1] - ref[2].item()) < 1e-6 and abs(token_lp - ref[0].item()) < 1e-6


def test_logprobs_are_named_records():
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    lps = sampler()(logits, [row(temperature=0, logprobs=1)]).logprobs[0]
    assert lps.top_ids == [1] and lps.rank == 1
    assert lps.logprob == lps.top_logprobs[0]


def bitmask_allowing(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    bits = torch.zeros(len(allowed), (vocab + 31) // 32, dtype=torch.int32)
    for i, tokens in enumerate(allowed):
        for t in tokens:
            word = int(bits[i, t // 32]) | (1 << (t % 32))
            bits[i, t // 32] = word - (1 << 32) if word >= 1 << 31 else word  # int32 wrap-around of bit 31
    return bits


def test_grammar_bitmask_constrains_only_its_rows_before_logprobs():
    logits = torch.randn(3, 70)
    rows = [row(temperature=0, logprobs=3)] * 3
    allowed = [[5, 31, 63], [2]]  # rows 0 and 2 are constrained; bit 31 checks the sign bit of a word
    out = sampler()(logits.clone(), rows, ([0, 2], bitmask_allowing(allowed, 70)))
    assert out.token_ids[0] == max(allowed[0], key=lambda t: logits[0, t]) and out.token_ids[2] == 2
    assert out.token_ids[1] == logits[1].argmax().item()  # unconstrained row untouched
    assert set(out.logprobs[0].top_ids) == set(allowed[0])  # logprobs of the constrained distribution
    assert out.logprobs[2].logprob == 0.0


def test_extreme_penalty_and_temperature_still_sample_only_what_the_grammar_allows():
    logits = torch.randn(4, 70, generator=torch.Generator().manual_seed(1)) * 10
    allowed = [[3, 9, 40]] * 4
    seen = list(range(70))  # every token was in the prompt: the penalty touches allowed and masked ones alike
    rows = [row(repetition_penalty=1e-120, prompt=seen, seed=s) for s in range(2)]
    rows += [row(repetition_penalty=1e-120, temperature=1e-5, prompt=seen), row(temperature=1e-300)]
    for _ in range(20):
        out = sampler()(logits.clone(), rows, (list(range(4)), bitmask_allowing(allowed, 70)))
        assert all(t in allowed[0] for t in out.token_ids), out.token_ids


def test_a_given_argmax_serves_plain_greedy_rows_and_is_ignored_once_the_logits_change():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(0))
    given = np.array([7, 11])  # no argmax of these logits, plain or changed: shows which rows trusted it
    assert sampler()(logits, [row(temperature=0)] * 2, argmax=given).token_ids == [7, 11]
    out = sampler()(logits, [row(temperature=0, logprobs=2)] * 2, argmax=given)
    assert out.token_ids == [7, 11] and out.logprobs[0].logprob == logits.log_softmax(-1)[0, 7].item()
    penalized = [row(temperature=0, presence_penalty=1.5, output=[3]), row(temperature=0)]
    expected = apply_penalties(logits, penalized).argmax(-1).tolist()
    assert sampler()(logits, penalized, argmax=given).token_ids == expected
    best = logits.argmax(-1).tolist()
    masked = logits.clone()
    masked[:, best] = float("-inf")
    rows = [row(temperature=0, min_tokens=2, stop_token_ids=best)] * 2
    assert sampler()(logits.clone(), rows, argmax=given).token_ids == masked.argmax(-1).tolist()
    assert not {7, 11} & {*best, *expected, *masked.argmax(-1).tolist()}
