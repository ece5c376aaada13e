"""One declaration per decoder layer (strata/layers/decoder_layer.py): for each architecture family, a layer's
`DecoderLayerSpec` run by the torch interpreter and by the CPU decode backend's C calls (per block, and the whole
stack) gives transformers' own decoder layer output on a decode step that reads a cached context past the windows."""
from __future__ import annotations

import functools
import math

import pytest
import torch
from arch_checkpoints import make_arch, make_gpt_oss, random_prompts

from strata import SamplingParams
from strata.config import EngineConfig
from strata.distributed import ParallelContext
from strata.executor.model_runner import ModelRunner
from strata.executor.step import NewRequestData, ScheduledRequest
from strata.kernels.cpu import decode_layer
from strata.layers.decode_stack import FusedDecodeStack
from strata.layers.decoder_layer import DecoderLayerSpec, GatedMLP, run_decoder_layer
from strata.layers.norm import GemmaRMSNorm

TOKENS = random_prompts((20,), seed=3)[0]  # the decode row sits at position 19: past the 8- and 16-token windows
# (architecture, layer): each family's features (q/k/v biases and a window, q/k norms, partial LongRoPE, Granite's
# multipliers, Gemma's sandwich norms with the soft cap or the local / global rotaries, gpt-oss's sinks and experts,
# Qwen3-MoE's experts).
CASES = [("qwen2", 1), ("qwen3", 0), ("phi3", 0), ("granite", 0), ("gemma2", 0), ("gemma3", 0), ("gemma3", 1),
         ("gpt_oss", 0), ("qwen3_moe", 0)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("decoder_layer")

    @functools.cache
    def build(name: str):
        if name == "gpt_oss":
            return make_gpt_oss(root / name)
        return make_arch(root / name, name)

    return build


def _transformers_layer_io(path, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' decoder layer `layer` over TOKENS: its input and output hidden states [T, hidden]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seen = {}

    def hook(module, args, kwargs, output):
        seen["in"] = args[0] if args else kwargs["hidden_states"]
        seen["out"] = output[0] if isinstance(output, tuple) else output

    model.model.layers[layer].register_forward_hook(hook, with_kwargs=True)
    with torch.no_grad():
        model(torch.tensor([TOKENS]))
    return seen["in"][0], seen["out"][0]


def _step(runner: ModelRunner, request: ScheduledRequest) -> tuple[torch.Tensor, object]:
    _, positions, meta = runner._prepare([request])
    return positions, runner.model.layer_context(meta)


@pytest.mark.parametrize(("name", "layer"), CASES, ids=[f"{n}-layer{i}" for n, i in CASES])
def test_the_interpreter_and_the_c_backend_read_one_declaration_and_give_transformers_layer(checkpoint, name, layer):
    if decode_layer.library() is None or decode_layer.kernels() is None:
        pytest.skip("no C compiler")
    path = checkpoint(name)
    hf_in, hf_out = _transformers_layer_io(path, layer)
    config = EngineConfig.create(str(path), dtype="float32", device="cpu", max_model_len=64)
    runner = ModelRunner(config, ParallelContext(), torch.device("cpu"))
    runner.allocate_kv_cache(8)
    spec = runner.model.stage_layers[layer].spec
    assert isinstance(spec, DecoderLayerSpec)
    if name.startswith("gemma"):  # the sandwich: post_attention_layernorm is the attention's out-norm
        layer_module = runner.model.stage_layers[layer]
        assert spec.attention_out_norm is layer_module.post_attention_layernorm
        assert spec.feed_forward_norm is layer_module.pre_feedforward_layernorm
        assert isinstance(spec.feed_forward_norm, GemmaRMSNorm) and spec.mlp.activation == "gelu_tanh"
    blocks = list(range(math.ceil(len(TOKENS) / config.cache.block_size)))
    prefix, last = len(TOKENS) - 1, len(TOKENS) - 1
    with torch.inference_mode():
        positions, context = _step(runner, ScheduledRequest("r", TOKENS[:prefix], 0, blocks, True,
                                                            new=NewRequestData(SamplingParams(), TOKENS[:prefix])))
        run_decoder_layer(spec, positions, hf_in[:prefix].contiguous(), None, context)  # the context's keys
        positions, context = _step(runner, ScheduledRequest("r", [TOKENS[last]], prefix, blocks, True))
        x = hf_in[last:].contiguous()
        torch_out = sum(run_decoder_layer(spec, positions, x, None, context))
        stack = FusedDecodeStack([spec], None)
        fused = stack.fused[0]
        assert fused.serves(x, context)
        assert (fused.plan.mlp is None) == (spec.mlp is None)  # experts run as modules after the attention call
        step = stack.step_for(context, positions, 1, fused.plan)
        blocks_out = sum(fused(positions, x, None, context, step))
        stacked = stack(positions, x, None, context)
    torch.testing.assert_close(torch_out, hf_out[last:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(blocks_out, torch_out, rtol=1e-5, atol=1e-5)
    if spec.mlp is None:
        assert stacked is None  # a feed-forward block of modules keeps the stack to the per-layer calls
    else:
        torch.testing.assert_close(sum(stacked), torch_out, rtol=1e-5, atol=1e-5)


def test_a_gated_mlp_of_an_activation_the_kernel_lacks_is_refused_by_name():
    from strata.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="relu"):
        GatedMLP(8, 16, ParallelContext(), torch.float32, activation="relu")
