"""The tokenizer a GGUF file describes, against the library that made it: a SentencePiece-style vocabulary (pieces,
scores, kinds) written as llama.cpp writes a Llama 2 tokenizer must split text as sentencepiece itself does."""
from __future__ import annotations

import inspect
import textwrap

import pytest
from checkpoints import make_llama
from gguf_checkpoints import Q8_0, types_by_prefix, write_gguf

from strata import LLM, SamplingParams

TEXTS = ["Hello world", "  two  spaces and\ttabs\nnew lines", "déjà vu, naïve café: 3.14 (ok?)",
         "def wrap(text, width=70):\n    return text.split()", "Ünïcödé ✓ 漢字 and unseen bytes \x7f"]


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory):
    """A byte-fallback BPE SentencePiece model (as Llama 2's) trained on stdlib prose, and a tiny Llama GGUF file with
    its vocabulary."""
    sentencepiece = pytest.importorskip("sentencepiece")
    folder = tmp_path_factory.mktemp("spm")
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(textwrap.dedent(inspect.getsource(m)) for m in (textwrap, inspect)))
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(folder / "spm"), vocab_size=400, model_type="bpe", byte_fallback=True,
        normalization_rule_name="identity", add_dummy_prefix=True, remove_extra_whitespaces=False,
        bos_id=1, eos_id=2, unk_id=0, minloglevel=2)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(folder / "spm.model"))
    hf = make_llama(folder / "hf", vocab_size=sp.get_piece_size(), seed=6)
    config = (hf / "config.json").read_text().replace('"bos_token_id": 0', '"bos_token_id": 1') \
        .replace('"eos_token_id": 1', '"eos_token_id": 2')
    (hf / "config.json").write_text(config)
    path = write_gguf(hf, folder / "spm.gguf", types_by_prefix({}, Q8_0), spm_model=folder / "spm.model")[0]
    return path, sp


def test_a_sentencepiece_vocabulary_splits_text_as_sentencepiece_does(spm_gguf):
    path, sp = spm_gguf
    with LLM(str(path), device="cpu") as llm:
        tokenizer = llm.get_tokenizer()
        for text in TEXTS:
            ids = tokenizer(text, add_special_tokens=False).input_ids
            assert ids == sp.encode(text), text
            assert tokenizer(text).input_ids == [sp.bos_id()] + sp.encode(text)
            assert tokenizer.decode(ids) == sp.decode(ids)
        out = llm.generate([TEXTS[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert out[0].prompt_token_ids == [sp.bos_id()] + sp.encode(TEXTS[0])
    assert len(out[0].outputs[0].token_ids) == 8


def test_a_smollm_style_vocabulary_splits_digits_as_its_own_tokenizer_and_llama_cpp_do(tmp_path):
    """`tokenizer.ggml.pre` "smollm" (also starcoder, command-r, ...): llama.cpp splits single digits before the GPT-2
    rule, as SmolLM2's own tokenizer.json does (a Digits pre-tokenizer). Without it, whitespace before a digit came
    apart ("\\n\\n  1" as "\\n\\n ", " ", "1"): 19 more tokens than llama.cpp on the GPL v3 text."""
    from tokenizers import Tokenizer, pre_tokenizers

    from strata.tokenizer import load_tokenizer

    hf = make_llama(tmp_path / "hf", seed=7)
    own = Tokenizer.from_file(str(hf / "tokenizer.json"))
    own.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    path = write_gguf(hf, tmp_path / "smollm.gguf", types_by_prefix({}, Q8_0), pre="smollm")[0]
    tokenizer = load_tokenizer(str(path.parent), str(path))
    digits = "Section\n\n  10. Terms 2007 and  42, return a + b  1"
    for text in [*TEXTS, digits]:
        assert tokenizer(text, add_special_tokens=False).input_ids == own.encode(text, add_special_tokens=False).ids
    gpt2_only = Tokenizer.from_file(str(hf / "tokenizer.json"))  # the rule alone splits this text otherwise
    assert gpt2_only.encode(digits, add_special_tokens=False).ids != own.encode(digits, add_special_tokens=False).ids
