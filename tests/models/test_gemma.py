"""Gemma 2 and Gemma 3 against transformers in float32: greedy tokens of `generate` and logprobs of full forward passes
over prompts and outputs that run past the 8-token sliding windows; soft-capping (attention and final logits) that
changes the result and is followed exactly; the config spellings each generation reads; a Gemma 3 multimodal
checkpoint's language model; the fused CPU decode path never running soft-capped attention, the C decode kernel and
the Triton kernels running it as torch does."""
from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

import pytest
import torch
from arch_checkpoints import (
    COMMON,
    GEMMA,
    GEMMA_WINDOW,
    assert_matches_transformers,
    edit_config,
    make_arch,
    random_prompts,
    strata_greedy,
)
from checkpoints import write_tokenizer

from strata.config import EngineConfig, HFConfig, kernels_for_model
from strata.layers.decode_forward import FusedDecodeForward
from strata.models.gemma import Gemma2Args, Gemma3Args

PROMPTS = tuple(tuple(p) for p in random_prompts((5, 11, 24), seed=7))  # 5 + 16 tokens already pass the window
MAX_TOKENS = 16


def transformers_generate(path: Path, prompts, max_tokens: int, model_class: str = "AutoModelForCausalLM",
                          **load_options) -> list[dict]:
    """transformers' `generate` (greedy, its KV cache, no stop token) and the log-softmax of a full forward pass
    over prompt + output at every generated position. `load_options` go to `from_pretrained`."""
    import transformers

    model = getattr(transformers, model_class).from_pretrained(path, dtype=torch.float32, **load_options).eval()
    results = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            tokens = out[0, len(prompt):].tolist()
            logits = model(out[:, :-1]).logits[0, len(prompt) - 1:]
            results.append({"tokens": tokens, "logprobs": torch.log_softmax(logits, dim=-1)})
    return results


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma")

    @functools.cache
    def build(name: str, tied: bool = True) -> Path:
        return make_arch(root / f"{name}{'_tied' if tied else ''}", name, tied=tied, seed=int(tied))

    return build


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("name", sorted(GEMMA))
def test_greedy_tokens_and_logprobs_match_transformers_generate(gemma_path, name, tied):
    path = gemma_path(name, tied)
    assert max(map(len, PROMPTS)) + MAX_TOKENS > 2 * GEMMA_WINDOW
    assert_matches_transformers(strata_greedy(path, PROMPTS, MAX_TOKENS),
                                transformers_generate(path, PROMPTS, MAX_TOKENS))


def _max_logprob_gap(a: list, b: list) -> float:
    """The largest difference between two runs' logprobs of the tokens both report."""
    gaps = [abs(pa[t].logprob - pb[t].logprob) for oa, ob in zip(a, b, strict=True)
            for pa, pb in zip(oa.outputs[0].logprobs, ob.outputs[0].logprobs, strict=True) for t in pa.keys() & pb]
    return max(gaps)


@pytest.mark.parametrize("caps", [dict(attn_logit_softcapping=None),
                                  dict(final_logit_softcapping=None)], ids=["attention", "final"])
def test_each_soft_cap_changes_the_result_and_is_followed(gemma_path, tmp_path, caps):
    """Without one of its caps the checkpoint gives other logprobs (so the cap is doing something at these sizes),
    and strata follows transformers both with and without it."""
    capped = gemma_path("gemma2")
    uncapped = make_arch(tmp_path / "uncapped", "gemma2", tied=True, seed=1, **caps)
    prompts = PROMPTS[:2]
    with_cap, without = strata_greedy(capped, prompts, 8), strata_greedy(uncapped, prompts, 8)
    assert _max_logprob_gap(with_cap, without) > 0.05
    assert_matches_transformers(with_cap, transformers_generate(capped, prompts, 8))
    assert_matches_transformers(without, transformers_generate(uncapped, prompts, 8))


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_decode_steps_take_the_whole_step_cpu_path_and_follow_transformers(gemma_path, monkeypatch, name):
    """Every decode step is one C call (embedding scale, the sandwich norms with their 1 + w weights, GELU-tanh,
    Gemma 2's attention and final caps, Gemma 3's q/k norms and two rotary bases, windows), and the tokens and
    logprobs are transformers'."""
    from strata.kernels.cpu import decode_layer

    if decode_layer.library() is None or decode_layer.kernels() is None:
        pytest.skip("no C compiler")
    served = []
    original = FusedDecodeForward.__call__
    monkeypatch.setattr(FusedDecodeForward, "__call__",
                        lambda self, *a: served.append(original(self, *a)) or served[-1])
    path = gemma_path(name)
    outputs = strata_greedy(path, PROMPTS, 6)
    assert sum(s is not None for s in served) == 5  # every decode step (the prefill takes the modules)
    assert_matches_transformers(outputs, transformers_generate(path, PROMPTS, 6))


