"""`strata plan MODEL -tp T -pp P`: each rank's layers, weight, KV-cache and Mamba-state bytes and traffic,
without workers.

Each rank's model is built on the meta device and "loaded" from the checkpoint's tensor shapes (read
from the safetensors headers only), so the figures come from the same layers and weight loaders that
the workers use, and a checkpoint that does not fit the layout is refused here too. Its TP traffic is what
the modules themselves report they communicate in a step (`collectives`), summed over the rank's model.
"""
from __future__ import annotations

import argparse
import logging
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn

from strata.config import EngineConfig
from strata.config.engine_args import EngineArgs
from strata.distributed import (
    Collective,
    ParallelContext,
    StepSize,
    module_collectives,
    pp_layer_range,
    rank_layout,
)
from strata.layers.attention import Attention
from strata.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from strata.layers.mamba.mixer import MambaState, state_bytes_per_slot
from strata.layers.stored_dtype import store_weights_as
from strata.models import loader

logger = logging.getLogger(__name__)

_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn}


@dataclass(frozen=True)
class RankPlan:
    rank: int
    node: int
    tp_rank: int
    pp_rank: int
    layers: tuple[int, int]  # [start, end)
    param_bytes: int
    lookup_table_bytes: int  # embedding tables a step reads one row of per token (not a tied LM head)
    kv_bytes_per_1k_tokens: int
    state_bytes_per_seq: int  # Mamba conv + SSM state slot
    has_embedding: bool
    has_lm_head: bool
    allreduce_count: int  # TP all-reduces per forward pass
    allreduce_bytes_per_token: int
    send_bytes_per_token: int  # PP hand-off to the next stage
    gather_bytes_per_sampled_token: int  # the LM head's all-gather of vocabulary shards
    gather_bytes_per_token: int  # column-parallel layers that gather their outputs


def checkpoint_shapes(folder: str, skip: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, meta tensor of the stored shape) for every checkpoint tensor; only headers are read."""
    for path in loader.checkpoint_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if not skip(name):
                    piece = f.get_slice(name)
                    dtype = _SAFETENSORS_DTYPES.get(piece.get_dtype(), torch.float32)
                    yield name, torch.empty(piece.get_shape(), dtype=dtype, device="meta")


def meta_model(config: EngineConfig, pc: ParallelContext) -> nn.Module:
    """This rank's model with meta tensors, passed through its weight loaders (which check every shape)."""
    cls = config.model.info.load_class()
    with torch.device("meta"):
        model = cls(config.model, pc, config.parallel.pp_layer_partition)
    skip = lambda name: loader.is_pp_missing(name, model.missing_prefixes)  # noqa: E731
    model.load_weights(loader.checkpoint_weights(config.model, skip, meta=True) if config.model.gguf_files
                       else checkpoint_shapes(config.model.path, skip))
    if config.model.weight_dtype is not None:
        store_weights_as(model, config.model.weight_dtype)
    return model


def rank_model(config: EngineConfig, rank: int) -> nn.Module:
    tp_rank, pp_rank = rank_layout(config.parallel.tensor_parallel_size, rank)
    return meta_model(config, ParallelContext(tp_rank, config.parallel.tensor_parallel_size, pp_rank,
                                              config.parallel.pipeline_parallel_size))


def step_collectives(config: EngineConfig, rank: int, step: StepSize) -> list[Collective]:
    """The TP collectives `rank` issues in one step of this size, as its layers report them."""
    return module_collectives(rank_model(config, rank), step)


def sampled_collectives(model: nn.Module) -> list[Collective]:
    """What computing one more sequence's logits adds to a step's collectives."""
    body = Counter(module_collectives(model, StepSize(num_tokens=1, num_sampled=0)))
    return list((Counter(module_collectives(model, StepSize(num_tokens=1, num_sampled=1))) - body).elements())


def plan_rank(config: EngineConfig, rank: int) -> RankPlan:
    par = config.parallel
    tp, pp = par.tensor_parallel_size, par.pipeline_parallel_size
    tp_rank, pp_rank = rank_layout(tp, rank)
    model = rank_model(config, rank)
    size = torch.empty((), dtype=config.model.dtype).element_size()
    hidden = config.model.text_config.hidden_size
    kv_bytes = sum(2 * m.num_kv_heads * m.head_dim * size * 1000 for m in model.modules() if isinstance(m, Attention))
    per_token = module_collectives(model, StepSize(num_tokens=1, num_sampled=0))
    reduces = [c for c in per_token if c.kind == "all_reduce"]
    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    embeddings = [m for m in model.modules() if isinstance(m, VocabParallelEmbedding) and m not in heads]
    return RankPlan(
        rank=rank, node=rank // (par.world_size // par.nnodes), tp_rank=tp_rank, pp_rank=pp_rank,
        layers=pp_layer_range(config.model.num_layers, pp_rank, pp, par.pp_layer_partition),
        param_bytes=stored_bytes(model),
        lookup_table_bytes=sum(stored_bytes(e) for e in embeddings
                               if not any(getattr(h, "weight", None) is e.weight for h in heads)),
        kv_bytes_per_1k_tokens=kv_bytes,
        state_bytes_per_seq=state_bytes_per_slot([m for m in model.modules() if isinstance(m, MambaState)],
                                                 config.model.dtype, config.cache.ssm_state_dtype(config.model.dtype)),
        has_embedding=bool(embeddings), has_lm_head=bool(heads),
        allreduce_count=len(reduces), allreduce_bytes_per_token=sum(c.nbytes for c in reduces),
        send_bytes_per_token=0 if pp_rank == pp - 1 else 2 * hidden * size,
        gather_bytes_per_sampled_token=gathered_bytes(sampled_collectives(model), tp),
        gather_bytes_per_token=gathered_bytes(per_token, tp))


