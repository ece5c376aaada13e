"""The device, compute dtype and attention kernels an engine runs with, resolved from its options and the machine."""
from __future__ import annotations

import importlib.util
import logging
import os

import torch

from strata.config.engine_args import KERNELS
from strata.config.hf_config import HFConfig
from strata.errors import ConfigError

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


def parse_dtype(dtype: str | torch.dtype, checkpoint_dtype: str | None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return DTYPES.get(checkpoint_dtype or "float32", torch.float32)
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}", param="dtype")
    return DTYPES[dtype]


def cpu_has_native_bfloat16() -> bool:
    """Whether oneDNN computes bfloat16 natively here (AVX-512 BF16 / AMX); elsewhere bfloat16 GEMMs are
    emulated, about five times slower than float32."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("device='cuda' was asked for but no CUDA device is available", param="device")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ConfigError(f"device {device!r} must be auto, cpu or cuda", param="device")
    return torch.device(device)


def resolve_kernels(kernels: str, device: str) -> str:
    """"torch" or "triton" for the `kernels` option: auto takes Triton on CUDA. Triton on CPU runs only in
    its interpreter, which is slow and meant for testing, so it must be asked for explicitly."""
    if kernels not in KERNELS:
        raise ConfigError(f"kernels {kernels!r} must be one of {', '.join(KERNELS)}", param="kernels")
    on_cuda = resolve_device(device).type == "cuda"
    has_triton = importlib.util.find_spec("triton") is not None
    if kernels == "auto":
        if on_cuda and not has_triton:
            logger.warning("the triton package is missing: CUDA runs the slower plain-torch kernels")
        return "triton" if on_cuda and has_triton else "torch"
    if kernels == "triton" and not has_triton:
        raise ConfigError("kernels='triton' needs the triton package (pip install triton)", param="kernels")
    if kernels == "triton" and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("kernels='triton' on CPU runs only in Triton's interpreter: set TRITON_INTERPRET=1 in "
                          "the environment before starting (slow; for testing), or use kernels='torch'",
                          param="kernels")
    return kernels


def kernels_for_model(option: str, resolved: str, text: HFConfig) -> str:
    """The kernels a model runs on, given the resolved choice: today always that choice, as the Triton attention
    kernels follow every attention option a model sets (windows, attention chunks, logit soft-capping, sinks).
    The one place a model the Triton kernels would compute wrongly is to fall back (`auto`) or be refused."""
    del option, text  # no model needs a fallback today
    return resolved
