"""PLaMo2 against mlx-lm's independent implementation (same HF checkpoint layout): logits and greedy tokens on
several layer patterns / KV head counts / heads, the layer pattern itself, and TP / PP against one process."""
from __future__ import annotations

import pytest
import torch
from mamba_checkpoints import StepRunner, make_plamo2, one_torch_thread  # noqa: F401 (fixture)
from plamo2_oracle import mlx_greedy, mlx_logits, needs_mlx

from strata import LLM, SamplingParams
from strata.config import HFConfig
from strata.models.plamo2 import is_mamba

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIGS = {
    # name: (builder arguments, description)
    "step2_mqa_tied": dict(mamba_step=2, num_layers=4, num_kv_heads=1, tied=True, vocab_size=300, seed=1),
    "step4_gqa_untied": dict(mamba_step=4, num_layers=6, num_kv_heads=2, tied=False, vocab_size=272, seed=2),
    # HF pads an untied head to a multiple of 16 rows (300 -> 304); strata slices it, mlx gets a sliced copy.
    "step2_gqa_padded_head": dict(mamba_step=2, num_layers=3, num_kv_heads=2, tied=False, vocab_size=300,
                                  lm_head_rows=304, seed=3),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    return {name: make_plamo2(tmp_path_factory.mktemp(name), **args) for name, args in CONFIGS.items()}


def random_prompt(length: int, seed: int, vocab: int = 260) -> list[int]:
    return torch.randint(2, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_layer_pattern_follows_mamba_step():
    def pattern(layers: int, step: int) -> str:
        cfg = HFConfig({"num_hidden_layers": layers, "mamba_step": step})
        return "".join("M" if is_mamba(cfg, i) else "A" for i in range(layers))

    assert pattern(4, 2) == "MAMA"
    assert pattern(1, 2) == "A"
    assert pattern(2, 4) == "MA"
    assert pattern(8, 4) == "MMAMMMAM"
    assert not is_mamba(HFConfig({"num_hidden_layers": 4, "mamba_step": 2, "mamba_enabled": False}), 0)


@needs_mlx
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_of_one_forward_pass_match_mlx_lm(name, checkpoints):
    path = checkpoints[name]
    runner = StepRunner(path)
    for i, length in enumerate((1, 9, 40)):
        ids = random_prompt(length, i)
        (got,) = runner.step([(f"r{i}", ids, 0)])
        expected = mlx_logits(path, ids)
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() < 1e-3


@needs_mlx
@pytest.mark.parametrize("name", ["step2_mqa_tied", "step4_gqa_untied"])
def test_greedy_generation_matches_mlx_lm_token_for_token(name, checkpoints):
    path = checkpoints[name]
    prompts = [random_prompt(n, 30 + n) for n in (2, 11, 25)]
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=128)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == mlx_greedy(path, prompt, 10)


@needs_mlx
def test_sliding_window_attends_to_the_last_window_plus_one_tokens(tmp_path):
    """One attention layer: RoPE scores depend only on distances, so token t with window W sees exactly what the
    last token of ids[t-W : t+1] sees without a window (which mlx-lm computes; it has no window itself)."""
    window = 5
    path = make_plamo2(tmp_path / "swa", num_layers=1, mamba_step=1, mamba_enabled=False, num_kv_heads=2,
                       window=window, seed=4)
    ids = random_prompt(30, 9)
    runner = StepRunner(path)
    got = list(runner.step([("r", ids[:20], 0)])[0])  # prefill crosses a 16-token KV block
    got += [runner.step([("r", [ids[t]], t)])[0][0] for t in range(20, len(ids))]  # decodes
    for t in range(len(ids)):
        expected = mlx_logits(path, ids[max(0, t - window):t + 1])[-1]
        assert (got[t] - expected).abs().max().item() < 1e-3


@needs_mlx
def test_bfloat16_logits_stay_close_to_the_float32_reference(checkpoints):
    path = checkpoints["step2_mqa_tied"]
    ids = random_prompt(24, 5)
    (got,) = StepRunner(path, dtype="bfloat16").step([("r", ids, 0)])
    expected = mlx_logits(path, ids)
    assert (got.float() - expected).abs().max().item() < 5e-2 * expected.abs().max().item()


def generate_both(path, **layout) -> tuple[list[list[int]], list[list[int]]]:
    prompts = [{"prompt_token_ids": random_prompt(n, 40 + n)} for n in (3, 18, 35)]
    with LLM(str(path), dtype="float32", device="cpu", max_model_len=128, max_num_seqs=8, **layout) as llm:
        greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
        seeded = llm.generate(prompts, SamplingParams(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True),
                              use_tqdm=False)
    return [o.outputs[0].token_ids for o in greedy], [o.outputs[0].token_ids for o in seeded]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "layout"), [
    ("step2_mqa_tied", {"pipeline_parallel_size": 2}),
    ("step2_mqa_tied", {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}),  # one KV head, replicated
    ("step4_gqa_untied", {"tensor_parallel_size": 2}),  # two KV heads, k-norm rows sharded
    ("step4_gqa_untied", {"tensor_parallel_size": 4}),  # two KV heads over four ranks: k-norm row r // 2
])
def test_parallel_layouts_generate_the_tokens_of_one_process(name, layout, checkpoints):
    path = checkpoints[name]
    greedy, seeded = generate_both(path, **layout)
    expected_greedy, expected_seeded = generate_both(path)
    assert greedy == expected_greedy
    if layout.get("tensor_parallel_size", 1) == 1:  # TP sums partial products in another order
        assert seeded == expected_seeded
