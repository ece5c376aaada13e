"""Draft-model proposals: a smaller model sharing the target's tokenizer (or a quantized copy of the target) runs in
the engine's process with its own KV cache and drafts greedily, k forward passes a step for all drafting requests at
once. A greedy draft is deterministic (q = 1 for its token), so the sampler's verification keeps the target's
distribution exactly. Each request's draft-side KV is kept for the tokens the target verified; what follows a
rejected draft is computed again on the next proposal."""
from __future__ import annotations

import logging
import time

from strata.config import EngineConfig, resolve_device
from strata.config.speculative_config import SpeculativeConfig
from strata.distributed import ParallelContext
from strata.engine.kv_cache import KVCacheManager
from strata.engine.request import Request
from strata.errors import ConfigError
from strata.executor.kv_budget import kv_cache_blocks
from strata.executor.model_runner import ModelRunner, RunnerOutput
from strata.executor.step import NewRequestData, ScheduledRequest, SchedulerOutput
from strata.sampling_params import SamplingParams
from strata.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0)
_CATCH_UP_ROWS = 16  # the most tokens of a catch-up pass laid out as decode rows (a decode step's kernels' limit)


def draft_engine_config(spec: SpeculativeConfig, target: EngineConfig) -> EngineConfig:
    """The draft model's configuration: the target's context length, batch size, device and kernels."""
    if spec.draft_tensor_parallel_size != 1:
        raise ConfigError(f"draft_tensor_parallel_size={spec.draft_tensor_parallel_size} is not supported: the draft "
                          "model runs whole in the engine's process; use 1",
                          param="speculative_config.draft_tensor_parallel_size")
    config = EngineConfig.create(spec.model, max_model_len=target.scheduler.max_model_len,
                                 max_num_seqs=target.scheduler.max_num_seqs,
                                 max_num_batched_tokens=target.scheduler.max_num_batched_tokens,
                                 kv_cache_memory=target.cache.kv_cache_memory, enable_prefix_caching=False,
                                 device=target.device, seed=target.seed, kernels=target.kernels)
    if config.model.text_info.is_hybrid:
        raise ConfigError(f"the draft model {spec.model!r} ({config.model.architecture}) keeps Mamba state, which "
                          "cannot be rolled back past rejected drafts; use an attention-only draft",
                          param="speculative_config.model")
    return config


def check_same_vocabulary(draft: EngineConfig, target: EngineConfig) -> None:
    """Draft tokens are target tokens: the two tokenizers must map every token to the same id."""
    mine = load_tokenizer(draft.model.tokenizer_path, draft.model.tokenizer_gguf_file).get_vocab()
    theirs = load_tokenizer(target.model.tokenizer_path, target.model.tokenizer_gguf_file).get_vocab()
    if mine != theirs or draft.model.vocab_size > target.model.vocab_size:
        raise ConfigError(f"the draft model {draft.model.path!r} does not share the target's tokenizer (their "
                          "vocabularies differ); use a draft of the same model family",
                          param="speculative_config.model")


