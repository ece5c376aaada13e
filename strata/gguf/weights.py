"""A GGUF model's tensors under the Hugging Face names strata's models load: float tensors as torch tensors,
quantized (and half-precision matrix) tensors as their ggml blocks, rows in the checkpoint's order (llama.cpp's
Q/K row permutation undone), stacked routed experts one tensor per expert (float, or in their ggml blocks when the
file quantized them)."""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from strata.errors import ConfigError
from strata.gguf import types
from strata.gguf.config import ArchitectureMap, architecture_map
from strata.gguf.families import family, refuse_unknown_tensors
from strata.gguf.reader import GGUFModel, TensorEntry

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_FLOAT = (types.F32, types.F16, types.BF16)
_CONSUMED = ("rope_freqs.weight",)  # read into the config (strata.gguf.config)
_HALF = {types.F16: torch.float16, types.BF16: torch.bfloat16}


@dataclass(frozen=True)
class GGUFTensor:
    """A tensor kept in its ggml blocks: `data` uint8 [rows, bytes per row] (a meta tensor when only shapes are
    read), `shape` the values' shape in torch order ([rows, cols], or [experts, rows, cols])."""

    data: torch.Tensor
    ggml_type: int
    shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        return self.data.shape[-1]


def hf_name(gguf_name: str, arch: ArchitectureMap | None = None) -> str | None:
    """The checkpoint name strata's models use for a GGUF tensor (of architecture `arch`, whose own layer names
    take precedence over Llama's), or None for one it does not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.match(gguf_name)
    names = {**_LAYER_NAMES, **arch.tensor_names} if arch is not None else _LAYER_NAMES
    if match is None or match.group(2) not in names:
        return None
    return f"model.layers.{match.group(1)}.{names[match.group(2)]}.{match.group(3)}"


def is_blocked(entry: TensorEntry) -> bool:
    """Matrices of any type but float32 stay in their blocks; vectors and float32 matrices load as tensors."""
    return len(entry.shape) >= 2 and entry.ggml_type != types.F32


def blocked_types(gguf: GGUFModel) -> dict[str, int]:
    """{HF name: ggml type} of every tensor kept in its blocks, checked to be a type strata reads; unknown tensor
    names are refused (strata never runs with weights it did not load)."""
    if (own := family(gguf.architecture)) is not None:
        return own.blocked_types(gguf)
    found = {}
    arch = architecture_map(gguf)
    consumed = (*_CONSUMED, *arch.consumed_tensors)
    refuse_unknown_tensors(gguf, [n for n in gguf.tensors if hf_name(n, arch) is None and n not in consumed])
    for name, entry in gguf.tensors.items():
        types.check_type(entry.ggml_type, name)
        if _EXPERTS.match(name):
            if experts_in_blocks(gguf, name):
                found[hf_name(name, arch)] = entry.ggml_type
        elif is_blocked(entry) and name not in consumed:
            found[hf_name(name, arch)] = entry.ggml_type
    return found


def experts_in_blocks(gguf: GGUFModel, name: str) -> bool:
    """Whether the routed experts of tensor `name`'s layer stay in their ggml blocks: when any of the layer's three
    stacked tensors is quantized (a float one beside it then comes as blocks of its float type too). All-float
    experts load as float."""
    layer = _EXPERTS.match(name).group(1)
    names = [f"blk.{layer}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")]
    return any(gguf.tensors[n].ggml_type not in _FLOAT for n in names if n in gguf.tensors)


def expert_blocks(gguf: GGUFModel, entry: TensorEntry, expert: int, meta: bool = False) -> GGUFTensor:
    """Expert `expert` of a stacked tensor [E, out, in] as its ggml blocks [out, bytes per row]: a copy of that
    expert's rows alone (the model keeps a rank's share of them; the file's other experts are not read)."""
    _, rows, cols = entry.shape
    if meta:
        data = torch.empty(rows, types.row_bytes(entry.ggml_type, cols, entry.name), dtype=torch.uint8, device="meta")
    else:
        data = torch.from_numpy(np.array(gguf.raw(entry.name)[expert * rows:(expert + 1) * rows]))
    return GGUFTensor(data, entry.ggml_type, (rows, cols))


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head reordering of q/k rows (rotate-half pairs -> interleaved pairs): rows of a head
    [2, half] were stored as [half, 2]."""
    shape = rows.shape
    return rows.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def iterate_gguf(gguf: GGUFModel, skip: Callable[[str], bool] = lambda name: False, meta: bool = False
                 ) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
    """(HF name, tensor) for every tensor the model loads; skipped names are never read. With `meta`, only
    shapes (meta tensors), for planning."""
    if (own := family(gguf.architecture)) is not None:
        yield from own.iterate(gguf, skip, meta)
        return
    arch = architecture_map(gguf)
    permuted = arch.permuted_qk
    heads = {"q_proj": gguf.get(".attention.head_count"), "k_proj": gguf.get(".attention.head_count_kv",
                                                                             gguf.get(".attention.head_count"))}
    heads = {k: v[0] if isinstance(v, list) else v for k, v in heads.items()}
    for name, entry in gguf.tensors.items():
        target = hf_name(name, arch)
        if target is not None and _EXPERTS.match(name):
            yield from _per_expert(gguf, entry, target, skip, meta)
            continue
        if target is None or skip(target):
            continue
        if meta:
            yield target, _meta(entry)
            continue
        rows = gguf.raw(name)
        projection = target.split(".")[-2]
        if permuted and projection in heads:
            rows = _unpermute(rows, heads[projection])
        tensor = _tensor(entry, rows)
        if arch.norm_offset and target.endswith("norm.weight"):
            tensor = tensor - arch.norm_offset  # the converter's 1 + w back to the checkpoint's w
        yield target, tensor


def _per_expert(gguf: GGUFModel, entry: TensorEntry, target: str, skip: Callable[[str], bool], meta: bool
                ) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
    """A stacked expert tensor [E, out, in] as one [out, in] tensor per expert, under the names checkpoints store
    them by (`...experts.{e}.gate_proj.weight`), which strata's MoE loads expert by expert: float, or the expert's
    ggml blocks when the layer's experts stay in blocks (experts_in_blocks)."""
    head, proj = target.removesuffix(".weight").rsplit(".", 1)
    names = [f"{head}.{e}.{proj}.weight" for e in range(entry.shape[0])]
    if all(skip(n) for n in names):
        return
    if experts_in_blocks(gguf, entry.name):
        for e, n in enumerate(names):
            yield n, expert_blocks(gguf, entry, e, meta)
        return
    stacked = None if meta else _float_values(entry, gguf.raw(entry.name))
    for e, n in enumerate(names):
        yield n, torch.empty(entry.shape[1:], device="meta") if stacked is None else stacked[e]


