"""LoRAModelManager: the adapter slots of one model's linear layers, the adapters kept in host memory (LRU,
max_cpu_loras), which adapter each slot holds (LRU, max_loras), and each step's rows of each slot.

An adapter's modules are named as in the base checkpoint (q_proj, gate_proj, ...); they map to the layers that
load those checkpoint tensors (a fused qkv_proj's "q" piece), so each projection fills its piece of the layer.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from strata.config.lora_config import LoRAConfig
from strata.errors import RequestError
from strata.executor.step import ScheduledRequest
from strata.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    PackableLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from strata.layers.lora import LinearLoRA, LoRABatch, LoRAContext
from strata.lora.peft import SERVED_TARGETS, LoRAAdapter, load_adapter
from strata.lora.request import LoRARequest
from strata.models.loader import is_pp_missing

logger = logging.getLogger(__name__)

# The layers adapters may target, by this model's module name (each loads checkpoint modules named like PEFT's
# targets: q_proj / k_proj / v_proj into qkv_proj, gate_proj / up_proj into gate_up_proj).
TARGET_LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_QKV_BLOCKS = {"q": 0, "k": 1, "v": 2}


@dataclass(frozen=True)
class _Block:
    """One adapter module as it fills a layer: its column block, A's columns of this rank's inputs, and B's rows
    as (output offset, rows) pieces of this rank's outputs."""

    layer: str
    block: int
    a: torch.Tensor
    b_rows: tuple[tuple[int, torch.Tensor], ...]


@dataclass(frozen=True)
class _Prepared:
    request: LoRARequest
    rank: int
    scale: float
    blocks: tuple[_Block, ...]


def _num_blocks(layer: PackableLinear) -> int:
    if isinstance(layer, QKVParallelLinear):
        return 3
    return len(layer.output_sizes) if isinstance(layer, MergedColumnParallelLinear) else 1


def _full_shape(layer: PackableLinear, shard: object) -> tuple[int, int]:
    """(rows, columns) of the checkpoint tensor of `shard` of `layer`: what an adapter's B rows and A columns are."""
    out, inp = layer.local_shape
    if isinstance(layer, RowParallelLinear):
        return out, layer.in_features
    if isinstance(layer, QKVParallelLinear):
        rows = {"q": layer.total_q, "k": layer.total_kv, "v": layer.total_kv}
        return rows.get(shard, layer.total_q + 2 * layer.total_kv), inp
    if isinstance(layer, MergedColumnParallelLinear):
        return (sum(layer.output_sizes) if shard is None else layer.output_sizes[shard]), inp
    if isinstance(layer, ColumnParallelLinear):
        return layer.out_per_rank * layer.pc.tp_size, inp
    return out, inp


