"""EngineArgs: the one list of engine options, each with its help text. The flags of `strata serve | bench
throughput | plan` are generated from it, `LLM(...)` keywords are checked against it, EngineConfig builds from it."""
from __future__ import annotations

import argparse
import difflib
import json
from collections.abc import Callable, Collection, Iterable
from dataclasses import Field, dataclass, field, fields
from typing import Any

from strata.config.multimodal_config import DEFAULT_MAX_IMAGE_PIXELS
from strata.reasoning import REASONING_PARSERS

DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float")
SSM_STATE_DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "bfloat16")  # vLLM's names; its fp8 kinds are refused
QUANTIZATIONS = ("experts_int8", "compressed-tensors", "gptq", "awq", "fp8", "gguf")
KERNELS = ("auto", "torch", "triton")
QUANTIZED_ACTIVATIONS = ("float", "int8")
RUNNERS = ("auto", "generate", "pooling")  # vLLM's --runner
CONVERTS = ("none", "embed", "classify")  # vLLM's --convert


def int_list(value: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None


def byte_size(value: str) -> int:
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    v = value.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if v and v[-1] in units:
            return int(float(v[:-1]) * units[v[-1]])
        return int(float(v))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size in bytes (e.g. 4G, 512M), got {value!r}") from None


def json_object(value: str) -> dict[str, Any]:
    """A flag whose value is a JSON object, e.g. --speculative-config '{"method": "ngram", ...}'."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r} ({e})") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object ({{...}}), got {value!r}")
    return parsed


def _option(default: Any, help: str, *, short: str | None = None, parse: Callable[[str], Any] | None = None,
            choices: Collection[str] | None = None, secret: bool = False) -> Any:
    """A field and what its flag needs besides its name: help, a short spelling, a value parser, choices;
    a `secret` one is left out of the repr (which may end up in logs)."""
    return field(default=default, repr=not secret,
                 metadata={"help": help, "short": short, "parse": parse, "choices": choices})


@dataclass(frozen=True)
class EngineArgs:
    """Every option of an engine. Field `x_y` is the flag `--x-y` and the keyword `LLM(x_y=...)`."""

    model: str  # not generated: each verb declares it (positional for serve and plan, --model for bench)
    revision: str | None = _option(None, "branch, tag or commit of a Hub model (default: main)")
    tokenizer: str | None = _option(None, "tokenizer folder or Hub ID (default: the model's own)")
    tokenizer_revision: str | None = _option(None, "branch, tag or commit of a Hub tokenizer (default: main)")
    download_dir: str | None = _option(None, "where Hub files are cached (default: huggingface_hub's cache, "
                                             "HF_HUB_CACHE or HF_HOME/hub)")
    hf_token: str | None = _option(None, "Hugging Face token for private and gated repos (default: HF_TOKEN, or "
                                         "the one `hf auth login` saved)", secret=True)
    gguf_file: str | None = _option(None, "the GGUF file of a Hub repo or folder to serve, e.g. "
                                          "model-Q4_K_M.gguf (or name the model ORG/NAME:Q4_K_M)")
    tensor_parallel_size: int = _option(1, "tensor-parallel ranks per pipeline stage", short="-tp")
    pipeline_parallel_size: int = _option(1, "pipeline stages (the layers are split between them)", short="-pp")
    pp_layer_partition: tuple[int, ...] | None = _option(
        None, "layers per pipeline stage, e.g. 3,5 (default: even split, vLLM's rule)", parse=int_list)
    dtype: str = _option("auto", "weights and activations dtype (auto: the checkpoint's)", choices=DTYPES)
    max_model_len: int | None = _option(None, "longest prompt + output in tokens "
                                              "(default: the model's max_position_embeddings)")
    max_num_seqs: int = _option(256, "most sequences in one step")
    max_num_batched_tokens: int | None = _option(None, "tokens in one step (default: max(2048, max_num_seqs))")
    kv_cache_memory: int | None = _option(None, "bytes for the KV cache per rank, e.g. 512M (default: on CPU a quarter "
                                                "of free memory, at most 4G, shared by the local ranks; on a GPU "
                                                "what --gpu-memory-utilization leaves)", parse=byte_size)
    gpu_memory_utilization: float = _option(0.9, "share of GPU memory the engine may use")
    block_size: int = _option(16, "tokens per KV-cache block")
    enable_prefix_caching: bool | None = _option(None, "reuse the KV blocks of shared prompt prefixes "
                                                       "(default: on, off for hybrid models)")
    kv_cache_dtype: str = _option("auto", "dtype of the KV cache: auto (= the model dtype), or bfloat16 for a float32 "
                                          "model on CPU (half the cache memory and the bytes a decode step reads)",
                                  choices=KV_CACHE_DTYPES)
    mamba_ssm_cache_dtype: str = _option("float32", "dtype of the Mamba SSM state (auto = the model dtype)",
                                         choices=SSM_STATE_DTYPES)
    quantization: str | None = _option(None, "experts_int8 quantizes the MoE experts while loading; a quantized "
                                       "checkpoint's method (compressed-tensors, gptq, awq, fp8) is detected, "
                                       "and naming it insists on it", short="-q", choices=QUANTIZATIONS)
    seed: int = _option(0, "seed of requests that set none")
    device: str = _option("auto", "auto, cpu, cuda or cuda:N")
    kernels: str = _option("auto", "attention and Mamba kernels: auto (Triton on CUDA, plain torch on CPU), torch, "
                                   "or triton (on CPU only under TRITON_INTERPRET=1, for testing)", choices=KERNELS)
    quantized_activations: str = _option(
        "float", "activations of the products with GGUF block weights: float (exact) or int8 (each row of x rounded "
                 "to Q8_0 / Q8_K blocks as llama.cpp rounds it, integer dot products; every batch size)",
        choices=QUANTIZED_ACTIVATIONS)
    nnodes: int = _option(1, "machines the workers are spread over")
    node_rank: int = _option(0, "this machine's index among --nnodes (0 serves)")
    master_addr: str = _option("127.0.0.1", "address of node 0, where all nodes meet")
    master_port: int | None = _option(None, "port on node 0 where all nodes meet (needed with --nnodes > 1)")
    structured_outputs_timeout: float = _option(10.0, "seconds a request's grammar may take to compile before the "
                                                      "request fails with 400")
    structured_outputs_max_whitespace: int = _option(
        2, "most whitespace characters between two tokens of constrained JSON (-1: any amount)")
    reasoning_parser: str | None = _option(
        None, "the model's thinking format (qwen3, deepseek_r1, openai_gptoss): chat responses carry the thinking in "
              "reasoning_content, and structured outputs constrain only the answer after it",
        choices=REASONING_PARSERS)
    runner: str = _option("auto", "generate (completions, chat) or pooling (/v1/embeddings, LLM.embed); auto: pooling "
                                  "for encoder architectures (BertModel), else generate; pooling on a generative "
                                  "architecture converts it (--convert embed)", choices=RUNNERS)
    convert: str = _option("none", "embed: serve a generative checkpoint (e.g. Qwen3-Embedding) as an embedding model, "
                                   "its hidden states pooled as its sentence-transformers config says (default: last "
                                   "token) and normalized; classify: as a classifier, its `score` head over the last "
                                   "token (/classify, /score; the default for *ForSequenceClassification)",
                           choices=CONVERTS)
    hf_overrides: dict[str, Any] | None = _option(
        None, 'keys merged into the model\'s config.json before it is read, as a JSON object, e.g. '
              '{"is_matryoshka": true}, or for Qwen3-Reranker {"architectures": ["Qwen3ForSequenceClassification"], '
              '"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}', parse=json_object)
    limit_mm_per_prompt: dict[str, Any] | None = _option(
        None, 'most inputs of each modality in one prompt, as a JSON object, e.g. {"image": 2} (default: as many as '
              'the context holds); strata takes images only, so video and audio may only be 0', parse=json_object)
    mm_processor_cache_gb: float = _option(4.0, "GiB of decoded images kept for requests that send the same image "
                                                "again (keyed by its bytes' digest; 0: no cache)")
    max_image_pixels: int = _option(DEFAULT_MAX_IMAGE_PIXELS, "largest image (width x height) a request may send; "
                                                              "larger ones are refused before decoding")
    speculative_config: dict[str, Any] | None = _option(
        None, 'speculative decoding as a JSON object (vLLM\'s keys): {"method": "ngram", "num_speculative_tokens": 4, '
              '"prompt_lookup_min": 2, "prompt_lookup_max": 5} or {"method": "suffix"}', parse=json_object)
    enable_lora: bool | None = _option(None, "serve LoRA adapters (PEFT folders) beside the base model; requests pick "
                                             "one (LLM: lora_request=LoRARequest(...); server: --lora-modules)")
    max_loras: int = _option(1, "LoRA adapters one step may use (each holds a slot in every targeted layer)")
    max_lora_rank: int = _option(16, "largest LoRA rank served; adapters of a higher rank are refused")
    max_cpu_loras: int | None = _option(None, "LoRA adapters kept loaded in host memory (default: max_loras)")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per option, with its default, value parser, choices and help."""
        for f in _options():
            meta = f.metadata
            names = ([meta["short"]] if meta["short"] else []) + ["--" + f.name.replace("_", "-")]
            if f.type == "bool | None":
                parser.add_argument(*names, action=argparse.BooleanOptionalAction, default=f.default,
                                    help=meta["help"])
                continue
            parse = meta["parse"] or _PARSERS[f.type.removesuffix(" | None")]
            parser.add_argument(*names, type=parse, default=f.default, choices=meta["choices"], help=meta["help"])

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, model: str) -> EngineArgs:
        return cls(model, **engine_kwargs(args))

    @classmethod
    def from_kwargs(cls, model: str, options: dict[str, Any], caller: str = "EngineArgs",
                    own_keywords: Iterable[str] = ()) -> EngineArgs:
        """EngineArgs from keywords, refusing unknown ones by naming close matches among the options and the
        caller's `own_keywords`."""
        check_keywords(caller, options, option_names(), own_keywords)
        return cls(model, **options)

_PARSERS: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str}


def _options() -> list[Field]:
    return [f for f in fields(EngineArgs) if f.name != "model"]


def option_names() -> tuple[str, ...]:
    """Every engine option (all EngineArgs fields but the model)."""
    return tuple(f.name for f in _options())


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options of parsed flags, as keywords for LLM or EngineConfig.create."""
    return {name: getattr(args, name) for name in option_names()}


def check_keywords(caller: str, given: Iterable[str], known: Collection[str], also_suggest: Iterable[str] = ()) -> None:
    """A misspelt option must not pass silently: name the close matches, or every option when none is close."""
    candidates = [*known, *also_suggest]
    for name in given:
        if name in known:
            continue
        close = difflib.get_close_matches(name, candidates, n=3)
        hint = f"did you mean {' or '.join(close)}?" if close else f"the options are: {', '.join(sorted(candidates))}"
        raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}; {hint}")
