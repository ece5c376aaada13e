"""gpt-oss against transformers in float32: greedy tokens of `generate` and logprobs of full forward passes over
prompts and outputs that run past the 8-token sliding windows; attention sinks, YaRN and the SwiGLU clamp each
changing the result and being followed exactly; YaRN's tables against transformers' for the spellings configs use;
the released config.json's keys; PP=2 and TP=2 giving one process's tokens."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from arch_checkpoints import (
    COMMON,
    GPT_OSS,
    GPT_OSS_WINDOW,
    assert_matches_transformers,
    edit_config,
    make_gpt_oss,
    random_prompts,
    strata_greedy,
)
from safetensors.torch import load_file, save_file
from test_gemma import transformers_generate

from strata.config import HFConfig
from strata.layers.rotary import RotaryEmbedding
from strata.models.gpt_oss import GptOssArgs

PROMPTS = tuple(tuple(p) for p in random_prompts((5, 11, 24), seed=7))  # 5 + 16 tokens already pass the window
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def gpt_oss_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss")

    @functools.cache
    def build(tied: bool = False) -> Path:
        return make_gpt_oss(root / f"gpt_oss{'_tied' if tied else ''}", tied=tied, seed=int(tied))

    return build


@pytest.fixture(scope="module")
def reference(gpt_oss_path):
    """transformers' and strata's runs of the untied checkpoint over the first two prompts, 8 tokens each."""
    path = gpt_oss_path()
    return strata_greedy(path, PROMPTS[:2], 8), transformers_generate(path, PROMPTS[:2], 8)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_greedy_tokens_and_logprobs_match_transformers_generate(gpt_oss_path, tied):
    assert max(map(len, PROMPTS)) + MAX_TOKENS > 2 * GPT_OSS_WINDOW
    path = gpt_oss_path(tied)
    assert_matches_transformers(strata_greedy(path, PROMPTS, MAX_TOKENS),
                                transformers_generate(path, PROMPTS, MAX_TOKENS))


def test_decode_steps_run_the_attention_blocks_in_c_with_the_sinks(gpt_oss_path, reference, monkeypatch):
    """Each layer's attention block (sinks, windows, biases) is one C call on decode steps and the experts run as
    modules; the tokens and logprobs are transformers'."""
    from strata.kernels.cpu import decode_layer
    from strata.layers.decode_block import FusedDecodeLayer

    if decode_layer.library() is None or decode_layer.kernels() is None:
        pytest.skip("no C compiler")
    served, original = [], FusedDecodeLayer.__call__
    monkeypatch.setattr(FusedDecodeLayer, "__call__", lambda self, *a: served.append(self.plan) or original(self, *a))
    outputs = strata_greedy(gpt_oss_path(), PROMPTS[:2], 8)
    assert len(served) == 7 * COMMON["num_hidden_layers"] and all(p.mlp is None and p.attention.sinks for p in served)
    assert_matches_transformers(outputs, reference[1])


def _max_logprob_gap(a: list, b: list) -> float:
    """The largest difference between two runs' logprobs of the tokens both report."""
    gaps = [abs(pa[t].logprob - pb[t].logprob) for oa, ob in zip(a, b, strict=True)
            for pa, pb in zip(oa.outputs[0].logprobs, ob.outputs[0].logprobs, strict=True) for t in pa.keys() & pb]
    return max(gaps)


def _zero_sinks(path: Path) -> None:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    assert any(name.endswith(".sinks") for name in tensors)
    save_file({name: torch.zeros_like(t) if name.endswith(".sinks") else t for name, t in tensors.items()}, str(file),
              metadata={"format": "pt"})


def _without_yarn(path: Path) -> None:
    edit_config(path, rope_parameters={"rope_type": "default", "rope_theta": GPT_OSS["rope_parameters"]["rope_theta"]})


def _unbinding_limit(path: Path) -> None:
    edit_config(path, swiglu_limit=1e4)


