"""PLaMo2's tokenizer, strata's own, against llama.cpp's: the ids libllama gives for a vocabulary that llama.cpp's
converter wrote from a tokenizer.jsonl (recorded in tests/fixtures/plamo2_tokenizer.json by
make_plamo2_tokenizer_fixture.py, and asked of libllama live where it is built), from the tokenizer.jsonl folder and
from the converted GGUF file; decoding gives the text back, also token by token; special pieces, ids and the chat
template come from the files; a vocabulary without every byte token is refused naming the missing ones."""
from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import pytest
from llama_cpp_gguf import convert
from llama_cpp_vocab import LlamaVocab, needs_libllama
from make_plamo2_tokenizer_fixture import (
    FIXTURE,
    GGUF_ONLY_TEXTS,
    TEXTS,
    llama_cpp_ids,
    vocabulary_lines,
    write_checkpoint,
    write_tokenizer_files,
)
from mamba_checkpoints import make_plamo2

from strata.errors import ConfigError
from strata.plamo2_tokenizer import Plamo2Tokenizer
from strata.tokenizer import IncrementalDetokenizer, load_tokenizer

RECORDED = json.loads(FIXTURE.read_text(encoding="utf-8"))


def recorded_ids(texts: list[str], parse_special: bool = True) -> list[list[int]]:
    every = RECORDED["texts"] + RECORDED["gguf_only_texts"]
    ids = RECORDED["ids"]["parse_special" if parse_special else "plain"]
    return [ids[every.index(text)] for text in texts]


@pytest.fixture(scope="module")
def recorded_folder(tmp_path_factory) -> Path:
    """A checkpoint folder's tokenizer files, as the fixture's vocabulary and tokenizer_config.json are."""
    folder = tmp_path_factory.mktemp("plamo2_tokenizer")
    write_tokenizer_files(folder, RECORDED["vocabulary"], RECORDED["tokenizer_config"])
    return folder


@pytest.fixture(scope="module")
def recorded_gguf(tmp_path_factory) -> Path:
    """The fixture's vocabulary in a GGUF file that llama.cpp's converter writes today (padded to vocab_size)."""
    root = tmp_path_factory.mktemp("plamo2_tokenizer_gguf")
    hf = make_plamo2(root / "hf", vocab_size=RECORDED["vocab_size"], hidden_size=32, num_layers=2, num_heads=2,
                     head_dim=16, mamba_num_heads=2, intermediate_size=32)
    write_tokenizer_files(hf, RECORDED["vocabulary"], RECORDED["tokenizer_config"])
    return convert(hf, root / "plamo2.gguf")


def strata_ids(tokenizer, texts: list[str], parse_special: bool = True) -> list[list[int]]:
    return [tokenizer(text, split_special_tokens=not parse_special).input_ids for text in texts]


def test_folder_tokenizer_gives_llama_cpps_recorded_ids(recorded_folder):
    tokenizer = load_tokenizer(str(recorded_folder))
    assert isinstance(tokenizer, Plamo2Tokenizer)
    texts = RECORDED["texts"]
    assert strata_ids(tokenizer, texts) == recorded_ids(texts)
    # without special-piece matching (llama.cpp's parse_special false) control pieces still segment as pieces
    assert strata_ids(tokenizer, texts, parse_special=False) == recorded_ids(texts, parse_special=False)


def test_gguf_tokenizer_gives_llama_cpps_recorded_ids(recorded_gguf):
    """With the converter's [PADn] pieces, scored exactly as llama.cpp's unknown row: matched, they win."""
    tokenizer = load_tokenizer(str(recorded_gguf.parent), str(recorded_gguf))
    assert isinstance(tokenizer, Plamo2Tokenizer)
    texts = RECORDED["texts"] + RECORDED["gguf_only_texts"]
    assert strata_ids(tokenizer, texts) == recorded_ids(texts)
    assert strata_ids(tokenizer, texts, parse_special=False) == recorded_ids(texts, parse_special=False)


