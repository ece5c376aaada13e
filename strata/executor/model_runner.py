"""Step description -> flat tensors -> model forward -> sampled tokens, on one rank.

The runner keeps per-request sampling state (generator, tokens so far) for the requests it has seen,
so each step's SchedulerOutput only carries what changed.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from strata.config import EngineConfig
from strata.distributed import IntermediateTensors, ParallelContext
from strata.errors import RequestError
from strata.executor.cpu_decode import CpuDecode
from strata.executor.lora_manager import LoRAModelManager
from strata.executor.step import GrammarBitmask, ScheduledRequest, SchedulerOutput
from strata.executor.step_inputs import is_decode_rows, prepare_step
from strata.host_memory import keep_freed_host_memory
from strata.kernels.cpu import attention as cpu_attention
from strata.kernels.cpu.attention import BlockZeroer
from strata.layers.attention import Attention
from strata.layers.forward_meta import ForwardMeta
from strata.layers.linear import pack_linear_weights
from strata.layers.mamba.mixer import MambaState, allocate_states, state_bytes_per_slot
from strata.layers.mrope import step_positions
from strata.layers.sampler import Sampler, SamplingRow, top_logprobs
from strata.layers.stored_dtype import store_weights_as
from strata.lora.request import LoRARequest
from strata.models import loader
from strata.outputs import PromptLogprobsChunk, TokenLogprobs
from strata.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class RunnerOutput:
    # The new tokens of each request that sampled: one, or with draft tokens the accepted drafts and one more.
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # of each new token, when asked
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)


@dataclass
class RequestState:
    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    mm_inputs: object = None
    # Multimodal models: (prompt positions, embeddings) of the request's image features, computed once
    # by the first stage and sliced for each prefill chunk.
    mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    lora_request: LoRARequest | None = None


class ModelRunner:
    def __init__(self, config: EngineConfig, pc: ParallelContext, device: torch.device) -> None:
        self.config, self.pc, self.device = config, pc, device
        self.block_size = config.cache.block_size
        self.states: dict[str, RequestState] = {}
        started = time.monotonic()
        model_cls = config.model.info.load_class()
        with torch.device(device):
            self.model = model_cls(config.model, pc, config.parallel.pp_layer_partition)
        self.model.load_weights(loader.checkpoint_weights(
            config.model, lambda name: loader.is_pp_missing(name, self.model.missing_prefixes)))
        self.model.eval()
        if config.model.weight_dtype is not None:
            store_weights_as(self.model, config.model.weight_dtype)
        self.weight_bytes = self._count_weight_bytes()
        self.param_names = [name for name, _ in self.model.named_parameters()]
        logger.info("%s loaded %s (%.1f MB of weights on this rank) in %.1f s", pc.log_prefix,
                    config.model.architecture, self.weight_bytes / 2**20, time.monotonic() - started)
        if device.type == "cpu":
            keep_freed_host_memory()
            pack_linear_weights(self.model)
            logger.info("%s linear weights packed for oneDNN", pc.log_prefix)
            cpu_attention.prepare()  # a first-time compile belongs to start-up, not to the first request
        # The fused CPU decode paths, read from the layers' declarations once the weights are final (None off CPU
        # and for models without declared layers); each decode step asks them first.
        self.cpu_decode = CpuDecode.build(self.model, device)
        # LoRA slots in the targetable layers (None when LoRA is off: the layers carry nothing). The fused CPU
        # decode paths add a step's adapter deltas in C, reading the slots' rows of each step.
        self.lora = None if config.lora is None else LoRAModelManager(self.model, config.lora, config.model.dtype,
                                                                       device)
        if self.lora is not None and self.cpu_decode is not None:
            self.cpu_decode.attach_lora(self.lora.context)
        generator = torch.Generator(device=device)
        generator.manual_seed(config.seed)
        self.sampler = Sampler(generator)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.mamba_layers = [m for m in self.model.modules() if isinstance(m, MambaState)]
        self.encodes_images = pc.is_first_stage and hasattr(self.model, "embed_multimodal")
        self.uses_mrope = getattr(self.model, "uses_mrope", False)  # Qwen2.5-VL: positions of three rows

    def _count_weight_bytes(self) -> int:
        """Parameter bytes (a tied tensor once) plus the packed weights quantized layers hold outside parameters."""
        seen = {}
        for p in self.model.parameters():
            seen[p.data_ptr()] = p.numel() * p.element_size()
        methods = {id(m.quant): m.quant for m in self.model.modules() if getattr(m, "quant", None) is not None}
        return sum(seen.values()) + sum(q.nbytes for q in methods.values())  # a tied head's method once

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.config.cache.kv_dtype(self.config.model.dtype)

    def kv_bytes_per_block(self) -> int:
        size = torch.empty((), dtype=self.kv_dtype).element_size()
        return sum(2 * self.block_size * a.num_kv_heads * a.head_dim * size for a in self.attention_layers)

    def state_bytes(self) -> int:
        """Bytes of the Mamba state slots (one per schedulable sequence) that allocate_kv_cache will bind."""
        dtype = self.config.model.dtype
        per_slot = state_bytes_per_slot(self.mamba_layers, dtype, self.config.cache.ssm_state_dtype(dtype))
        return per_slot * self.config.scheduler.max_num_seqs

    def allocate_kv_cache(self, num_blocks: int) -> None:
        # Uninitialised memory costs nothing until touched; each block is zeroed on its first use,
        # because attention multiplies masked (padding) slots by zero and NaN garbage would survive that.
        self.unzeroed_blocks = bytearray(b"\x01") * num_blocks
        for layer in self.attention_layers:
            shape = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = torch.empty(shape, dtype=self.kv_dtype, device=self.device)
            layer.v_cache = torch.empty(shape, dtype=self.kv_dtype, device=self.device)
        self.zero_blocks = BlockZeroer.create([c for layer in self.attention_layers
                                               for c in (layer.k_cache, layer.v_cache)])
        if self.mamba_layers:  # one state slot per schedulable sequence, as the scheduler's SlotPool
            cache = self.config.cache
            nbytes = allocate_states(self.mamba_layers, self.config.scheduler.max_num_seqs, self.config.model.dtype,
                                     cache.ssm_state_dtype(self.config.model.dtype), self.device)
            logger.info("%s Mamba state: %d slots x %d layers (%.1f MiB, SSM state in %s)", self.pc.log_prefix,
                        self.config.scheduler.max_num_seqs, len(self.mamba_layers), nbytes / 2**20,
                        str(cache.ssm_state_dtype(self.config.model.dtype)).removeprefix("torch."))

    def _zero_new_blocks(self, requests: list[ScheduledRequest]) -> None:
        """Zero the step's blocks never used before, block 0 too: padded block tables point there, and the
        gathered decode path reads it (masked). Looked up in Python: numpy's calls on a few block ids cost a
        decode step 0.15 ms once the weights had streamed through the caches."""
        unzeroed = self.unzeroed_blocks
        fresh = {b for s in requests for b in s.block_ids if unzeroed[b]}
        if unzeroed[0]:
            fresh.add(0)
        if not fresh:
            return
        for b in fresh:
            unzeroed[b] = 0
        blocks = sorted(fresh)
        if self.zero_blocks is not None:  # CPU caches: one C call
            self.zero_blocks(blocks)
            return
        index = torch.tensor(blocks, dtype=torch.int64, device=self.device)
        for layer in self.attention_layers:
            layer.k_cache.index_fill_(0, index, 0)
            layer.v_cache.index_fill_(0, index, 0)

    def _update_states(self, out: SchedulerOutput) -> None:
        for request_id in out.finished_request_ids:
            self.states.pop(request_id, None)
        for s in out.requests:
            if s.new is not None:
                generator = None
                if s.new.sampling_params.seed is not None:
                    generator = torch.Generator(device=self.device)
                    generator.manual_seed(s.new.sampling_params.seed)
                self.states[s.request_id] = RequestState(s.new.sampling_params, generator,
                                                         list(s.new.prompt_token_ids), [], s.new.mm_inputs,
                                                         lora_request=s.new.lora_request)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and check an adapter before its first request is queued (refused with the reason)."""
        if self.lora is None:
            raise RequestError("this engine was started without enable_lora: it serves no LoRA adapters",
                               param="lora_request")
        self.lora.add_adapter(lora_request)

    def remove_lora(self, lora_int_id: int) -> None:
        if self.lora is not None:
            self.lora.remove_adapter(lora_int_id)

    def pin_lora(self, lora_int_id: int) -> None:
        if self.lora is not None:
            self.lora.pin_adapter(lora_int_id)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, intermediate: IntermediateTensors | None = None) -> RunnerOutput:
        """One step on the last stage (or the only one): the sampled tokens and the logprobs asked for."""
        assert self.pc.is_last_stage, "stages before the last run execute_stage"
        requests = self._begin_step(out)
        if not requests:
            return RunnerOutput()
        input_ids, positions, meta = self._prepare(requests)
        embeds = self._multimodal_embeds(requests, input_ids)
        if self.cpu_decode is not None and embeds is None and intermediate is None and \
                all(s.sample for s in requests):
            decoded = self.cpu_decode.decode_logits(input_ids, positions, meta)  # a CPU decode step in one C call
            if decoded is not None:
                logits, argmax = decoded
                if len(meta.logits_indices) != len(argmax):  # catch-up rows: only each request's last is sampled
                    logits, argmax = logits[meta.logits_indices], argmax[meta.logits_indices.numpy()]
                return self._sample(requests, logits, argmax, out.grammar_bitmask)
        hidden = self._forward(input_ids, positions, meta, intermediate, embeds)
        logits = self.model.compute_logits(hidden[meta.logits_indices]) if any(s.sample for s in requests) else None
        result = self._sample(requests, logits, None, out.grammar_bitmask)
        self._prompt_logprobs(requests, hidden, result)
        return result

    @torch.inference_mode()
    def execute_stage(self, out: SchedulerOutput, intermediate: IntermediateTensors | None = None
                      ) -> IntermediateTensors | None:
        """One step on a stage before the last: the intermediate tensors for the next stage (None for a step
        without requests). `intermediate` is what the previous stage sent (None on the first stage)."""
        assert not self.pc.is_last_stage, "the last stage runs execute"
        requests = self._begin_step(out)
        if not requests:
            return None
        input_ids, positions, meta = self._prepare(requests)
        return self._forward(input_ids, positions, meta, intermediate, self._multimodal_embeds(requests, input_ids))

    def _begin_step(self, out: SchedulerOutput) -> list[ScheduledRequest]:
        """Update per-request state; the step's requests in the order the batch is laid out (decodes first)."""
        self._update_states(out)
        return sorted(out.requests, key=lambda s: not is_decode_rows(s))

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta,
                 intermediate: IntermediateTensors | None, embeds: torch.Tensor | None
                 ) -> torch.Tensor | IntermediateTensors:
        if self.cpu_decode is not None and embeds is None and positions.dim() == 1:
            out = self.cpu_decode.forward(input_ids, positions, meta, intermediate)
            if out is not None:
                return out
        extra = {} if embeds is None else {"inputs_embeds": embeds}
        return self.model(input_ids, positions, meta, intermediate, **extra)

    def _prepare(self, requests: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, ForwardMeta]:
        """(input_ids, positions, ForwardMeta) of a step whose requests come decodes first."""
        if self.config.kernels == "torch":  # the Triton kernels never read past a sequence's last key
            self._zero_new_blocks(requests)
        mm_inputs = [self.states[s.request_id].mm_inputs if s.request_id in self.states else None
                     for s in requests]
        if self.lora is not None:
            loras = [self.states[s.request_id].lora_request if s.request_id in self.states else None for s in requests]
            self.lora.set_batch(requests, loras)
        input_ids, positions, meta = prepare_step(requests, self.block_size, self.device, self.config.kernels,
                                                  bool(self.mamba_layers), mm_inputs)
        if self.uses_mrope:  # image tokens' (t, h, w) rows; later tokens at index + the request's delta
            positions = step_positions([(s.num_computed_tokens, len(s.token_ids)) for s in requests], mm_inputs,
                                       positions)
        return input_ids, positions, meta

    def _multimodal_embeds(self, requests: list[ScheduledRequest], input_ids: torch.Tensor
                           ) -> torch.Tensor | None:
        """Token embeddings with image features written over their placeholder tokens in this step's chunks
        (first stage of multimodal models only; None when no scheduled token is an image feature)."""
        if not self.encodes_images:
            return None
        rows, features, offset = [], [], 0
        for s in requests:
            state, n, start = self.states[s.request_id], len(s.token_ids), s.num_computed_tokens
            where, embeds = state.mm_embeds or (None, None)
            overlaps = where is None or (start <= int(where[-1]) and start + n > int(where[0]))
            if state.mm_inputs is not None and overlaps:
                if embeds is None:  # first chunk with image tokens, or recomputed after a preemption
                    where, embeds = self.model.embed_multimodal(state.mm_inputs, state.prompt_token_ids)
                inside = (where >= start) & (where < start + n)
                rows.append(where[inside] - start + offset)
                features.append(embeds[inside])
                # Past the last image token the features are not needed again (unless preempted): free them.
                state.mm_embeds = (where, None if start + n > int(where[-1]) else embeds)
            offset += n
        if not rows or sum(r.numel() for r in rows) == 0:
            return None
        embeds = self.model.embed_input_ids(input_ids)
        embeds[torch.cat(rows)] = torch.cat(features).to(embeds.dtype)
        return embeds

    def _sample(self, requests: list[ScheduledRequest], logits: torch.Tensor | None, argmax: np.ndarray | None,
                bitmask: GrammarBitmask | None = None) -> RunnerOutput:
        """The new tokens (and their logprobs when asked) of each sampling request; `logits` holds their rows in
        order (with draft tokens, one per verified position), `argmax` (when given) each row's first largest logit."""
        result = RunnerOutput()
        rows, owners = [], []  # sampler rows, and the request id of each
        for s in requests:
            if s.sample:
                rows += self._sampling_rows(s)
                owners += [s.request_id] * (s.num_draft_tokens + 1)
        if not rows:
            return result
        sampled = self.sampler(logits, rows, _grammar_rows(bitmask, owners), argmax)
        for j, request_id in enumerate(owners):
            if sampled.emitted is not None and not sampled.emitted[j]:
                continue
            token = sampled.token_ids[j]
            result.sampled.setdefault(request_id, []).append(token)
            self.states[request_id].output_token_ids.append(token)
            if sampled.logprobs[j] is not None:
                result.logprobs.setdefault(request_id, []).append(sampled.logprobs[j])
        return result

    def _sampling_rows(self, s: ScheduledRequest) -> list[SamplingRow]:
        """A request's sampler rows: one, or with draft tokens one per verified position, each seeing the drafts
        before it as output tokens (penalties, min_tokens)."""
        state = self.states[s.request_id]
        outputs, drafts = state.output_token_ids, s.draft_token_ids
        return [SamplingRow(state.params, state.generator, state.prompt_token_ids,
                            outputs + drafts[:j] if j else outputs, drafts[j] if j < len(drafts) else None)
                for j in range(len(drafts) + 1)]

    def _prompt_logprobs(self, requests: list[ScheduledRequest], hidden: torch.Tensor, result: RunnerOutput) -> None:
        end = 0
        for s in requests:
            start, end = end, end + len(s.token_ids)  # the request's rows in hidden
            state = self.states[s.request_id]
            k = state.params.prompt_logprobs
            num_prompt = len(state.prompt_token_ids)
            first, last = s.num_computed_tokens, min(s.num_computed_tokens + len(s.token_ids), num_prompt - 1)
            if k is None or first >= last:
                continue
            logits = self.model.compute_logits(hidden[start:start + last - first]).float()
            targets = torch.tensor(state.prompt_token_ids[first + 1:last + 1], device=self.device)
            ids, lps, target_lp, rank = top_logprobs(logits.log_softmax(-1), targets, k)
            ids, lps, target_lp, rank = ids.tolist(), lps.tolist(), target_lp.tolist(), rank.tolist()
            result.prompt_logprobs[s.request_id] = PromptLogprobsChunk(
                first + 1, [TokenLogprobs(ids[j], lps[j], target_lp[j], rank[j]) for j in range(last - first)])


def _grammar_rows(bitmask: GrammarBitmask | None, row_owners: list[str]) -> tuple[list[int], torch.Tensor] | None:
    """The sampler rows under a grammar, in the order of the bitmask's rows (the engine wrote one per sampled
    position of each constrained request: its request id once per row)."""
    if bitmask is None:
        return None
    first: dict[str, int] = {}
    for j, request_id in enumerate(row_owners):
        first.setdefault(request_id, j)
    seen: dict[str, int] = {}
    rows = []
    for request_id in bitmask.request_ids:
        rows.append(first[request_id] + seen.get(request_id, 0))
        seen[request_id] = seen.get(request_id, 0) + 1
    return rows, bitmask.tensor()
