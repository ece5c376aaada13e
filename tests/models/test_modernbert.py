"""ModernBertModel embeddings against sentence-transformers on random-weight checkpoints (float32): mixed lengths,
most longer than the local attention window, mean and CLS pooling, with and without biases, and config.json in
transformers 5's keys and in the older ones of the Hub's checkpoints."""
from __future__ import annotations

import pytest
import torch
from modernbert_checkpoints import write_modernbert_checkpoint

from strata import LLM

# From 3 to ~60 tokens: the window is 8 tokens (4 on either side), so all but the shortest attend locally in
# part in the two local layers.
TEXTS = ["The quick brown fox jumps over the lazy dog.", "import os",
         "Once upon a time there was a small model that served tokens very quickly. " * 4, "def add(a, b):",
         "Paged attention stores keys and values in fixed size blocks, and the quick brown fox jumps."]

CHECKPOINTS = {"mean_normalized": dict(pooling="mean", normalize=True),
               "cls_biases": dict(pooling="cls", normalize=False, biases=True, seed=1),
               "old_config_keys": dict(pooling="mean", normalize=True, old_config_keys=True, seed=2)}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    return write_modernbert_checkpoint(tmp_path_factory.mktemp("modernbert") / request.param,
                                       **CHECKPOINTS[request.param])


def test_embed_matches_sentence_transformers_beyond_the_local_window(checkpoint):
    from sentence_transformers import SentenceTransformer

    oracle = SentenceTransformer(str(checkpoint), device="cpu")
    expected = oracle.encode(TEXTS, convert_to_tensor=True, batch_size=2)
    with LLM(str(checkpoint), max_num_batched_tokens=128, max_num_seqs=2) as llm:  # several packed batches
        outs = llm.embed(TEXTS)
    assert max(len(o.prompt_token_ids) for o in outs) > 40 and min(len(o.prompt_token_ids) for o in outs) < 8
    got = torch.tensor([o.outputs.embedding for o in outs])
    cos = torch.nn.functional.cosine_similarity(got, expected)
    assert (1 - cos).abs().max() < 1e-5, cos
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("change", "words"), [
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}}, "scaled RoPE"),
    ({"layer_types": ["full_attention", "chunked_attention"]}, "layer_types"),
    ({"hidden_activation": "quick_gelu"}, "hidden_activation"),
])
def test_unsupported_modernbert_configs_are_refused(change, words):
    from strata.config.hf_config import HFConfig
    from strata.errors import UnsupportedModelError
    from strata.models.modernbert import ModernBertArgs

    base = {"vocab_size": 10, "hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 8,
            "num_hidden_layers": 2}
    with pytest.raises(UnsupportedModelError, match=words):
        ModernBertArgs.from_hf(HFConfig({**base, **change}))


def _tp_rank_main(rank: int, port: int, folder: str, sequences: list, out: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    from processes import leave_process_group

    from strata.config.hf_config import read_config_json
    from strata.executor.parallel import init_distributed
    from strata.layers.pooler import pool
    from strata.models.bert import PackedBatch
    from strata.models.loader import iterate_weights
    from strata.models.modernbert import ModernBertModel

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    pc = init_distributed(rank, 2, 2, store, "gloo", timedelta(seconds=60))
    model = ModernBertModel(read_config_json(f"{folder}/config.json"), pc)
    model.load_weights(iterate_weights(folder))
    batch = PackedBatch.build(sequences)
    with torch.inference_mode():
        pooled = pool(model(batch), batch.seq_lens, "mean")
    if rank == 0:
        torch.save(pooled, out)
    leave_process_group()


@pytest.mark.slow
def test_tp2_modernbert_shards_heads_and_geglu_as_sentence_transformers_sees_them(tmp_path):
    from processes import spawn_ranks
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    folder = write_modernbert_checkpoint(tmp_path / "tp", biases=True, seed=3)
    sequences = [AutoTokenizer.from_pretrained(folder)(t).input_ids for t in TEXTS]
    out = tmp_path / "tp2.pt"
    spawn_ranks(_tp_rank_main, 2, lambda port: (port, str(folder), sequences, str(out)))
    got = torch.nn.functional.normalize(torch.load(out), dim=-1)
    expected = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_tensor=True)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
