"""Frozen configuration of an engine (model, parallel layout, cache, scheduler) and all its validation."""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from strata.config import model_registry as registry
from strata.config.device import (
    DTYPES,
    cpu_has_native_bfloat16,
    kernels_for_model,
    parse_dtype,
    resolve_device,
    resolve_kernels,
)
from strata.config.engine_args import (
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    QUANTIZED_ACTIVATIONS,
    SSM_STATE_DTYPES,
    EngineArgs,
)
from strata.config.hf_config import HFConfig, apply_hf_overrides, read_config_json
from strata.config.layout_rules import check_nodes, check_pp
from strata.config.lora_config import LoRAConfig, lora_config
from strata.config.multimodal_config import MultiModalConfig, multimodal_config
from strata.config.pooling_config import check_pooling_options, resolve_runner
from strata.config.quant_config import GGUFQuantConfig, QuantConfig, parse_quant_config
from strata.config.speculative_config import SpeculativeConfig, check_target, parse_speculative_config
from strata.config.tp_rules import check_quant_tp, check_tp, check_vision_tp, num_routed_experts
from strata.errors import ConfigError
from strata.gguf.config import hf_config as gguf_hf_config
from strata.gguf.reader import GGUFModel
from strata.gguf.weights import blocked_types
from strata.model_source import ModelSource, resolve_model
from strata.reasoning import REASONING_PARSERS

logger = logging.getLogger(__name__)

def auto_compute_dtype(model: ModelConfig, dtype: str | torch.dtype, device: str) -> ModelConfig:
    """`dtype=auto` for a bfloat16 checkpoint on a CPU without native bfloat16 computes in float32 with its
    linear weights and embedding tables kept in bfloat16 (`weight_dtype`: the checkpoint's memory, half the bytes
    a decode step reads); an explicit `dtype=bfloat16` is kept."""
    if dtype != "auto" or model.dtype != torch.bfloat16 or resolve_device(device).type != "cpu" \
            or cpu_has_native_bfloat16():
        return model
    logger.info("this CPU has no native bfloat16 arithmetic (bfloat16 GEMMs would run about 5x slower than "
                "float32): dtype=auto computes the bfloat16 checkpoint in float32, its linear weights and embedding "
                "tables kept in bfloat16 (widened by the kernels); pass dtype=bfloat16 to compute in bfloat16, "
                "dtype=float32 to store float32 weights")
    return dataclasses.replace(model, dtype=torch.float32, weight_dtype=torch.bfloat16)


def resolve_source(args: EngineArgs) -> ModelSource:
    """Where `args.model`'s files are: a local path as it is, a Hub ID downloaded (only what strata reads) with
    --revision, --download-dir, --hf-token; --gguf-file and --tokenizer resolved alike."""
    return resolve_model(args.model, revision=args.revision, tokenizer=args.tokenizer,
                         tokenizer_revision=args.tokenizer_revision, download_dir=args.download_dir,
                         hf_token=args.hf_token, gguf_file=args.gguf_file)


