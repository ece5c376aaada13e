"""GPTQ and AWQ checkpoints written by hand, following each format's layout exactly (no library that writes them
installs beside the CPU torch here), plus the dense checkpoint of the very weights they encode: the oracle.

Round-to-nearest quantization of a base Llama's linear weights; the dense twin holds (q - zero) * scale computed
here in float64 from the unpacked integers, independently of strata's unpacking code.
"""
from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def pack_rows(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unsigned values [..., M] -> int32 [..., M * bits / 32], packed along the last dim (value j of a word at
    position order.index(j), lowest bits first)."""
    per = 32 // bits
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, per)
    word = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for position in range(per):
        column = order[position] if order else position
        word |= v[..., column] << (bits * position)
    return (word - ((word >> 31) << 32)).to(torch.int32)  # two's complement, as the formats store it


def _rtn(w: torch.Tensor, bits: int, group: int, sym: bool, g_idx: torch.Tensor):
    """Per (output, group) round-to-nearest: returns q [N, K], scale [G, N], zero [G, N] (unsigned)."""
    n, k = w.shape
    groups = int(g_idx.max()) + 1
    maxq = 2 ** bits - 1
    scale, zero = torch.zeros(groups, n, dtype=torch.float64), torch.zeros(groups, n, dtype=torch.float64)
    q = torch.zeros(n, k, dtype=torch.int64)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        block = w[:, cols].double()
        lo, hi = block.min(1).values.clamp(max=0), block.max(1).values.clamp(min=0)
        if sym:
            s = torch.maximum(hi.abs(), lo.abs()).clamp(min=1e-8) * 2 / maxq
            z = torch.full_like(s, (maxq + 1) // 2)
        else:
            s = (hi - lo).clamp(min=1e-8) / maxq
            z = torch.round(-lo / s)
        s = s.half().double()  # the checkpoint stores float16 scales
        scale[g], zero[g] = s, z
        q[:, cols] = torch.clamp(torch.round(block / s[:, None]) + z[:, None], 0, maxq).long()
    return q, scale, zero


def write_gptq_and_dense(base: Path, out: Path, dense: Path, bits: int, group: int, sym: bool, desc_act: bool,
                         seed: int = 0) -> None:
    stored, dense_tensors, linears = _split(base)
    for name, module, w in linears:
        n, k = w.shape
        g = k if group == -1 else group
        g_idx = torch.arange(k) // g
        if desc_act:  # GPTQ's act-order: groups are formed in an order of the input rows that depends on the
            # layer's input only, so projections of one input (q, k, v; gate, up) share it
            proj = module.rsplit(".", 1)[-1]
            key = module.rsplit(".", 1)[0] + {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(
                proj, proj)
            gen = torch.Generator().manual_seed(seed + zlib.crc32(key.encode()))
            g_idx = g_idx[torch.randperm(k, generator=gen).argsort()]
        q, scale, zero = _rtn(w, bits, g, sym, g_idx)
        stored[module + ".qweight"] = pack_rows(q, bits).t().contiguous()  # [K / pf, N], packed along K
        stored[module + ".qzeros"] = pack_rows(zero.long() - 1, bits)  # GPTQ v1 stores zero - 1
        stored[module + ".scales"] = scale.half()
        stored[module + ".g_idx"] = g_idx.to(torch.int32)
        dense_tensors[name] = ((q.double() - zero[g_idx].t()) * scale[g_idx].t()).float()
    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
              "checkpoint_format": "gptq"}
    _save(base, out, stored, config)
    _save(base, dense, dense_tensors, None)


def write_awq_and_dense(base: Path, out: Path, dense: Path, group: int) -> None:
    stored, dense_tensors, linears = _split(base)
    for name, module, w in linears:
        k = w.shape[1]
        g_idx = torch.arange(k) // group
        q, scale, zero = _rtn(w, 4, group, False, g_idx)
        stored[module + ".qweight"] = pack_rows(q.t(), 4, AWQ_ORDER)  # [K, N / 8], packed along N
        stored[module + ".qzeros"] = pack_rows(zero.long(), 4, AWQ_ORDER)  # [K / G, N / 8]
        stored[module + ".scales"] = scale.half()  # [K / G, N]
        dense_tensors[name] = ((q.double() - zero[g_idx].t()) * scale[g_idx].t()).float()
    config = {"quant_method": "awq", "version": "gemm", "w_bit": 4, "q_group_size": group, "zero_point": True}
    _save(base, out, stored, config)
    _save(base, dense, dense_tensors, None)


def _split(base: Path) -> tuple[dict, dict, list[tuple[str, str, torch.Tensor]]]:
    """The base checkpoint's tensors that stay as they are (in both outputs), and its linear weights as
    (name, module, weight) to quantize."""
    kept, linears = {}, []
    for name, w in load_file(str(base / "model.safetensors")).items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS:
            linears.append((name, module, w))
        else:
            kept[name] = w
    return dict(kept), dict(kept), linears


def _save(base: Path, out: Path, tensors: dict[str, torch.Tensor], quant: dict | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    config = json.loads((base / "config.json").read_text())
    if quant:
        config["quantization_config"] = quant
    (out / "config.json").write_text(json.dumps(config))
    for f in base.glob("tokenizer*"):
        shutil.copy(f, out)
