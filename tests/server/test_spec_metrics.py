"""Speculative decoding's counters on /metrics under vLLM's names, read back with prometheus_client's parser, and the
log line with the acceptance rate and mean acceptance length."""
from __future__ import annotations

import logging

from prometheus_client.parser import text_string_to_metric_families

from strata import LLM, SamplingParams
from strata.server.metrics import ServerMetrics


class _Served:
    """What ServerMetrics reads of an AsyncEngine, over an offline engine."""

    def __init__(self, engine) -> None:
        self.engine, self.config, self.is_dead = engine, engine.config, False

    def stats(self) -> dict:
        return self.engine.snapshot()


def test_spec_decode_counters_are_exported_under_vllms_names(llama_gqa, caplog):
    llm = LLM(str(llama_gqa), speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                  "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    prompt = {"prompt_token_ids": [5, 6, 7, 8] * 8}
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.spec.stats
    samples = {}
    for family in text_string_to_metric_families(ServerMetrics(_Served(llm.engine), "m").render().decode()):
        for sample in family.samples:
            samples[(sample.name, sample.labels.get("position"))] = sample.value
    assert samples[("vllm:spec_decode_num_drafts_total", None)] == stats.num_drafts > 0
    assert samples[("vllm:spec_decode_num_draft_tokens_total", None)] == stats.num_draft_tokens
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", None)] == stats.num_accepted_tokens > 0
    per_pos = [samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(i))] for i in range(3)]
    assert sum(per_pos) == stats.num_accepted_tokens and per_pos == sorted(per_pos, reverse=True)
    with caplog.at_level(logging.INFO):
        logging.getLogger("test").info("%s", llm.engine.spec.interval_summary())
    rate = 100 * stats.num_accepted_tokens / stats.num_draft_tokens
    assert f"acceptance rate {rate:.1f}%" in caplog.text
    assert f"mean acceptance length {1 + stats.num_accepted_tokens / stats.num_drafts:.2f}" in caplog.text
    assert llm.engine.spec.interval_summary() is None  # nothing new since the last line
