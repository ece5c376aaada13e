"""`strata plan`'s TP traffic is what the layers report, and what they report is what a real step issues: every
all-reduce and all-gather through ParallelContext is counted on each rank of a tp=2 x pp=2 gloo world while a
ModelRunner runs real steps, and compared with the plan's collectives for a step of the same size."""
from __future__ import annotations

import json
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from processes import leave_process_group, spawn_ranks

from strata.config import EngineConfig
from strata.distributed import ParallelContext, StepSize
from strata.plan import plan_layout, step_collectives

pytestmark = pytest.mark.slow

TP, PP = 2, 2
# Two steps: a prefill of "a" (sampled) beside the first chunk of "b" (not sampled); then a decode of "a"
# beside b's last chunk (both sampled). The runner orders decodes first, as the plan need not know.
PROMPTS = {"a": [5, 6, 7, 8, 9], "b": [10, 11, 12, 13, 14, 15]}
STEPS = [[("a", 0, 5), ("b", 0, 3)], [("a", 5, 6), ("b", 3, 6)]]  # (request, first token, end) of each chunk


def step_size(step: list[tuple[str, int, int]]) -> StepSize:
    return StepSize(num_tokens=sum(end - first for _, first, end in step),
                    num_sampled=sum(end >= len(PROMPTS[r]) for r, _, end in step))


def engine_config(path: str) -> EngineConfig:
    return EngineConfig.create(path, tensor_parallel_size=TP, pipeline_parallel_size=PP, dtype="float32",
                               device="cpu", max_model_len=32, max_num_seqs=2)


def scheduler_output(step: list[tuple[str, int, int]], blocks_per_seq: int):
    from strata.engine.scheduler import NewRequestData, ScheduledRequest, SchedulerOutput
    from strata.sampling_params import SamplingParams

    requests = []
    for slot, (request_id, first, end) in enumerate(step):
        prompt = PROMPTS[request_id]
        tokens = prompt[first:end] if end <= len(prompt) else [1]  # a decode feeds the last sampled token
        new = NewRequestData(SamplingParams(temperature=0), list(prompt)) if first == 0 else None
        blocks = list(range(slot * blocks_per_seq, (slot + 1) * blocks_per_seq))
        requests.append(ScheduledRequest(request_id, tokens, first, blocks, end >= len(prompt), slot, new))
    return SchedulerOutput(requests)


def _record(calls: list, kind: str, original):
    def counted(self, x: torch.Tensor, *args, **kwargs):
        if self.tp_size > 1:
            calls.append([kind, x.numel(), str(x.dtype)])
        return original(self, x, *args, **kwargs)

    return counted


def _run_steps(config: EngineConfig, pc: ParallelContext, calls: list) -> list[list]:
    """Each step's recorded collectives on this rank, with the PP hand-off a worker does around them."""
    from strata.executor.model_runner import ModelRunner

    runner = ModelRunner(config, pc, torch.device("cpu"))
    blocks_per_seq = -(-config.scheduler.max_model_len // config.cache.block_size)
    runner.allocate_kv_cache(2 * blocks_per_seq)
    hidden_size, recorded = config.model.text_config.hidden_size, []
    for step in STEPS:
        out = scheduler_output(step, blocks_per_seq)
        intermediate = None
        if not pc.is_first_stage:
            intermediate = pc.recv_intermediate(out.num_tokens, hidden_size, config.model.dtype, torch.device("cpu"))
        calls.clear()
        result = (runner.execute if pc.is_last_stage else runner.execute_stage)(out, intermediate)
        recorded.append(list(calls))
        if not pc.is_last_stage:
            pc.send_intermediate(result).wait()
    return recorded


def _rank_main(rank: int, port: int, paths: list[str], folder: str) -> None:
    from strata.executor.parallel import init_distributed

    torch.set_num_threads(1)
    world = TP * PP
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=120))
    pc = init_distributed(rank, world, TP, store, "gloo", timedelta(seconds=120), local_ranks=range(world))
    calls: list = []
    ParallelContext.all_reduce = _record(calls, "all_reduce", ParallelContext.all_reduce)
    ParallelContext.all_gather = _record(calls, "all_gather", ParallelContext.all_gather)
    results = {path: _run_steps(engine_config(path), pc, calls) for path in paths}
    Path(folder, f"rank{rank}.json").write_text(json.dumps(results))
    leave_process_group()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from checkpoints import make_llama
    from llama4_checkpoints import make_llama4_multimodal, make_llama4_text
    from mamba_checkpoints import make_mamba2, make_plamo2

    root = tmp_path_factory.mktemp("plan_collectives")
    return {
        "llama": make_llama(root / "llama", vocab_size=300, num_layers=3, seed=3),
        "llama4": make_llama4_text(root / "llama4"),  # layers 1 and 3 are MoE: one per stage
        "llama4_multimodal": make_llama4_multimodal(root / "llama4_mm"),  # a vision tower beside the text model
        "mamba2_tied": make_mamba2(root / "mamba2", num_layers=4, tied=True),  # one group: GatedRMSNorm reduces
        "plamo2": make_plamo2(root / "plamo2"),
    }


@pytest.fixture(scope="module")
def counted(checkpoints, tmp_path_factory) -> dict[str, list]:
    """{checkpoint: [[rank 0's collectives in each step], ...]} from the real tp=2 x pp=2 run."""
    folder = tmp_path_factory.mktemp("plan_collectives_counts")
    paths = [str(p) for p in checkpoints.values()]
    spawn_ranks(_rank_main, TP * PP, lambda port: (port, paths, str(folder)))
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(TP * PP)]
    return {name: [ranks[r][str(path)] for r in range(TP * PP)] for name, path in checkpoints.items()}


def as_records(collectives) -> Counter:
    return Counter((c.kind, c.numel, str(c.dtype)) for c in collectives)


@pytest.mark.parametrize("name", ["llama", "llama4", "llama4_multimodal", "mamba2_tied", "plamo2"])
def test_plan_reports_the_collectives_a_real_step_issues_on_every_rank(checkpoints, counted, name):
    config = engine_config(str(checkpoints[name]))
    for rank in range(TP * PP):
        for step, calls in zip(STEPS, counted[name][rank], strict=True):
            planned = as_records(step_collectives(config, rank, step_size(step)))
            issued = Counter(tuple(c) for c in calls)
            assert issued == planned, f"{name}, rank {rank}, step {step}: issued {issued}, planned {planned}"
            assert calls, (name, rank, step)  # every stage has row-parallel layers


def test_moe_and_gated_norm_all_reduces_count_in_the_plan(checkpoints):
    # Llama 4, stage 0 (layers 0-1): embedding, 2 attention outputs, a dense MLP, the MoE block's single reduce.
    llama4 = plan_layout(engine_config(str(checkpoints["llama4"])))
    assert llama4[0].allreduce_count == 1 + 2 + 1 + 1
    # Mamba2, stage 1 (layers 2-3): each layer reduces its gated norm's sum of squares (float32) and out_proj.
    mamba2 = plan_layout(engine_config(str(checkpoints["mamba2_tied"])))
    assert mamba2[2].allreduce_count == 2 * 2
    assert mamba2[2].allreduce_bytes_per_token == 2 * (4 + 64 * 4)
    # The tied last stage holds the embedding for its LM head but never looks tokens up in it.
    assert mamba2[2].has_embedding and mamba2[2].gather_bytes_per_sampled_token == 320 * 4