def _greedy_runs_match(a: list, b: list, tolerance: float) -> None:
    """The same greedy tokens, and every logprob both report within `tolerance`."""
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert _max_logprob_gap(a, b) < tolerance


def test_triton_kernels_give_the_soft_capped_tokens_of_torch(gemma_path):
    """Gemma 2's capped attention on the Triton kernels (the interpreter on CPU): the tokens and logprobs of the
    torch kernels, through chunked prefill (8-token chunks) and a prefix-cache hit (the third prompt repeats the
    first's 16-token head, so its prefill reads cached context). `auto` and the start-up check keep it on Triton."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("no triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 before triton is imported (tests/conftest.py sets it)")
    path = gemma_path("gemma2")
    prompts = [PROMPTS[2], PROMPTS[1], PROMPTS[2][:16] + PROMPTS[0]]
    options = dict(max_num_batched_tokens=8, enable_prefix_caching=True, max_num_seqs=1)
    torch_run = strata_greedy(path, prompts, 5, kernels="torch", **options)
    triton_run = strata_greedy(path, prompts, 5, kernels="triton", **options)
    _greedy_runs_match(triton_run, torch_run, 1e-4)
    assert EngineConfig.create(str(path), kernels="triton", device="cpu", dtype="float32").kernels == "triton"
    assert kernels_for_model("auto", "triton", HFConfig({"attn_logit_softcapping": 50.0})) == "triton"


def test_decode_steps_attend_through_the_cpu_kernel_with_the_cap(gemma_path, monkeypatch):
    """On the modules' path (as with TP > 1, whose all-reduce comes before the sandwich norms), capped layers' decode
    steps run the C decode kernel given the cap, and the tokens still follow transformers."""
    from strata.kernels.cpu import attention as cpu_attention

    if cpu_attention.decode_library() is None:
        pytest.skip("no C compiler")
    from strata.layers import decode_block

    monkeypatch.setattr(decode_block, "describe", lambda *a: None)  # the modules' path, not the fused C blocks
    caps = []
    kernel = cpu_attention.paged_decode_attention
    monkeypatch.setattr(cpu_attention, "paged_decode_attention",
                        lambda *a, **kw: caps.append(kw.get("softcap")) or kernel(*a, **kw))
    path = gemma_path("gemma2")
    outputs = strata_greedy(path, PROMPTS[:2], 6)
    assert caps and set(caps) == {GEMMA["gemma2"][2]["attn_logit_softcapping"]}
    assert len(caps) >= 5 * GEMMA["gemma2"][2]["num_hidden_layers"]  # every layer of every decode step
    assert_matches_transformers(outputs, transformers_generate(path, PROMPTS[:2], 6))


def test_windows_follow_transformers_layer_types_and_patterns():
    """Configs without layer_types: Gemma 2 slides on even layers, Gemma 3 on all but every sliding_window_pattern-th
    (as transformers derives layer_types from them)."""
    from transformers import Gemma2Config, Gemma3TextConfig

    values = dict(COMMON, num_hidden_layers=7, sliding_window=GEMMA_WINDOW)
    for config, args_class, extra in ((Gemma2Config(**values), Gemma2Args, {}),
                                      (Gemma3TextConfig(**values, sliding_window_pattern=3), Gemma3Args,
                                       dict(sliding_window_pattern=3))):
        expected = tuple(GEMMA_WINDOW if kind == "sliding_attention" else None for kind in config.layer_types)
        assert None in expected and GEMMA_WINDOW in expected
        assert args_class.from_hf(HFConfig({**values, **extra})).windows == expected


def test_gemma3_older_rope_keys_load_as_transformers_reads_them(tmp_path):
    """Configs before transformers 5: rope_theta and rope_scaling for global layers, rope_local_base_freq for local
    ones, a sliding_window_pattern instead of layer_types."""
    path = make_arch(tmp_path / "old", "gemma3", seed=3)
    edit_config(path, rope_parameters=None, layer_types=None, sliding_window_pattern=2, rope_theta=5000.0,
                rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_local_base_freq=50.0)
    args = Gemma3Args.from_hf(HFConfig(__import__("json").loads((path / "config.json").read_text())))
    assert (args.rope_theta, args.local_rope_theta, args.rope_scaling["factor"]) == (5000.0, 50.0, 2.0)
    assert args.windows == (GEMMA_WINDOW, None, GEMMA_WINDOW, None)
    assert_matches_transformers(strata_greedy(path, PROMPTS[:2], 8), transformers_generate(path, PROMPTS[:2], 8))


def test_gemma3_multimodal_checkpoint_runs_its_language_model_on_text(tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint (a tiny SigLIP tower beside the language model): text prompts
    give transformers' tokens and logprobs of the whole model; the vision weights are skipped."""
    import transformers

    text = dict(COMMON, **GEMMA["gemma3"][2], tie_word_embeddings=True)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    image = COMMON["vocab_size"] + 5  # special tokens outside the vocabulary: no text token is one of them
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=image, boi_token_index=image + 1, eoi_token_index=image + 2)
    torch.manual_seed(5)
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif "norm" in name and "language_model" in name:
                p.uniform_(-0.4, 0.4)
    path = tmp_path / "gemma3_mm"
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, COMMON["vocab_size"])
    prompts = PROMPTS[:2]
    assert_matches_transformers(strata_greedy(path, prompts, 8),
                                transformers_generate(path, prompts, 8, "Gemma3ForConditionalGeneration"))



