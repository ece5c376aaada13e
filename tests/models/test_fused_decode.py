"""The CPU decode path reads each architecture's layer description (biases, q/k norms, sliding windows, partial
rotary, multipliers, routed experts falling back per layer, GGUF blocks and tables) and gives exactly the tokens and
logprobs of the modules."""
from __future__ import annotations

import pytest
from arch_checkpoints import ARCHITECTURES, random_prompts

from strata import LLM, SamplingParams
from strata.kernels.cpu import decode_layer
from strata.layers.decode_block import FusedDecodeLayer
from strata.layers.decode_forward import FusedDecodeForward
from strata.layers.decode_stack import FusedDecodeStack


def _spy(monkeypatch, cls: type, method: str = "__call__") -> list:
    calls, original = [], getattr(cls, method)
    monkeypatch.setattr(cls, method, lambda self, *args: calls.append(original(self, *args)) or calls[-1])
    return calls


def modules_only(monkeypatch) -> None:
    """Every fused path off (the stack and the whole step keep the plans they described, so each is switched off)."""
    monkeypatch.setattr(FusedDecodeForward, "__call__", lambda self, *args: None)
    monkeypatch.setattr(FusedDecodeStack, "__call__", lambda self, *args: None)
    monkeypatch.setattr(FusedDecodeLayer, "serves_rows", lambda self, rows, meta: False)


def _fused_and_plain(path, monkeypatch, prompts) -> tuple[list, list, list, list]:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=4)
    with LLM(str(path), device="cpu", max_model_len=64, enable_prefix_caching=False) as llm:  # prefill alike
        whole, layers = _spy(monkeypatch, FusedDecodeForward), _spy(monkeypatch, FusedDecodeLayer)
        fused = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        modules_only(monkeypatch)
        plain = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    return fused, plain, [w for w in whole if w is not None], layers


def _assert_same(fused: list, plain: list) -> None:
    for a, b in zip(fused, plain, strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert {t: p.logprob for t, p in la.items()} == {t: p.logprob for t, p in lb.items()}


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_fused_decode_gives_the_modules_tokens_and_logprobs(name, arch_path, monkeypatch):
    if decode_layer.library() is None or decode_layer.kernels() is None:
        pytest.skip("no C compiler")
    prompts = [{"prompt_token_ids": p} for p in random_prompts((20, 9))]  # past the 16-token windows
    fused, plain, whole, layers = _fused_and_plain(arch_path(name), monkeypatch, prompts)
    _assert_same(fused, plain)
    if name == "qwen3_moe":  # routed experts: each layer's attention block in C, its experts as modules
        assert not whole and len(layers) == 9 * 3
    else:  # the 9 decode steps of each batch size (two prompts, then one) as one C call each
        assert len(whole) == 9 and not layers


def test_fused_decode_reads_ggml_blocks_mixed_pieces_and_a_block_table(gguf_all_types, monkeypatch):
    """Every ggml type, q/k/v stored in three types (one linear of three pieces), a Q8_0 embedding table."""
    prompts = [{"prompt_token_ids": list(range(5, 25))}, {"prompt_token_ids": list(range(40, 47))}]
    fused, plain, whole, _ = _fused_and_plain(gguf_all_types, monkeypatch, prompts)
    _assert_same(fused, plain)
    assert len(whole) == 9


def test_layers_past_their_measured_crossover_take_the_gemm_in_both_paths_alike(gguf_all_types, monkeypatch):
    """A crossover of 2 rows (as kernel_choice may measure where the GEMM is fast): decode steps of 3 and 4 rows
    take the GEMM for every ggml layer, inside the C step as in the modules, with the same bits; the default
    crossover keeps them on the small-batch kernel, whose sums round otherwise."""
    from strata.kernels.cpu import crossovers

    prompts = [{"prompt_token_ids": list(range(5 + 3 * i, 12 + 4 * i))} for i in range(4)]
    default, _, _, _ = _fused_and_plain(gguf_all_types, monkeypatch, prompts)
    monkeypatch.undo()
    monkeypatch.setattr(crossovers, "small_batch_rows", lambda operands, k: 2)
    fused, plain, whole, _ = _fused_and_plain(gguf_all_types, monkeypatch, prompts)
    _assert_same(fused, plain)
    assert len(whole) == 9
    assert any(a.logprobs != b.logprobs for a, b in zip(fused, default, strict=True))
