"""Phi-3's LongRoPE: the factors are chosen once from max_model_len (vLLM's rule), never per step, so a sequence that
grows past original_max_position_embeddings keeps the keys it cached. transformers switches per forward pass by the
sequence length; it is the oracle wherever its choice is the same for every pass, and for a sequence that crosses
the original length the oracle is transformers with the short factors replaced by the long ones."""
from __future__ import annotations

import json
import shutil

from arch_checkpoints import assert_matches_transformers, edit_config, random_prompts, strata_greedy

ORIGINAL = 64  # original_max_position_embeddings of the phi3 checkpoint; max_position_embeddings is 256


def test_long_factors_when_max_model_len_exceeds_the_original_length(arch_path, hf_outputs):
    path = arch_path("phi3")
    prompts = tuple(tuple(p) for p in random_prompts((70, 90), seed=7))  # transformers: long factors throughout
    assert_matches_transformers(strata_greedy(path, prompts, 8, max_model_len=256), hf_outputs(path, prompts, 8))


def test_a_sequence_crossing_the_original_length_keeps_the_factors_chosen_at_start(arch_path, hf_outputs, tmp_path):
    path = arch_path("phi3")
    always_long = tmp_path / "always_long"
    shutil.copytree(path, always_long)
    rope = json.loads((path / "config.json").read_text())["rope_parameters"]
    edit_config(always_long, rope_parameters={**rope, "short_factor": rope["long_factor"]})
    prompts = tuple(tuple(p) for p in random_prompts((ORIGINAL - 6, 20), seed=8))
    long = hf_outputs(always_long, prompts, 12)
    assert_matches_transformers(strata_greedy(path, prompts, 12, max_model_len=256), long)
    # A max_model_len within the original length keeps the short factors, as transformers does there; the two
    # choices give different tokens, so the comparisons tell them apart.
    short = hf_outputs(path, prompts[1:], 12)
    assert_matches_transformers(strata_greedy(path, prompts[1:], 12, max_model_len=ORIGINAL), short)
    assert short[0]["tokens"] != long[1]["tokens"]