def _tensor(entry: TensorEntry, raw: np.ndarray) -> torch.Tensor | GGUFTensor:
    if is_blocked(entry):
        # A copy: the model keeps these bytes, and a view would pin pages of the file's mapping.
        return GGUFTensor(torch.from_numpy(np.array(raw)), entry.ggml_type, entry.shape)
    return _float_values(entry, raw)


def _float_values(entry: TensorEntry, raw: np.ndarray) -> torch.Tensor:
    if entry.ggml_type == types.F32:
        values = torch.from_numpy(np.array(raw).view("<f4"))
    elif entry.ggml_type in _HALF:
        values = torch.from_numpy(np.array(raw).view("<u2").view(np.int16)).view(_HALF[entry.ggml_type]).float()
    else:
        raise ConfigError(f"GGUF tensor {entry.name} is a {types.type_name(entry.ggml_type)} vector; strata reads "
                          "vectors (norms, biases) stored as F32, F16 or BF16", param="model")
    return values.reshape(entry.shape)


def _meta(entry: TensorEntry) -> torch.Tensor | GGUFTensor:
    if is_blocked(entry):
        rows = entry.nbytes // types.row_bytes(entry.ggml_type, entry.shape[-1], entry.name)
        data = torch.empty(rows, entry.nbytes // rows, dtype=torch.uint8, device="meta")
        return GGUFTensor(data, entry.ggml_type, entry.shape)
    return torch.empty(entry.shape, dtype=torch.float32, device="meta")
