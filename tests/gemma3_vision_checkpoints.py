"""A tiny random Gemma3ForConditionalGeneration built by transformers, saved with a real Gemma3Processor (its
preprocessor config and a BPE tokenizer that has Gemma 3's turn and image tokens and a Gemma style chat template)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from checkpoints import CORPUS

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                  "<end_of_image>", "<image_soft_token>"]
TOKEN = {t: i for i, t in enumerate(SPECIAL_TOKENS)}  # trained BPE gives specials the first ids, in order
VOCAB = 320
IMAGE_SIZE, PATCH, TOKENS_PER_IMAGE = 32, 4, 16  # an 8 x 8 patch grid pooled 2 x 2 into 16 soft tokens
WINDOW = 12  # local layers' window: shorter than an image's 16 tokens plus the text around it

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<start_of_image>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def _write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS + ["\n\n", "Describe this.\n\n"], trainer)
    (folder / "tokenizer.json").write_text(tok.to_str())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
              "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE, "model_max_length": 4096,
              "extra_special_tokens": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                       "image_token": "<image_soft_token>"}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def make_gemma3_vision(folder: Path, *, seed: int = 0) -> Path:
    """Random weights large enough that tokens differ sharply; Gemma norms (offsets from one) away from 0."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=20, sliding_window=WINDOW,
                layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                max_position_embeddings=512, bos_token_id=TOKEN["<bos>"], eos_token_id=TOKEN["<eos>"],
                pad_token_id=TOKEN["<pad>"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=IMAGE_SIZE, patch_size=PATCH, vision_use_head=False)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS_PER_IMAGE,
                                       image_token_index=TOKEN["<image_soft_token>"],
                                       boi_token_index=TOKEN["<start_of_image>"],
                                       eoi_token_index=TOKEN["<end_of_image>"], tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08 if "language_model" in name else 0.2)
            elif "norm" in name and ("language_model" in name or "mm_soft_emb_norm" in name):
                p.uniform_(-0.4, 0.4)
            elif "norm" in name and name.endswith("weight"):  # SigLIP's LayerNorms scale by the weight itself
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.1)
    model.save_pretrained(folder)
    _write_tokenizer(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    image_processor = transformers.Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    transformers.Gemma3Processor(image_processor, tokenizer, chat_template=CHAT_TEMPLATE,
                                 image_seq_length=TOKENS_PER_IMAGE).save_pretrained(folder)
    return folder
