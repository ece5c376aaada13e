"""The engine's speculative decoder: which decoding requests get drafts this step and how many (the step's draft
budget), the proposer that makes them, and the acceptance counters behind the metrics and the log line."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from strata.config import EngineConfig, resolve_device
from strata.config.speculative_config import SpeculativeConfig
from strata.engine.request import Request
from strata.engine.speculative.draft_length import DraftDepth
from strata.engine.speculative.draft_model import DraftModelProposer
from strata.engine.speculative.ngram import NgramProposer
from strata.engine.speculative.suffix import SuffixProposer


@dataclass
class SpecDecodeStats:
    """Counters under vLLM's names: verification steps with drafts, draft tokens, accepted ones, and accepted ones
    by position in the draft."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos += [0] * (drafted - len(self.accepted_per_pos))
        for position in range(accepted):
            self.accepted_per_pos[position] += 1

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_pos))

    def since(self, earlier: SpecDecodeStats) -> SpecDecodeStats:
        per_pos = [n - (earlier.accepted_per_pos[i] if i < len(earlier.accepted_per_pos) else 0)
                   for i, n in enumerate(self.accepted_per_pos)]
        return SpecDecodeStats(self.num_drafts - earlier.num_drafts, self.num_draft_tokens - earlier.num_draft_tokens,
                               self.num_accepted_tokens - earlier.num_accepted_tokens, per_pos)

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification step emits on average: its accepted drafts and the one token it samples."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def summary(self) -> str:
        per_pos = ", ".join(f"{n / self.num_drafts:.2f}" for n in self.accepted_per_pos) if self.num_drafts else "-"
        return (f"speculative decoding: acceptance rate {100 * self.acceptance_rate:.1f}%, mean acceptance length "
                f"{self.mean_acceptance_length:.2f} ({self.num_drafts} drafts, {self.num_draft_tokens} draft tokens, "
                f"{self.num_accepted_tokens} accepted; by position {per_pos})")


def make_proposer(config: SpeculativeConfig, target: EngineConfig
                  ) -> NgramProposer | SuffixProposer | DraftModelProposer:
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method == "suffix":
        return SuffixProposer(config)
    return DraftModelProposer(config, target)


def within_budget(proposals: dict[str, list[int]], budget: int) -> dict[str, list[int]]:
    """The proposals cut to `budget` tokens in all, nearest positions first: every request keeps its first draft
    token before any keeps a second (a draft's later tokens are the less likely to be accepted)."""
    if sum(len(p) for p in proposals.values()) <= budget:
        return proposals
    depth = 0
    while sum(min(len(p), depth + 1) for p in proposals.values()) <= budget:
        depth += 1
    left = budget - sum(min(len(p), depth) for p in proposals.values())
    cut = {}
    for request_id, proposal in proposals.items():
        take = min(len(proposal), depth)
        if left > 0 and len(proposal) > depth:
            take, left = take + 1, left - 1
        if take:
            cut[request_id] = proposal[:take]
    return cut


class SpeculativeDecoder:
    """Drafts for a step's decoding requests. A step with drafts stays about as cheap as a decode step while it is
    bound by reading the weights; once it is bound by compute every draft token costs its share. So each step's
    drafts go as deep as the measured step times and acceptance make worthwhile (DraftDepth), are cut to the step
    token budget (nearest positions kept), and vanish once the decodes alone fill it."""

    def __init__(self, config: SpeculativeConfig, target: EngineConfig) -> None:
        self.config = config
        self.proposer = make_proposer(config, target)
        self.step_budget = config.step_token_budget(resolve_device(target.device).type)
        self.stats = SpecDecodeStats()
        self.depth = DraftDepth()
        self._logged = SpecDecodeStats()  # the counters at the last log line
        # Set by the engine for requests under a grammar: the draft cut before the first token the grammar refuses.
        self.grammar_cut: Callable[[Request, list[int]], list[int]] | None = None

    def drafts(self, decoding: list[Request], num_running: int) -> dict[str, list[int]]:
        """Draft tokens by request id for `decoding` (running requests whose next step samples one token)."""
        disable = self.config.disable_by_batch_size
        room = self.step_budget - len(decoding)
        if not decoding or room <= 0 or (disable is not None and num_running >= disable):
            return {}
        # A verification step emits up to one token more than its drafts; their positions need KV slots.
        limits = [min(self.config.num_speculative_tokens, r.max_tokens - r.num_output_tokens - 1,
                      r.max_model_len - r.num_tokens) for r in decoding]
        drafting = [(r, n) for r, n in zip(decoding, limits, strict=True) if n > 0]
        if isinstance(self.proposer, DraftModelProposer):
            # Each draft position is a pass of the draft model: the depth is chosen before, counting its passes.
            depth = self.depth.choose(len(decoding), [n for _, n in drafting], self.proposer.mean_pass_s, room)
            found = self.proposer.propose_many([r for r, _ in drafting], [min(n, depth) for _, n in drafting]) \
                if depth else {}
        else:
            depth = None
            found = {r.request_id: self.proposer.propose(r, n)[:n] for r, n in drafting}
        proposals = {}
        for request, _ in drafting:
            proposal = found.get(request.request_id, [])
            if proposal and self.grammar_cut is not None:
                proposal = self.grammar_cut(request, proposal)
            if proposal:
                proposals[request.request_id] = proposal
        if depth is None:
            depth = self.depth.choose(len(decoding), [len(p) for p in proposals.values()], room=room)
        return within_budget({r: p[:depth] for r, p in proposals.items() if depth}, room)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A decode or verification step's time (no prefill in it), for choosing later drafts' depth."""
        self.depth.times.observe(num_tokens, seconds)

    def record(self, drafted: int, accepted: int) -> None:
        self.stats.record(drafted, accepted)
        self.depth.record(drafted, accepted)

    def interval_summary(self) -> str | None:
        """The log line of the drafts verified since the last call (None when there were none)."""
        interval = self.stats.since(self._logged)
        self._logged = self.stats.copy()
        return interval.summary() if interval.num_drafts else None

    def finish(self, request: Request) -> None:
        self.proposer.finish(request)
