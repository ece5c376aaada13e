"""Which pipeline partitions and multi-node layouts work (tensor-parallel sizes: strata.config.tp_rules); each refusal
names the field, its value and what would work."""
from __future__ import annotations

from strata.distributed import pp_partition
from strata.errors import ConfigError


def check_pp(pp: int, partition: tuple[int, ...] | None, num_layers: int) -> None:
    """At most one stage per layer; a hand-made partition gives every stage a layer and covers them all."""
    if pp > num_layers:
        raise ConfigError(f"pipeline_parallel_size={pp} exceeds the model's {num_layers} layers; "
                          f"use 1 to {num_layers}", param="pipeline_parallel_size")
    if partition is None:
        return
    if len(partition) != pp or sum(partition) != num_layers or min(partition) < 1:
        example = ",".join(map(str, pp_partition(num_layers, pp)))
        raise ConfigError(f"pp_layer_partition={','.join(map(str, partition))} must have {pp} positive entries "
                          f"(one per stage) that sum to the model's {num_layers} layers, e.g. {example}",
                          param="pp_layer_partition")


def check_nodes(nnodes: int, node_rank: int, world_size: int, master_port: int | None) -> None:
    """Node ranks, the workers split evenly across nodes, and a meeting port when there are several."""
    if nnodes < 1:
        raise ConfigError(f"nnodes must be >= 1, got {nnodes}", param="nnodes")
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"node_rank={node_rank} must be in 0..{nnodes - 1} for nnodes={nnodes}",
                          param="node_rank")
    if world_size % nnodes:
        works = [n for n in range(1, world_size + 1) if world_size % n == 0]
        raise ConfigError(f"nnodes={nnodes} must divide the {world_size} workers "
                          f"(tensor_parallel_size x pipeline_parallel_size) evenly; nnodes that work: "
                          f"{', '.join(map(str, works))}", param="nnodes")
    if master_port is not None and not 0 < master_port < 65536:
        raise ConfigError(f"master_port={master_port} must be in 1..65535", param="master_port")
    if nnodes > 1 and master_port is None:
        raise ConfigError(f"nnodes={nnodes} needs --master-port (and --master-addr, the address of node 0) "
                          "so that every node meets at the same place", param="master_port")
