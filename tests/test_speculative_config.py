"""speculative_config: vLLM's keys and defaults, and refusals that name the key and the fix."""
from __future__ import annotations

import pytest

from strata.cli import build_parser
from strata.config.engine_args import EngineArgs
from strata.config.speculative_config import parse_speculative_config
from strata.errors import ConfigError


def test_ngram_lookup_bounds_follow_vllms_defaults():
    assert parse_speculative_config(None) is None
    both = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4})
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)
    one = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)
    suffix = parse_speculative_config({"method": "suffix"})
    assert suffix.num_speculative_tokens == suffix.suffix_decoding_max_tree_depth == 24
    assert (suffix.suffix_decoding_max_cached_requests, suffix.suffix_decoding_max_spec_factor,
            suffix.suffix_decoding_min_token_prob) == (10000, 1.0, 0.1)
    assert parse_speculative_config({"model": "/draft", "num_speculative_tokens": 3}).method == "draft_model"


@pytest.mark.parametrize(("options", "param", "words"), [
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_mni": 2}, "prompt_lookup_mni",
     "did you mean prompt_lookup_min"),
    ({"method": "ngram"}, "num_speculative_tokens", "is missing"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method", "not supported"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens", ">= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min", "<= prompt_lookup_max"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob", "[0, 1]"),
    ({"method": "ngram", "model": "/draft", "num_speculative_tokens": 2}, "model", "only for draft-model"),
    ({"num_speculative_tokens": 2}, "method", "is missing"),
])
def test_a_bad_key_is_refused_naming_it(options, param, words):
    with pytest.raises(ConfigError, match=r".*" + words.replace("[", r"\[").replace("(", r"\(")) as refused:
        parse_speculative_config(options)
    assert refused.value.param == f"speculative_config.{param}"


def test_the_flag_takes_a_json_object():
    args = build_parser().parse_args(["bench", "throughput", "--model", "m", "--speculative-config",
                                      '{"method": "suffix", "num_speculative_tokens": 12}'])
    assert EngineArgs.from_cli_args(args, "m").speculative_config == {"method": "suffix", "num_speculative_tokens": 12}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "m", "--speculative-config", "[1, 2]"])