@pytest.mark.parametrize("change", [_zero_sinks, _without_yarn, _unbinding_limit], ids=["sinks", "yarn", "clamp"])
def test_each_feature_changes_the_result_and_is_followed(reference, tmp_path, change):
    """The checkpoint with its sinks zeroed, its rotary left unscaled, or its SwiGLU limit out of reach gives other
    logprobs (so the feature does something at these sizes), and strata follows transformers with it too."""
    path = make_gpt_oss(tmp_path / "changed")
    change(path)
    with_feature, hf = reference
    assert_matches_transformers(with_feature, hf)
    without = strata_greedy(path, PROMPTS[:2], 8)
    assert _max_logprob_gap(with_feature, without) > 0.05
    assert_matches_transformers(without, transformers_generate(path, PROMPTS[:2], 8))


def test_released_config_spellings_load_as_transformers_reads_them(tmp_path):
    """The released config.json: YaRN under `rope_scaling` with `rope_theta` beside it, no layer_types (even layers
    slide), no swiglu_alpha, and experts_per_token beside num_experts_per_tok."""
    path = make_gpt_oss(tmp_path / "released", seed=2)
    config = json.loads((path / "config.json").read_text())
    scaling = {k: v for k, v in config["rope_parameters"].items() if k != "rope_theta"}
    edit_config(path, rope_parameters=None, rope_scaling=scaling, rope_theta=config["rope_parameters"]["rope_theta"],
                layer_types=None, swiglu_alpha=None, experts_per_token=config["num_experts_per_tok"])
    args = GptOssArgs.from_hf(HFConfig(json.loads((path / "config.json").read_text())))
    assert args.windows == (GPT_OSS_WINDOW, None, GPT_OSS_WINDOW) and args.rope_scaling["rope_type"] == "yarn"
    assert_matches_transformers(strata_greedy(path, PROMPTS[:2], 8), transformers_generate(path, PROMPTS[:2], 8))


@pytest.mark.parametrize("rope", [
    {},  # no rotary keys: transformers' gpt-oss default (YaRN x32 over 4096, base 150k, untruncated)
    {"rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                      "original_max_position_embeddings": 4096}, "rope_theta": 150000},
    {"rope_parameters": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 10000.0,
                         "original_max_position_embeddings": 1024}},  # truncated ramp, default betas
    {"rope_parameters": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 10000.0, "mscale": 1.0,
                         "mscale_all_dim": 0.5, "beta_fast": 16.0, "original_max_position_embeddings": 1024}},
], ids=["defaults", "released", "truncated", "mscale"])
def test_yarn_frequencies_and_attention_factor_match_transformers(rope):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    values = dict(COMMON, head_dim=64, max_position_embeddings=131072, **rope)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](GptOssConfig(**values), "cpu")
    args = GptOssArgs.from_hf(HFConfig(values))
    rotary = RotaryEmbedding(args.head_dim, args.rope_theta, args.rope_scaling)
    assert torch.equal(rotary.inv_freq, inv_freq)
    assert rotary.mscale == pytest.approx(attention_factor, rel=1e-12) and rotary.mscale > 1.0


@pytest.fixture(scope="module")
def layouts(gpt_oss_path, tmp_path_factory) -> dict[str, dict]:
    """Greedy runs of both checkpoints in one process and across two gloo ranks as PP=2 and as TP=2 (the
    machinery of test_architecture_layouts: one pair of processes for all of them)."""
    from processes import spawn_ranks
    from test_architecture_layouts import _rank_main, greedy

    from strata.distributed import ParallelContext

    paths = {name: str(gpt_oss_path(tied)) for name, tied in (("untied", False), ("tied", True))}
    folder = tmp_path_factory.mktemp("gpt_oss_layouts")
    spawn_ranks(_rank_main, 2, lambda port: (port, list(paths.values()), str(folder)))
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]
    return {name: {"one": greedy(path, ParallelContext()), "pp2": ranks[1][path]["pp2"],
                   "tp2": ranks[0][path]["tp2"]} for name, path in paths.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["untied", "tied"])
def test_pp2_and_tp2_give_the_tokens_of_one_process(layouts, name):
    """PP=2 (the last stage samples): the same tokens, logprobs within 1e-5. TP=2 (heads, sinks and the experts'
    intermediate width split): the same tokens or, where they first differ, each side's token in the other's top 5,
    logprobs within 1e-4 before that."""
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