class DraftModelProposer:
    def __init__(self, spec: SpeculativeConfig, target: EngineConfig) -> None:
        started = time.monotonic()
        config = draft_engine_config(spec, target)
        check_same_vocabulary(config, target)
        device = resolve_device(config.device)
        self.runner = ModelRunner(config, ParallelContext(), device)
        num_blocks = kv_cache_blocks(config, self.runner.kv_bytes_per_block(), device)
        self.runner.allocate_kv_cache(num_blocks)
        self.kv = KVCacheManager(num_blocks, config.cache.block_size, enable_prefix_caching=False)
        self.shadows: dict[str, Request] = {}  # request id -> the draft's view: tokens fed and their blocks
        self._finished: list[str] = []  # to tell the draft runner with its next step
        # Time in draft passes past the prompts (a prompt's prefill is no cost of a draft position), for the cost
        # per step: counting prefills made the depth chooser turn drafts off for 16 steps at a time, after which the
        # draft caught up on 17 tokens in a prefill chunk (0.9x of no speculation on 500-token prompts).
        self.forward_s, self.forwards = 0.0, 0
        logger.info("draft model %s loaded (%d KV blocks) in %.1f s", spec.model, num_blocks,
                    time.monotonic() - started)

    @property
    def mean_pass_s(self) -> float:
        """Seconds a draft pass past the prompts took on average (0 before the first)."""
        return self.forward_s / self.forwards if self.forwards else 0.0

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        return self.propose_many([request], [max_tokens]).get(request.request_id, [])

    def propose_many(self, requests: list[Request], limits: list[int]) -> dict[str, list[int]]:
        """Greedy drafts of up to `limits` tokens for each request, in as many batched draft passes."""
        drafts: dict[str, list[int]] = {r.request_id: [] for r in requests}
        wanted = {r.request_id: n for r, n in zip(requests, limits, strict=True)}
        active = [self._shadow(r) for r in requests]
        while active:
            out = self._feed(active)
            if out is None:  # the draft's KV cache is full: no drafts this step
                return {}
            still = []
            for shadow in active:
                token = out.sampled[shadow.request_id][0]
                shadow.token_ids.append(token)
                drafts[shadow.request_id].append(token)
                if len(drafts[shadow.request_id]) < wanted[shadow.request_id]:
                    still.append(shadow)
            active = still
        return drafts

    def _shadow(self, request: Request) -> Request:
        """The request as the draft sees it: its verified tokens; the KV of tokens past where they agree with what
        the draft was fed (rejected drafts) counts as not computed."""
        shadow = self.shadows.get(request.request_id)
        if shadow is None:
            shadow = self.shadows[request.request_id] = Request(request.request_id, request.prompt_token_ids,
                                                                _GREEDY, request.max_model_len)
        agree = 0
        for mine, theirs in zip(shadow.token_ids, request.token_ids, strict=False):
            if mine != theirs:
                break
            agree += 1
        # The last token is fed again even when the draft saw it (a cut draft): its pass gives the next token.
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, agree, request.num_tokens - 1)
        shadow.token_ids = list(request.token_ids)
        return shadow

    def _feed(self, shadows: list[Request]) -> RunnerOutput | None:
        """One draft pass over each shadow's tokens not yet computed, giving each its greedy next token; None when
        the draft's KV cache cannot hold them (the shadows are then dropped, to be computed again later)."""
        if not all(self.kv.allocate(s, s.num_tokens - s.num_computed_tokens) for s in shadows):
            for shadow in shadows:
                self.finish(shadow)
            return None
        scheduled = []
        for shadow in shadows:
            start, n = shadow.num_computed_tokens, shadow.num_tokens - shadow.num_computed_tokens
            new = None
            if not shadow.known_to_workers:
                new, shadow.known_to_workers = NewRequestData(_GREEDY, shadow.prompt_token_ids), True
            # Past the prompt, the tokens verified since the last pass (a few) run as decode rows, not as a prefill
            # chunk attending its gathered context: at a 135-token context such a pass took 19-22 ms against 7.
            scheduled.append(ScheduledRequest(shadow.request_id, shadow.token_ids[start:], start,
                                              list(shadow.block_ids), True, new=new,
                                              catch_up=0 < start and n <= _CATCH_UP_ROWS))
            shadow.num_computed_tokens += n
        step = SchedulerOutput(scheduled, finished_request_ids=self._finished)
        self._finished = []
        started = time.perf_counter()
        out = self.runner.execute(step)
        if all(s.catch_up for s in scheduled):
            self.forward_s += time.perf_counter() - started
            self.forwards += 1
        return out

    def finish(self, request: Request) -> None:
        shadow = self.shadows.pop(request.request_id, None)
        if shadow is not None:
            self.kv.free(shadow)
            if shadow.known_to_workers:
                self._finished.append(shadow.request_id)

