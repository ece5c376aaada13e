"""A tiny Llama that thinks: its tokenizer has Qwen3's chat markers and template, Mistral's and Granite's tool-call
tokens, and its weights make greedy decoding follow one chain, `<think> quick brown fox</think>[TOOL_CALLS]` then
EOS, where `[TOOL_CALLS]` is a special token: it shows only when special tokens are decoded.

The weights are set, not trained: attention and MLP outputs are zero, so each position's logits depend on its own
token only; the chain's tokens have orthogonal embeddings and the LM head maps each to its successor. Tests force
the answer after the thinking with a grammar.
"""
from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import torch
from checkpoints import write_chat_tokenizer

# Qwen3's template, cut down to what tests need: tools, documents, reasoning_content in history, tool calls and
# responses, and enable_thinking=False closing an empty think block in the generation prompt.
QWEN3_TEMPLATE = (
    "{%- if tools or documents %}{{- '<|im_start|>system\\n' }}"
    "{%- for tool in tools or [] %}{{- '<tools>' ~ (tool | tojson) ~ '</tools>\\n' }}{%- endfor %}"
    "{%- for doc in documents or [] %}{{- '<document>' ~ doc.title ~ ': ' ~ doc.text ~ '</document>\\n' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.reasoning_content %}{{- '<think>' ~ message.reasoning_content ~ '</think>\\n\\n' }}{%- endif %}"
    "{{- message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}{{- '<tool_call>\\n' ~ ({'name': call.function.name, "
    "'arguments': call.function.arguments} | tojson) ~ '\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>' ~ message.content ~ '</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' ~ message.role ~ '\\n' ~ message.content ~ '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)
# DeepSeek-R1's way: the generation prompt opens the think block, so the output starts inside it.
R1_TEMPLATE = ("{%- for message in messages %}{{- '<|im_start|>' ~ message.role ~ '\\n' ~ message.content ~ "
               "'<|im_end|>\\n' }}{%- endfor %}{{- '<|im_start|>assistant\\n<think>' }}")
SPECIAL = ["<|im_start|>", "<|im_end|>", "[TOOL_CALLS]", "[ARGS]", "<|tool_call|>"]  # as in those models
PLAIN = ["<think>", "</think>", "<tool_call>", "</tool_call>"]  # added tokens that are text, as in Qwen3's
THOUGHT = " quick brown fox"
VOCAB_SIZE = 528


def write_thinking_tokenizer(folder: Path):
    """The tokenizer (a BPE with the added tokens above and QWEN3_TEMPLATE), saved in `folder` and loaded."""
    return write_chat_tokenizer(folder, SPECIAL, PLAIN, QWEN3_TEMPLATE, "<|im_end|>")


def make_thinking_llama(folder: Path) -> Path:
    """The checkpoint in `folder`; greedy output after the chat template's generation prompt is
    `<think>` + THOUGHT + `</think>[TOOL_CALLS]`, then EOS (`<|im_end|>`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = write_thinking_tokenizer(folder)
    assert len(tokenizer) <= VOCAB_SIZE
    chain = _chain(tokenizer)
    llama = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama)
    with torch.no_grad():
        for layer in model.model.layers:  # nothing but the token's own embedding reaches the head
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed.normal_(0, 0.02)
        embed[:, :len(chain)] = 0.0  # the chain's directions belong to the chain's tokens only
        head.zero_()
        for k, (token, successor) in enumerate(chain):
            embed[token] = 0.0
            embed[token, k] = 1.0
            head[successor, k] = 4.0  # a logit of 32 after the final norm: greedy and sampling agree
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def _chain(tokenizer) -> list[tuple[int, int]]:
    """(token, successor) pairs from the last token of the generation prompt to EOS."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)
    start = tokenizer(prompt, add_special_tokens=False).input_ids[-1]
    ids = tokenizer.convert_tokens_to_ids
    thought = tokenizer(THOUGHT, add_special_tokens=False).input_ids
    path = [start, ids("<think>"), *thought, ids("</think>"), ids("[TOOL_CALLS]"), tokenizer.eos_token_id]
    assert len(set(path)) == len(path), "the chain must not visit a token twice"
    return list(pairwise(path))
