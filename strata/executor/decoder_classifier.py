"""A decoder served as a sequence classifier (vLLM's `--convert classify`; `*ForSequenceClassification` checkpoints as
transformers saves them): its final hidden state at each prompt's last token through the `score` head."""
from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

from strata.config import EngineConfig
from strata.config.pooling_config import RERANKER_OVERRIDES
from strata.distributed import ParallelContext
from strata.errors import UnsupportedModelError
from strata.executor.decoder_pooling import decoder_hidden_states, load_decoder
from strata.models.bert import num_labels
from strata.models.loader import checkpoint_weights

logger = logging.getLogger(__name__)

HEAD = "score."  # transformers' name of a decoder classifier's head (LlamaForSequenceClassification, Qwen3's, ...)


def _without_head(weights: Iterable[tuple[str, torch.Tensor]], head: dict[str, torch.Tensor]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """The decoder's weights; the head's are put aside in `head` (the decoder has no module of that name)."""
    for name, tensor in weights:
        if name.startswith(HEAD):
            head[name.removeprefix(HEAD)] = tensor
        else:
            yield name, tensor


class DecoderClassifier:
    """Loads the decoder without its LM head, and the `score` head (replicated on every rank: it is hidden x labels);
    `logits` runs whole prompts packed flat and returns [B, num_labels] logits."""

    def __init__(self, config: EngineConfig, pc: ParallelContext, device: torch.device) -> None:
        model_config = config.model
        hf = model_config.text_config
        head: dict[str, torch.Tensor] = {}
        weights = _without_head(checkpoint_weights(model_config), head)
        self.model = load_decoder(model_config, pc, device, weights=weights)
        self.num_labels = num_labels(model_config.hf_config)
        hidden = hf.hidden_size
        if "weight" not in head:
            raise UnsupportedModelError(
                f"{model_config.architecture} as a classifier (--convert classify) reads the checkpoint's "
                f"classification head `score.weight` ([num_labels, {hidden}], as transformers saves "
                f"*ForSequenceClassification), and this checkpoint has none. For Qwen3-Reranker (a Qwen3ForCausalLM "
                f"checkpoint judged by its yes/no logits) pass {RERANKER_OVERRIDES}", param="model")
        unknown = sorted(set(head) - {"weight", "bias"})
        if unknown or head["weight"].shape != (self.num_labels, hidden):
            raise UnsupportedModelError(
                f"the classification head has {dict((k, tuple(v.shape)) for k, v in head.items())}; expected "
                f"score.weight of [{self.num_labels}, {hidden}] (num_labels from id2label, hidden_size)",
                param="model")
        # float32 on the pooled rows only: a head this small costs nothing, and the logits keep their precision.
        self.weight = head["weight"].to(device, torch.float32)
        self.bias = head["bias"].to(device, torch.float32) if "bias" in head else None
        logger.info("%s loaded as a classifier of %d labels (last-token pooling)", model_config.architecture,
                    self.num_labels)

    @torch.inference_mode()
    def logits(self, sequences: list[list[int]]) -> torch.Tensor:
        """[B, num_labels] float32 logits on the CPU: the head over each sequence's last hidden state."""
        device = self.weight.device
        hidden = decoder_hidden_states(self.model, sequences, device)
        last = torch.tensor([len(s) for s in sequences], device=device).cumsum(0) - 1
        return F.linear(hidden[last].float(), self.weight, self.bias).cpu()
