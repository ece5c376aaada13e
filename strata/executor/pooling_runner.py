"""PoolingRunner: one rank's encoder (BERT) or converted decoder (Qwen3-Embedding) and pooling; token sequences in,
one vector per sequence out."""
from __future__ import annotations

import logging

import torch

from strata.config import EngineConfig, resolve_device
from strata.config.pooling_config import PoolingConfig, read_pooling_config, yes_no_reranker_tokens
from strata.distributed import ParallelContext
from strata.errors import UnsupportedModelError
from strata.executor.decoder_pooling import decoder_hidden_states, load_decoder
from strata.executor.decoder_scoring import DecoderScorer, yes_no_token_ids
from strata.layers.linear import pack_linear_weights
from strata.layers.pooler import normalize, pool
from strata.models.bert import PackedBatch
from strata.models.loader import checkpoint_weights
from strata.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class PoolingRunner:
    """Loads the model once; `embed` runs a batch of token sequences packed flat (no padding in the linears, so the
    last token of a sequence is its last real one)."""

    def __init__(self, config: EngineConfig, pc: ParallelContext | None = None) -> None:
        model_config = config.model
        if model_config.gguf_files:
            raise UnsupportedModelError("embedding models load from safetensors checkpoints; GGUF ones are not "
                                        "supported yet", param="model")
        if model_config.quant_config is not None:
            raise UnsupportedModelError("quantized embedding checkpoints are not supported", param="quantization")
        self.device = resolve_device(config.device)
        self.pc = pc or ParallelContext()
        self.dtype = model_config.dtype
        self.is_encoder = model_config.info.is_encoder
        self.scorer: DecoderScorer | None = None
        answers = yes_no_reranker_tokens(model_config.hf_config, model_config.architecture)
        if answers is not None:  # Qwen3-Reranker: one label, logit_yes - logit_no at the last token
            tokenizer = load_tokenizer(model_config.tokenizer_path, model_config.tokenizer_gguf_file)
            self.scorer = DecoderScorer(config, *yes_no_token_ids(tokenizer, *answers), self.pc)
            self.model, self.max_positions = self.scorer.model, model_config.max_model_len
            self.num_labels: int | None = 1
            self.pooling: PoolingConfig | None = None
            return
        if self.is_encoder:
            self.model = model_config.info.load_class()(model_config.text_config, self.pc, self.dtype)
            self.model.load_weights(checkpoint_weights(model_config))
            self.model.to(self.device)
            self.max_positions = self.model.max_positions
        else:  # a decoder converted (--convert embed): last-token pooling unless its sentence-transformers files say
            self.model = load_decoder(model_config, self.pc, self.device)
            self.max_positions = model_config.max_model_len
        if self.device.type == "cpu":
            pack_linear_weights(self.model)
        # A sequence classifier (cross-encoder) has its own head, and no sentence-transformers pooling to read.
        self.num_labels = getattr(self.model, "num_labels", None)
        if self.num_labels is not None:
            self.pooling = None
            logger.info("%s loaded: a classifier of %d labels", model_config.architecture, self.num_labels)
            return
        self.pooling = read_pooling_config(model_config.path, model_config.hf_config,
                                           "cls" if self.is_encoder else "last")
        logger.info("%s loaded: %s pooling%s", model_config.architecture, self.pooling.mode,
                    ", normalized" if self.pooling.normalize else "")

    @property
    def hidden_size(self) -> int:
        return self.model.args.hidden_size

    @torch.inference_mode()
    def embed(self, sequences: list[list[int]]) -> torch.Tensor:
        """[B, hidden] float32 embeddings on the CPU, pooled (and normalized) as the checkpoint says."""
        seq_lens = torch.tensor([len(s) for s in sequences], device=self.device)
        if self.is_encoder:
            hidden = self.model(PackedBatch.build(sequences, self.device))
        else:
            hidden = decoder_hidden_states(self.model, sequences, self.device)
        pooled = pool(hidden, seq_lens, self.pooling.mode)
        if self.pooling.normalize:
            pooled = normalize(pooled)
        return pooled.float().cpu()

    @torch.inference_mode()
    def classify(self, sequences: list[list[int]], token_types: list[list[int]] | None = None) -> torch.Tensor:
        """[B, num_labels] float32 logits on the CPU of a sequence classifier; `token_types` of pair inputs."""
        if self.scorer is not None:  # a decoder: no segment ids
            return self.scorer.logits(sequences)[:, None]
        batch = PackedBatch.build(sequences, self.device, token_types)
        return self.model.classify(self.model(batch), batch).float().cpu()
