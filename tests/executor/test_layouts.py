"""Every TP x PP layout gives the tokens and logprobs of one process, and each rank holds what `strata plan` says."""
from __future__ import annotations

import pytest

from strata import LLM, SamplingParams
from strata.plan import plan_layout

PROMPTS = [
    "The quick brown fox",
    "def add(a, b):\n    return",
    "Paged attention stores keys and values in fixed size blocks. Once upon a time there was",
    "import os",
]
LAYOUTS = {
    "pp2": {"pipeline_parallel_size": 2},
    "pp3_uneven": {"pipeline_parallel_size": 3},  # 5 layers: 2, 2, 1
    "tp2_pp2": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
    "pp2_partition_1_4": {"pipeline_parallel_size": 2, "pp_layer_partition": (1, 4)},
    "tp2": {"tensor_parallel_size": 2},
    "tp4_more_ranks_than_kv_heads": {"tensor_parallel_size": 4},
}
NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 2, 16, 16


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **kw)


def seeded(i: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=0.95, seed=100 + i, max_tokens=12, ignore_eos=True)


def generate(llm: LLM, prompts: list[str], params) -> list:
    return llm.generate(prompts, params, use_tqdm=False)


def token_ids(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def run_all(llm: LLM) -> dict[str, list]:
    """The outputs every layout is compared on: single and batched prompts, greedy and seeded."""
    return {
        "greedy_single": generate(llm, PROMPTS[:1], greedy()),
        "greedy_batch": generate(llm, PROMPTS, greedy()),
        "seeded_single": generate(llm, PROMPTS[1:2], seeded(1)),
        "seeded_batch": generate(llm, PROMPTS, [seeded(i) for i in range(len(PROMPTS))]),
        "logprobs": generate(llm, PROMPTS[2:3], greedy(logprobs=5, prompt_logprobs=20)),
    }


@pytest.fixture(scope="module")
def expected(llama5, engine_args) -> dict[str, list]:
    with LLM(str(llama5), **engine_args) as llm:
        return run_all(llm)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request, llama5, engine_args):
    llm = LLM(str(llama5), **engine_args, **LAYOUTS[request.param])
    yield llm, run_all(llm)
    llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["greedy_single", "greedy_batch", "seeded_single", "seeded_batch"])
def test_tokens_match_one_process(layout, expected, case):
    _, got = layout
    assert token_ids(got[case]) == token_ids(expected[case])


def assert_positions_close(got: dict, want: dict, tolerance: float) -> None:
    """Same top-k values (sorted, so exact ties may swap ids) and the same chosen token's logprob."""
    got_values = sorted(lp.logprob for lp in got.values())
    want_values = sorted(lp.logprob for lp in want.values())
    assert len(got_values) == len(want_values)
    assert max(abs(a - b) for a, b in zip(got_values, want_values, strict=True)) < tolerance
    for token in set(got) & set(want):
        assert abs(got[token].logprob - want[token].logprob) < tolerance


@pytest.mark.slow
def test_prompt_and_sampled_logprobs_match_one_process_within_1e_4(layout, expected):
    _, got = layout
    got_out, want_out = got["logprobs"][0], expected["logprobs"][0]
    assert got_out.outputs[0].token_ids == want_out.outputs[0].token_ids
    assert want_out.prompt_logprobs[0] is None and got_out.prompt_logprobs[0] is None
    for got_pos, want_pos in zip(got_out.prompt_logprobs[1:], want_out.prompt_logprobs[1:], strict=True):
        assert_positions_close(got_pos, want_pos, 1e-4)
    for got_pos, want_pos in zip(got_out.outputs[0].logprobs, want_out.outputs[0].logprobs, strict=True):
        assert_positions_close(got_pos, want_pos, 1e-4)


@pytest.mark.slow
def test_each_rank_loads_the_bytes_strata_plan_predicts(layout):
    llm, _ = layout
    executor = llm.engine.executor
    plans = plan_layout(llm.engine.config)
    assert [info.rank for info in executor.rank_infos] == [p.rank for p in plans]
    for info, plan in zip(executor.rank_infos, plans, strict=True):
        assert info.weight_bytes == plan.param_bytes
        assert info.layers == plan.layers
        assert (info.tp_rank, info.pp_rank) == (plan.tp_rank, plan.pp_rank)


@pytest.mark.slow
def test_stages_hold_only_their_layers_and_their_kv_cache(layout):
    llm, _ = layout
    par = llm.engine.config.parallel
    assert llm.engine.executor.max_concurrent_batches == par.pipeline_parallel_size
    for info in llm.engine.executor.rank_infos:
        first, last = info.pp_rank == 0, info.pp_rank == par.pipeline_parallel_size - 1
        layers = {int(n.split(".")[2]) for n in info.param_names if n.startswith("model.layers.")}
        assert layers == set(range(*info.layers))
        # An untied checkpoint: the embedding only on the first stage, norm and LM head only on the last.
        assert any(n.startswith("model.embed_tokens.") for n in info.param_names) == first
        assert any(n.startswith("lm_head.") for n in info.param_names) == last
        assert any(n.startswith("model.norm.") for n in info.param_names) == last
        kv_heads = max(1, NUM_KV_HEADS // par.tensor_parallel_size)
        per_layer = 2 * BLOCK_SIZE * kv_heads * HEAD_DIM * 4
        assert info.kv_bytes_per_block == per_layer * len(layers)
    assert llm.engine.executor.num_kv_blocks == min(i.max_kv_blocks for i in llm.engine.executor.rank_infos)


def first_divergence_is_close(a, b, top: int = 5) -> None:
    """vLLM's check_logprobs_close: at the first differing token, each side's token is in the other's top-k."""
    for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
        if x != y:
            assert x in b.logprobs[i] and y in a.logprobs[i], f"position {i}: {x} vs {y} not in each other's top-{top}"
            return


@pytest.mark.slow
def test_tp2_in_bfloat16_stays_within_vllms_logprob_rule(llama5, engine_args):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    with LLM(str(llama5), dtype="bfloat16", **engine_args) as one:
        want = generate(one, PROMPTS, params)
    with LLM(str(llama5), dtype="bfloat16", tensor_parallel_size=2, **engine_args) as two:
        got = generate(two, PROMPTS, params)
    for g, w in zip(got, want, strict=True):
        first_divergence_is_close(g.outputs[0], w.outputs[0])
