"""Random checkpoints of real shapes written straight from device tensors (a bf16 1B model in seconds on a GPU):
Llama and Mamba2 in transformers' own layout, PLaMo2 in its HF checkpoint layout, and a trained BPE tokenizer."""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import torch

LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=8192, vocab_size=32000)
MAMBA2_1B = dict(hidden_size=2048, num_hidden_layers=32, head_dim=64, state_size=128, n_groups=8, chunk_size=256,
                 vocab_size=32000)
PLAMO2_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=1,
                 head_dim=128, mamba_num_heads=32, d_state=64, intermediate_size=8192, chunk_size=256,
                 vocab_size=32000)
# The same families at test size: every code path of a 1B run, in well under a second on a CPU.
LLAMA_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=640)
MAMBA2_TINY = dict(hidden_size=64, num_hidden_layers=2, head_dim=16, state_size=16, n_groups=2, chunk_size=8,
                   vocab_size=640)
PLAMO2_TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                   mamba_num_heads=4, d_state=16, intermediate_size=128, chunk_size=8, vocab_size=640)


@functools.cache
def _tokenizer(vocab_size: int, corpus_bytes: int):
    from strata.demo.train import stdlib_sources, train_tokenizer

    return train_tokenizer(stdlib_sources(max_bytes=corpus_bytes), vocab_size=vocab_size)


def write_tokenizer(folder: Path, vocab_size: int, corpus_bytes: int = 3_500_000) -> int:
    """random_model.py's tokenizer (byte-level BPE on the stdlib), trained once per process; returns its size,
    which may be below `vocab_size` (the model's) when the corpus runs out of merges."""
    tokenizer = _tokenizer(vocab_size, corpus_bytes)
    tokenizer.save_pretrained(folder)
    return len(tokenizer)


class _Random:
    """Draws every tensor on `device` in `dtype` from one seeded generator."""

    def __init__(self, device: str, dtype: torch.dtype, seed: int) -> None:
        self.device, self.dtype = torch.device(device), dtype
        self.gen = torch.Generator(self.device).manual_seed(seed)

    def normal(self, *shape: int, std: float = 0.02, mean: float = 0.0) -> torch.Tensor:
        x = torch.randn(*shape, generator=self.gen, device=self.device, dtype=torch.float32)
        return (x * std + mean).to(self.dtype)

    def near_one(self, *shape: int) -> torch.Tensor:
        return self.normal(*shape, std=0.05, mean=1.0)

    def dt_bias(self, heads: int) -> torch.Tensor:
        """Inverse softplus of time steps spread log-uniformly over [1e-3, 1e-1], Mamba's own initialisation."""
        u = torch.rand(heads, generator=self.gen, device=self.device)
        dt = torch.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
        return (dt + torch.log(-torch.expm1(-dt))).to(self.dtype)

    def a_log(self, heads: int) -> torch.Tensor:
        return torch.log(torch.arange(1, heads + 1, device=self.device, dtype=torch.float32)).to(self.dtype)


