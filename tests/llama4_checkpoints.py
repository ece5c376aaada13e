"""Tiny random Llama 4 checkpoints built with transformers (spec llama4.md §6), with a BPE tokenizer that
has Llama 4's special and image tokens and a Llama 4 style chat template that renders image parts."""
from __future__ import annotations

import base64
import functools
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints import CORPUS
from PIL import Image
from safetensors.torch import load_file, save_file

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|header_start|>", "<|header_end|>", "<|eot|>",
                  "<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>",
                  "<|tile_y_separator|>"]
TOKEN = {t: i for i, t in enumerate(SPECIAL_TOKENS)}  # trained BPE gives specials the first ids, in order

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|header_start|>{{ m['role'] }}<|header_end|>\n\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|image|>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|header_start|>assistant<|header_end|>\n\n{% endif %}"
)

# The spec's recipe: every layer kind is exercised by short prompts (chunk 8, floor_scale 4).
TEXT_CONFIG = dict(
    vocab_size=512, hidden_size=64, intermediate_size=32, intermediate_size_mlp=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
    interleave_moe_layer_step=2, no_rope_layer_interval=4, attention_chunk_size=8, use_qk_norm=True,
    attn_temperature_tuning=True, floor_scale=4, attn_scale=0.1, max_position_embeddings=4096,
    bos_token_id=TOKEN["<|begin_of_text|>"], eos_token_id=[TOKEN["<|end_of_text|>"], TOKEN["<|eot|>"]],
    pad_token_id=TOKEN["<|end_of_text|>"],
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
)
VISION_CONFIG = dict(
    hidden_size=32, num_attention_heads=2, num_hidden_layers=2, intermediate_size=128, image_size=56,
    patch_size=14, pixel_shuffle_ratio=0.5, projector_input_dim=64, projector_output_dim=64, vision_output_dim=64,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


@pytest.fixture(autouse=False)
def one_thread():
    """Ops on these tiny models take microseconds: a second thread only adds sync overhead, which grows
    many-fold when other processes share the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.cache
def _tokenizer_files(vocab_size: int) -> dict[str, str]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", 0)])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
              "eos_token": "<|eot|>", "pad_token": "<|end_of_text|>", "chat_template": CHAT_TEMPLATE,
              "model_max_length": 4096}
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(config)}


def write_tokenizer(folder: Path, vocab_size: int = 512) -> None:
    for name, text in _tokenizer_files(vocab_size).items():
        (folder / name).write_text(text)


def _randomize(model: torch.nn.Module, seed: int, std: float) -> None:
    """Larger weights than transformers' init (sharp logits, few greedy near-ties); norms != 1."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, std)
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, std)


def split_experts(folder: Path, prefix: str = "") -> None:
    """Rewrite the fused expert tensors as one gate/up/down tensor per expert (the other layout)."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    out = {}
    for name, t in tensors.items():
        if name.endswith("experts.gate_up_proj"):
            stem, inter = name[: -len("gate_up_proj")], t.shape[-1] // 2
            for e in range(t.shape[0]):
                out[f"{stem}{e}.gate_proj.weight"] = t[e, :, :inter].T.contiguous()
                out[f"{stem}{e}.up_proj.weight"] = t[e, :, inter:].T.contiguous()
        elif name.endswith("experts.down_proj"):
            stem = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{stem}{e}.down_proj.weight"] = t[e].T.contiguous()
        else:
            out[name] = t
    assert any(".experts.0.gate_proj.weight" in n for n in out), prefix
    save_file(out, path, metadata={"format": "pt"})


def make_llama4_text(folder: Path, *, seed: int = 0, std: float = 0.15, per_expert: bool = False,
                     dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """A random Llama4ForCausalLM saved by transformers (safetensors) with the Llama 4 test tokenizer."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    folder.mkdir(parents=True, exist_ok=True)
    model = Llama4ForCausalLM(Llama4TextConfig(**{**TEXT_CONFIG, **overrides}))
    _randomize(model, seed, std)
    model.to(dtype).save_pretrained(folder)
    if per_expert:
        split_experts(folder)
    write_tokenizer(folder, TEXT_CONFIG["vocab_size"])
    return folder


def make_llama4_multimodal(folder: Path, *, seed: int = 0, std: float = 0.15, per_expert: bool = False,
                           text_overrides: dict | None = None) -> Path:
    """A random Llama4ForConditionalGeneration (image token = <|patch|>) plus preprocessor_config.json."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    folder.mkdir(parents=True, exist_ok=True)
    config = Llama4Config(text_config={**TEXT_CONFIG, **(text_overrides or {})}, vision_config=VISION_CONFIG,
                          image_token_index=TOKEN["<|patch|>"], boi_token_index=TOKEN["<|image_start|>"],
                          eoi_token_index=TOKEN["<|image_end|>"], tie_word_embeddings=False)
    model = Llama4ForConditionalGeneration(config)
    _randomize(model, seed, std)
    model.save_pretrained(folder)
    if per_expert:
        split_experts(folder, "language_model.")
    # At most 4 tiles (+ the global one) keeps the prompts short.
    (folder / "preprocessor_config.json").write_text(json.dumps({"max_patches": 4, "size": {"height": 56,
                                                                                            "width": 56}}))
    write_tokenizer(folder, TEXT_CONFIG["vocab_size"])
    return folder


def noise_image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def data_uri(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_chat(image: Image.Image, text: str = "What is in this picture? Describe it.") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(image)}},
                                         {"type": "text", "text": text}]}]
