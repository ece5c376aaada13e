"""Draft proposers against brute-force references: the n-gram lookup finds the latest longest earlier occurrence;
the suffix tree counts every depth-limited occurrence of a string, through growth and removal; the suffix proposal
follows the most frequent continuation and its length follows the match; the draft budget keeps nearest positions."""
from __future__ import annotations

import random

import numpy as np

from strata.config.speculative_config import parse_speculative_config
from strata.engine.request import Request
from strata.engine.speculative.decoder import within_budget
from strata.engine.speculative.draft_length import DraftDepth
from strata.engine.speculative.ngram import continuation, latest_longest_match
from strata.engine.speculative.suffix import SuffixProposer
from strata.engine.speculative.suffix_tree import SuffixTree
from strata.sampling_params import SamplingParams


def brute_force_match(tokens: list[int], min_n: int, max_n: int) -> tuple[int, int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1:end + 1] == suffix:
                return n, end
    return 0, -1


def test_ngram_lookup_finds_the_latest_longest_earlier_occurrence():
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        low = rng.randrange(1, 4)
        high = rng.randrange(low, 7)
        assert latest_longest_match(np.array(tokens), low, high) == brute_force_match(tokens, low, high), tokens


def test_ngram_continuation_repeats_a_pattern_that_overlaps_the_end():
    tokens = np.array([9, 1, 2, 3, 1, 2, 3, 1, 2])
    n, end = latest_longest_match(tokens, 1, 5)
    assert (n, end) == (5, 5)
    assert continuation(tokens, end + 1, 7) == [3, 1, 2, 3, 1, 2, 3]


def occurrences(sequences: list[list[int]], s: list[int], depth: int) -> int:
    """Suffixes (cut to `depth` tokens) that start with `s`."""
    return sum(1 for seq in sequences for start in range(len(seq))
               if len(s) <= depth and seq[start:start + len(s)] == s)


def node_count(tree: SuffixTree, s: list[int]) -> int:
    found = tree._match(s)
    return 0 if found is None else found[0].count


