"""The model's declaration (ModelArgs): Gemma's embedding scale and final soft cap are fields, defined once and applied
by CausalLM's one `embed_input_ids` / `compute_logits`, which the C whole decode step reads as well."""
from __future__ import annotations

import math

import pytest
import torch
from arch_checkpoints import make_arch, random_prompts

from strata.config import EngineConfig
from strata.distributed import ParallelContext
from strata.executor.model_runner import ModelRunner

HIDDEN = 48  # sqrt(48) = 6.9282...: 6.9375 in bfloat16, so the rounding rule shows in the embeddings


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    root = tmp_path_factory.mktemp("declaration")
    return {name: make_arch(root / name, name, hidden_size=HIDDEN) for name in ("gemma2", "gemma3")}


def _runner(path, dtype: str) -> ModelRunner:
    return ModelRunner(EngineConfig.create(str(path), dtype=dtype, device="cpu"), ParallelContext(),
                       torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_gemma_embeddings_are_scaled_with_transformers_rounding(gemma, dtype):
    """transformers rounds sqrt(hidden) to float32, then to the model's dtype, and multiplies in that dtype."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor(random_prompts((12,), seed=4)[0])
    hf = AutoModelForCausalLM.from_pretrained(gemma["gemma3"], dtype=dtype).eval()
    with torch.no_grad():
        want = hf.model.embed_tokens(ids[None])[0]
    model = _runner(gemma["gemma3"], str(dtype).removeprefix("torch.")).model
    with torch.inference_mode():
        got, table = model.embed_input_ids(ids), model.model.embed_tokens(ids)
    assert got.dtype == dtype and torch.equal(got, want)
    if dtype == torch.bfloat16:  # the unrounded scale gives other embeddings: the rule is doing something
        assert not torch.equal(got, table * math.sqrt(HIDDEN))


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_the_whole_decode_step_reads_the_scale_and_cap_the_torch_path_applies(gemma, name):
    """The C whole step's embedding scale is the torch path's float32 scale (transformers' embed_scale), its final
    soft cap the one compute_logits applies (Gemma 2's; none for Gemma 3)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    runner = _runner(gemma[name], "float32")
    hf = AutoModelForCausalLM.from_pretrained(gemma[name], dtype=torch.float32)
    embed_scale, divisor, cap = runner.cpu_decode.whole_step.scales
    assert embed_scale == float(hf.model.embed_tokens.embed_scale.float()) != math.sqrt(HIDDEN)
    assert embed_scale == float(runner.model.embedding_scale(torch.float32))
    want_cap = AutoConfig.from_pretrained(gemma[name]).final_logit_softcapping
    assert divisor == 1.0 and cap == (want_cap or 0.0) and runner.model.args.final_softcap == want_cap
    hidden = torch.randn(3, HIDDEN)
    with torch.inference_mode():
        logits = runner.model.compute_logits(hidden)
    with torch.no_grad():
        raw = hf.lm_head(hidden)
    expected = raw if want_cap is None else torch.tanh(raw / want_cap) * want_cap
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
