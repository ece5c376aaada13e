"""EngineArgs is the one list of engine options: every field is a flag of each engine verb and an LLM keyword,
and a misspelt keyword is refused naming the close matches."""
from __future__ import annotations

import dataclasses

import pytest

import strata.llm
from strata import LLM
from strata.cli import build_parser
from strata.config import EngineConfig
from strata.config.engine_args import EngineArgs, option_names

# A value other than the default for every option, with how it is written on the command line.
NON_DEFAULTS = {
    "tensor_parallel_size": (2, "2"), "pipeline_parallel_size": (3, "3"), "pp_layer_partition": ((2, 3), "2,3"),
    "dtype": ("bfloat16", "bfloat16"), "max_model_len": (99, "99"), "max_num_seqs": (7, "7"),
    "max_num_batched_tokens": (64, "64"), "kv_cache_memory": (3 << 20, "3M"), "gpu_memory_utilization": (0.5, "0.5"),
    "block_size": (32, "32"), "enable_prefix_caching": (False, None), "mamba_ssm_cache_dtype": ("auto", "auto"),
    "kv_cache_dtype": ("bfloat16", "bfloat16"),
    "quantization": ("experts_int8", "experts_int8"), "seed": (5, "5"), "device": ("cpu", "cpu"),
    "nnodes": (2, "2"), "node_rank": (1, "1"), "master_addr": ("10.0.0.1", "10.0.0.1"), "master_port": (29500, "29500"),
    "kernels": ("triton", "triton"),
    "structured_outputs_timeout": (2.5, "2.5"), "structured_outputs_max_whitespace": (-1, "-1"),
    "reasoning_parser": ("qwen3", "qwen3"),
    "runner": ("pooling", "pooling"), "convert": ("embed", "embed"), "quantized_activations": ("int8", "int8"),
    "revision": ("v2", "v2"), "tokenizer": ("org/tok", "org/tok"), "tokenizer_revision": ("t1", "t1"),
    "download_dir": ("/tmp/hub", "/tmp/hub"), "hf_token": ("hf_x", "hf_x"), "gguf_file": ("m.gguf", "m.gguf"),
    "speculative_config": ({"method": "ngram", "num_speculative_tokens": 3},
                           '{"method": "ngram", "num_speculative_tokens": 3}'),
    "hf_overrides": ({"is_matryoshka": True}, '{"is_matryoshka": true}'),
    "limit_mm_per_prompt": ({"image": 2}, '{"image": 2}'), "mm_processor_cache_gb": (0.5, "0.5"),
    "max_image_pixels": (1000, "1000"),
    "enable_lora": (False, None), "max_loras": (4, "4"), "max_lora_rank": (64, "64"), "max_cpu_loras": (8, "8"),
}
VERBS = {"serve": ["serve", "m"], "bench throughput": ["bench", "throughput", "--model", "m"], "plan": ["plan", "m"]}


def flags() -> list[str]:
    argv = []
    for name, (_, text) in NON_DEFAULTS.items():
        flag = "--" + name.replace("_", "-")
        argv += [flag, text] if text is not None else ["--no-" + flag[2:]]
    return argv


def test_every_option_has_a_non_default_sample():
    assert set(NON_DEFAULTS) == set(option_names())
    defaults = EngineArgs("m")
    assert all(getattr(defaults, name) != value for name, (value, _) in NON_DEFAULTS.items())


@pytest.mark.parametrize("verb", VERBS)
def test_every_option_is_a_flag_of_each_engine_verb(verb):
    parser = build_parser()
    assert EngineArgs.from_cli_args(parser.parse_args(VERBS[verb]), "m") == EngineArgs("m")
    parsed = EngineArgs.from_cli_args(parser.parse_args(VERBS[verb] + flags()), "m")
    assert parsed == EngineArgs("m", **{name: value for name, (value, _) in NON_DEFAULTS.items()})


def test_every_option_is_an_llm_keyword(monkeypatch):
    seen = []

    def capture(args, **front_end):
        seen.append(args)
        raise RuntimeError("captured")

    monkeypatch.setattr(strata.llm.EngineConfig, "from_args", capture)
    options = {name: value for name, (value, _) in NON_DEFAULTS.items()}
    with pytest.raises(RuntimeError, match="captured"):
        LLM("m", **options)
    assert seen == [EngineArgs("m", **options)]


def test_every_option_has_help_text():
    assert all(f.metadata["help"] for f in dataclasses.fields(EngineArgs) if f.name != "model")


def test_prefixes_of_long_flags_are_accepted():
    args = build_parser().parse_args(["plan", "m", "--tensor-parallel", "4", "--kv-cache-mem", "1G"])
    assert (args.tensor_parallel_size, args.kv_cache_memory) == (4, 1 << 30)


def test_an_unknown_llm_keyword_names_the_close_matches():
    with pytest.raises(TypeError, match=r"LLM\(\) got an unexpected keyword argument 'tensor_paralel_size'; "
                                        r"did you mean tensor_parallel_size\b"):
        LLM("m", tensor_paralel_size=2)
    # LLM's own keywords are suggested too.
    with pytest.raises(TypeError, match="did you mean chat_template"):
        LLM("m", chat_templat="x")
    with pytest.raises(TypeError, match="the options are: .*tensor_parallel_size"):
        LLM("m", zzz=1)


def test_an_unknown_engine_config_keyword_names_the_close_matches():
    with pytest.raises(TypeError, match="did you mean max_num_seqs"):
        EngineConfig.create("m", max_num_seq=4)
