"""Builders of tiny random Mamba2 (saved by transformers) and PLaMo2 (hand-built HF layout) checkpoints."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from checkpoints import write_tokenizer
from safetensors.torch import save_file


@pytest.fixture(scope="module")
def one_torch_thread():
    """These tiny models gain nothing from a second thread, which on a busy machine mostly waits for a core."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_mamba2(folder: Path, *, vocab_size: int = 300, hidden_size: int = 64, num_layers: int = 3,
                num_heads: int = 8, head_dim: int = 16, state_size: int = 16, n_groups: int = 1,
                tied: bool = False, chunk_size: int = 8, seed: int = 0) -> Path:
    """A random transformers Mamba2ForCausalLM with weights scaled so that every part changes the tokens."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    config = Mamba2Config(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                          num_heads=num_heads, head_dim=head_dim, state_size=state_size, n_groups=n_groups,
                          expand=num_heads * head_dim // hidden_size, chunk_size=chunk_size,
                          tie_word_embeddings=tied, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(seed)
    model = Mamba2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("conv1d.weight"):
                p.normal_(0, 0.3)
            elif name.endswith("conv1d.bias"):
                p.normal_(0, 0.1)
            elif p.dim() == 2:
                p.normal_(0, 0.08)
            elif name.endswith(("norm.weight", "norm_f.weight")):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(".D"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("dt_bias"):
                p.add_(torch.linspace(0, 2, p.numel()))  # a spread of decays, some strong
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder, 256)
    return folder


def plamo2_is_mamba(num_layers: int, mamba_step: int, i: int, enabled: bool = True) -> bool:
    """The layer pattern of the spec (1.2), written out here so that tests do not read it from strata."""
    if not enabled:
        return False
    if num_layers <= mamba_step // 2:
        return i != num_layers - 1
    return i % mamba_step != mamba_step // 2


def make_plamo2(folder: Path, *, vocab_size: int = 300, hidden_size: int = 64, num_layers: int = 4,
                mamba_step: int = 2, num_heads: int = 4, num_kv_heads: int = 1, head_dim: int = 16,
                mamba_num_heads: int = 4, d_state: int = 16, d_conv: int = 4, intermediate_size: int = 128,
                tied: bool = True, lm_head_rows: int | None = None, window: int = 2048, seed: int = 0,
                full_attention_idx: list[int] | None = None, mamba_enabled: bool = True) -> Path:
    """A random PLaMo2 in the HF checkpoint layout (interleaved in_proj, A_log, offset-form norms).

    `lm_head_rows` sets the stored rows of an untied head (HF pads it to a multiple of 16).
    """
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    d, cm, rank = hidden_size, mamba_num_heads * head_dim, max(64, hidden_size // 16)
    weights = {"model.embed_tokens.weight": normal(vocab_size, d, std=0.5), "model.norm.weight": normal(d, std=0.1)}
    if not tied:
        weights["lm_head.weight"] = normal(lm_head_rows or vocab_size, d, std=0.5)
    for i in range(num_layers):
        p = f"model.layers.layers.{i}."
        for norm in ("pre_mixer_norm", "post_mixer_norm", "pre_mlp_norm", "post_mlp_norm"):
            weights[p + norm + ".weight"] = normal(d, std=0.1)
        weights[p + "mlp.gate_up_proj.weight"] = normal(2 * intermediate_size, d)
        weights[p + "mlp.down_proj.weight"] = normal(d, intermediate_size)
        m = p + "mixer."
        if plamo2_is_mamba(num_layers, mamba_step, i, mamba_enabled):
            dt = torch.exp(torch.rand(mamba_num_heads, generator=gen) * (math.log(0.1) - math.log(0.001))
                           + math.log(0.001)).clamp(min=1e-4)
            dt_bias = dt + torch.log(-torch.expm1(-dt))
            dt_bias[::2] += 2.0  # strong decay on some heads
            weights.update({
                m + "in_proj.weight": normal(2 * cm, d), m + "conv1d.weight": normal(cm, 1, d_conv, std=0.3),
                m + "bcdt_proj.weight": normal(2 * d_state + rank, cm),
                m + "dt_proj.weight": normal(mamba_num_heads, rank),
                m + "dt_bias": dt_bias, m + "A_log": torch.log(torch.arange(1, mamba_num_heads + 1).float()),
                m + "D": 1 + normal(mamba_num_heads, std=0.1), m + "dt_norm_weight": 1 + normal(rank, std=0.1),
                m + "B_norm_weight": 1 + normal(d_state, std=0.1), m + "C_norm_weight": 1 + normal(d_state, std=0.1),
                m + "out_proj.weight": normal(d, cm)})
        else:
            weights.update({
                m + "qkv_proj.weight": normal((num_heads + 2 * num_kv_heads) * head_dim, d, std=0.2),
                m + "q_weight": 1 + normal(num_heads, head_dim, std=0.1),
                m + "k_weight": 1 + normal(num_kv_heads, head_dim, std=0.1),
                m + "o_proj.weight": normal(d, num_heads * head_dim)})
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    config = {
        "architectures": ["Plamo2ForCausalLM"], "model_type": "plamo2", "hidden_size": d,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "hidden_size_per_head": head_dim, "intermediate_size": intermediate_size, "mamba_d_state": d_state,
        "mamba_d_conv": d_conv, "mamba_num_heads": mamba_num_heads, "mamba_step": mamba_step,
        "mamba_enabled": mamba_enabled, "mamba_chunk_size": 8, "rms_norm_eps": 1e-6, "vocab_size": vocab_size,
        "max_position_embeddings": 10485760, "attention_window_size": window,
        "full_attention_idx": full_attention_idx or [], "tie_word_embeddings": tied, "bos_token_id": 0,
        "eos_token_id": 1, "pad_token_id": None, "torch_dtype": "float32"}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(folder, 256)
    return folder


class StepRunner:
    """Drives strata's ModelRunner with hand-made steps and returns the logits of every fed token.

    Each request gets its own state slot and a fixed run of KV blocks, as the scheduler would give it.
    """

    def __init__(self, path: Path, max_model_len: int = 256, max_num_seqs: int = 8, **engine_args) -> None:
        from strata.config import EngineConfig
        from strata.distributed import ParallelContext
        from strata.executor.model_runner import ModelRunner

        self.config = EngineConfig.create(str(path), dtype=engine_args.pop("dtype", "float32"), device="cpu",
                                          max_model_len=max_model_len, max_num_seqs=max_num_seqs, **engine_args)
        self.runner = ModelRunner(self.config, ParallelContext(), torch.device("cpu"))
        self.blocks_per_seq = -(-max_model_len // self.config.cache.block_size)
        self.runner.allocate_kv_cache(max_num_seqs * self.blocks_per_seq)
        self.slots: dict[str, int] = {}

    def step(self, chunks: list[tuple[str, list[int], int]]) -> list[torch.Tensor]:
        """chunks: (request id, tokens fed now, tokens already computed); returns [len(tokens), vocab] each,
        in the order given (the runner itself reorders decodes first)."""
        from strata.executor.step import NewRequestData, ScheduledRequest, SchedulerOutput
        from strata.sampling_params import SamplingParams

        requests = []
        for request_id, tokens, computed in chunks:
            new = None
            if request_id not in self.slots:
                self.slots[request_id] = len(self.slots)
                new = NewRequestData(SamplingParams(), list(tokens))
            slot = self.slots[request_id]
            blocks = list(range(slot * self.blocks_per_seq, (slot + 1) * self.blocks_per_seq))
            requests.append(ScheduledRequest(request_id, list(tokens), computed, blocks, True, slot, new))
        out = SchedulerOutput(requests)
        runner = self.runner
        runner._update_states(out)
        ordered = sorted(requests, key=lambda s: len(s.token_ids) != 1)  # the runner's order
        with torch.inference_mode():
            input_ids, positions, meta = runner._prepare(ordered)
            logits = runner.model.compute_logits(runner.model(input_ids, positions, meta))
        pieces = dict(zip([s.request_id for s in ordered],
                          logits.split([len(s.token_ids) for s in ordered]), strict=True))
        return [pieces[request_id] for request_id, _, _ in chunks]
