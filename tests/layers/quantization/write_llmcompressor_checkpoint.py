"""Quantize a checkpoint with llm-compressor's `oneshot` (run in llm-compressor's own environment, by subprocess).

usage: python write_llmcompressor_checkpoint.py BASE_FOLDER OUT_PARENT SCHEME [SCHEME ...]
writes OUT_PARENT/SCHEME for each; SCHEME is one of llm-compressor's preset names (W4A16, W4A16_ASYM,
W8A16, W8A8, FP8_DYNAMIC) or
W4A16_G32 / W4A16_G64 / W4A16_CHANNEL / W4A16_ASYM_G64 / W8A16_G128 (int weights, one group size / strategy);
a _HEAD suffix (W4A16_G32_HEAD) quantizes the LM head too (llm-compressor then unties it from the embedding).
Llama 4 MoE layers are quantized as Scout's W4A16 checkpoints are: every routed expert's gate/up/down saved on its
own, the router (and a multimodal checkpoint's vision tower and projector) left as they are.
"""
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from transformers import AutoConfig, AutoModelForCausalLM, Llama4ForConditionalGeneration


def scheme_for(name: str):
    base, _, variant = name.partition("_G")
    if not variant and not name.endswith("_CHANNEL"):
        return {"config_groups": None, "scheme": name}
    bits = 4 if base.startswith("W4") else 8
    symmetric = "ASYM" not in base
    if name.endswith("_CHANNEL"):
        weights = QuantizationArgs(num_bits=bits, symmetric=symmetric, strategy="channel")
    else:
        weights = QuantizationArgs(num_bits=bits, symmetric=symmetric, strategy="group", group_size=int(variant))
    return {"config_groups": {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}, "scheme": None}


def main() -> None:
    base, parent, *names = sys.argv[1:]
    for name in names:
        write(base, str(Path(parent) / name), name)


def linearize_llama4_text_experts(model) -> None:
    """oneshot replaces Llama 4's fused experts by per-expert Linear modules itself, but its replacement reads
    `config.text_config` and so fails on a text-only Llama4ForCausalLM: hand it the text config that way."""
    from llmcompressor.modeling.moe.llama4 import Llama4LinearExperts
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    for name, module in list(model.named_modules()):
        if isinstance(module, Llama4TextExperts):
            config = SimpleNamespace(text_config=model.config)
            model.set_submodule(name, Llama4LinearExperts.from_experts_module(module, config))


def write(base: str, out: str, name: str) -> None:
    multimodal = hasattr(AutoConfig.from_pretrained(base), "vision_config")
    model = (Llama4ForConditionalGeneration if multimodal else AutoModelForCausalLM).from_pretrained(
        base, torch_dtype="auto")
    if not multimodal:
        linearize_llama4_text_experts(model)
    head = name.endswith("_HEAD")
    chosen = scheme_for(name.removesuffix("_HEAD"))
    kwargs = {"targets": ["Linear"], "ignore": ([] if head else ["lm_head", "re:.*lm_head$"])
              + ["re:.*router$", "re:.*vision_model.*", "re:.*multi_modal_projector.*"]}
    if chosen["scheme"]:
        kwargs["scheme"] = chosen["scheme"]
    else:
        kwargs["config_groups"] = chosen["config_groups"]
        kwargs.pop("targets")
    oneshot(model=model, recipe=QuantizationModifier(**kwargs))
    model.save_pretrained(out, save_compressed=True)
    for extra in [*Path(base).glob("tokenizer*"), *Path(base).glob("preprocessor_config.json")]:
        shutil.copy(extra, out)


if __name__ == "__main__":
    main()
