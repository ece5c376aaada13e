"""Random-weight benchmark checkpoints (`python -m strata.bench.random_model PRESET DIR`).

Speed does not depend on the weights' values, so benchmarks run on random models of real shapes,
with a real byte-level BPE tokenizer trained on the Python standard library.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

PRESETS: dict[str, dict] = {
    # ~44M parameters (tied 32k embedding)
    "llama-40m": dict(architecture="llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=True),
    # ~240M parameters
    "llama-250m": dict(architecture="llama", hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                       num_attention_heads=16, num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=True),
    # The Llama-250m shape in each of Llama's descendants (decode speed beside a Llama of the same bytes).
    **{f"{arch}-250m": dict(architecture=arch, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                            num_attention_heads=16, num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=True,
                            **extra)
       for arch, extra in {"qwen2": {}, "qwen3": dict(head_dim=64), "mistral": dict(sliding_window=4096),
                           "phi3": dict(partial_rotary_factor=0.75, pad_token_id=0),
                           "granite": dict(embedding_multiplier=12.0, attention_multiplier=0.015625,
                                           residual_multiplier=0.22, logits_scaling=8.0)}.items()},
    # Gemma 3 in that shape (5 sliding layers to 1 global, q/k norms); gpt-oss with Llama-250m's bytes: 8 experts of
    # width 352 (2 of them per token) hold what Llama's one MLP of 2816 does; `-mxfp4`: those experts as released.
    "gemma3-250m": dict(architecture="gemma3", hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=64, vocab_size=32000,
                        sliding_window=512),
    **{name: dict(architecture="gpt_oss", hidden_size=1024, intermediate_size=352, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=64, num_local_experts=8,
                  num_experts_per_tok=2, vocab_size=32000, tie_word_embeddings=True, mxfp4=name.endswith("mxfp4"))
       for name in ("gpt_oss-250m", "gpt_oss-250m-mxfp4")},
    # ~30M parameters: the Mamba2 benchmark shape
    "mamba2-30m": dict(architecture="mamba2", hidden_size=512, num_hidden_layers=8, state_size=64, head_dim=64,
                       vocab_size=32000, tie_word_embeddings=True),
    # ~320M parameters: Qwen2.5-VL-3B's vision blocks (width 1280, 16 heads, MLP 3420, 112-pixel windows) at depth 8
    # (~190M, full attention in blocks 3 and 7) before an 8-layer Qwen2 of width 1024 (~130M)
    "qwen2_5_vl-300m": dict(architecture="qwen2_5_vl", hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                            num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                            vision=dict(depth=8, hidden_size=1280, intermediate_size=3420, num_heads=16,
                                        window_size=112, fullatt_block_indexes=[3, 7])),
    # bert-base (~110M): the encoder of `strata bench embed` (strata/bench/random_encoder.py)
    "bert-110m": dict(architecture="bert"),
}


_DECODERS = {**{name: (f"{cls}Config", f"{cls}ForCausalLM") for name, cls in
                {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "phi3": "Phi3",
                 "granite": "Granite", "gpt_oss": "GptOss"}.items()},
             "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}


def build(preset: str, output: Path, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    from transformers import PreTrainedTokenizerFast

    from strata.demo.train import stdlib_sources, train_tokenizer

    shape = dict(PRESETS[preset])
    kind, mxfp4 = shape.pop("architecture"), shape.pop("mxfp4", False)
    output.mkdir(parents=True, exist_ok=True)
    if kind == "bert":
        from strata.bench.random_encoder import bert_embedder

        params = sum(p.numel() for p in bert_embedder(output, seed).parameters())
        logger.info("wrote %s (%.1fM parameters) to %s", preset, params / 1e6, output)
        return output
    tokenizer: PreTrainedTokenizerFast = train_tokenizer(stdlib_sources(), vocab_size=shape["vocab_size"])
    torch.manual_seed(seed)
    if kind == "qwen2_5_vl":
        model = qwen2_5_vl_model(shape, tokenizer, output)
    elif kind in _DECODERS:
        import transformers

        config_class, model_class = (getattr(transformers, name) for name in _DECODERS[kind])
        config = config_class(max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id, **shape)
        model = model_class(config)
    else:
        from transformers import Mamba2Config, Mamba2ForCausalLM

        heads = 2 * shape["hidden_size"] // shape["head_dim"]
        config = Mamba2Config(num_heads=heads, n_groups=1, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id, **shape)
        model = Mamba2ForCausalLM(config)
    model.to(dtype).save_pretrained(output, safe_serialization=True)
    tokenizer.save_pretrained(output)
    if mxfp4:
        experts_as_mxfp4(output, seed)
    params = sum(p.numel() for p in model.parameters())
    logger.info("wrote %s (%s, %.1fM parameters) to %s", preset, kind, params / 1e6, output)
    return output


def qwen2_5_vl_model(shape: dict, tokenizer, output: Path) -> torch.nn.Module:
    """transformers' Qwen2_5_VLForConditionalGeneration of `shape`; the tokenizer gains Qwen's vision tokens (the demo
    chat template writes an image as their placeholder text) and the folder transformers' default image processor
    settings."""
    import json

    import transformers

    vision_tokens = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
    tokenizer.add_tokens(vision_tokens, special_tokens=True)
    ids = dict(zip(vision_tokens, tokenizer.convert_tokens_to_ids(vision_tokens), strict=True))
    vision, text = shape.pop("vision"), {**shape, "vocab_size": len(tokenizer)}
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    section = [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]  # Qwen2.5-VL's 16 / 24 / 24 of 128, scaled
    text.update(max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                                      "mrope_section": section})
    config = transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config={**vision, "out_hidden_size": text["hidden_size"], "tokens_per_second": 2},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True)
    pre = {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280,
           "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}
    (output / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    return transformers.Qwen2_5_VLForConditionalGeneration(config)


def experts_as_mxfp4(folder: Path, seed: int) -> None:
    """Replace the saved experts by MXFP4 blocks and scales of their shapes (random codes, exponents giving values
    up to 6 * 2^-4) and say so in config.json, as gpt-oss checkpoints are released."""
    import json

    from safetensors.torch import load_file, save_file

    generator = torch.Generator().manual_seed(seed)
    for file in folder.glob("*.safetensors"):
        tensors = {}
        for name, t in load_file(str(file)).items():
            if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                tensors[name] = t
                continue
            experts, inputs, outputs = t.shape
            tensors[name + "_blocks"] = torch.randint(0, 256, (experts, outputs, inputs // 32, 16),
                                                      dtype=torch.uint8, generator=generator)
            tensors[name + "_scales"] = torch.randint(119, 124, (experts, outputs, inputs // 32), dtype=torch.uint8,
                                                      generator=generator)
        save_file(tensors, str(file), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("preset", choices=sorted(PRESETS))
    parser.add_argument("output", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    build(args.preset, args.output, args.seed)


if __name__ == "__main__":
    main()
