"""Verification of draft tokens in the sampler: the emitted tokens follow the target distribution exactly (checked
against a plain numpy computation of softmax, top-k and top-p over 20k+ samples), greedy rows accept drafts while
they equal the argmax, and a seeded request draws one number per emitted token, so drafts never change its tokens."""
from __future__ import annotations

import numpy as np
import torch

from strata.layers.sampler import Sampler, SamplingRow
from strata.sampling_params import SamplingParams

SAMPLES = 24_000
# Chi-square critical values at a false-alarm rate of 1e-6 (scipy.stats.chi2.ppf(1 - 1e-6, df)), by degrees of freedom.
CHI2_CRITICAL = {1: 23.93, 2: 27.63, 3: 30.66, 4: 33.38, 5: 35.89, 6: 38.26, 7: 40.52}


def target(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """softmax at temperature 1, then the k most likely, then the smallest most-likely set reaching top_p."""
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    kept = np.zeros_like(probs)
    kept[order[:top_k]] = probs[order[:top_k]]
    kept /= kept.sum()
    mass, keep = 0.0, []
    for token in order:
        if mass >= top_p:
            break
        keep.append(token)
        mass += kept[token]
    final = np.zeros_like(kept)
    final[keep] = kept[keep]
    return final / final.sum()


def chi_square_fits(counts: np.ndarray, probs: np.ndarray) -> bool:
    """Whether counts drawn from `probs` pass a chi-square test at a false-alarm rate of 1e-6 (zero-probability
    tokens must never appear)."""
    if counts[probs == 0].any():
        return False
    support = probs > 0
    expected = counts.sum() * probs[support]
    statistic = float(((counts[support] - expected) ** 2 / expected).sum())
    return statistic < CHI2_CRITICAL[int(support.sum()) - 1]


LOGITS = np.array([[2.0, 1.5, 1.0, 0.6, 0.3, 0.0, -0.5, -1.0],
                   [0.2, 1.8, -0.3, 1.1, 0.9, 0.0, 0.4, -1.2]], dtype=np.float32)
TOP_K, TOP_P = 6, 0.9
DRAFT = 2  # the draft token of the first position (probability about 0.16 under the target)


def verify_many(generator_seed: int) -> tuple[np.ndarray, np.ndarray]:
    """SAMPLES verifications of the draft [DRAFT] over two positions: the first emitted token of each, and the
    second one where the draft was accepted (-1 where it was not)."""
    params = SamplingParams(temperature=1.0, top_k=TOP_K, top_p=TOP_P)
    rows = [SamplingRow(params, None, [], [], DRAFT), SamplingRow(params, None, [], [DRAFT])] * SAMPLES
    logits = torch.from_numpy(np.tile(LOGITS, (SAMPLES, 1)))
    out = Sampler(torch.Generator().manual_seed(generator_seed))(logits, rows)
    tokens = np.array(out.token_ids).reshape(SAMPLES, 2)
    emitted = np.array(out.emitted).reshape(SAMPLES, 2)
    assert emitted[:, 0].all()
    return tokens[:, 0], np.where(emitted[:, 1], tokens[:, 1], -1)


def test_verified_tokens_follow_the_target_distribution_at_each_position():
    first, second = verify_many(generator_seed=3)
    p0, p1 = target(LOGITS[0], TOP_K, TOP_P), target(LOGITS[1], TOP_K, TOP_P)
    assert chi_square_fits(np.bincount(first, minlength=8), p0)
    accepted = first == DRAFT
    assert (second[accepted] >= 0).all() and (second[~accepted] == -1).all()
    # The draft stands with probability p(draft); after it, the next token follows the next position's target.
    assert abs(accepted.mean() - p0[DRAFT]) < 4 * np.sqrt(p0[DRAFT] * (1 - p0[DRAFT]) / SAMPLES)
    assert chi_square_fits(np.bincount(second[accepted], minlength=8), p1)


def test_the_distribution_check_rejects_a_sampler_that_resamples_from_the_whole_target():
    """The check has the power to catch a wrong verifier: one that, on rejecting the draft, samples again from p
    (the draft included) emits the draft with probability p + (1 - p) p instead of p."""
    rng = np.random.default_rng(0)
    p0 = target(LOGITS[0], TOP_K, TOP_P)
    accept = rng.random(SAMPLES) < p0[DRAFT]
    wrong = np.where(accept, DRAFT, rng.choice(8, SAMPLES, p=p0))
    assert not chi_square_fits(np.bincount(wrong, minlength=8), p0)
    right = np.where(accept, DRAFT, rng.choice(8, SAMPLES, p=np.where(np.arange(8) == DRAFT, 0, p0) / (1 - p0[DRAFT])))
    assert chi_square_fits(np.bincount(right, minlength=8), p0)


def test_greedy_rows_accept_drafts_while_they_equal_the_argmax():
    logits = torch.randn(4, 30)
    best = logits.argmax(-1).tolist()
    params = SamplingParams(temperature=0)
    drafts = [best[0], best[1], (best[2] + 1) % 30]
    rows = [SamplingRow(params, None, [], [], d) for d in drafts] + [SamplingRow(params, None, [], [])]
    for argmax in (None, np.array(best)):  # computed here, or given by a whole-step decode path
        out = Sampler(torch.Generator().manual_seed(0))(logits, rows, argmax=argmax)
        assert out.token_ids == best
        assert out.emitted == [True, True, True, False]


def test_a_seeded_request_gets_the_same_tokens_with_or_without_drafts():
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    params = SamplingParams(temperature=1.0, seed=11)
    plain_gen = torch.Generator().manual_seed(11)
    plain = [Sampler(torch.Generator().manual_seed(1))(logits[i:i + 1], [SamplingRow(params, plain_gen, [], [])])
             .token_ids[0] for i in range(8)]
    spec_gen = torch.Generator().manual_seed(11)
    sampler = Sampler(torch.Generator().manual_seed(2))
    emitted, position = [], 0
    drafts_by_step = [[plain[0], plain[1], (plain[2] + 1) % 50], [(plain[3] + 7) % 50], [plain[4], plain[5]]]
    for drafts in drafts_by_step:  # some drafts right, some wrong; an unseeded neighbour row in every call
        rows = [SamplingRow(params, spec_gen, [], [], d) for d in drafts] + [SamplingRow(params, spec_gen, [], [])]
        block = logits[position:position + len(rows)]
        out = sampler(torch.cat([block, logits[:1]]), rows + [SamplingRow(SamplingParams(), None, [], [])])
        new = [t for t, e in zip(out.token_ids[:len(rows)], out.emitted[:len(rows)], strict=True) if e]
        emitted += new
        position += len(new)
    assert emitted == plain[:len(emitted)] and len(emitted) == 7
