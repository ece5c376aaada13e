"""Qwen2, Qwen3, Qwen3-MoE, Mistral, Phi-3 and Granite split across two gloo ranks give the greedy tokens of one
process: PP=2 token for token (logprobs within 1e-5), TP=2 the same tokens or, at the first difference, each side's
token in the other's top 5 (vLLM's rule); each rank holds the weight bytes `strata plan` predicts, and the TP
collectives a step issues are the ones the plan counts from the layers.

Both layouts run in one pair of processes (their start-up is the expensive part on 2 cores): the world is PP=2
(TP=1), and a second group of the same two ranks serves as the TP=2 group."""
from __future__ import annotations

import json
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from arch_checkpoints import random_prompts
from processes import leave_process_group, spawn_ranks

from strata.config import EngineConfig
from strata.distributed import ParallelContext, StepSize
from strata.executor.step import NewRequestData, ScheduledRequest, SchedulerOutput
from strata.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

# A tied head on the last stage needs the embedding there too: half the checkpoints are tied.
CHECKPOINTS = [("qwen2", False), ("qwen3", True), ("qwen3_moe", False), ("mistral", True), ("phi3", False),
               ("granite", True)]
PROMPTS = random_prompts((7, 23, 13), seed=4)
MAX_TOKENS, MAX_MODEL_LEN = 12, 64
COUNTED_STEPS = 2  # the prefill and the first decode: their collectives are checked against the plan


def _scheduled(step: int, prompts: list[list[int]], outputs: list[list[int]], blocks: int) -> SchedulerOutput:
    """Every prompt prefilled in step 0; then one decode each, feeding the token sampled last."""
    requests = []
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        block_ids = list(range(i * blocks, (i + 1) * blocks))
        if step == 0:
            new = NewRequestData(SamplingParams(temperature=0, logprobs=5), prompt)
            requests.append(ScheduledRequest(str(i), prompt, 0, block_ids, True, new=new))
        else:
            requests.append(ScheduledRequest(str(i), [out[-1]], len(prompt) + len(out) - 1, block_ids, True))
    return SchedulerOutput(requests)


def engine_config(path: str, tp: int = 1, pp: int = 1) -> EngineConfig:
    return EngineConfig.create(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, dtype="float32",
                               device="cpu", max_model_len=MAX_MODEL_LEN, max_num_seqs=4)


def greedy(path: str, pc: ParallelContext, calls: list | None = None) -> dict:
    """Greedy tokens and top-5 logprobs of every prompt, with this rank's weight bytes and (with `calls`, the
    collectives recorded under it) the TP collectives each counted step issued, and the step's size."""
    from strata.executor.model_runner import ModelRunner

    config = engine_config(path, pc.tp_size, pc.pp_size)
    runner = ModelRunner(config, pc, torch.device("cpu"))
    blocks = -(-MAX_MODEL_LEN // config.cache.block_size)
    runner.allocate_kv_cache(len(PROMPTS) * blocks)
    hidden = config.model.text_config.hidden_size
    sampler_rank = (pc.pp_size - 1) * pc.tp_size  # TP rank 0 of the last stage
    outputs: list[list[int]] = [[] for _ in PROMPTS]
    logprobs: list[list] = [[] for _ in PROMPTS]
    collectives = []
    for step in range(MAX_TOKENS):
        out = _scheduled(step, PROMPTS, outputs, blocks)
        if calls is not None:
            calls.clear()
        if pc.is_last_stage:
            intermediate = None if pc.is_first_stage else pc.recv_intermediate(out.num_tokens, hidden,
                                                                               config.model.dtype, runner.device)
            result = runner.execute(out, intermediate)
            # One token a request (no draft tokens to verify), with its top-5 logprobs.
            sampled = [(result.sampled[str(i)][-1], result.logprobs[str(i)][-1]) for i in range(len(PROMPTS))]
        else:
            pc.send_intermediate(runner.execute_stage(out)).wait()
            sampled = None
        if calls is not None and step < COUNTED_STEPS:
            collectives.append({"issued": list(calls), "num_tokens": out.num_tokens, "num_sampled": len(PROMPTS)})
        shared = [sampled]
        if pc.world_group is not None:  # every rank feeds the sampled tokens to the next step
            dist.broadcast_object_list(shared, src=sampler_rank)
        for i, (token, token_logprobs) in enumerate(shared[0]):
            outputs[i].append(token)
            # str keys: the ranks' results travel as JSON
            logprobs[i].append({str(t): lp for t, lp in zip(token_logprobs.top_ids, token_logprobs.top_logprobs,
                                                           strict=True)})
    return {"tokens": outputs, "logprobs": logprobs, "weight_bytes": runner.weight_bytes, "collectives": collectives}


def _record(calls: list, kind: str, original):
    def counted(self, x: torch.Tensor, *args, **kwargs):
        if self.tp_size > 1:
            calls.append([kind, x.numel(), str(x.dtype)])
        return original(self, x, *args, **kwargs)

    return counted


def _rank_main(rank: int, port: int, paths: list[str], folder: str) -> None:
    from strata.executor.parallel import init_distributed

    torch.set_num_threads(1)
    timeout = timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout)
    pp = init_distributed(rank, 2, 1, store, "gloo", timeout, local_ranks=range(2))
    tp = ParallelContext(tp_rank=rank, tp_size=2, tp_group=dist.new_group([0, 1]), world_group=dist.group.WORLD)
    calls: list = []
    ParallelContext.all_reduce = _record(calls, "all_reduce", ParallelContext.all_reduce)
    ParallelContext.all_gather = _record(calls, "all_gather", ParallelContext.all_gather)
    results = {path: {"pp2": greedy(path, pp), "tp2": greedy(path, tp, calls)} for path in paths}
    Path(folder, f"rank{rank}.json").write_text(json.dumps(results))
    leave_process_group()


