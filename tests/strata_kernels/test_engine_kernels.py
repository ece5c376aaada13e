"""The whole engine with kernels="triton" (on CPU under Triton's interpreter) gives the greedy tokens of the
plain-torch kernels: Llama, Llama 4 (text, and with an image), Mamba2 and PLaMo2, through chunked prefill,
prefix-cache hits, preemption, and TP=2 / PP=2."""
from __future__ import annotations

import os

import pytest
import torch
from llama4_checkpoints import image_chat, make_llama4_multimodal, make_llama4_text, noise_image
from mamba_checkpoints import StepRunner, make_mamba2, make_plamo2
from PIL import Image

from strata import LLM, ConfigError, SamplingParams
from strata.config import resolve_kernels

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 before triton is imported (tests/conftest.py sets it)",
                allow_module_level=True)

MAX_TOKENS = 4  # each step is slow in the interpreter


def prompts(lengths: tuple[int, ...], vocab: int, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, vocab, (n,), generator=gen).tolist()} for n in lengths]


def tokens(path, requests: list, *, chat: bool = False, max_tokens: int = MAX_TOKENS,
           **engine_args) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=engine_args.pop("max_model_len", 256),
              **engine_args)
    run = llm.chat if chat else llm.generate
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in run(requests, greedy, use_tqdm=False)], llm


def assert_same_tokens(path, requests: list, *, chat: bool = False, **engine_args) -> LLM:
    expected, _ = tokens(path, requests, chat=chat, kernels="torch", **engine_args)
    got, llm = tokens(path, requests, chat=chat, kernels="triton", **engine_args)
    assert llm.engine.config.kernels == "triton"
    assert got == expected
    return llm


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from checkpoints import make_llama

    return make_llama(tmp_path_factory.mktemp("llama_triton"), num_heads=4, num_kv_heads=2, hidden_size=64)


@pytest.fixture(scope="module")
def plamo2(tmp_path_factory):
    """Layers M A M A with a 12-token window, so that long prompts leave keys behind."""
    return make_plamo2(tmp_path_factory.mktemp("plamo2_triton"), num_kv_heads=2, window=12, seed=3)


@pytest.fixture(scope="module")
def mamba2(tmp_path_factory):
    return make_mamba2(tmp_path_factory.mktemp("mamba2_triton"), n_groups=2, seed=4)


def test_llama_chunked_prefill_and_batching(llama):
    assert_same_tokens(llama, prompts((1, 5, 23, 40), 300), max_num_batched_tokens=16)


def test_llama_prefix_cache_hits_continue_from_cached_blocks(llama):
    shared = prompts((40,), 300, seed=5)[0]["prompt_token_ids"]
    requests = [{"prompt_token_ids": shared + [7, 8, 9]}, {"prompt_token_ids": shared + [10, 11]}]
    llm = assert_same_tokens(llama, requests, enable_prefix_caching=True, max_num_seqs=1)
    assert llm.engine.snapshot()["prefix_hits"] > 0


def test_llama_preemption_recomputes_the_same_tokens(llama):
    # 2 layers x 2 KV heads x 16 dims x 16 tokens x 2 (K, V) x 4 bytes = 8 KiB a block: 6 blocks admit all three
    # prompts (two blocks each), and the first to need a third block preempts another.
    llm = assert_same_tokens(llama, prompts((28, 29, 30), 300, seed=1), kv_cache_memory=6 * 8192,
                             enable_prefix_caching=False, max_model_len=64, max_tokens=6)
    assert llm.engine.scheduler.num_preemptions > 0


def test_llama4_attention_chunks_and_moe(tmp_path):
    path = make_llama4_text(tmp_path / "llama4", seed=2)
    assert_same_tokens(path, prompts((3, 19, 30), 500), max_num_batched_tokens=8)


def test_llama4_with_an_image_split_across_chunks(tmp_path):
    path = make_llama4_multimodal(tmp_path / "llama4_mm", seed=7,
                                  text_overrides=dict(attention_chunk_size=16, no_rope_layer_interval=2))
    conversations = [image_chat(noise_image(60, 150, seed=1)), image_chat(Image.new("RGB", (40, 30)), "Hi"),
                     [{"role": "user", "content": "The quick brown fox"}]]
    assert_same_tokens(path, conversations, chat=True, max_num_batched_tokens=12, max_num_seqs=3)


@pytest.mark.parametrize("name", ["plamo2", "mamba2"])
def test_hybrid_and_mamba_models_batched_and_chunked(name, request):
    path = request.getfixturevalue(name)
    assert_same_tokens(path, prompts((1, 2, 9, 30, 45), 260, seed=2), max_num_batched_tokens=16)


def test_plamo2_preemption_recomputes_state_and_cache(plamo2):
    # 8 KiB a block (as for Llama above), beside one state slot per sequence.
    state = StepRunner(plamo2, max_num_seqs=256).runner.state_bytes()
    llm = assert_same_tokens(plamo2, prompts((28, 29, 30), 260, seed=6), kv_cache_memory=state + 6 * 8192,
                             max_model_len=64, max_num_batched_tokens=32, max_tokens=6)
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)])
def test_tp2_and_pp2_give_the_tokens_of_one_rank(plamo2, llama, layout):
    for path, vocab in ((plamo2, 260), (llama, 300)):
        requests = prompts((4, 21), vocab, seed=9)
        expected, _ = tokens(path, requests, kernels="torch")
        got, llm = tokens(path, requests, kernels="triton", max_num_batched_tokens=16, **layout)
        llm.shutdown()
        assert got == expected


def test_kernels_option_is_resolved_and_checked(monkeypatch):
    assert resolve_kernels("auto", "cpu") == "torch"
    assert resolve_kernels("torch", "cpu") == "torch"
    assert resolve_kernels("triton", "cpu") == "triton"  # TRITON_INTERPRET=1 here
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        resolve_kernels("triton", "cpu")
    with pytest.raises(ConfigError, match="kernels"):
        resolve_kernels("cuda-graphs", "cpu")
