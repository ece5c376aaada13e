"""A decoder checkpoint that judges a prompt by its next token (Qwen3-Reranker): score = sigmoid(logit_yes - logit_no)
at each prompt's last position, as vLLM scores it (the softmax of the two logits, read at "yes")."""
from __future__ import annotations

import logging
from typing import Any

import torch

from strata.config import EngineConfig, resolve_device
from strata.distributed import ParallelContext
from strata.errors import ConfigError, UnsupportedModelError
from strata.executor.decoder_pooling import decoder_hidden_states, load_decoder
from strata.layers.linear import pack_linear_weights

logger = logging.getLogger(__name__)


def yes_no_token_ids(tokenizer: Any, yes: str = "yes", no: str = "no") -> tuple[int, int]:
    """The ids of the two tokens a reranker answers with (vLLM's `classifier_from_token`: ["no", "yes"]), each
    required to be one token of the vocabulary."""
    ids = []
    for token in (yes, no):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ConfigError(f"the reranker's answer token {token!r} is not a token of this tokenizer",
                              param="model")
        ids.append(int(token_id))
    return ids[0], ids[1]


class DecoderScorer:
    """Loads a causal LM with its LM head; `score` runs whole prompts (each a query and document already formatted
    and tokenized as one sequence) packed flat and returns one relevance score in (0, 1) per prompt."""

    def __init__(self, config: EngineConfig, yes_id: int, no_id: int, pc: ParallelContext | None = None,
                 device: torch.device | None = None) -> None:
        model_config = config.model
        if model_config.gguf_files or model_config.quant_config is not None or model_config.info.is_encoder:
            raise UnsupportedModelError("a yes/no reranker is an unquantized decoder checkpoint in safetensors "
                                        f"(Qwen3-Reranker); {model_config.architecture} is not", param="model")
        for name, token_id in (("yes", yes_id), ("no", no_id)):
            if not 0 <= token_id < model_config.vocab_size:
                raise ConfigError(f"the {name} token id {token_id} is outside the vocabulary "
                                  f"[0, {model_config.vocab_size})", param="model")
        self.device = device or resolve_device(config.device)
        self.model = load_decoder(model_config, pc or ParallelContext(), self.device, keep_lm_head=True)
        if self.device.type == "cpu":
            pack_linear_weights(self.model)
        self.token_ids = torch.tensor([yes_id, no_id], device=self.device)
        logger.info("%s loaded as a yes/no reranker (tokens %d, %d)", model_config.architecture, yes_id, no_id)

    @torch.inference_mode()
    def logits(self, sequences: list[list[int]]) -> torch.Tensor:
        """[B] float32 logit_yes - logit_no on the CPU (the one-label classifier vLLM builds from the two rows of the
        LM head): the LM head over each sequence's last hidden state alone, two logits kept."""
        hidden = decoder_hidden_states(self.model, sequences, self.device)
        last = torch.tensor([len(s) for s in sequences], device=self.device).cumsum(0) - 1
        logits = self.model.compute_logits(hidden[last])[:, self.token_ids].float()
        return (logits[:, 0] - logits[:, 1]).cpu()

    def score(self, sequences: list[list[int]]) -> torch.Tensor:
        """[B] float32 scores in (0, 1) on the CPU: sigmoid(logit_yes - logit_no)."""
        return torch.sigmoid(self.logits(sequences))
