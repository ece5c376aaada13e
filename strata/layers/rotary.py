"""Rotary position embeddings (half-split "neox" and interleaved-pair styles, over the whole head or its first
`rotary_dim` dimensions), with llama3, LongRoPE and YaRN scaling; on CPU half-split heads are rotated in place by a
small C kernel (one call for q and k instead of a dozen ops, a prefill's tokens shared among the threads)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from strata.errors import UnsupportedModelError
from strata.kernels.cpu import cpu_kernels_apply, norm_rope
from strata.kernels.cpu.abi import DTYPE_FLAGS


def _kernel_serves(x: torch.Tensor, head_dim: int) -> bool:
    """[T, H, D] heads whose values are contiguous per token row (e.g. views into a fused qkv output)."""
    return (cpu_kernels_apply(x) and x.dtype in DTYPE_FLAGS and x.dim() == 3 and x.stride(2) == 1
            and x.stride(1) == head_dim and norm_rope.rotary_library() is not None)


def rope_parameters(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(base, scaling dict or None) from either `rope_parameters` (new) or `rope_theta`/`rope_scaling`."""
    params = config.get("rope_parameters")
    if params:
        base = params.get("rope_theta", config.get("rope_theta", 10000.0))
        kind = params.get("rope_type", params.get("type", "default"))
        return base, (_with_original_length(dict(params), config) if kind != "default" else None)
    scaling = config.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return config.get("rope_theta", 10000.0), scaling and _with_original_length(dict(scaling), config)


def _with_original_length(scaling: dict[str, Any], config: Any) -> dict[str, Any]:
    """The scaling dict completed with the lengths its kind needs (LongRoPE's, YaRN's); others pass as they are."""
    if scaling.get("rope_type", scaling.get("type")) == "yarn":
        return _with_yarn_lengths(scaling, config)
    return _with_longrope_lengths(scaling, config)


def _with_yarn_lengths(scaling: dict[str, Any], config: Any) -> dict[str, Any]:
    """A YaRN dict with `original_max_position_embeddings` as transformers completes it: the config's top-level
    value first, then the dict's own, then max_position_embeddings; and `factor`, when absent, their ratio."""
    original = (config.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
                or config.get("max_position_embeddings"))
    if original is None:
        raise UnsupportedModelError("YaRN rotary scaling needs original_max_position_embeddings (or "
                                    "max_position_embeddings) in config.json", param="rope_scaling")
    scaling["rope_type"], scaling["original_max_position_embeddings"] = "yarn", original
    if scaling.get("factor") is None:
        scaling["factor"] = config.get("max_position_embeddings", original) / original
    return scaling


def partial_rotary_factor(config: Any) -> float:
    """The share of each head that rotates: from `rope_parameters` (transformers 5) or the config's top level."""
    params = config.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))


