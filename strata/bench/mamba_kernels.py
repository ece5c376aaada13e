"""Milliseconds per call of the Mamba2 Triton kernels beside their torch references, on one device
(`python -m strata.bench.mamba_kernels` on a GPU prints them)."""
from __future__ import annotations

import json

import torch

from strata.kernels.triton import causal_conv1d as tconv
from strata.kernels.triton import ssd as tssd
from strata.kernels.triton import state_update as tsu
from strata.kernels.triton.jit import require_triton, triton
from strata.layers.mamba import causal_conv1d as rconv
from strata.layers.mamba import ssd as rssd
from strata.layers.mamba import state_update as rsu


def benchmark(
    num_tokens: int = 8192, num_seqs: int = 8, heads: int = 64, head_dim: int = 64, groups: int = 8,
    dstate: int = 128, chunk_size: int = 256, decode_batch: int = 256, conv_width: int = 4,
    dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
) -> dict[str, float]:
    """Prefill of `num_seqs` equal sequences of `num_tokens` in all, and a decode step of `decode_batch`
    sequences, at a Mamba2 layer's shapes (conv over x, B and C). float32 SSM states."""
    require_triton()
    gen = torch.Generator(device).manual_seed(0)

    def rand(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dt)

    slots_n = max(num_seqs, decode_batch)
    channels = heads * head_dim + 2 * groups * dstate
    qsl_host = torch.linspace(0, num_tokens, num_seqs + 1).long().tolist()
    qsl = torch.tensor(qsl_host, device=device, dtype=torch.int32)
    seq_slots = torch.randperm(slots_n, device=device, generator=gen)[:num_seqs]
    dec_slots = torch.randperm(slots_n, device=device, generator=gen)[:decode_batch]
    flags = torch.ones(num_seqs, dtype=torch.bool, device=device)
    conv_pool = rand(slots_n, conv_width - 1, channels).transpose(1, 2)
    ssm_pool = rand(slots_n, heads, head_dim, dstate, scale=0.1, dt=torch.float32)
    weight, bias = rand(channels, conv_width), rand(channels)
    xbc, xbc_dec = rand(num_tokens, channels), rand(decode_batch, channels)
    A = -torch.rand(heads, generator=gen, device=device) - 0.5
    D, dt_bias = rand(heads, dt=torch.float32), rand(heads, dt=torch.float32)

    def scan_inputs(t):
        return dict(x=rand(t, heads, head_dim), dt=rand(t, heads) - 1.0, A=A,
                    B=rand(t, groups, dstate, scale=dstate ** -0.5), C=rand(t, groups, dstate, scale=dstate ** -0.5))

    pre, dec = scan_inputs(num_tokens), scan_inputs(decode_batch)
    chunks = tssd.scan_chunks(qsl_host, chunk_size, device)
    extra = dict(D=D, dt_bias=dt_bias)
    bench = triton.testing.do_bench
    return {
        "conv_varlen_triton_ms": bench(lambda: tconv.causal_conv1d_varlen(
            xbc, weight, bias, qsl, conv_pool, seq_slots, flags)),
        "conv_varlen_torch_ms": bench(lambda: rconv.causal_conv1d_varlen(
            xbc, weight, bias, qsl, conv_pool[seq_slots], flags)),
        "conv_update_triton_ms": bench(lambda: tconv.causal_conv1d_update(
            xbc_dec, conv_pool, weight, bias, "silu", dec_slots)),
        "conv_update_torch_ms": bench(lambda: rconv.causal_conv1d_update(
            xbc_dec, conv_pool, weight, bias, "silu", dec_slots)),
        "scan_triton_ms": bench(lambda: tssd.ssd_chunk_scan_varlen(
            **pre, chunks=chunks, ssm_state=ssm_pool, state_slots=seq_slots, has_initial_state=flags, **extra)),
        "scan_torch_ms": bench(lambda: rssd.ssd_chunk_scan_varlen(
            **pre, chunk_size=chunk_size, query_start_loc=qsl, initial_states=ssm_pool[seq_slots], **extra)),
        "state_update_triton_ms": bench(lambda: tsu.selective_state_update(
            ssm_pool, **dec, **extra, state_batch_indices=dec_slots)),
        "state_update_torch_ms": bench(lambda: rsu.selective_state_update(
            ssm_pool, **dec, **extra, state_batch_indices=dec_slots)),
    }


if __name__ == "__main__":
    print(json.dumps(benchmark(), indent=1))
