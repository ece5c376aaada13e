"""A Gemma-style SentencePiece vocabulary in a GGUF file (byte fallback, no dummy prefix, runs of spaces and newlines
and the turn markers as added tokens, written as llama.cpp's converter writes them: the turn markers as control
tokens, the others as user-defined ones with their spaces spelled as spaces) must split mixed text, and its chat
template's output, as sentencepiece itself does."""
from __future__ import annotations

import inspect
import textwrap

import pytest
from arch_checkpoints import make_arch
from gguf_checkpoints import Q8_0, types_by_prefix
from gguf_variants import write_variant_gguf

from strata.tokenizer import load_tokenizer

TURNS = ["<start_of_turn>", "<end_of_turn>"]
WHITESPACE = ["\n", "\n\n", "\n\n\n", "\t", "\u2581\u2581", "\u2581\u2581\u2581", "\u2581\u2581\u2581\u2581"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else "
            "m['role'] }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
            "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
TEXTS = ["Hello world", "  two  spaces,   three and\ttabs\nnew lines\n\n\n  indented", "trailing   ", " leading",
         "déjà vu, naïve café: 3.14159 (ok?) 1234567890", "漢字とかな。Привет, мир! مرحبا", "emoji 😀🚀👍🏽 👨‍👩‍👧",
         "def f(x):\n    return {'a': [x, x ** 2]}  # comment\n", "unseen bytes \x7f\x01"]


@pytest.fixture(scope="module")
def gemma_spm(tmp_path_factory):
    """A trained Gemma-style sentencepiece model and a tiny Gemma 3 GGUF file carrying it."""
    sentencepiece = pytest.importorskip("sentencepiece")
    folder = tmp_path_factory.mktemp("gemma_spm")
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(textwrap.dedent(inspect.getsource(m)) for m in (textwrap, inspect)))
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(folder / "spm"), vocab_size=600, model_type="bpe", byte_fallback=True,
        normalization_rule_name="identity", add_dummy_prefix=False, remove_extra_whitespaces=False,
        split_digits=True, user_defined_symbols=TURNS + WHITESPACE, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        minloglevel=2)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(folder / "spm.model"))
    hf = make_arch(folder / "hf", "gemma3", vocab_size=sp.get_piece_size(), tied=True, num_hidden_layers=2,
                   layer_types=None, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    path = write_variant_gguf(hf, folder / "gemma.gguf", "gemma3", types_by_prefix({}, Q8_0),
                              vocabulary=lambda writer: _gemma_vocabulary(writer, sp))
    return path, sp


def _gemma_vocabulary(writer, sp) -> None:
    """`_set_vocab_sentencepiece` on a Gemma checkpoint: pieces, scores and kinds, then the tokenizer config's added
    tokens re-marked (special: control 3; others user-defined 4, their \u2581 written as spaces); no space prefix."""
    tokens, kinds = [], []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        kind = 2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1
        if piece in TURNS:
            kind = 3
        elif piece in WHITESPACE:
            piece, kind = piece.replace("\u2581", " "), 4
        tokens.append(piece)
        kinds.append(kind)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([sp.get_score(i) for i in range(sp.get_piece_size())])
    writer.add_token_types(kinds)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(TEMPLATE)


def test_mixed_text_splits_as_sentencepiece_does(gemma_spm):
    path, sp = gemma_spm
    tokenizer = load_tokenizer(str(path.parent), str(path))
    for text in TEXTS:
        assert tokenizer(text, add_special_tokens=False).input_ids == sp.encode(text), text
        assert tokenizer(text).input_ids == [2] + sp.encode(text)
        assert tokenizer.decode(sp.encode(text)) == sp.decode(sp.encode(text))


def test_chat_template_output_splits_as_sentencepiece_does(gemma_spm):
    path, sp = gemma_spm
    tokenizer = load_tokenizer(str(path.parent), str(path))
    messages = [{"role": "user", "content": TEXTS[1]}, {"role": "assistant", "content": TEXTS[7]},
                {"role": "user", "content": TEXTS[5]}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    bos = sp.id_to_piece(2)
    assert text.startswith(bos + "<start_of_turn>user\n") and text.endswith("<start_of_turn>model\n")
    assert ids == [2] + sp.encode(text.removeprefix(bos))