def _with_longrope_lengths(scaling: dict[str, Any], config: Any) -> dict[str, Any]:
    """A LongRoPE dict (`su` is its old name) completed with the lengths it needs, as transformers completes it:
    `original_max_position_embeddings` from the config's top level when set there (Phi-3 keeps it there), and the
    `factor` that sets the attention scaling, else max_position_embeddings / original_max_position_embeddings."""
    if scaling.get("rope_type", scaling.get("type")) not in ("longrope", "su"):
        return scaling
    original = config.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
    if original is None:
        original = config.get("max_position_embeddings")
    scaling["rope_type"], scaling["original_max_position_embeddings"] = "longrope", original
    if scaling.get("factor") is None:
        scaling["factor"] = config.get("max_position_embeddings", original) / original
    return scaling


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def longrope_inv_freq(base: float, rotary_dim: int, scaling: dict[str, Any], max_model_len: int | None
                      ) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): (inverse frequencies, the factor cos and sin are multiplied by).

    Each frequency is divided by a per-dimension factor: `long_factor` when the engine may run sequences past
    `original_max_position_embeddings` (max_model_len longer than it), else `short_factor`, chosen once for every
    position and sequence, as vLLM chooses. transformers instead switches per forward pass by the longest sequence
    in it, which would leave a sequence that grows past the original length with keys cached under the short
    factors beside queries under the long ones; here a cached key keeps the rotation it was written with, so the
    KV cache (and the prefix cache) stays valid. The cost is vLLM's: a server started with a long max_model_len
    uses the long factors for short prompts too (start it with max_model_len <= the original length to avoid it).
    """
    original = scaling["original_max_position_embeddings"]
    long = max_model_len is not None and max_model_len > original
    factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    if factors.numel() != rotary_dim // 2:
        raise UnsupportedModelError(f"rope_scaling {'long' if long else 'short'}_factor has {factors.numel()} "
                                    f"values; the rotary dimensions need {rotary_dim // 2}", param="rope_scaling")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (factors * base ** exponents)
    factor = scaling.get("factor", 1.0)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:  # the LongRoPE paper's: sqrt(1 + ln(s) / ln(L)) for a context s times L
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq, float(attention_factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(base: float, rotary_dim: int, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (NTK-by-parts): (inverse frequencies, the factor cos and sin are multiplied by).

    Dimensions that turn more than `beta_fast` times over the original context keep their frequency
    (extrapolation), those turning fewer than `beta_slow` times are divided by `factor` (interpolation), and a
    linear ramp blends the ones between. `truncate` (default true; gpt-oss sets false) rounds the ramp's ends
    outwards to whole dimensions. The attention factor defaults to 0.1 ln(factor) + 1, or the ratio of two such
    terms when `mscale` and `mscale_all_dim` are both given (DeepSeek's spelling)."""
    factor, original = float(scaling["factor"]), scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))

    def dimension_of(rotations: float) -> float:
        """The (fractional) dimension whose frequency turns `rotations` times over the original context."""
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension_of(beta_fast), dimension_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: a fast (high-frequency) dimension keeps its frequency; 0: a slow one is interpolated
    wavelengths = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
    # Rounded as transformers rounds them (1 / (factor * w), the blend weights as 1 - keep), for identical tables.
    return (1.0 / (factor * wavelengths)) * (1 - keep) + (1.0 / wavelengths) * keep, float(attention_factor)


def _mrope_rows(section: Sequence[int], rotary_dim: int) -> torch.Tensor:
    """The position row (0 temporal, 1 height, 2 width) each of the rotary_dim / 2 frequencies reads."""
    if len(section) != 3 or sum(section) != rotary_dim // 2:
        raise UnsupportedModelError(f"mrope_section {list(section)} must be three counts summing to "
                                    f"{rotary_dim // 2} (half the rotary dimensions)", param="rope_scaling")
    return torch.repeat_interleave(torch.arange(3), torch.tensor(list(section)))