@dataclass(frozen=True)
class ModelConfig:
    path: str
    hf_config: HFConfig
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    quantization: str | None = None  # experts_int8, or the checkpoint's quantization method
    quant_config: QuantConfig | GGUFQuantConfig | None = None  # how the checkpoint's linear layers are stored
    # Linear weights and embedding tables stored narrower than `dtype` (see auto_compute_dtype), or None.
    weight_dtype: torch.dtype | None = None
    # Where the files are (what the user named, GGUF files, an explicit tokenizer); `path` is its folder.
    source: ModelSource | None = None

    @property
    def tokenizer_path(self) -> str:
        """The folder the tokenizer loads from: --tokenizer's when given, else the checkpoint's."""
        return (self.source.tokenizer if self.source else None) or self.path

    @property
    def tokenizer_gguf_file(self) -> str | None:
        """The GGUF file whose metadata holds the tokenizer, unless --tokenizer names another."""
        return self.gguf_files[0] if self.gguf_files and not self.source.tokenizer else None

    @property
    def gguf_files(self) -> tuple[str, ...]:
        """Local GGUF files (all split parts, in order); () for a safetensors checkpoint."""
        return self.source.gguf_files if self.source else ()

    @property
    def text_config(self) -> HFConfig:
        """The language model's config: `text_config` of multimodal checkpoints, else the top level."""
        return self.hf_config.get("text_config") or self.hf_config

    @property
    def info(self) -> registry.ModelInfo:
        return registry.lookup(self.architecture)

    @property
    def text_info(self) -> registry.ModelInfo:
        return registry.text_model_info(self.architecture)

    @property
    def num_layers(self) -> int:
        return self.text_config.num_hidden_layers

    @property
    def vocab_size(self) -> int:
        return self.text_config.vocab_size

    @property
    def eos_token_ids(self) -> set[int]:
        eos = self.hf_config.get("eos_token_id", self.text_config.get("eos_token_id"))
        if eos is None:
            return set()
        return set(eos) if isinstance(eos, list) else {eos}

    @classmethod
    def from_path(cls, path: str | ModelSource, dtype: str | torch.dtype = "auto", max_model_len: int | None = None,
                  quantization: str | None = None, hf_overrides: dict[str, Any] | None = None) -> ModelConfig:
        """From a local checkpoint folder, or a resolved ModelSource (see strata.model_source.resolve_model);
        `hf_overrides` (vLLM's) are merged into its config before anything reads it."""
        source = path if isinstance(path, ModelSource) else ModelSource(str(path), str(path))
        folder = Path(source.folder)
        gguf_quant = None
        if source.gguf_files:  # the metadata is the config.json; the tensors' types, how layers store them
            hf, gguf_quant = _gguf_checkpoint(source.gguf_files, quantization)
        elif not (folder / "config.json").is_file():
            raise ConfigError(f"model {source.model!r} is not a folder with a config.json", param="model")
        else:
            hf = read_config_json(folder / "config.json")
        hf = apply_hf_overrides(hf, hf_overrides)
        architecture = registry.architecture_of(hf)
        text = hf.get("text_config") or hf
        checkpoint_dtype = hf.get("torch_dtype", hf.get("dtype", text.get("torch_dtype", text.get("dtype"))))
        derived_len = text.get("max_position_embeddings", 2048)
        if max_model_len is None:
            max_model_len = derived_len
        elif max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {max_model_len}", param="max_model_len")
        elif max_model_len > derived_len:
            logger.warning("max_model_len %d exceeds the model's max_position_embeddings %d",
                           max_model_len, derived_len)
        quant = gguf_quant or parse_quant_config(hf._values.get("quantization_config"), quantization)
        return cls(str(folder), hf, architecture, parse_dtype(dtype, checkpoint_dtype), max_model_len,
                   quant.method if quant else quantization, quant, source=source)


