"""BertModel embeddings against sentence-transformers on random-weight checkpoints (float32, mixed lengths)."""
from __future__ import annotations

import pytest
import torch
from bert_checkpoints import write_bert_checkpoint

from strata import LLM
from strata.errors import ConfigError, RequestError

TEXTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):", "Paged attention",
         "Once upon a time there was a small model that served tokens very quickly. " * 3, "import os"]


@pytest.fixture(scope="module")
def mean_normalized(tmp_path_factory):
    return write_bert_checkpoint(tmp_path_factory.mktemp("bert") / "mean", pooling="mean", normalize=True)


@pytest.fixture(scope="module")
def cls_plain(tmp_path_factory):
    return write_bert_checkpoint(tmp_path_factory.mktemp("bert") / "cls", pooling="cls", normalize=False, seed=1)


def _oracle(folder, texts) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_tensor=True, batch_size=2)


@pytest.mark.parametrize("checkpoint", ["mean_normalized", "cls_plain"])
def test_embed_matches_sentence_transformers_for_mixed_lengths(checkpoint, request):
    folder = request.getfixturevalue(checkpoint)
    expected = _oracle(folder, TEXTS)
    with LLM(str(folder), max_num_batched_tokens=64, max_num_seqs=2) as llm:  # several batches
        outs = llm.embed(TEXTS)
    got = torch.tensor([o.outputs.embedding for o in outs])
    assert got.shape == expected.shape
    cos = torch.nn.functional.cosine_similarity(got, expected)
    assert (1 - cos).abs().max() < 1e-5, cos
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)  # norms too (CLS is not normalized)
    if checkpoint == "cls_plain":
        assert not torch.allclose(got.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-3)


def test_embed_through_the_cpu_encoder_attention_kernel_matches_sentence_transformers(tmp_path):
    """Heads of 32 dimensions, which the C kernel takes (the tiny checkpoints' 16 go to SDPA); a text over 128
    tokens spans several key blocks, short ones share its batch."""
    from strata.kernels.cpu import attention as cpu_attention

    folder = write_bert_checkpoint(tmp_path / "wide", pooling="mean", normalize=False, heads=2, max_positions=256)
    head = torch.zeros(1, 2, 32)
    assert cpu_attention.prefill_library() is None or cpu_attention.prefill_serves(head, head, head)
    texts = [*TEXTS, "Once upon a time there was a small model that served tokens very quickly. " * 9]
    expected = _oracle(folder, texts)
    with LLM(str(folder)) as llm:
        got = torch.tensor([o.outputs.embedding for o in llm.embed(texts)])
    assert len(llm.get_tokenizer()(texts[-1]).input_ids) > 128
    cos = torch.nn.functional.cosine_similarity(got, expected)
    assert (1 - cos).abs().max() < 1e-5, cos
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_embed_token_ids_equal_embed_text(mean_normalized):
    with LLM(str(mean_normalized)) as llm:
        ids = llm.get_tokenizer()(TEXTS[0]).input_ids
        by_text, by_ids = llm.embed([TEXTS[0], ids])
    assert by_ids.prompt_token_ids == ids
    torch.testing.assert_close(torch.tensor(by_ids.outputs.embedding), torch.tensor(by_text.outputs.embedding))


def test_long_input_is_refused_unless_truncated_like_sentence_transformers(mean_normalized):
    long_text = "the quick brown fox " * 40  # far over the 64 positions
    with LLM(str(mean_normalized)) as llm:
        with pytest.raises(RequestError, match="truncate_prompt_tokens"):
            llm.embed(long_text)
        out = llm.embed(long_text, truncate_prompt_tokens=-1)[0]
    assert len(out.prompt_token_ids) == 64
    expected = _oracle(mean_normalized, [long_text])[0]  # sentence-transformers cuts at max_seq_length (64)
    assert torch.nn.functional.cosine_similarity(torch.tensor(out.outputs.embedding), expected, dim=0) > 1 - 1e-5


def test_dimensions_refused_without_matryoshka_and_truncated_with_it(mean_normalized, tmp_path):
    with LLM(str(mean_normalized)) as llm:
        with pytest.raises(RequestError, match="dimensions"):
            llm.embed("hello", dimensions=16)
    folder = write_bert_checkpoint(tmp_path / "m", matryoshka_dimensions=[16, 32])
    with LLM(str(folder)) as llm:
        full, = llm.embed("the lazy dog")
        cut, = llm.embed("the lazy dog", dimensions=16)
        with pytest.raises(RequestError, match="dimensions"):
            llm.embed("the lazy dog", dimensions=20)
    expected = torch.nn.functional.normalize(torch.tensor(full.outputs.embedding[:16]), dim=0)
    torch.testing.assert_close(torch.tensor(cut.outputs.embedding), expected)


def test_generation_on_an_encoder_is_refused(mean_normalized):
    with LLM(str(mean_normalized)) as llm:
        with pytest.raises(RequestError, match="LLM.embed"):
            llm.generate("hello")
    with pytest.raises(ConfigError, match="--runner pooling"):
        LLM(str(mean_normalized), runner="generate")


def test_checkpoint_with_an_unexpected_tensor_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = write_bert_checkpoint(tmp_path / "x")
    tensors = load_file(folder / "model.safetensors")
    tensors["encoder.layer.0.extra.weight"] = torch.zeros(2)
    del tensors["encoder.layer.1.output.dense.bias"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ConfigError, match=r"missing tensors: encoder\.layer\.1\.output\.bias.*unexpected tensors"):
        LLM(str(folder))


def _tp_rank_main(rank: int, port: int, folder: str, sequences: list, out: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    from processes import leave_process_group

    from strata.config.hf_config import read_config_json
    from strata.executor.parallel import init_distributed
    from strata.layers.pooler import pool
    from strata.models.bert import BertModel, PackedBatch
    from strata.models.loader import iterate_weights

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    pc = init_distributed(rank, 2, 2, store, "gloo", timedelta(seconds=60))
    model = BertModel(read_config_json(f"{folder}/config.json"), pc)
    model.load_weights(iterate_weights(folder))
    batch = PackedBatch.build(sequences)
    with torch.inference_mode():
        pooled = pool(model(batch), batch.seq_lens, "mean")
    if rank == 0:
        torch.save(pooled, out)
    leave_process_group()


@pytest.mark.slow
def test_tp2_encoder_gives_tp1_embeddings(mean_normalized, tmp_path):
    from processes import spawn_ranks

    with LLM(str(mean_normalized)) as llm:
        sequences = [llm.get_tokenizer()(t).input_ids for t in TEXTS]
        expected = torch.tensor([o.outputs.embedding for o in llm.embed(sequences)])
    out = tmp_path / "tp2.pt"
    spawn_ranks(_tp_rank_main, 2, lambda port: (port, str(mean_normalized), sequences, str(out)))
    got = torch.nn.functional.normalize(torch.load(out), dim=-1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
