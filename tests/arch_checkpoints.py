"""Tiny random checkpoints of the Llama-descended architectures (Qwen2, Qwen3, Qwen3-MoE, Mistral, Phi-3, Granite),
each built and saved by transformers' own classes, with the BPE tokenizer of `checkpoints.py`; their greedy tokens
and logits from transformers (full forward passes, no generation config in the way), and strata's against them."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from checkpoints import write_tokenizer

VOCAB = 320
WINDOW = 16  # sliding windows short enough that a 24-token prompt or generation runs past them
# Sizes every architecture shares: 4 heads over 2 KV heads (TP=2 splits both), PP=2 splits the layers.
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=1)
# What each architecture sets beyond them, chosen so that every feature it has differs from Llama's defaults.
ARCHITECTURES = {
    # Layer 0 full attention, layers 1-2 windowed (max_window_layers), q/k/v biases.
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, rope_theta=1e6)),
    # head_dim 32 is not hidden / heads (16).
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    # Layers 0 and 2 route over 4 experts (2 each, renormalised); layer 1 is dense (mlp_only_layers).
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW, head_dim=32)),
    # Half of each head rotates; LongRoPE with distinct short and long factors over an original length of 64
    # (a max_model_len of 64 keeps the short ones).
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(partial_rotary_factor=0.5, original_max_position_embeddings=64, max_position_embeddings=256,
                  rope_scaling={"type": "longrope", "short_factor": [1.0, 1.3, 1.9, 2.6],
                                "long_factor": [1.5, 2.9, 4.1, 7.3]})),
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(embedding_multiplier=6.0, attention_multiplier=0.11, residual_multiplier=0.4,
                     logits_scaling=3.0)),
}


GEMMA_WINDOW = 8
# Gemma's own checkpoints (tests/models/test_gemma.py), kept apart from the Llama-like shapes above.
# Soft caps small enough to bend these weights' scores and logits; query_pre_attn_scalar unlike head_dim; Gemma 3
# with two global layers among four and distinct rotary bases (linear scaling on the global ones).
GEMMA = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=GEMMA_WINDOW, attn_logit_softcapping=1.5,
                    final_logit_softcapping=4.0, num_hidden_layers=4)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=32, query_pre_attn_scalar=20, sliding_window=GEMMA_WINDOW, num_hidden_layers=4,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
                                     "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                        "rope_theta": 5000.0}})),
}


def make_arch(folder: Path, name: str, *, tied: bool = False, seed: int = 0, **overrides) -> Path:
    """A random `name` checkpoint saved by transformers (float32), with weights large enough that tokens differ
    sharply, norms and biases away from their 1 / 0 defaults (Gemma's norms, stored as offsets from one, away
    from 0), and the shared tokenizer."""
    import transformers

    config_class, model_class, extra = {**ARCHITECTURES, **GEMMA}[name]
    norms = (-0.4, 0.4) if name in GEMMA else (0.6, 1.4)
    config = getattr(transformers, config_class)(**{**COMMON, **extra, "tie_word_embeddings": tied, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif "norm" in param_name:
                p.uniform_(*norms)
            else:  # biases
                p.normal_(0, 0.3)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder, VOCAB)
    return folder


def edit_config(folder: Path, **changes) -> None:
    """Rewrite config.json with keys set (a None value removes the key)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        config.pop(key, None) if value is None else config.__setitem__(key, value)
    path.write_text(json.dumps(config))


def transformers_greedy(path: Path, prompts: list[list[int]], max_tokens: int, **load_args) -> list[dict]:
    """transformers' greedy continuation of each prompt by full forward passes, with the log-softmax of the
    logits at every generated position: [{"tokens": [...], "logprobs": float32 [max_tokens, vocab]}].
    `load_args` go to from_pretrained (`gguf_file=` loads a GGUF file in `path`, dequantized)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load_args).eval()
    results = []
    with torch.no_grad():
        for prompt in prompts:
            sequence = list(prompt)
            for _ in range(max_tokens):
                sequence.append(int(model(torch.tensor([sequence])).logits[0, -1].argmax()))
            logits = model(torch.tensor([sequence[:-1]])).logits[0, len(prompt) - 1:]
            results.append({"tokens": sequence[len(prompt):], "logprobs": torch.log_softmax(logits, dim=-1)})
    return results


def random_prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def strata_greedy(path: Path, prompts, max_tokens: int, *, max_model_len: int = 64, **engine_args) -> list:
    """strata's greedy outputs (float32, CPU) for token-id prompts, with the top-5 logprobs of each token."""
    from strata import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=max_model_len, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    return llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)


def assert_matches_transformers(outputs: list, expected: list[dict]) -> None:
    """The same greedy tokens; each reported logprob within 1e-4 of transformers' log-softmax."""
    for out, want in zip(outputs, expected, strict=True):
        got = out.outputs[0]
        assert got.token_ids == want["tokens"]
        for position, logprobs in enumerate(got.logprobs):
            for token, logprob in logprobs.items():
                assert abs(logprob.logprob - float(want["logprobs"][position, token])) < 1e-4


GPT_OSS_WINDOW = 8
# gpt-oss (tests/models/test_gpt_oss.py): layers 0 and 2 slide over 8 tokens, layer 1 attends fully; 4 experts of
# width 32, 2 per token; YaRN (x4 over an original 16 positions = max_position_embeddings 64, untruncated as the
# released configs); a SwiGLU limit low enough that these weights' gates and ups reach it.
GPT_OSS = dict(head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
               sliding_window=GPT_OSS_WINDOW, swiglu_limit=1.0, max_position_embeddings=64,
               rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16})


def make_gpt_oss(folder: Path, *, tied: bool = False, seed: int = 0, **overrides) -> Path:
    """A random gpt-oss checkpoint saved by transformers (float32) as `make_arch` makes the others: matrices and
    experts N(0, 0.08), norms near one, biases N(0, 0.3), and sinks N(0, 1) so that they take a real share of
    each softmax row."""
    import transformers

    config = transformers.GptOssConfig(**{**COMMON, **GPT_OSS, "tie_word_embeddings": tied, **overrides})
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if p.dim() >= 2 and not param_name.endswith("_bias"):
                p.normal_(0, 0.08)
            elif "norm" in param_name:
                p.uniform_(0.6, 1.4)
            else:
                p.normal_(0, 1.0 if param_name.endswith("sinks") else 0.3)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder, VOCAB)
    return folder
