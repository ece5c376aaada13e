"""Rotary embedding: q and k rotated in place by the C kernel (a decode step's tokens, or a prefill's shared among the
threads) equal the torch ops' copies."""
from __future__ import annotations

import pytest
import torch

from strata.kernels.cpu import norm_rope
from strata.layers.rotary import RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("positions", [[0, 3, 70, 5000], list(range(40, 140))], ids=["decode", "prefill"])
def test_in_place_kernel_gives_the_torch_rotation_exactly(dtype, positions):
    if norm_rope.rotary_library() is None:
        pytest.skip("no C compiler")
    rope = RotaryEmbedding(64, 10000.0)
    positions, t = torch.tensor(positions), len(positions)
    qkv = torch.randn(t, (16 + 8 + 8) * 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    q, k = qkv[:, :1024].view(t, 16, 64), qkv[:, 1024:1536].view(t, 8, 64)
    cos, sin = rope._tables(positions, dtype)
    want_q, want_k = rope._rotate_half_split(q, cos, sin), rope._rotate_half_split(k, cos, sin)
    got_q, got_k = rope(positions, q, k)
    assert got_q.data_ptr() == q.data_ptr()  # rotated in place, inside the qkv output
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_interleaved_pairs_and_strided_heads_return_copies():
    positions = torch.arange(40)
    q, k = torch.randn(len(positions), 4, 32), torch.randn(len(positions), 2, 32)
    wide = torch.randn(len(positions), 4, 64)[..., :32]  # heads not contiguous: the kernel does not take them
    for rope, x in ((RotaryEmbedding(32, 500.0, interleaved=True), q), (RotaryEmbedding(32, 500.0), wide)):
        before = x.clone()
        got, _ = rope(positions, x, k)
        assert got.data_ptr() != x.data_ptr() and torch.equal(x, before)


@pytest.mark.parametrize("max_model_len, positions", [(64, [0, 5, 63]), (256, [0, 70, 255])],
                         ids=["short_factors", "long_factors"])
def test_partial_longrope_rotation_matches_transformers_phi3(max_model_len, positions):
    """Half of each head rotates, with LongRoPE's factors and attention scaling; transformers picks its factors by
    the positions it sees (here all on one side of the original length), strata by max_model_len once."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    from strata.config.hf_config import HFConfig
    from strata.layers.rotary import partial_rotary_factor, rope_parameters

    values = dict(hidden_size=64, num_attention_heads=2, partial_rotary_factor=0.5, max_position_embeddings=256,
                  original_max_position_embeddings=64,
                  rope_scaling={"type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0, 2.2, 2.9, 3.1, 4.0],
                                "long_factor": [1.5, 2.0, 3.0, 4.5, 6.0, 9.0, 12.0, 20.0]})
    base, scaling = rope_parameters(HFConfig(values))
    rope = RotaryEmbedding(32, base, scaling, rotary_dim=int(32 * partial_rotary_factor(HFConfig(values))),
                           max_model_len=max_model_len)
    q, k = torch.randn(3, 2, 32), torch.randn(3, 1, 32)
    got_q, got_k = rope(torch.tensor(positions), q.clone(), k.clone())
    reference = Phi3RotaryEmbedding(Phi3Config(**values))
    cos, sin = reference(q, torch.tensor([positions]))
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), rtol=0, atol=1e-6)
