"""A generative checkpoint run as an embedding model (vLLM's `--convert embed`: Qwen3-Embedding and any other decoder):
the model class's own layers over whole prompts, causal attention with no KV cache bound, final hidden states out."""
from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from strata.config import ModelConfig
from strata.distributed import ParallelContext
from strata.errors import UnsupportedModelError
from strata.layers.attention import Attention, AttentionMetadata, PrefillChunk
from strata.layers.forward_meta import ForwardMeta
from strata.layers.stored_dtype import store_weights_as
from strata.models.base import CausalLM, PPMissingLayer
from strata.models.loader import checkpoint_weights

logger = logging.getLogger(__name__)


def load_decoder(model_config: ModelConfig, pc: ParallelContext, device: torch.device, keep_lm_head: bool = False,
                 weights: Iterable[tuple[str, torch.Tensor]] | None = None) -> CausalLM:
    """The checkpoint's causal LM, without its LM head unless `keep_lm_head` (embeddings read the final hidden
    states; a yes/no reranker reads two logits), loaded from a `*ForCausalLM` checkpoint or from a bare `*Model` one
    (Qwen3-Embedding's tensors lack the `model.` prefix); `weights`: the checkpoint's, less those another head
    takes (default: all of them)."""
    info = model_config.text_info
    if info.is_hybrid or model_config.info.is_multimodal:
        raise UnsupportedModelError(f"{model_config.architecture} cannot be served as an embedding model: converting "
                                    "(--convert embed) takes attention-only text decoders", param="convert")
    with torch.device(device):
        model = model_config.info.load_class()(model_config, pc)
    if not isinstance(model, CausalLM):
        raise UnsupportedModelError(f"{model_config.architecture} cannot be converted to an embedding model",
                                    param="convert")
    if not keep_lm_head:
        model.lm_head = PPMissingLayer()  # replaces the registered head: nothing to load or keep
        model.missing_prefixes.append("lm_head")
    weights = checkpoint_weights(model_config) if weights is None else weights
    model.load_weights(_under_model_names(model, weights))
    model.eval()
    if model_config.weight_dtype is not None:
        store_weights_as(model, model_config.weight_dtype)
    for layer in model.modules():
        if isinstance(layer, Attention):
            layer.k_cache = layer.v_cache = None  # attention reads each prompt's own keys (Attention._forward_uncached)
    return model


def _under_model_names(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint names, those of a bare decoder (`layers.0...`, saved from `*Model`) put under the causal LM's
    decoder module (`model.layers.0...`)."""
    tops = {name for name, _ in model.named_children()}
    base = model.names.layers.split(".")[0]
    for name, tensor in weights:
        if name.startswith("score."):  # a *ForSequenceClassification head, which this conversion has no use for
            raise UnsupportedModelError(f"the checkpoint has a classification head ({name}): serve it as a "
                                        "classifier with --convert classify (/classify, LLM.classify)",
                                        param="convert")
        yield (name if name.split(".")[0] in tops else f"{base}.{name}"), tensor


def decoder_hidden_states(model: CausalLM, sequences: list[list[int]], device: torch.device) -> torch.Tensor:
    """[T, hidden] final hidden states of the sequences packed back to back, each attending causally to itself."""
    lens = [len(s) for s in sequences]
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    starts = [0, *itertools.accumulate(lens)]
    empty = torch.zeros(0, dtype=torch.long, device=device)
    attn = AttentionMetadata(slot_mapping=empty, num_decodes=0, decode_block_tables=empty.view(0, 0),
                             decode_seq_lens=empty, block_size=1,
                             prefills=[PrefillChunk(starts[i], starts[i + 1], 0, None) for i in range(len(lens))])
    return model(ids, positions, ForwardMeta(attn))