def _hf_value(rand: _Random, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A value for a transformers parameter, by what its name says it is (norms 1, Mamba's A, D and dt set up as
    at initialisation, matrices small), so that bf16 activations stay finite through every layer."""
    if name.endswith("A_log"):
        return rand.a_log(shape[0])
    if name.endswith("dt_bias"):
        return rand.dt_bias(shape[0])
    if name.endswith(".D") or (len(shape) == 1 and "norm" in name):
        return torch.ones(shape, device=rand.device, dtype=rand.dtype)
    if name.endswith("conv1d.weight"):
        return rand.normal(*shape, std=0.2)
    if len(shape) == 1:
        return torch.zeros(shape, device=rand.device, dtype=rand.dtype)
    return rand.normal(*shape)


def _save(folder: Path, tensors: dict[str, torch.Tensor]) -> int:
    """Writes model.safetensors; returns its tensor bytes."""
    from safetensors.torch import save_file

    cpu = {k: v.contiguous().cpu() for k, v in tensors.items()}
    save_file(cpu, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in cpu.values())


def _write_hf(folder: Path, config, device: str, dtype: torch.dtype, seed: int) -> int:
    """Takes parameter names and shapes from transformers' model built on the meta device (no memory, no time)."""
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    rand = _Random(device, dtype, seed)
    tensors = {}
    for name, p in model.state_dict().items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        tensors[name] = _hf_value(rand, name, tuple(p.shape))
    config.save_pretrained(folder)
    return _save(folder, tensors)


def write_llama(folder: Path, shape: dict, *, device: str = "cpu", dtype: torch.dtype = torch.bfloat16,
                seed: int = 0) -> int:
    """A random LlamaForCausalLM (tied embeddings, as Llama 3.2 1B); returns the weight bytes."""
    from transformers import LlamaConfig

    config = LlamaConfig(architectures=["LlamaForCausalLM"], max_position_embeddings=2048, tie_word_embeddings=True,
                         bos_token_id=0, eos_token_id=1, dtype=str(dtype).removeprefix("torch."), **shape)
    return _write_hf(folder, config, device, dtype, seed)


def write_mamba2(folder: Path, shape: dict, *, device: str = "cpu", dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0) -> int:
    """A random Mamba2ForCausalLM (expand 2, tied embeddings, as state-spaces/mamba2); returns the weight bytes."""
    from transformers import Mamba2Config

    shape = dict(shape)
    heads = 2 * shape["hidden_size"] // shape["head_dim"]
    config = Mamba2Config(architectures=["Mamba2ForCausalLM"], num_heads=heads, expand=2, tie_word_embeddings=True,
                          bos_token_id=0, eos_token_id=1, pad_token_id=1, dtype=str(dtype).removeprefix("torch."),
                          **shape)
    return _write_hf(folder, config, device, dtype, seed)


def _plamo2_is_mamba(num_layers: int, mamba_step: int, i: int) -> bool:
    if num_layers <= mamba_step // 2:
        return i != num_layers - 1
    return i % mamba_step != mamba_step // 2


def _plamo2_mixer(rand: _Random, s: dict, mamba: bool) -> dict[str, torch.Tensor]:
    d, hd, heads = s["hidden_size"], s["head_dim"], s["mamba_num_heads"]
    if not mamba:
        qkv = (s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * hd
        return {"qkv_proj.weight": rand.normal(qkv, d), "o_proj.weight": rand.normal(d, s["num_attention_heads"] * hd),
                "q_weight": rand.near_one(s["num_attention_heads"], hd),
                "k_weight": rand.near_one(s["num_key_value_heads"], hd)}
    cm, rank, n = heads * hd, max(64, d // 16), s["d_state"]
    return {"in_proj.weight": rand.normal(2 * cm, d), "conv1d.weight": rand.normal(cm, 1, 4, std=0.2),
            "bcdt_proj.weight": rand.normal(2 * n + rank, cm), "dt_proj.weight": rand.normal(heads, rank),
            "dt_bias": rand.dt_bias(heads), "A_log": rand.a_log(heads), "D": rand.near_one(heads),
            "dt_norm_weight": rand.near_one(rank), "B_norm_weight": rand.near_one(n), "C_norm_weight": rand.near_one(n),
            "out_proj.weight": rand.normal(d, cm)}


def write_plamo2(folder: Path, shape: dict, *, device: str = "cpu", dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0) -> int:
    """A random PLaMo2 in the HF checkpoint layout (as tests/mamba_checkpoints.py, offset-form norms near 0,
    Mamba on every layer but each second one); returns the weight bytes."""
    s, rand = dict(shape), _Random(device, dtype, seed)
    d, layers, step = s["hidden_size"], s["num_hidden_layers"], 2
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {"model.embed_tokens.weight": rand.normal(s["vocab_size"], d), "model.norm.weight": rand.normal(d)}
    for i in range(layers):
        p = f"model.layers.layers.{i}."
        for norm in ("pre_mixer_norm", "post_mixer_norm", "pre_mlp_norm", "post_mlp_norm"):
            tensors[p + norm + ".weight"] = rand.normal(d)
        tensors[p + "mlp.gate_up_proj.weight"] = rand.normal(2 * s["intermediate_size"], d)
        tensors[p + "mlp.down_proj.weight"] = rand.normal(d, s["intermediate_size"])
        mixer = _plamo2_mixer(rand, s, _plamo2_is_mamba(layers, step, i))
        tensors.update({p + "mixer." + k: v for k, v in mixer.items()})
    config = {
        "architectures": ["Plamo2ForCausalLM"], "model_type": "plamo2", "hidden_size": d, "num_hidden_layers": layers,
        "num_attention_heads": s["num_attention_heads"], "num_key_value_heads": s["num_key_value_heads"],
        "hidden_size_per_head": s["head_dim"], "intermediate_size": s["intermediate_size"],
        "mamba_d_state": s["d_state"], "mamba_d_conv": 4, "mamba_num_heads": s["mamba_num_heads"],
        "mamba_step": step, "mamba_enabled": True, "mamba_chunk_size": s["chunk_size"], "rms_norm_eps": 1e-6,
        "vocab_size": s["vocab_size"], "max_position_embeddings": 2048, "attention_window_size": 2048,
        "full_attention_idx": [], "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 1,
        "pad_token_id": None, "torch_dtype": str(dtype).removeprefix("torch.")}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return _save(folder, tensors)
