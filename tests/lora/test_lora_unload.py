"""An adapter unloaded while requests still use it (one running, one waiting for the only slot) and its folder
deleted: they finish with it (PEFT's tokens and logprobs), host memory holding it past max_cpu_loras while another
adapter runs; then it is forgotten, and the engine keeps serving."""
from __future__ import annotations

import shutil

from arch_checkpoints import assert_matches_transformers, random_prompts
from checkpoints import make_llama
from lora_checkpoints import make_adapter, peft_greedy

from strata import LLM, LoRARequest, SamplingParams

MAX_TOKENS = 6
PROMPTS = random_prompts((11, 5), seed=2)


def test_unloaded_adapter_serves_its_unfinished_requests_until_they_end(tmp_path):
    base = make_llama(tmp_path / "base")
    kept = make_adapter(base, tmp_path / "kept", r=8, alpha=16, seed=1)  # PEFT's copy of the one deleted below
    gone = shutil.copytree(kept, tmp_path / "gone")
    other = make_adapter(base, tmp_path / "other", r=4, alpha=8, rslora=True, seed=2)
    gone_lora, other_lora = LoRARequest("gone", 1, str(gone)), LoRARequest("other", 2, str(other))
    # One slot and one adapter in host memory: without the pin, "other" would evict "gone", read again later.
    llm = LLM(str(base), dtype="float32", device="cpu", max_model_len=64, enable_lora=True, max_loras=1,
              max_lora_rank=8, max_cpu_loras=1)
    try:
        engine, manager = llm.engine, llm.engine.core.executor.runner.lora
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
        engine.add_request("other_first", {"prompt_token_ids": PROMPTS[1]}, params, lora_request=other_lora)
        engine.add_request("gone_0", {"prompt_token_ids": PROMPTS[0]}, params, lora_request=gone_lora)
        engine.add_request("gone_1", {"prompt_token_ids": PROMPTS[1]}, params, lora_request=gone_lora)
        engine.add_request("other_last", {"prompt_token_ids": PROMPTS[0]}, params, lora_request=other_lora)
        done = {out.request_id: out for out in engine.step() if out.finished}  # "other_first" runs, the rest wait
        engine.core.remove_lora(gone_lora.lora_int_id)
        shutil.rmtree(gone)
        assert 1 in manager.pinned and 1 in manager.loaded
        while engine.has_unfinished_requests():
            done.update((out.request_id, out) for out in engine.step() if out.finished)
        assert 1 not in manager.known and 1 not in manager.loaded and not manager.pinned
        assert not engine.core.unloading_loras
        # The engine still serves: the base model and the other adapter.
        after = llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 2, params, use_tqdm=False,
                             lora_request=[None, other_lora])
    finally:
        llm.shutdown()
    assert_matches_transformers([done["gone_0"], done["gone_1"]], peft_greedy(base, kept, PROMPTS, MAX_TOKENS))
    assert_matches_transformers([done["other_first"], done["other_last"]],
                                peft_greedy(base, other, PROMPTS[::-1], MAX_TOKENS))
    assert_matches_transformers(after[:1], peft_greedy(base, None, PROMPTS[:1], MAX_TOKENS))
    assert_matches_transformers(after[1:], peft_greedy(base, other, PROMPTS[:1], MAX_TOKENS))