def _gguf_checkpoint(files: tuple[str, ...], quantization: str | None) -> tuple[HFConfig, GGUFQuantConfig]:
    """A GGUF model's config.json (from its metadata) and which of its tensors stay in ggml blocks."""
    if quantization not in (None, "gguf"):
        raise ConfigError(f"quantization={quantization!r} was asked for, but {files[0]} is a GGUF file (its tensors "
                          "keep their own ggml types); leave quantization unset", param="quantization")
    gguf = GGUFModel(files)
    return HFConfig(gguf_hf_config(gguf)), GGUFQuantConfig(blocked_types(gguf))


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pp_layer_partition: tuple[int, ...] | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes per rank; None = a safe share of free memory
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    mamba_ssm_cache_dtype: str = "float32"  # auto (= the model dtype) | float32 | bfloat16 | float16
    kv_cache_dtype: str = "auto"  # auto (= the model dtype) | bfloat16

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype if self.kv_cache_dtype == "auto" else DTYPES[self.kv_cache_dtype]

    def ssm_state_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype if self.mamba_ssm_cache_dtype == "auto" else DTYPES[self.mamba_ssm_cache_dtype]


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Grammar-constrained decoding: how long a grammar may compile, the whitespace JSON may use, and the
    reasoning parser whose end of thinking a grammar waits for (None: grammars constrain from the first token)."""

    timeout_s: float = 10.0
    max_whitespace: int = 2  # whitespace characters allowed between JSON tokens; -1: any
    reasoning_parser: str | None = None


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "auto"
    seed: int = 0
    served_model_names: tuple[str, ...] = ()
    chat_template: str | None = None
    kernels: str = "torch"  # resolved: "torch" or "triton"
    structured: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative: SpeculativeConfig | None = None  # speculative decoding, when asked for
    runner: str = "generate"  # "generate", or "pooling" (embeddings; strata.engine.pooling_engine)
    lora: LoRAConfig | None = None  # LoRA adapters served beside the base model (None: off, no LoRA weights)
    multimodal: MultiModalConfig = field(default_factory=MultiModalConfig)  # image limits and cache
    convert: str = "none"  # the pooling runner's decoder: "embed" or "classify" (resolve_runner); else "none"

    @classmethod
    def create(cls, model: str, *, served_model_name: str | list[str] | None = None,
               chat_template: str | None = None, **options: Any) -> EngineConfig:
        """From keywords named like EngineArgs' fields; an unknown one is refused naming the close matches."""
        args = EngineArgs.from_kwargs(model, options, "EngineConfig.create", ("served_model_name", "chat_template"))
        return cls.from_args(args, served_model_name=served_model_name, chat_template=chat_template)

    @classmethod
    def from_args(cls, args: EngineArgs, *, served_model_name: str | list[str] | None = None,
                  chat_template: str | None = None) -> EngineConfig:
        """The engine's configuration, every option checked: an impossible one is refused before any process
        starts. `served_model_name` (default: the model path) and `chat_template` are the front end's."""
        _check_options(args)  # before a download, which may take long
        model_config = ModelConfig.from_path(resolve_source(args), args.dtype, args.max_model_len, args.quantization,
                                             args.hf_overrides)
        model_config = auto_compute_dtype(model_config, args.dtype, args.device)
        model_config = with_quantized_activations(model_config, args.quantized_activations)
        parallel = ParallelConfig(args.tensor_parallel_size, args.pipeline_parallel_size, args.pp_layer_partition,
                                  args.nnodes, args.node_rank, args.master_addr, args.master_port)
        if args.quantization == "experts_int8" and num_routed_experts(model_config.text_config) == 0:
            raise ConfigError(f"quantization='experts_int8' quantizes the routed experts of MoE layers, but "
                              f"{model_config.architecture} has no MoE layers; run it without --quantization",
                              param="quantization")
        hybrid = model_config.text_info.is_hybrid
        enable_prefix_caching = args.enable_prefix_caching
        if enable_prefix_caching is None:
            enable_prefix_caching = not hybrid
        if hybrid:
            logger.info("prefix caching is off for hybrid models (their recurrent state is not snapshotted)")
            enable_prefix_caching = False
        cache = CacheConfig(args.block_size, args.kv_cache_memory, args.gpu_memory_utilization,
                            enable_prefix_caching, args.mamba_ssm_cache_dtype, args.kv_cache_dtype)
        max_num_batched_tokens = args.max_num_batched_tokens or max(2048, args.max_num_seqs)
        scheduler = SchedulerConfig(args.max_num_seqs, max_num_batched_tokens, model_config.max_model_len)
        if model_config.architecture == "Gemma3ForConditionalGeneration":  # an image's tokens go in one chunk
            image_tokens = model_config.hf_config.get("mm_tokens_per_image", 256)
            if max_num_batched_tokens < image_tokens:
                raise ConfigError(f"max_num_batched_tokens={max_num_batched_tokens} is below the {image_tokens} "
                                  "tokens of one Gemma 3 image, which are prefilled together (they attend to each "
                                  "other)", param="max_num_batched_tokens")
        if isinstance(served_model_name, str):
            served_model_name = [served_model_name]
        names = tuple(served_model_name or [args.model])
        structured = StructuredOutputsConfig(args.structured_outputs_timeout, args.structured_outputs_max_whitespace,
                                             args.reasoning_parser)
        speculative = parse_speculative_config(args.speculative_config)
        if speculative is not None:
            check_target(speculative, _architecture_name(model_config), hybrid, model_config.max_model_len)
        runner, convert = resolve_runner(args.runner, args.convert, model_config.architecture,
                                         model_config.info.pooling_only, model_config.info.is_encoder)
        config = cls(model_config, parallel, cache, scheduler, args.device, args.seed, names, chat_template,
                     kernels_for_model(args.kernels, resolve_kernels(args.kernels, args.device),
                                       model_config.text_config), structured, speculative, runner,
                     lora_config(bool(args.enable_lora), args.max_loras, args.max_lora_rank, args.max_cpu_loras),
                     multimodal_config(args.limit_mm_per_prompt, args.mm_processor_cache_gb, args.max_image_pixels,
                                       model_config.info.is_multimodal), convert)
        check_pooling_options(runner, config.lora is not None, parallel.pipeline_parallel_size)
        validate_parallel(config)
        return config


def with_quantized_activations(model: ModelConfig, activations: str) -> ModelConfig:
    """The model with its GGUF products' activations chosen (logged); int8 is refused for a checkpoint whose
    linear layers are not GGUF blocks (the GGUF types without int8 kernels are refused as their layers load)."""
    if activations not in QUANTIZED_ACTIVATIONS:
        raise ConfigError(f"quantized_activations {activations!r} is not one of {', '.join(QUANTIZED_ACTIVATIONS)}",
                          param="quantized_activations")
    quant = model.quant_config
    if not isinstance(quant, GGUFQuantConfig):
        if activations == "int8":
            raise ConfigError("quantized_activations='int8' applies to the products of GGUF block weights (Q4_0, "
                              "Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K); this checkpoint has none: use "
                              "quantized_activations='float'", param="quantized_activations")
        return model
    logger.info("GGUF products: %s", "int8 activations (x rounded to Q8_0 / Q8_K blocks as llama.cpp rounds it, "
                "integer dot products, every batch size)" if activations == "int8" else "float activations (exact)")
    return dataclasses.replace(model, quant_config=dataclasses.replace(quant, activations=activations))


