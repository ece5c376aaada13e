"""LoRA beyond Llama and Qwen3, against PEFT (unmerged PeftModel): Gemma 3 (text, tied embeddings; rsLoRA on and
off) and Qwen3-MoE's attention (q/k/v/o); adapters on Qwen3-MoE's experts or router are refused when loaded, with
the reason, before anything is queued."""
from __future__ import annotations

import pytest
import torch
from arch_checkpoints import assert_matches_transformers, make_arch, random_prompts
from lora_checkpoints import make_adapter, peft_greedy
from safetensors.torch import save_file

from strata import LLM, LoRARequest, RequestError, SamplingParams

MAX_TOKENS = 6
PROMPTS = random_prompts((19, 7), seed=1)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
# (rank, alpha, rsLoRA, targets) of each Gemma 3 adapter.
GEMMA_ADAPTERS = {
    "all_rslora": (8, 32, True, None),
    "some": (4, 8, False, ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]),
}


def _generate(llm, prompts, lora):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=lora)


def _llm(base) -> LLM:
    return LLM(str(base), dtype="float32", device="cpu", max_model_len=64, enable_lora=True, max_loras=2,
               max_lora_rank=8)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_gemma3")
    base = make_arch(root / "base", "gemma3", tied=True)
    adapters = {name: make_adapter(base, root / name, r=r, alpha=alpha, rslora=rslora, targets=targets, seed=i)
                for i, (name, (r, alpha, rslora, targets)) in enumerate(GEMMA_ADAPTERS.items())}
    llm = _llm(base)
    yield base, adapters, llm
    llm.shutdown()


@pytest.mark.parametrize("name", list(GEMMA_ADAPTERS))
def test_gemma3_adapter_matches_peft(gemma3, name):
    base, adapters, llm = gemma3
    lora = LoRARequest(name, list(GEMMA_ADAPTERS).index(name) + 1, str(adapters[name]))
    assert_matches_transformers(_generate(llm, PROMPTS, lora), peft_greedy(base, adapters[name], PROMPTS, MAX_TOKENS))


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_qwen3_moe")
    base = make_arch(root / "base", "qwen3_moe")
    llm = _llm(base)
    yield base, root, llm
    llm.shutdown()


@pytest.mark.parametrize("rslora", [True, False])
def test_qwen3_moe_attention_adapter_matches_peft(qwen3_moe, rslora):
    base, root, llm = qwen3_moe
    adapter = make_adapter(base, root / f"attention_{rslora}", r=8, alpha=24, rslora=rslora, targets=ATTENTION,
                           seed=5 + rslora)
    outputs = _generate(llm, PROMPTS, LoRARequest(f"attention_{rslora}", 10 + rslora, str(adapter)))
    assert_matches_transformers(outputs, peft_greedy(base, adapter, PROMPTS, MAX_TOKENS))


def _per_module_adapter(folder, module: str, rows: int):
    """An adapter of one module by name, with the config and tensor names PEFT writes for it (transformers 4 named
    Qwen3-MoE's experts one module each: mlp.experts.<e>.gate_proj)."""
    import json

    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": [module.rpartition(".")[2]], "bias": "none"}))
    prefix = f"base_model.model.model.layers.0.{module}"
    save_file({f"{prefix}.lora_A.weight": torch.randn(4, 64), f"{prefix}.lora_B.weight": torch.randn(rows, 4)},
              folder / "adapter_model.safetensors")
    return folder


def test_qwen3_moe_expert_adapters_are_refused_when_loaded(qwen3_moe):
    base, root, llm = qwen3_moe
    # PEFT with transformers 5 (fused experts) turns gate_proj / up_proj / down_proj into target_parameters.
    fused = make_adapter(base, root / "experts", r=4, alpha=8)
    cases = [(fused, r"target_parameters .* \(LoRA on MoE expert weights\) is not supported"),
             (_per_module_adapter(root / "expert0", "mlp.experts.0.gate_proj", 32),
              "targets model.layers.0.mlp.experts.0.gate_proj, an MoE expert or router"),
             (_per_module_adapter(root / "router", "mlp.gate", 4), "targets model.layers.0.mlp.gate, an MoE expert")]
    for i, (folder, reason) in enumerate(cases):
        with pytest.raises(RequestError, match=reason):
            _generate(llm, PROMPTS[:1], LoRARequest(folder.name, 20 + i, str(folder)))
        assert not llm.engine.has_unfinished_requests()
        with pytest.raises(RequestError, match=reason):  # and when loaded on its own (the server's load route)
            llm.engine.core.add_lora(LoRARequest(folder.name, 30 + i, str(folder)))