def stored_bytes(module: nn.Module) -> int:
    """Bytes of the weights as stored: parameters, and the blocks GGUF layers keep outside them (a tied head's
    table once)."""
    methods = {id(m.quant): m.quant for m in module.modules() if getattr(m, "quant", None) is not None}
    return sum(p.numel() * p.element_size() for p in module.parameters()) + sum(q.nbytes for q in methods.values())


def gathered_bytes(collectives: list[Collective], tp: int) -> int:
    """Bytes the all-gathers among `collectives` return on each rank (every rank's part)."""
    return sum(c.nbytes * tp for c in collectives if c.kind == "all_gather")


def plan_layout(config: EngineConfig) -> list[RankPlan]:
    return [plan_rank(config, rank) for rank in range(config.parallel.world_size)]


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_plan(config: EngineConfig, plans: list[RankPlan]) -> str:
    par, sched = config.parallel, config.scheduler
    dtype = str(config.model.dtype).removeprefix("torch.")
    lines = [f"{config.model.path} ({config.model.architecture}, {dtype}): tp={par.tensor_parallel_size} x "
             f"pp={par.pipeline_parallel_size} = {par.world_size} ranks on {par.nnodes} node(s)",
             f"{'rank':>4} {'node':>4} {'tp':>3} {'pp':>3}  {'layers':<12} {'parameter bytes':>28}  "
             f"{'KV/1k tokens':>12}  {'embed':<5} {'lm_head':<7}  {'TP all-reduce/token':>22}  "
             f"{'PP send/token':>13}" + (f"  {'state/seq':>10}" if any(p.state_bytes_per_seq for p in plans) else "")]
    for p in plans:
        layers = f"{p.layers[0]}-{p.layers[1] - 1} ({p.layers[1] - p.layers[0]})"
        params = f"{p.param_bytes:,} ({human(p.param_bytes)})"
        reduce = f"{p.allreduce_count} ops, {human(p.allreduce_bytes_per_token)}" if p.allreduce_count else "-"
        send = human(p.send_bytes_per_token) if p.send_bytes_per_token else "-"
        lines.append(f"{p.rank:>4} {p.node:>4} {p.tp_rank:>3} {p.pp_rank:>3}  {layers:<12} {params:>28}  "
                     f"{human(p.kv_bytes_per_1k_tokens):>12}  {'yes' if p.has_embedding else 'no':<5} "
                     f"{'yes' if p.has_lm_head else 'no':<7}  {reduce:>22}  {send:>13}"
                     + (f"  {human(p.state_bytes_per_seq):>10}" if any(q.state_bytes_per_seq for q in plans) else ""))
    tokens = sched.max_num_batched_tokens
    worst_reduce = max(p.allreduce_bytes_per_token for p in plans)
    send = max(p.send_bytes_per_token for p in plans)
    gather = max(p.gather_bytes_per_sampled_token for p in plans)
    token_gather = max(p.gather_bytes_per_token for p in plans)
    lines += [
        f"total parameter bytes over all ranks: {sum(p.param_bytes for p in plans):,} "
        f"({human(sum(p.param_bytes for p in plans))}); largest rank: {human(max(p.param_bytes for p in plans))}",
        f"communication per step of {tokens} tokens (max_num_batched_tokens), payload sizes:",
        f"  TP all-reduce per rank: {human(worst_reduce * tokens)}"
        + (f" ({human(worst_reduce)} per token)" if worst_reduce else " (no TP)"),
        *([f"  TP all-gather of layer outputs per rank: {human(token_gather * tokens)}"] if token_gather else []),
        f"  PP hand-off per stage boundary (hidden_states + residual): {human(send * tokens)}"
        + ("" if send else " (no PP)"),
        f"  logits all-gather on the last stage: {human(gather)} per sampled sequence"
        f" ({human(gather * sched.max_num_seqs)} for max_num_seqs={sched.max_num_seqs})",
    ]
    return "\n".join(lines) + "\n"


def run_plan(args: argparse.Namespace) -> int:
    config = EngineConfig.from_args(EngineArgs.from_cli_args(args, args.model))
    sys.stdout.write(format_plan(config, plan_layout(config)))
    return 0