@needs_libllama
def test_live_libllama_gives_strata_s_ids_and_the_recorded_ones(tmp_path):
    """The fixture's checkpoint written afresh and converted: libllama's ids now are strata's, from the GGUF file
    and from the folder, and still those the fixture recorded (else re-run make_plamo2_tokenizer_fixture.py)."""
    hf = write_checkpoint(tmp_path / "hf")
    gguf_file = convert(hf, tmp_path / "plamo2.gguf")
    live = llama_cpp_ids(gguf_file, TEXTS + GGUF_ONLY_TEXTS)
    from_gguf = load_tokenizer(str(tmp_path), str(gguf_file))
    for parse_special in (True, False):
        want = live["parse_special" if parse_special else "plain"]
        assert strata_ids(from_gguf, TEXTS + GGUF_ONLY_TEXTS, parse_special) == want
        assert strata_ids(load_tokenizer(str(hf)), TEXTS, parse_special) == want[:len(TEXTS)]
    assert json.dumps(vocabulary_lines()) == json.dumps(RECORDED["vocabulary"])
    assert live == RECORDED["ids"], "llama.cpp tokenizes differently now: re-run make_plamo2_tokenizer_fixture.py"


@needs_libllama
def test_live_libllama_agrees_on_a_random_vocabulary_of_overlapping_pieces(tmp_path):
    """Pieces drawn from a 13-character alphabet (so most texts have many segmentations), scores with ties, halves,
    invalid and exactly-unknown values, and random texts with [PADn], control pieces and BOMs in them."""
    rng = random.Random(7)
    alphabet = [*"abc [P]D1", "日", "本", "é", "😀"]
    pieces = sorted({"".join(rng.choices(alphabet, k=rng.randint(1, 6))) for _ in range(400)})
    lines = vocabulary_lines()[:262]  # the specials and byte tokens
    ties = [-1.0, -2.0, -0.5, -3.0, -1000.0, -2500.0, -0.03125, -1.23455]
    lines += [[p, rng.choice(ties) if rng.random() < 0.3 else round(rng.uniform(-10, 0), rng.choice([1, 2, 6])),
               "NORMAL"] for p in pieces]
    hf = make_plamo2(tmp_path / "hf", vocab_size=len(lines) + 6, hidden_size=32, num_layers=2, num_heads=2,
                     head_dim=16, mamba_num_heads=2, intermediate_size=32)
    write_tokenizer_files(hf, lines, RECORDED["tokenizer_config"])
    gguf_file = convert(hf, tmp_path / "plamo2.gguf")
    extras = ["[PAD1]", "[PAD3]", "<|plamo:op|>", "\ufeff"]
    texts = ["".join(rng.choices(alphabet + extras, k=rng.randint(0, 60))) for _ in range(300)]
    from_gguf, from_folder = load_tokenizer(str(tmp_path), str(gguf_file)), load_tokenizer(str(hf))
    with LlamaVocab(gguf_file) as vocab:
        for text in texts:
            for parse_special in (True, False):
                want = vocab.tokenize(text, parse_special=parse_special)
                assert strata_ids(from_gguf, [text], parse_special) == [want], text
                if "[PAD" not in text:  # the converter's padding pieces are the GGUF file's alone
                    assert strata_ids(from_folder, [text], parse_special) == [want], text


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_decode_gives_the_text_back_whole_and_token_by_token(source, recorded_folder, recorded_gguf):
    """Byte tokens join back into UTF-8 characters (a BOM opening a piece of text is the one thing the tokenizer
    drops); the incremental detokenizer emits each character once its bytes are complete."""
    if source == "folder":
        tokenizer, texts = load_tokenizer(str(recorded_folder)), RECORDED["texts"]
    else:
        tokenizer = load_tokenizer(str(recorded_gguf.parent), str(recorded_gguf))
        texts = RECORDED["texts"] + RECORDED["gguf_only_texts"]
    for text, ids in zip(texts, recorded_ids(texts), strict=True):
        expected = re.sub("(^|\\|>)\ufeff", r"\1", text)  # a BOM opening the text or following a control piece
        assert tokenizer.decode(ids) == expected
        detokenizer = IncrementalDetokenizer(tokenizer, [], stop=[], skip_special_tokens=False)
        for token_id in ids:
            detokenizer.add(token_id)
        assert detokenizer.visible_text(finished=True) == expected


