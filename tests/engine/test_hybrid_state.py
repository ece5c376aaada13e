"""Per-request Mamba state through the engine: continuation (prefix + decode, chunked prefill), batching,
preemption, slot reuse and release, and the state cache options, on PLaMo2 (hybrid) and Mamba2 (no attention)."""
from __future__ import annotations

import random

import pytest
import torch
from mamba_checkpoints import StepRunner, make_mamba2, make_plamo2, one_torch_thread  # noqa: F401 (fixture)

from strata import LLM, ConfigError, SamplingParams
from strata.engine.engine import Engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-4


@pytest.fixture(scope="module")
def plamo2(tmp_path_factory):
    """Layers M A M A, two KV heads; block size 16 so that prompts cross KV blocks."""
    return make_plamo2(tmp_path_factory.mktemp("plamo2_state"), num_kv_heads=2, seed=7)


@pytest.fixture(scope="module")
def mamba2(tmp_path_factory):
    return make_mamba2(tmp_path_factory.mktemp("mamba2_state"), n_groups=2, seed=8)


@pytest.fixture(params=["plamo2", "mamba2"])
def model(request):
    return request.getfixturevalue(request.param)


def random_prompt(length: int, seed: int, vocab: int = 260) -> list[int]:
    return torch.randint(2, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def token_prompts(lengths, seed: int = 0) -> list[dict]:
    return [{"prompt_token_ids": random_prompt(n, seed + i)} for i, n in enumerate(lengths)]


def greedy(llm: LLM, prompts: list[dict], max_tokens: int = 8) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def make_llm(path, **args) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", max_model_len=args.pop("max_model_len", 128), **args)


@pytest.mark.parametrize("split", [1, 2, 5, 9])
def test_prefill_equals_prefix_prefill_then_token_by_token_decode(model, split):
    ids = random_prompt(21, split)
    runner = StepRunner(model)
    (full,) = runner.step([("full", ids, 0)])
    (head,) = runner.step([("split", ids[:split], 0)])
    rows = [head[-1]]
    for pos in range(split, len(ids) - 1):
        rows.append(runner.step([("split", [ids[pos]], pos)])[0][0])
    assert (torch.stack(rows) - full[split - 1:-1]).abs().max().item() < TOL


@pytest.mark.parametrize("ssm_dtype", ["float32", "bfloat16"])
def test_bfloat16_decode_stays_close_to_bfloat16_prefill(plamo2, ssm_dtype):
    ids = random_prompt(24, 77)
    runner = StepRunner(plamo2, dtype="bfloat16", mamba_ssm_cache_dtype=ssm_dtype)
    (full,) = runner.step([("full", ids, 0)])
    runner.step([("split", ids[:8], 0)])
    rows = [runner.step([("split", [ids[pos]], pos)])[0][0] for pos in range(8, len(ids))]
    diff = (torch.stack(rows).float() - full[8:].float()).abs().max().item()
    assert diff < 5e-2 * full.float().abs().max().item()


def test_prefill_equals_prefill_of_chunks_not_aligned_to_the_scan_chunk(model):
    ids = random_prompt(150, 3)  # scan chunks are 64 tokens; these splits fall inside them
    runner = StepRunner(model)
    (full,) = runner.step([("full", ids, 0)])
    parts, start = [], 0
    for end in (13, 77, 150):
        parts.append(runner.step([("chunked", ids[start:end], start)])[0])
        start = end
    assert (torch.cat(parts) - full).abs().max().item() < TOL


def test_batched_decodes_with_different_histories_equal_each_alone(model):
    prompts = [random_prompt(n, 50 + n) for n in (3, 10, 26)]
    alone = StepRunner(model)
    expected = []
    for i, p in enumerate(prompts):
        alone.step([(f"r{i}", p[:-1], 0)])
        expected.append(alone.step([(f"r{i}", p[-1:], len(p) - 1)])[0])
    together = StepRunner(model)
    together.step([(f"r{i}", p[:-1], 0) for i, p in enumerate(prompts)])
    got = together.step([(f"r{i}", p[-1:], len(p) - 1) for i, p in enumerate(prompts)])
    for g, e in zip(got, expected, strict=True):
        assert (g - e).abs().max().item() < TOL


@pytest.mark.parametrize("budget", [1, 4, 16])
def test_chunked_prefill_gives_the_tokens_of_unchunked_prefill(model, budget):
    prompts = token_prompts((5, 23, 40))
    expected = greedy(make_llm(model), prompts)
    assert greedy(make_llm(model, max_num_batched_tokens=budget), prompts) == expected


def test_all_prompts_batched_give_the_tokens_of_one_at_a_time(model):
    prompts = token_prompts((1, 4, 17, 33, 64), seed=100)
    llm = make_llm(model)
    one_by_one = [greedy(llm, [p])[0] for p in prompts]
    assert greedy(llm, prompts) == one_by_one


def test_preempted_requests_are_recomputed_to_the_same_tokens(plamo2):
    prompts = token_prompts((20, 30, 40, 25, 35, 45), seed=200)
    expected = greedy(make_llm(plamo2), prompts, max_tokens=24)
    # 2 attention layers x 2 KV heads x 16 dims x 16 tokens x 2 (K, V) x 4 bytes = 8 KiB per block; 10 blocks hold
    # two or three of these sequences at once, beside the state slots.
    llm = make_llm(plamo2, kv_cache_memory=state_bytes(plamo2) + 10 * 8192, max_num_batched_tokens=32)
    assert greedy(llm, prompts, max_tokens=24) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.slots.num_free == llm.engine.scheduler.slots.num_slots


def test_rounds_of_requests_with_aborts_leave_every_slot_and_block_free(model):
    llm = make_llm(model, max_num_seqs=16)
    engine: Engine = llm.engine
    rng = random.Random(0)
    prompts = [random_prompt(rng.randint(1, 30), 300 + i) for i in range(100)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 4), ignore_eos=True) for _ in prompts]
    first_round = None
    for round_ in range(10):
        ids = [f"{round_}-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, params, strict=True):
            engine.add_request(request_id, {"prompt_token_ids": prompt}, p)
        aborted = set(ids[round_::10])
        for request_id in aborted:
            engine.abort_request(request_id)
        results = {}
        while engine.has_unfinished_requests():
            if rng.random() < 0.2 and engine.output.groups:  # abort something mid-flight too
                victim = rng.choice(sorted(engine.output.groups))
                engine.abort_request(victim)
                aborted.add(victim)
            for out in engine.step():
                if out.finished:
                    results[out.request_id.split("-")[1]] = out.outputs[0].token_ids
        finished = {k: v for k, v in results.items() if f"{round_}-{k}" not in aborted}
        assert len(finished) + len(aborted) == len(prompts)
        assert all(len(v) == params[int(k)].max_tokens for k, v in finished.items())
        if first_round is None:
            first_round = finished
        else:  # a reused slot carries nothing over from its previous request
            assert all(first_round[k] == v for k, v in finished.items() if k in first_round)
    scheduler = engine.scheduler
    assert scheduler.slots.num_free == scheduler.slots.num_slots == 16
    assert not scheduler.running and not scheduler.waiting
    assert scheduler.kv.pool.num_free == scheduler.kv.pool.num_blocks


def test_ssm_state_dtype_follows_the_option(plamo2):
    runner = StepRunner(plamo2, mamba_ssm_cache_dtype="bfloat16").runner
    assert {m.ssm_state.dtype for m in runner.mamba_layers} == {torch.bfloat16}
    assert {m.conv_state.dtype for m in runner.mamba_layers} == {torch.float32}
    default = StepRunner(plamo2, dtype="bfloat16").runner
    assert {m.ssm_state.dtype for m in default.mamba_layers} == {torch.float32}
    assert {m.conv_state.dtype for m in default.mamba_layers} == {torch.bfloat16}


def test_ssm_state_dtype_flag_reaches_the_engine_config():
    from strata.cli import build_parser
    from strata.config.engine_args import engine_kwargs

    args = build_parser().parse_args(["bench", "throughput", "--model", "m", "--input-len", "1", "--output-len", "1",
                                      "--num-prompts", "1", "--mamba-ssm-cache-dtype", "bfloat16"])
    assert engine_kwargs(args)["mamba_ssm_cache_dtype"] == "bfloat16"


def state_bytes(path, max_num_seqs: int = 256) -> int:
    return StepRunner(path, max_num_seqs=max_num_seqs).runner.state_bytes()


def test_attention_free_model_needs_no_kv_cache(mamba2):
    runner = StepRunner(mamba2).runner
    assert runner.kv_bytes_per_block() == 0 and not runner.attention_layers
    llm = make_llm(mamba2, kv_cache_memory=state_bytes(mamba2), max_num_seqs=256)
    assert llm.engine.scheduler.kv.pool.num_blocks > 0


def test_state_slots_are_paid_from_the_cache_budget(plamo2, mamba2):
    block = StepRunner(plamo2).runner.kv_bytes_per_block()
    llm = make_llm(plamo2, kv_cache_memory=state_bytes(plamo2, 8) + 12 * block, max_num_seqs=8)
    assert llm.engine.scheduler.kv.pool.num_blocks == 12
    with pytest.raises(ConfigError, match="max_num_seqs=8") as e:
        make_llm(mamba2, kv_cache_memory=state_bytes(mamba2, 8) - 1, max_num_seqs=8)
    assert e.value.param == "max_num_seqs" and "at most 7" in e.value.message


def test_prefix_caching_is_off_for_hybrid_models(plamo2):
    assert make_llm(plamo2, enable_prefix_caching=True).engine.config.cache.enable_prefix_caching is False


@pytest.mark.parametrize(("maker", "field"), [(make_plamo2, "mamba_num_heads"), (make_mamba2, "num_heads")])
def test_tensor_parallel_size_must_divide_the_mamba_heads(maker, field, tmp_path):
    path = maker(tmp_path / "m", **({"mamba_num_heads": 6, "intermediate_size": 96} if field == "mamba_num_heads"
                                    else {"num_heads": 6, "head_dim": 32, "hidden_size": 96}))
    with pytest.raises(ConfigError, match=f"{field}=6"):
        make_llm(path, tensor_parallel_size=4)