def _check_options(args: EngineArgs) -> None:
    """The options whose valid values do not depend on the model."""
    if args.max_num_seqs < 1:
        raise ConfigError(f"max_num_seqs must be >= 1, got {args.max_num_seqs}", param="max_num_seqs")
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < 1:
        raise ConfigError(f"max_num_batched_tokens must be >= 1, got {args.max_num_batched_tokens}",
                          param="max_num_batched_tokens")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {args.gpu_memory_utilization}",
                          param="gpu_memory_utilization")
    if args.structured_outputs_timeout <= 0:
        raise ConfigError(f"structured_outputs_timeout must be > 0 seconds, got {args.structured_outputs_timeout}",
                          param="structured_outputs_timeout")
    if args.structured_outputs_max_whitespace < -1:
        raise ConfigError("structured_outputs_max_whitespace must be -1 (any) or >= 0, got "
                          f"{args.structured_outputs_max_whitespace}", param="structured_outputs_max_whitespace")
    if args.reasoning_parser not in (None, *REASONING_PARSERS):
        raise ConfigError(f"reasoning_parser {args.reasoning_parser!r} is not one of {', '.join(REASONING_PARSERS)}",
                          param="reasoning_parser")
    if args.kv_cache_memory is not None and args.kv_cache_memory <= 0:
        raise ConfigError(f"kv_cache_memory must be a positive number of bytes, got {args.kv_cache_memory}",
                          param="kv_cache_memory")
    if args.quantization not in (None, *QUANTIZATIONS):
        raise ConfigError(f"quantization {args.quantization!r} is not supported (supported: "
                          f"{', '.join(QUANTIZATIONS)})", param="quantization")
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype {args.kv_cache_dtype!r} is not supported (supported: "
                          f"{', '.join(KV_CACHE_DTYPES)}; fp8 caches are not)", param="kv_cache_dtype")
    if args.kv_cache_dtype != "auto" and resolve_device(args.device).type != "cpu":
        raise ConfigError(f"kv_cache_dtype={args.kv_cache_dtype!r} is supported on CPU only (the GPU kernels read "
                          "a cache of the model's dtype); use kv_cache_dtype='auto'", param="kv_cache_dtype")
    if args.mamba_ssm_cache_dtype not in SSM_STATE_DTYPES:
        raise ConfigError(f"mamba_ssm_cache_dtype {args.mamba_ssm_cache_dtype!r} is not one of auto, float32, "
                          "bfloat16, float16", param="mamba_ssm_cache_dtype")


def validate_parallel(config: EngineConfig) -> None:
    """Refuse layouts that cannot work, naming the field, its value and the sizes that would."""
    par, text = config.parallel, config.model.text_config
    tp, pp = par.tensor_parallel_size, par.pipeline_parallel_size
    for name, value in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}", param=name)
    info = config.model.text_info
    arch = _architecture_name(config.model)
    if tp > 1 and not info.supports_tp:
        raise ConfigError(f"{arch} does not support tensor parallelism (tensor_parallel_size={tp}); "
                          "use tensor_parallel_size=1", param="tensor_parallel_size")
    if pp > 1 and not info.supports_pp:
        raise ConfigError(f"{arch} does not support pipeline parallelism (pipeline_parallel_size={pp}); "
                          "use pipeline_parallel_size=1", param="pipeline_parallel_size")
    if tp > 1:
        check_tp(tp, text)
        check_vision_tp(tp, config.model.hf_config.get("vision_config"))
        check_quant_tp(tp, config.model.quant_config, text)
    check_pp(pp, par.pp_layer_partition, text.num_hidden_layers)
    check_nodes(par.nnodes, par.node_rank, par.world_size, par.master_port)
    _check_devices(config, tp * pp)


def _architecture_name(model: ModelConfig) -> str:
    """The architecture whose capabilities count, naming the language model of multimodal checkpoints."""
    text_arch = model.info.text_architecture
    return f"{text_arch} (the language model of {model.architecture})" if text_arch else str(model.architecture)


def _check_devices(config: EngineConfig, world_size: int) -> None:
    if resolve_device(config.device).type != "cuda":
        return
    local = world_size // config.parallel.nnodes
    available = torch.cuda.device_count()
    if local > available:
        raise ConfigError(f"tensor_parallel_size x pipeline_parallel_size = {world_size} workers need {local} "
                          f"GPUs on each of {config.parallel.nnodes} node(s) but {available} are visible; "
                          f"use at most {available * config.parallel.nnodes} workers",
                          param="tensor_parallel_size")


def default_cpu_kv_cache_bytes(num_local_ranks: int) -> int:
    """A safe share of the machine's free memory for the KV cache of one rank."""
    try:
        pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        pages = 8 << 30
    return int(min(pages * 0.25, 4 << 30) // max(1, num_local_ranks))
