"""PoolingRunner: one rank's encoder (BERT) and pooling; token sequences in, one vector per sequence out."""
from __future__ import annotations

import logging

import torch

from strata.config import EngineConfig, resolve_device
from strata.config.pooling_config import PoolingConfig, read_pooling_config
from strata.distributed import ParallelContext
from strata.errors import UnsupportedModelError
from strata.layers.linear import pack_linear_weights
from strata.layers.pooler import normalize, pool
from strata.models.bert import PackedBatch
from strata.models.loader import checkpoint_weights

logger = logging.getLogger(__name__)


class PoolingRunner:
    """Loads the encoder once; `embed` runs a batch of token sequences packed flat (no padding in the linears)."""

    def __init__(self, config: EngineConfig, pc: ParallelContext | None = None) -> None:
        model_config = config.model
        if model_config.gguf_files:
            raise UnsupportedModelError("encoder models load from safetensors checkpoints; GGUF encoders are not "
                                        "supported yet", param="model")
        if model_config.quant_config is not None:
            raise UnsupportedModelError("quantized encoder checkpoints are not supported", param="quantization")
        self.device = resolve_device(config.device)
        self.pc = pc or ParallelContext()
        self.dtype = model_config.dtype
        self.model = model_config.info.load_class()(model_config.text_config, self.pc, self.dtype)
        self.model.load_weights(checkpoint_weights(model_config))
        self.model.to(self.device)
        if self.device.type == "cpu":
            pack_linear_weights(self.model)
        self.pooling: PoolingConfig = read_pooling_config(model_config.path, model_config.hf_config)
        logger.info("%s loaded: %s pooling%s", model_config.architecture, self.pooling.mode,
                    ", normalized" if self.pooling.normalize else "")

    @property
    def hidden_size(self) -> int:
        return self.model.hidden_size

    @torch.inference_mode()
    def embed(self, sequences: list[list[int]]) -> torch.Tensor:
        """[B, hidden] float32 embeddings on the CPU, pooled (and normalized) as the checkpoint says."""
        batch = PackedBatch.build(sequences, self.device)
        pooled = pool(self.model(batch), batch.seq_lens, self.pooling.mode)
        if self.pooling.normalize:
            pooled = normalize(pooled)
        return pooled.float().cpu()
