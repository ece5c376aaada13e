"""A tiny random Qwen2_5_VLForConditionalGeneration built by transformers, saved with a real Qwen2_5_VLProcessor (its
preprocessor config with small min/max pixels, and a BPE tokenizer with Qwen's chat and vision tokens and a chat
template that renders image parts as the released one does)."""
from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import torch
from checkpoints import CORPUS
from PIL import Image

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>"]
TOKEN = {t: i for i, t in enumerate(SPECIAL_TOKENS)}  # trained BPE gives specials the first ids, in order
VOCAB = 320
PATCH, MERGE = 14, 2
WINDOW = 56  # 2 x 2 merged tokens per window: images of a few windows, ragged at their edges
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 24

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS + ["user\n", "assistant\n", "Describe this."], trainer)
    (folder / "tokenizer.json").write_text(tok.to_str())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "chat_template": CHAT_TEMPLATE, "model_max_length": 4096}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def make_qwen2_5_vl(folder: Path, *, seed: int = 0) -> Path:
    """Three vision blocks (the middle one full attention), two text layers; weights large enough that tokens
    differ sharply between images."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                bos_token_id=TOKEN["<|endoftext|>"], eos_token_id=TOKEN["<|im_end|>"],
                pad_token_id=TOKEN["<|endoftext|>"])
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=2, window_size=WINDOW, out_hidden_size=64,
                  fullatt_block_indexes=[1], tokens_per_second=2)
    config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                                           image_token_id=TOKEN["<|image_pad|>"],
                                           video_token_id=TOKEN["<|video_pad|>"],
                                           vision_start_token_id=TOKEN["<|vision_start|>"],
                                           vision_end_token_id=TOKEN["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.1 if "visual" not in name else 0.15)
            elif "norm" in name or "ln_q" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.1)
    model.save_pretrained(folder)
    _write_tokenizer(folder)
    image_processor = transformers.Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
                                                            patch_size=PATCH, merge_size=MERGE)
    image_processor.save_pretrained(folder)  # the processor itself needs torchvision (its video part) to save
    return folder


def hf_processor(folder: Path, monkeypatch) -> object:
    """transformers' Qwen2_5_VLProcessor over the saved tokenizer and image processor, without a video processor
    (whose class needs torchvision): images and text only."""
    import transformers
    from transformers.processing_utils import ProcessorMixin

    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)
    return transformers.Qwen2_5_VLProcessor(transformers.Qwen2VLImageProcessorPil.from_pretrained(folder),
                                            transformers.AutoTokenizer.from_pretrained(folder), None)


def noise_image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def data_uri(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
