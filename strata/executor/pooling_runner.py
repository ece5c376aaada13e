"""PoolingRunner: one rank's encoder (BERT) or converted decoder (Qwen3-Embedding) and pooling; token sequences in,
one vector per sequence out."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from strata.config import EngineConfig, resolve_device
from strata.config.pooling_config import PoolingConfig, read_pooling_config, yes_no_reranker_tokens
from strata.distributed import ParallelContext
from strata.errors import UnsupportedModelError
from strata.executor.decoder_classifier import DecoderClassifier
from strata.executor.decoder_pooling import decoder_hidden_states, load_decoder
from strata.executor.decoder_scoring import DecoderScorer, yes_no_token_ids
from strata.executor.step import PoolingStep
from strata.layers.linear import pack_linear_weights
from strata.layers.pooler import normalize, pool
from strata.models.bert import PackedBatch
from strata.models.loader import checkpoint_weights
from strata.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolingInfo:
    """What the engine reads of a loaded pooling model (a rank reports it to the multiprocess driver)."""

    num_labels: int | None  # a classifier's outputs; None for an embedding model
    pooling: PoolingConfig | None  # an embedding model's pooling
    hidden_size: int
    max_positions: int


class PoolingRunner:
    """Loads the model once; `embed` runs a batch of token sequences packed flat (no padding in the linears, so the
    last token of a sequence is its last real one)."""

    def __init__(self, config: EngineConfig, pc: ParallelContext | None = None,
                 device: torch.device | None = None) -> None:
        model_config = config.model
        if model_config.gguf_files:
            raise UnsupportedModelError("embedding models load from safetensors checkpoints; GGUF ones are not "
                                        "supported yet", param="model")
        if model_config.quant_config is not None:
            raise UnsupportedModelError("quantized embedding checkpoints are not supported", param="quantization")
        self.device = device or resolve_device(config.device)
        self.pc = pc or ParallelContext()
        self.dtype = model_config.dtype
        self.is_encoder = model_config.info.is_encoder
        self.scorer: DecoderScorer | None = None
        self.classifier: DecoderClassifier | None = None
        answers = yes_no_reranker_tokens(model_config.hf_config, model_config.architecture)
        if answers is not None:  # Qwen3-Reranker: one label, logit_yes - logit_no at the last token
            tokenizer = load_tokenizer(model_config.tokenizer_path, model_config.tokenizer_gguf_file)
            self.scorer = DecoderScorer(config, *yes_no_token_ids(tokenizer, *answers), self.pc, self.device)
            self.model, self.max_positions = self.scorer.model, model_config.max_model_len
            self.num_labels: int | None = 1
            self.pooling: PoolingConfig | None = None
            return
        self.model, self.max_positions = self._load(config)
        if self.device.type == "cpu":
            pack_linear_weights(self.model)
        # A sequence classifier (cross-encoder) has its own head, and no sentence-transformers pooling to read.
        self.num_labels = self.classifier.num_labels if self.classifier else getattr(self.model, "num_labels", None)
        if self.num_labels is not None:
            self.pooling = None
            logger.info("%s loaded: a classifier of %d labels", model_config.architecture, self.num_labels)
            return
        self.pooling = read_pooling_config(model_config.path, model_config.hf_config,
                                           "cls" if self.is_encoder else "last")
        logger.info("%s loaded: %s pooling%s", model_config.architecture, self.pooling.mode,
                    ", normalized" if self.pooling.normalize else "")

    def _load(self, config: EngineConfig) -> tuple[torch.nn.Module, int]:
        """The model and its longest input: an encoder, or a decoder converted (--convert embed: last-token pooling
        unless its sentence-transformers files say otherwise; --convert classify: its `score` head)."""
        model_config = config.model
        if self.is_encoder:
            model = model_config.info.load_class()(model_config.text_config, self.pc, self.dtype)
            model.load_weights(checkpoint_weights(model_config))
            return model.to(self.device), model.max_positions
        if config.convert == "classify":
            self.classifier = DecoderClassifier(config, self.pc, self.device)
            return self.classifier.model, model_config.max_model_len
        return load_decoder(model_config, self.pc, self.device), model_config.max_model_len

    @property
    def hidden_size(self) -> int:
        return self.model.args.hidden_size

    @property
    def info(self) -> PoolingInfo:
        return PoolingInfo(self.num_labels, self.pooling, self.hidden_size, self.max_positions)

    def run(self, step: PoolingStep) -> torch.Tensor:
        """One batch of the multiprocess executor: every rank runs it (the layers' collectives pair up)."""
        if step.task == "embed":
            return self.embed(step.sequences)
        return self.classify(step.sequences, step.token_types)

    def check_health(self) -> None:
        """Nothing runs in other processes."""

    def shutdown(self) -> None:
        """Nothing runs in other processes."""

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
        if self.classifier is not None:
            return self.classifier.logits(sequences)
        batch = PackedBatch.build(sequences, self.device, token_types)
        return self.model.classify(self.model(batch), batch).float().cpu()