class LoRAModelManager:
    """Slots in every targetable layer of `model` (attached as their `lora`), and the adapters in and out of them."""

    def __init__(self, model: nn.Module, config: LoRAConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.model, self.config, self.dtype, self.device = model, config, dtype, device
        self.context = LoRAContext()
        self.layers: dict[str, PackableLinear] = {}
        for name, module in model.named_modules():
            if isinstance(module, PackableLinear) and name.rpartition(".")[2] in TARGET_LAYERS:
                out, inp = module.local_shape
                module.lora = LinearLoRA(config.max_loras, config.max_lora_rank, _num_blocks(module), inp, out,
                                         self.context, dtype, device)
                self.layers[name] = module
        self.loaded: OrderedDict[int, _Prepared] = OrderedDict()  # host memory, least recently used first
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.known: dict[int, LoRARequest] = {}
        self.pinned: set[int] = set()  # unloaded adapters unfinished requests still use: never evicted
        logger.info("LoRA: %d slots of rank up to %d in %d layers", config.max_loras, config.max_lora_rank,
                    len(self.layers))

    def add_adapter(self, request: LoRARequest) -> None:
        """Load and check an adapter (refused with the reason), keeping it in host memory."""
        self._prepared(request)

    def pin_adapter(self, lora_int_id: int) -> None:
        """Keep a known adapter in host memory until it is removed (loaded again now if it was evicted): it was
        unloaded while requests still use it, and its folder may be gone by the time their steps need it."""
        request = self.known.get(lora_int_id)
        if request is None:
            raise RequestError(f"no LoRA adapter of lora_int_id {lora_int_id} is loaded", param="lora_int_id")
        self._prepared(request)
        self.pinned.add(lora_int_id)

    def remove_adapter(self, lora_int_id: int) -> None:
        """Forget an adapter: its host copy, its id, and its slot (cleared). The engine removes one only when no
        unfinished request uses it (until then it is pinned)."""
        self.loaded.pop(lora_int_id, None)
        self.known.pop(lora_int_id, None)
        self.pinned.discard(lora_int_id)
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None:
            for layer in self.layers.values():
                layer.lora.clear_slot(slot)

    def set_batch(self, requests: list[ScheduledRequest], loras: list[LoRARequest | None]) -> bool:
        """Put the step's adapters in slots and tell every layer the rows of each; True when any row uses one."""
        wanted = list(dict.fromkeys(lora.lora_int_id for lora in loras if lora is not None))
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(f"a step uses {len(wanted)} LoRA adapters, more than max_loras="
                               f"{self.config.max_loras} (the scheduler admits no more)")
        slots = {lora.lora_int_id: self._slot(lora, wanted) for lora in loras if lora is not None}
        spans, start = [], 0
        for s, lora in zip(requests, loras, strict=True):
            end = start + len(s.token_ids)
            spans.append((-1 if lora is None else slots[lora.lora_int_id], start, end))
            start = end
        self.context.batch = LoRABatch.from_spans(spans, self.device)
        return bool(self.context.batch.groups)

    def _slot(self, lora: LoRARequest, wanted: list[int]) -> int:
        """The slot holding `lora`, after loading it into a free one or the least recently used one this step
        does not need."""
        slot = self.slot_of.get(lora.lora_int_id)
        if slot is not None:
            self.slot_of.move_to_end(lora.lora_int_id)
            return slot
        used = set(self.slot_of.values())
        free = [s for s in range(self.config.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(i for i in self.slot_of if i not in wanted)
            slot = self.slot_of.pop(victim)
        self._write_slot(slot, self._prepared(lora))
        self.slot_of[lora.lora_int_id] = slot
        return slot

    def _write_slot(self, slot: int, adapter: _Prepared) -> None:
        for layer in self.layers.values():
            layer.lora.clear_slot(slot)
        for block in adapter.blocks:
            self.layers[block.layer].lora.set_block(slot, block.block, adapter.rank, block.a, list(block.b_rows),
                                                    adapter.scale)
        logger.debug("LoRA adapter %r in slot %d", adapter.request.lora_name, slot)

    def _prepared(self, request: LoRARequest) -> _Prepared:
        """The adapter from host memory, or loaded (evicting the least recently used beyond max_cpu_loras)."""
        known = self.known.get(request.lora_int_id)
        if known is not None and (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
            raise RequestError(f"lora_int_id {request.lora_int_id} already names adapter {known.lora_name!r} "
                               f"({known.lora_path}); give {request.lora_name!r} another id", param="lora_request")
        prepared = self.loaded.get(request.lora_int_id)
        if prepared is None:
            prepared = self._prepare(load_adapter(request, self.config.max_lora_rank))
            self.known[request.lora_int_id] = request
            self.loaded[request.lora_int_id] = prepared
            self._evict(keep=request.lora_int_id)
        self.loaded.move_to_end(request.lora_int_id)
        return prepared

    def _evict(self, keep: int) -> None:
        """Drop the least recently used host copies beyond max_cpu_loras, never a pinned one (nor `keep`): pinned
        ones may hold the count above it until their requests end."""
        while len(self.loaded) > self.config.max_cpu_loras:
            victim = next((i for i in self.loaded if i not in self.pinned and i != keep), None)
            if victim is None:
                return
            del self.loaded[victim]

    def _prepare(self, adapter: LoRAAdapter) -> _Prepared:
        """The adapter's modules mapped onto this model's layers, shapes checked, cut to this rank's part."""
        blocks = []
        for module, (a, b) in adapter.weights.items():
            target = self._target(adapter.request, module)
            if target is None:  # a layer of another pipeline stage, which loads it
                continue
            layer_name, shard = target
            layer = self.layers[layer_name]
            rows, cols = _full_shape(layer, shard)
            if tuple(b.shape) != (rows, adapter.rank) or tuple(a.shape) != (adapter.rank, cols):
                raise RequestError(f"LoRA adapter {adapter.request.lora_name!r}: {module} has lora_A "
                                   f"{tuple(a.shape)} and lora_B {tuple(b.shape)}, but this model's layer needs "
                                   f"[{adapter.rank}, {cols}] and [{rows}, {adapter.rank}]", param="lora_request")
            start, size = layer.in_range()
            a_local = a[:, start:start + size].to(self.dtype)
            b_rows = tuple((offset, b[first:first + n].to(self.dtype)) for offset, first, n in layer.out_pieces(shard))
            block = _QKV_BLOCKS.get(shard, 0) if isinstance(shard, str) else (shard or 0)
            blocks.append(_Block(layer_name, block, a_local, b_rows))
        return _Prepared(adapter.request, adapter.rank, adapter.scale, tuple(blocks))

    def _target(self, request: LoRARequest, module: str) -> tuple[str, object] | None:
        """(layer name, shard id) of an adapter module named as in the base checkpoint, None when it belongs to
        another pipeline stage; refused when no LoRA layer of this model loads it."""
        name, shard = self.model.rename_weight(module + ".weight"), None
        if is_pp_missing(name, getattr(self.model, "missing_prefixes", ())):
            return None
        for param_part, checkpoint_part, shard_id in getattr(self.model, "stacked_params", ()):
            if checkpoint_part in name:
                name, shard = name.replace(checkpoint_part, param_part), shard_id
                break
        layer = name.removesuffix(".weight")
        if layer not in self.layers:
            # Experts (per-expert modules, as transformers 4 named them) and routers are MoE weights.
            what = "an MoE expert or router, which LoRA does not apply to" if ".experts" in module or \
                module.endswith((".gate", ".router")) else "not a layer LoRA applies to in this model"
            raise RequestError(f"LoRA adapter {request.lora_name!r} targets {module}, {what} ({SERVED_TARGETS})",
                               param="lora_request")
        return layer, shard