def test_special_pieces_ids_and_chat_template_come_from_the_files(recorded_folder, recorded_gguf):
    pieces = [line[0] for line in RECORDED["vocabulary"]]
    config = RECORDED["tokenizer_config"]
    conversation = [{"role": "user", "content": "hi"}]
    for tokenizer in (load_tokenizer(str(recorded_folder)), load_tokenizer(str(recorded_gguf.parent),
                                                                           str(recorded_gguf))):
        for name in ("bos", "eos", "pad", "unk"):
            assert getattr(tokenizer, f"{name}_token_id") == pieces.index(config[f"{name}_token"])
        assert tokenizer("Hello world").input_ids == recorded_ids(["Hello world"])[0]  # no BOS added
        ids = tokenizer("<|plamo:bos|>Hello<|plamo:op|><|plamo:img|>").input_ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == "Hello"  # every control piece is special
    # llama.cpp's converter keeps PLaMo2's chat template out of the GGUF file: the folder has it
    rendered = load_tokenizer(str(recorded_folder)).apply_chat_template(conversation, tokenize=False,
                                                                         add_generation_prompt=True)
    assert rendered == "<|plamo:op|>user\nhi<|plamo:eos|>\n<|plamo:op|>assistant\n"
    assert rendered in RECORDED["texts"]


def test_a_vocabulary_without_every_byte_token_is_refused_naming_them(tmp_path):
    lines = [line for line in RECORDED["vocabulary"] if line[0] not in ("<0x00>", "<0x7F>")]
    write_tokenizer_files(tmp_path, lines, RECORDED["tokenizer_config"])
    with pytest.raises(ConfigError, match=r"lacks the byte tokens <0x00>, <0x7F> \(pieces of type BYTE\)"):
        load_tokenizer(str(tmp_path))


def test_a_folder_naming_plamos_tokenizer_without_tokenizer_jsonl_is_refused(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(RECORDED["tokenizer_config"]))
    with pytest.raises(ConfigError, match=r"no tokenizer\.jsonl.*--tokenizer"):
        load_tokenizer(str(tmp_path))


def test_100_kb_of_text_takes_well_under_a_second(recorded_folder):
    tokenizer = load_tokenizer(str(recorded_folder))
    text = "".join(t for t in RECORDED["texts"] if "\ufeff" not in t)
    text *= 100_000 // len(text.encode()) + 1
    start = time.process_time()
    ids = tokenizer(text).input_ids
    spent = time.process_time() - start
    assert tokenizer.decode(ids) == text
    assert spent < 1.0, f"{spent:.2f} s of CPU for {len(text.encode())} bytes"


def test_a_grammar_compiles_for_the_tokenizer_and_accepts_exactly_its_own_spelling(recorded_folder):
    """xgrammar reads the vocabulary as raw bytes (it does not know this tokenizer class): a choice grammar then
    admits the ids the tokenizer writes for one of its words, token by token, and nothing else."""
    import xgrammar as xgr

    from strata.config import StructuredOutputsConfig
    from strata.sampling_params import StructuredOutputsParams
    from strata.structured.grammar import GrammarCompiler, result_of

    tokenizer = load_tokenizer(str(recorded_folder))
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], StructuredOutputsConfig())
    params = StructuredOutputsParams(choice=["こんにちは世界", "the cat"])
    matcher = xgr.GrammarMatcher(result_of(compiler.submit(params), params, 60.0))
    for token in tokenizer("the cat", add_special_tokens=False).input_ids:
        assert matcher.accept_token(token)
    assert matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()
    other = xgr.GrammarMatcher(result_of(compiler.submit(params), params, 60.0))
    assert not all(other.accept_token(t) for t in tokenizer("the dog", add_special_tokens=False).input_ids)
