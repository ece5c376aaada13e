"""A tiny gpt-oss that writes harmony: after the generation prompt it thinks on the analysis channel
(`<|channel|>analysis<|message|> quick brown fox<|end|>`), then opens a second message: the final answer
(` It is sunny.`, ended by `<|return|>`) or, when the user asked about the ` weather`, a tool call on the commentary
channel (`<|channel|>commentary to=functions.get_weather<|constrain|>json<|message|>{"city": "Oslo"}<|call|>`).

The weights are set, not trained. The experts output zero, and the chain's tokens have orthogonal embeddings,
so the LM head sees the current token plus what two attention heads report: each head's query and its key for one
watched token (` fox`, ` weather`) lie in the slowest rotary pair (where positions barely turn them), and its
learned sink takes the whole softmax row until the watched token has been seen, after which that token takes it.
The sink is what makes each head's report a clean yes or no. `<|channel|>` and `<|message|>` therefore lead to
`analysis` / ` quick` before the thinking, to `final` / the answer after it, and to `commentary` / the arguments
when the weather was asked.
"""
from __future__ import annotations

from pathlib import Path

import torch
from checkpoints import write_chat_tokenizer

SPECIAL = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
PLAIN = ["assistant", "user", "analysis", "final", "commentary", "json", " to=functions.get_weather", " quick",
         " brown", " fox", " It is sunny.", '{"city": "Oslo"}', " weather"]
THOUGHT, ANSWER, ARGUMENTS = " quick brown fox", " It is sunny.", {"city": "Oslo"}
TEMPLATE = ("{%- for m in messages %}{{- '<|start|>' ~ m.role ~ '<|message|>' ~ m.content ~ '<|end|>' }}{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}")
VOCAB_SIZE = 544
HIDDEN, HEAD_DIM, SLOW = 64, 16, 7  # SLOW: the rotary pair (7, 15) whose angle moves ~1e-5 rad a position
WATCHED = (" fox", " weather")  # what head 0 and head 1 report; their reports land in hidden dims 62 and 63
THOUGHT_DONE, WEATHER_ASKED = 62, 63


def write_harmony_tokenizer(folder: Path):
    return write_chat_tokenizer(folder, SPECIAL, PLAIN, TEMPLATE, "<|return|>")


def _successors() -> list[tuple[str, dict[str, float]]]:
    """(next token, logit weights: the current token's direction, and THOUGHT_DONE / WEATHER_ASKED), so that each
    token's successor wins by a margin of at least 1 (before the final norm's scaling) in every state it occurs in."""
    chain = [("assistant", "<|channel|>"), ("analysis", "<|message|>"), (" quick", " brown"), (" brown", " fox"),
             (" fox", "<|end|>"), ("<|end|>", "<|start|>"), ("<|start|>", "assistant"), ("final", "<|message|>"),
             (" It is sunny.", "<|return|>"), ("commentary", " to=functions.get_weather"),
             (" to=functions.get_weather", "<|constrain|>"), ("<|constrain|>", "json"), ("json", "<|message|>"),
             ('{"city": "Oslo"}', "<|call|>")]
    rows = [(nxt, {cur: 4.0}) for cur, nxt in chain]
    for marker, (thinking, answer, call) in {"<|channel|>": ("analysis", "final", "commentary"),
                                             "<|message|>": (" quick", " It is sunny.", '{"city": "Oslo"}')}.items():
        rows += [(thinking, {marker: 4.0, "done": -4.0}),
                 (answer, {marker: 2.0, "done": 2.0, "weather": -4.0}),
                 (call, {marker: 1.0, "done": 1.0, "weather": 2.0})]
    return rows


def make_harmony_gpt_oss(folder: Path) -> Path:
    """The checkpoint in `folder` (float32), with the tokenizer above and `<|return|>` / `<|call|>` as its ends."""
    from transformers import GptOssConfig, GptOssForCausalLM

    tokenizer = write_harmony_tokenizer(folder)
    assert len(tokenizer) <= VOCAB_SIZE
    ids = tokenizer.convert_tokens_to_ids
    chain = SPECIAL + PLAIN
    assert len(chain) < THOUGHT_DONE and len({ids(t) for t in chain}) == len(chain)
    config = GptOssConfig(vocab_size=VOCAB_SIZE, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=2, head_dim=HEAD_DIM, num_local_experts=2,
                          num_experts_per_tok=1, layer_types=["full_attention"], max_position_embeddings=512,
                          rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
                          eos_token_id=[ids("<|return|>"), ids("<|call|>")], bos_token_id=0, pad_token_id=1,
                          tie_word_embeddings=False)
    torch.manual_seed(0)
    model = GptOssForCausalLM(config)
    direction = {t: k for k, t in enumerate(chain)} | {"done": THOUGHT_DONE, "weather": WEATHER_ASKED}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        embed = model.model.embed_tokens.weight
        embed.normal_(0, 0.02)
        embed[:, :len(chain)] = 0.0  # the chain's and the heads' directions belong to them alone
        embed[:, THOUGHT_DONE:] = 0.0
        for t in chain:
            embed[ids(t)] = 0.0
            embed[ids(t), direction[t]] = 1.0
        for norm in (model.model.norm, model.model.layers[0].input_layernorm,
                     model.model.layers[0].post_attention_layernorm):
            norm.weight.fill_(1.0)
        attn = model.model.layers[0].self_attn
        scale = HIDDEN ** 0.5  # a one-hot embedding leaves the input norm this long
        for head, (watched, report) in enumerate(zip(WATCHED, (THOUGHT_DONE, WEATHER_ASKED), strict=True)):
            row = head * HEAD_DIM + SLOW
            attn.q_proj.bias[row] = 11.0  # every query the same; 11 * 11 / sqrt(16) = 30 against the sink's 10
            attn.k_proj.weight[row, direction[watched]] = 11.0 / scale
            attn.v_proj.weight[row, direction[watched]] = 1.0 / scale
            attn.o_proj.weight[report, row] = 1.0
            attn.sinks[head] = 10.0
        head_weights = model.lm_head.weight
        for nxt, weights in _successors():
            for source, w in weights.items():
                head_weights[ids(nxt), direction[source]] = w
    model.save_pretrained(folder, safe_serialization=True)
    return folder