def test_chunked_prefill_prefix_hits_and_preemption_keep_transformers_tokens(gpt_oss_path, hf_outputs):
    """The engine's ways of running a sequence in pieces (test_architecture_engine_features' cases) with sinks,
    8-token windows and routed experts: 6-token chunks, a two-block prefix hit, preemption mid-sequence."""
    from test_architecture_engine_features import (
        assert_chunks_and_prefix_hits_keep_transformers_tokens,
        assert_preemption_keeps_transformers_tokens,
    )

    assert_chunks_and_prefix_hits_keep_transformers_tokens(gpt_oss_path(), hf_outputs)
    assert_preemption_keeps_transformers_tokens(gpt_oss_path(), hf_outputs)


def make_mxfp4(folder: Path, seed: int = 0) -> Path:
    """A gpt-oss checkpoint as released: each layer's experts as MXFP4 `*_blocks` [E, out, in/32, 16] and `*_scales`
    [E, out, in/32] (random codes) and the quantization_config that says so (the benchmark checkpoints' writer)."""
    from strata.bench.random_model import experts_as_mxfp4

    path = make_gpt_oss(folder, seed=seed)
    experts_as_mxfp4(path, seed)
    return path


def test_mxfp4_checkpoint_matches_transformers_dequantizing_it(tmp_path):
    """transformers (on CPU) dequantizes the experts to float32 exactly; strata keeps them 4-bit and must give its
    tokens and logprobs. The 40-token prompt sends more than the C kernel's rows through an expert (the
    dequantized-panel GEMM), decode steps fewer. transformers is told to dequantize: with the `kernels` package
    installed it would otherwise fetch its MXFP4 kernels from the Hub."""
    from transformers import Mxfp4Config

    path = make_mxfp4(tmp_path / "mxfp4")
    prompts = [*PROMPTS[:2], *random_prompts((40,), seed=8)]
    assert_matches_transformers(strata_greedy(path, prompts, MAX_TOKENS),
                                transformers_generate(path, prompts, MAX_TOKENS,
                                                      quantization_config=Mxfp4Config(dequantize=True)))


def test_mxfp4_experts_stay_four_bit_in_memory(tmp_path):
    from model_forward import strata_logits

    from strata.config import EngineConfig
    from strata.distributed import ParallelContext
    from strata.executor.model_runner import ModelRunner

    path = make_mxfp4(tmp_path / "mxfp4")
    runner = ModelRunner(EngineConfig.create(str(path), dtype="float32", device="cpu"), ParallelContext(),
                         torch.device("cpu"))
    experts = runner.model.model.layers[0].mlp.experts
    stored = dict(experts.named_parameters())
    assert {n: (t.dtype, tuple(t.shape)) for n, t in stored.items() if n.endswith(("_blocks", "_scales"))} == {
        "gate_up_proj_blocks": (torch.uint8, (4, 64, 2, 16)), "gate_up_proj_scales": (torch.uint8, (4, 64, 2)),
        "down_proj_blocks": (torch.uint8, (4, 64, 1, 16)), "down_proj_scales": (torch.uint8, (4, 64, 1))}
    assert not hasattr(experts, "gate_up_proj") and not hasattr(experts, "down_proj")
    assert torch.isfinite(strata_logits(path, list(PROMPTS[0]))).all()


def test_mxfp4_checkpoint_with_a_layout_or_tensors_it_cannot_serve_is_refused(tmp_path):
    """TP=2 would leave each rank 16 of the experts' 32 inputs to down_proj: half an MXFP4 block. A checkpoint
    missing its scales names them."""
    from strata import LLM
    from strata.config import EngineConfig
    from strata.errors import ConfigError, StrataError

    path = make_mxfp4(tmp_path / "mxfp4")
    with pytest.raises(ConfigError, match="MXFP4 block of 32"):
        EngineConfig.create(str(path), tensor_parallel_size=2, dtype="float32", device="cpu")
    file = path / "model.safetensors"
    kept = {n: t for n, t in load_file(str(file)).items() if not n.endswith("layers.1.mlp.experts.down_proj_scales")}
    save_file(kept, str(file), metadata={"format": "pt"})
    with pytest.raises((StrataError, ValueError), match="layers.1.mlp.experts.down_proj_scales"):
        LLM(str(path), dtype="float32", device="cpu", max_model_len=64)
