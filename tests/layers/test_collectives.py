"""Each parallel layer reports the TP collectives its forward issues (what `strata plan` sums): checked in one
process against a ParallelContext that counts the calls instead of talking to other ranks."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from strata.distributed import Collective, ParallelContext, StepSize, module_collectives
from strata.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from strata.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from strata.layers.mamba.mixer import GatedRMSNorm


@dataclass(frozen=True)
class CountingContext(ParallelContext):
    """Rank `tp_rank` of `tp_size` whose collectives are recorded; sums and gathers stand in with this rank's part."""

    calls: list[Collective] = field(default_factory=list)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(Collective("all_reduce", x.numel(), x.dtype))
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self.calls.append(Collective("all_gather", x.numel(), x.dtype))
        return torch.cat([x] * self.tp_size, dim=dim)


def reported_and_issued(make, run, step: StepSize, tp_size: int = 2, pp_rank: int = 0, pp_size: int = 1):
    pc = CountingContext(tp_rank=1, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size)
    module = make(pc)
    with torch.no_grad():
        run(module, step)
    return module_collectives(module, step), pc.calls


def _tokens(n: int, width: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(n, width).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make, width", [
    (lambda pc, dt: RowParallelLinear(32, 24, pc, bias=True, dtype=dt), 16),
    (lambda pc, dt: RowParallelLinear(32, 24, pc, reduce_results=False, dtype=dt), 16),
    (lambda pc, dt: ColumnParallelLinear(24, 32, pc, gather_output=True, dtype=dt), 24),
    (lambda pc, dt: ColumnParallelLinear(24, 32, pc, dtype=dt), 24),
    (lambda pc, dt: MergedColumnParallelLinear(24, [16, 16], pc, dtype=dt), 24),
])
def test_linear_layers_report_the_collectives_their_forward_issues(make, width, dtype):
    def run(layer, step):
        torch.nn.init.normal_(layer.weight)
        layer(_tokens(step.num_tokens, width, dtype))

    reported, issued = reported_and_issued(lambda pc: make(pc, dtype), run, StepSize(num_tokens=7, num_sampled=2))
    assert reported == issued


@pytest.mark.parametrize("pp_rank", [0, 1])
def test_the_embedding_reduces_its_lookups_on_the_first_stage_only(pp_rank):
    def run(embedding, step):
        if embedding.pc.is_first_stage:  # later stages receive hidden states instead of token ids
            embedding(torch.randint(0, 100, (step.num_tokens,)))

    reported, issued = reported_and_issued(lambda pc: VocabParallelEmbedding(100, 16, pc), run,
                                           StepSize(num_tokens=5, num_sampled=1), pp_rank=pp_rank, pp_size=2)
    assert reported == issued
    assert len(issued) == (1 if pp_rank == 0 else 0)


@pytest.mark.parametrize("num_sampled", [0, 3])
def test_the_lm_head_gathers_vocabulary_shards_for_the_rows_that_sample(num_sampled):
    def run(head, step):
        if step.num_sampled:  # the runner computes no logits in a step that samples nothing
            head.compute_logits(_tokens(step.num_sampled, 16))

    reported, issued = reported_and_issued(lambda pc: ParallelLMHead(100, 16, pc), run,
                                           StepSize(num_tokens=9, num_sampled=num_sampled))
    assert reported == issued
    assert [c.numel for c in issued] == ([num_sampled * 64] if num_sampled else [])  # 100 rows padded to 128


@pytest.mark.parametrize("groups, tp_size", [(1, 2), (2, 2), (1, 1)])
def test_gated_norm_reduces_a_float32_sum_of_squares_when_its_group_spans_ranks(groups, tp_size):
    def run(norm, step):
        torch.nn.init.ones_(norm.weight)
        channels = norm.weight.shape[0]
        norm(_tokens(step.num_tokens, channels, torch.bfloat16), _tokens(step.num_tokens, channels, torch.bfloat16))

    reported, issued = reported_and_issued(lambda pc: GatedRMSNorm(32, groups, 4, 1e-5, pc, torch.bfloat16), run,
                                           StepSize(num_tokens=6, num_sampled=1), tp_size=tp_size)
    assert reported == issued
    assert issued == ([Collective("all_reduce", 6, torch.float32)] if groups % tp_size else [])