@pytest.fixture(scope="module")
def layouts(gemma_path, tmp_path_factory) -> dict[str, dict]:
    """Both generations' greedy runs in one process and across two gloo ranks as PP=2 and as TP=2 (the machinery
    of test_architecture_layouts: one pair of processes for all of them)."""
    import json

    from processes import spawn_ranks
    from test_architecture_layouts import _rank_main, greedy

    from strata.distributed import ParallelContext

    paths = {name: str(gemma_path(name, tied)) for name, tied in (("gemma2", True), ("gemma3", False))}
    folder = tmp_path_factory.mktemp("gemma_layouts")
    spawn_ranks(_rank_main, 2, lambda port: (port, list(paths.values()), str(folder)))
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]
    return {name: {"one": greedy(path, ParallelContext()), "pp2": ranks[1][path]["pp2"],
                   "tp2": ranks[0][path]["tp2"]} for name, path in paths.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(GEMMA))
def test_pp2_and_tp2_give_the_tokens_of_one_process(layouts, name):
    """PP=2 (the last stage samples): the same tokens, logprobs within 1e-5. TP=2: the same tokens or, where they
    first differ, each side's token in the other's top 5, logprobs within 1e-4 before that."""
    one, pp, tp = layouts[name]["one"], layouts[name]["pp2"], layouts[name]["tp2"]
    assert pp["tokens"] == one["tokens"]
    for got, want in zip(pp["logprobs"], one["logprobs"], strict=True):
        for got_pos, want_pos in zip(got, want, strict=True):
            assert got_pos.keys() == want_pos.keys()
            assert max(abs(got_pos[t] - want_pos[t]) for t in want_pos) < 1e-5
    for got, want, got_lp, want_lp in zip(tp["tokens"], one["tokens"], tp["logprobs"], one["logprobs"],
                                          strict=True):
        same = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(want))
        for got_pos, want_pos in zip(got_lp[:same], want_lp[:same], strict=True):
            assert max(abs(got_pos[t] - lp) for t, lp in want_pos.items() if t in got_pos) < 1e-4
        if same < len(want):
            assert str(got[same]) in want_lp[same] and str(want[same]) in got_lp[same]
