"""n-gram speculative decoding with LoRA adapters: a verification step's rows carry their request's adapter, so
greedy tokens and logprobs stay PEFT's for each adapter and the base in one mixed batch."""
from __future__ import annotations

from arch_checkpoints import assert_matches_transformers
from checkpoints import make_llama
from lora_checkpoints import make_adapter, peft_greedy

from strata import LLM, LoRARequest, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Repetitive prompts: the tiny random model soon repeats itself too, so drafts are often right.
PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9, 13, 5, 9], [40, 41, 42, 43, 40, 41, 42, 43, 40, 41], [7, 7, 8, 7, 7, 8, 7]]
MAX_TOKENS = 24


def test_drafts_verified_under_each_requests_adapter_give_pefts_tokens(tmp_path):
    llama = make_llama(tmp_path / "base")
    adapters = [make_adapter(llama, tmp_path / f"lora{i}", r=r, alpha=2 * r, seed=i) for i, r in enumerate((4, 8))]
    llm = LLM(str(llama), dtype="float32", device="cpu", max_model_len=64, enable_lora=True, max_loras=2,
              max_lora_rank=8, speculative_config=NGRAM)
    try:
        loras = [LoRARequest("a", 1, str(adapters[0])), LoRARequest("b", 2, str(adapters[1])), None]
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
        before = llm.engine.spec.stats.copy()
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False,
                               lora_request=loras)
        stats = llm.engine.spec.stats.since(before)
    finally:
        llm.shutdown()
    assert stats.num_drafts > 0  # steps verified drafts (how many are accepted depends on the random model)
    for output, prompt, adapter in zip(outputs, PROMPTS, [*adapters, None], strict=True):
        assert_matches_transformers([output], peft_greedy(llama, adapter, [prompt], MAX_TOKENS))