class RotaryEmbedding(nn.Module):
    """`rotary_dim`: the leading dimensions of each head that rotate (partial rotary), the whole head by default;
    `max_model_len`: the longest sequence the engine runs (LongRoPE chooses its factors by it)."""

    def __init__(self, head_dim: int, base: float, scaling: dict[str, Any] | None = None,
                 interleaved: bool = False, *, rotary_dim: int | None = None, max_model_len: int | None = None,
                 mrope_section: Sequence[int] | None = None) -> None:
        """`mrope_section`: M-RoPE (Qwen2-VL) frequency counts turning with the temporal, height and width rows of
        [3, T] positions; 1-D positions (all three rows equal) rotate as plain RoPE."""
        super().__init__()
        self.head_dim, self.interleaved = head_dim, interleaved
        self.rotary_dim = dim = rotary_dim or head_dim
        if dim % 2 or dim > head_dim or (interleaved and dim != head_dim):
            raise UnsupportedModelError(f"a rotary dimension of {dim} in heads of {head_dim} is not supported "
                                        "(it must be even, and whole heads for interleaved pairs)",
                                        param="partial_rotary_factor")
        self.mscale = 1.0  # cos and sin are multiplied by it (LongRoPE's and YaRN's attention scaling)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "llama3":
                inv_freq = llama3_inv_freq(inv_freq, scaling)
            elif kind in ("longrope", "su"):
                inv_freq, self.mscale = longrope_inv_freq(base, dim, scaling, max_model_len)
            elif kind == "yarn":
                inv_freq, self.mscale = yarn_inv_freq(base, dim, scaling)
            elif kind == "linear":  # positions divided by the factor: the same angles as frequencies divided
                inv_freq = inv_freq / float(scaling["factor"])
            elif kind == "freq_factors":  # a divisor per frequency, as GGUF files carry Llama 3.1's (rope_freqs)
                factors = torch.tensor(scaling["freq_factors"], dtype=torch.float32)
                if factors.shape != inv_freq.shape:
                    raise UnsupportedModelError(f"{len(factors)} rotary frequency factors for {len(inv_freq)} "
                                                "frequencies", param="rope_scaling")
                inv_freq = inv_freq / factors
            else:
                raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported (supported: llama3, "
                                            "longrope, linear, yarn)", param="rope_scaling")
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.mrope_rows = None if mrope_section is None else _mrope_rows(mrope_section, dim)
        # The step's positions and dtype, its cos/sin, and (once asked for) its half-split tables.
        self._last: tuple[torch.Tensor, torch.dtype, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._last_tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self._float_tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, rotary_dim / 2] of positions [T], or of M-RoPE positions [3, T]: frequency j turns with
        the row of its section (transformers' product and rounding)."""
        if positions.dim() == 2:
            if self.mrope_rows is None:
                raise ValueError("positions of three rows need a rotary embedding built with mrope_section")
            rows = self.mrope_rows.to(positions.device)
            freqs = positions.T.float()[:, rows] * self.inv_freq.to(positions.device)
        else:
            freqs = positions.float().unsqueeze(-1) * self.inv_freq.to(positions.device)
        if self.mscale != 1.0:
            return (freqs.cos() * self.mscale).to(dtype), (freqs.sin() * self.mscale).to(dtype)
        return freqs.cos().to(dtype), freqs.sin().to(dtype)

    def float_tables(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin [n, rotary_dim / 2] of positions 0..n-1, n >= rows: `cos_sin`'s values, to look up
        (grown by doubling, so a long generation computes them a few times)."""
        have = 0 if self._float_tables is None else self._float_tables[0].shape[0]
        if have < rows:
            self._float_tables = self.cos_sin(torch.arange(max(rows, 2 * have, 256)), torch.float32)
        return self._float_tables

    def _step_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`cos_sin`, computed once per positions tensor: a model shares one instance among its layers, so once
        per step. Keyed by the tensor object: every step builds new positions (holding the last one keeps its id
        unique)."""
        if self._last is None or self._last[0] is not positions or self._last[1] != dtype:
            self._last = (positions, dtype, self.cos_sin(positions, dtype))
            self._last_tables = None
        return self._last[2]

    def _tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin as [T, 1, D] for the half-split style, sin negated on the first half; once per step too."""
        cos, sin = self._step_cos_sin(positions, dtype)
        if self._last_tables is None:
            self._last_tables = torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((-sin, sin), -1).unsqueeze(1)
        return self._last_tables

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D] -> the rotated heads: copies, or q and k themselves rotated in place (on
        CPU; callers pass fresh projections)."""
        if self.interleaved:
            cos, sin = self._step_cos_sin(positions, q.dtype)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            return self._rotate_pairs(q, cos, sin), self._rotate_pairs(k, cos, sin)
        if _kernel_serves(q, self.head_dim) and _kernel_serves(k, self.head_dim):
            return self._rotate_in_place(positions, q, k)
        cos, sin = self._tables(positions, q.dtype)
        if self.rotary_dim < self.head_dim:  # the first rotary_dim dimensions rotate, the rest pass through
            return self._rotate_leading(q, cos, sin), self._rotate_leading(k, cos, sin)
        return self._rotate_half_split(q, cos, sin), self._rotate_half_split(k, cos, sin)

    def _rotate_in_place(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated in place: callers pass fresh projections (views into one qkv output)."""
        cos, sin = self._step_cos_sin(positions, q.dtype)  # [T, D / 2], contiguous
        for x in (q, k):
            norm_rope.rope_half_split(x, self.head_dim, self.rotary_dim, cos, sin)
        return q, k

    def _rotate_leading(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        d = self.rotary_dim
        return torch.cat((self._rotate_half_split(x[..., :d], cos, signed_sin), x[..., d:]), dim=-1)

    @staticmethod
    def _rotate_half_split(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        # [x1 cos - x2 sin, x2 cos + x1 sin], each product and sum rounded as the two-half form rounds them.
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((x2, x1), dim=-1) * signed_sin

    @staticmethod
    def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