@pytest.fixture(scope="module")
def runs(arch_path, tmp_path_factory) -> dict[str, dict]:
    """{name: {"one": single process, "pp2" / "tp2": [rank 0's, rank 1's]}}."""
    paths = {name: str(arch_path(name, tied)) for name, tied in CHECKPOINTS}
    folder = tmp_path_factory.mktemp("architecture_layouts")
    spawn_ranks(_rank_main, 2, lambda port: (port, list(paths.values()), str(folder)))
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]
    return {name: {"one": greedy(path, ParallelContext()), "path": path,
                   **{layout: [ranks[r][path][layout] for r in range(2)] for layout in ("pp2", "tp2")}}
            for name, path in paths.items()}


@pytest.mark.parametrize("name", [name for name, _ in CHECKPOINTS])
def test_pp2_gives_the_tokens_and_logprobs_of_one_process(runs, name):
    one, last_stage = runs[name]["one"], runs[name]["pp2"][1]
    assert last_stage["tokens"] == one["tokens"]
    for got, want in zip(last_stage["logprobs"], one["logprobs"], strict=True):
        for got_pos, want_pos in zip(got, want, strict=True):
            assert got_pos.keys() == want_pos.keys()
            assert max(abs(got_pos[t] - want_pos[t]) for t in want_pos) < 1e-5


@pytest.mark.parametrize("name", [name for name, _ in CHECKPOINTS])
def test_tp2_gives_the_tokens_of_one_process_or_stays_within_the_top5(runs, name):
    """Up to the first differing token (if any) the logprobs agree within 1e-4; there each side's token is in the
    other's top 5."""
    one, tp_rank0 = runs[name]["one"], runs[name]["tp2"][0]
    for got, want, got_lp, want_lp in zip(tp_rank0["tokens"], one["tokens"], tp_rank0["logprobs"],
                                          one["logprobs"], strict=True):
        differ = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
        same = differ[0] if differ else len(want)
        for got_pos, want_pos in zip(got_lp[:same], want_lp[:same], strict=True):
            assert max(abs(got_pos[t] - lp) for t, lp in want_pos.items() if t in got_pos) < 1e-4
        if differ:
            assert str(got[same]) in want_lp[same] and str(want[same]) in got_lp[same], f"{name}: position {same}"


@pytest.mark.parametrize("name", [name for name, _ in CHECKPOINTS])
def test_each_rank_holds_the_bytes_and_issues_the_collectives_strata_plan_predicts(runs, name):
    """The plan (meta-device models, built here once rather than in every rank) against what the ranks did."""
    from strata.plan import plan_layout, step_collectives

    path = runs[name]["path"]
    for layout, (tp, pp) in {"pp2": (1, 2), "tp2": (2, 1)}.items():
        plans = plan_layout(engine_config(path, tp, pp))
        assert [rank["weight_bytes"] for rank in runs[name][layout]] == [plan.param_bytes for plan in plans]
    config = engine_config(path, 2, 1)
    for rank, result in enumerate(runs[name]["tp2"]):
        assert len(result["collectives"]) == COUNTED_STEPS
        for step in result["collectives"]:
            size = StepSize(num_tokens=step["num_tokens"], num_sampled=step["num_sampled"])
            planned = Counter((c.kind, c.numel, str(c.dtype)) for c in step_collectives(config, rank, size))
            assert step["issued"] and Counter(map(tuple, step["issued"])) == planned