def test_suffix_tree_counts_every_occurrence_through_growth_and_removal():
    rng = random.Random(1)
    depth = 6
    tree, live = SuffixTree(depth), {}
    for step in range(60):
        seq_id = rng.randrange(5)
        if rng.random() < 0.15 and seq_id in live:
            tree.remove(seq_id)
            del live[seq_id]
        else:
            new = [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
            tree.extend(seq_id, new)
            live.setdefault(seq_id, []).extend(new)
        for _ in range(20):
            source = live[rng.choice(list(live))] if live else [0]
            start = rng.randrange(len(source))
            s = source[start:start + rng.randrange(1, depth + 1)]
            assert node_count(tree, s) == occurrences(list(live.values()), s, depth), (step, s)


def test_suffix_drafts_follow_the_most_frequent_continuation_as_far_as_the_match_supports():
    tree = SuffixTree(8)
    tree.extend("a", [1, 2, 3, 4, 5, 6])
    tree.extend("b", [1, 2, 3, 4, 7, 8])
    tree.extend("c", [1, 2, 3, 4, 5, 9])
    # "2 3" matched (2 tokens, factor 1): at most 2 tokens, "4" then "5" (2 of the 3 continuations).
    draft = tree.speculate([0, 2, 3], max_tokens=8, max_spec_factor=1.0, min_prob=0.1)
    assert (draft.token_ids, draft.match_len) == ([4, 5], 2)
    assert abs(draft.score - (1 + 2 / 3)) < 1e-9
    # A longer match proposes more; a high minimum probability stops before the 2-in-3 branch.
    assert tree.speculate([1, 2, 3], 8, 2.0, 0.1).token_ids == [4, 5, 6]
    assert tree.speculate([1, 2, 3], 8, 2.0, 0.7).token_ids == [4]


def test_the_suffix_proposer_drafts_from_other_requests_outputs():
    config = parse_speculative_config({"method": "suffix", "num_speculative_tokens": 8})
    proposer = SuffixProposer(config)
    params = SamplingParams(max_tokens=50)
    first = Request("first", [3, 4], params, 100)
    first.token_ids += [10, 11, 12, 13, 14, 15, 16]
    proposer.propose(first, 8)
    proposer.finish(first)
    second = Request("second", [5, 6, 10, 11, 12], params, 100)
    assert proposer.propose(second, 8) == [13, 14, 15]  # three matched tokens: up to three drafted


def test_the_draft_budget_keeps_every_requests_nearest_positions_first():
    proposals = {"a": [1, 2, 3, 4], "b": [5], "c": [6, 7, 8]}
    assert within_budget(proposals, 20) == proposals
    assert within_budget(proposals, 6) == {"a": [1, 2, 3], "b": [5], "c": [6, 7]}
    assert within_budget(proposals, 2) == {"a": [1], "b": [5]}


def depth_after(seconds_per_step, acceptance: float, lengths: list[int], num_decodes: int = 1,
                room: int | None = None) -> int:
    """The depth DraftDepth picks once it measured steps of 1 to 17 tokens and drafts accepted at `acceptance`
    per position (cumulative: a token is accepted only after all before it)."""
    depth = DraftDepth()
    for tokens in range(1, 18):
        depth.times.observe(tokens, seconds_per_step(tokens))
    for _ in range(200):
        depth.record(8, 8)
    for position in range(8):  # set the measured acceptance to acceptance ** (position + 1)
        depth.accepted[position] = round(200 * acceptance ** (position + 1))
    return depth.choose(num_decodes, lengths, room=room)


def test_drafts_go_deep_while_steps_cost_the_same_and_vanish_once_every_token_costs_a_decode():
    assert depth_after(lambda t: 0.05, 0.8, [8]) == 8  # bound by reading the weights: every draft is free
    assert depth_after(lambda t: 0.05 * t, 0.8, [8]) == 0  # every token costs a decode step
    # A decode at 50 ms and 20 ms a token more (as a busy 2-core CPU measured): a few drafts pay, not eight.
    assert 2 <= depth_after(lambda t: 0.03 + 0.02 * t, 0.8, [8]) <= 5
    assert depth_after(lambda t: 0.03 + 0.02 * t, 0.2, [8]) <= 1  # rarely accepted: hardly any


def test_depths_are_weighed_at_the_size_the_step_budget_leaves():
    """Four decodes with room for four draft tokens: every depth past one is cut back to one draft each, so one is
    the depth chosen while drafts are nearly free."""
    assert depth_after(lambda t: 0.05 + 0.0001 * t, 0.8, [8] * 4, num_decodes=4, room=4) == 1
    assert depth_after(lambda t: 0.05 + 0.0001 * t, 0.8, [8] * 4, num_decodes=4) == 8


def test_drafts_need_a_clear_promised_gain_and_both_ends_keep_being_measured():
    # One draft token accepted at 0.1 per step of 2 tokens costing 8% more: 1.1 / 1.08 tokens, under the 5% margin.
    assert depth_after(lambda t: 0.05 * (1 + 0.08 * (t - 1)), 0.1, [1]) == 0
    assert depth_after(lambda t: 0.05 * (1 + 0.08 * (t - 1)), 0.5, [1]) == 1  # 1.5 / 1.08: a clear gain
    for cost_per_token, accepted in ((0.0, 20), (0.08, 0)):
        depth = DraftDepth()
        for tokens in range(1, 18):
            depth.times.observe(tokens, 0.05 * (1 + cost_per_token * (tokens - 1)))
        for i in range(20):
            depth.record(1, int(i < accepted))
        chosen = [depth.choose(1, [1]) for _ in range(32)]
        # Free drafts accepted 21 times in 22: always drafted. Accepted 1 time in 22 at 8% more a token: only in
        # the steps that keep every draft (one in 16). Then a 1.5 / 1.08 gain (as measured before any draft):
        # drafted, but for one step in 16, which measures plain decoding again (a gain that small could come from a
        # stale time of the plain step).
        assert chosen.count(1) == (32 if accepted else 2)
    depth = DraftDepth()
    for tokens in range(1, 18):
        depth.times.observe(tokens, 0.05 * (1 + 0.08 * (tokens - 1)))
    chosen = [depth.choose(1, [1]) for _ in range(32)]
    assert chosen.count(0) == 2 and chosen.count(1) == 30


def test_a_request_that_never_drafted_still_leaves_its_output_to_the_shared_tree():
    proposer = SuffixProposer(parse_speculative_config({"method": "suffix", "num_speculative_tokens": 8}))
    done = Request("done", [1, 2], SamplingParams(max_tokens=50), 100)
    done.token_ids += [20, 21, 22, 23]
    proposer.finish(done)  # finished while the steps were full: no tree of its prompt was built
    assert proposer.local == {}
    later = Request("later", [9, 20, 21], SamplingParams(max_tokens=50), 100)
    assert proposer.propose(later, 8) == [22, 23]
