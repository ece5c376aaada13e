"""Speculative decoding across processes: with TP = PP = 2 (drafts verified by every TP rank alike, batches in
flight between the stages), greedy and seeded requests get the tokens of one process without speculation."""
from __future__ import annotations

from strata import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": ([7, 8, 9, 10, 11] * 10)[:12 + 7 * i]} for i in range(4)]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def test_tp2_pp2_with_drafts_gives_the_tokens_of_one_process_without(llama5, engine_args):
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)] * 2
    with LLM(str(llama5), **engine_args) as one:
        want = [o.outputs[0].token_ids for o in one.generate(PROMPTS, params, use_tqdm=False)]
    with LLM(str(llama5), tensor_parallel_size=2, pipeline_parallel_size=2, speculative_config=NGRAM,
             **engine_args) as four:
        got = [o.outputs[0].token_ids for o in four.generate(PROMPTS, params, use_tqdm=False)]
        stats = four.engine.spec.stats
    assert got == want
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
