"""Records llama.cpp's answers for PLaMo2's tokenizer into tests/fixtures/plamo2_tokenizer.json, the fixture CI
checks strata against where no libllama is built.

It writes a tiny random PLaMo2 checkpoint whose tokenizer.jsonl is the vocabulary below (a few hundred overlapping
pieces: words, sub-words, Japanese, whitespace runs, code, plus the 256 byte tokens and PLaMo's control pieces, and
pieces built to tell apart rounding, tie-breaking and invalid scores), converts it with llama.cpp's own
convert_hf_to_gguf.py, and tokenizes each text with libllama (`llama_tokenize` on the vocabulary alone), with and
without parse_special. Run from the repository root: `.ci-venv/bin/python tests/make_plamo2_tokenizer_fixture.py`.
"""
from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

FIXTURE = Path(__file__).parent / "fixtures" / "plamo2_tokenizer.json"
SPECIALS = ["<|plamo:unk|>", "<|plamo:bos|>", "<|plamo:eos|>", "<|plamo:pad|>", "<|plamo:op|>"]
# The converter pads the vocabulary to config.json's vocab_size with [PADn] pieces scored -1000, exactly the score
# of llama.cpp's unknown row: a match ends the candidates there.
PADDING = 4
CHAT_TEMPLATE = ("{% for m in messages %}<|plamo:op|>{{ m['role'] }}\n{{ m['content'] }}<|plamo:eos|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|plamo:op|>assistant\n{% endif %}")
TOKENIZER_CONFIG = {"tokenizer_class": "PlamoTokenizer", "bos_token": SPECIALS[1], "eos_token": SPECIALS[2],
                    "pad_token": SPECIALS[3], "unk_token": SPECIALS[0], "add_bos_token": False,
                    "chat_template": CHAT_TEMPLATE}

WORDS = ["the", " the", "The", " The", "cat", " cat", " is", "is", " on", " mat", "Hello", " Hello", " world", "world",
         "token", " token", " tok", "tok", "en", "izer", "ization", "ize", "ing", " ing", "tion", " and", " a", "an",
         "ab", "bc", "abc", "de", " model", "model", " serve", "serv", "er", " fast", "fa", "st", "Net", "works",
         " Networks", "Pre", "ferred", " Preferred", "PL", "aMo", "PLaMo", "Mo", " family", " emoji"]
JAPANESE = ("今日 は いい 天気 です ね 。 、 東京 へ 行き ます 日本 日本語 語 の モデル トークン "
            "ナイザー トー クン を 使 使い い ま す で 言語 大規模 大 規模 です。 こんにちは 世界").split()
SPACES = [" ", "  ", "   ", "    ", "        ", "\n", "\n\n", "\n\n\n", "\t", "\t\t", "\r\n", " \n", "\n    ",
          "\n        "]
CODE = ["def", " def", "(", ")", "):", ":", " return", "return", " +", " =", " ==", "==", "->", " ->", "x", " x",
        "1", " 1", "0", "()", "print", "self", ".", ",", " {", "}", "[", "]", "\"", "'", "#", " #"]
EMOJI = ["😀", "👩", "💻", "👨", "👧", "🎉"]
SINGLES = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)] + \
    [str(d) for d in range(10)] + list("!?-_;/<>|")
# (piece, score): rounding of float32(score) * 1e4 half away from zero, and in float32 not double; equal totals
# going to the longer piece; a piece worse than unknown; scores that are never chosen; pieces overlapping [PADn].
DESIGNED = [("x", -0.0156), ("y", -0.0156), ("xy", -0.03125),
            ("p", -0.6), ("q", -0.6345), ("pq", -1.23455),
            ("k", -1.0), ("l", -1.0), ("m", -1.0), ("kl", -1.0), ("lm", -1.0),
            ("ŵŵ", -1500.0), ("zz", -2500.5), ("qq", float("nan")), ("jj", float("-inf")), ("🎉🎉", 0.75),
            (" [", -2.0), ("[PA", -3.0), ("AD", -2.5)]


def vocabulary_lines(seed: int = 0) -> list[list]:
    """tokenizer.jsonl's rows, [piece, score, type], the specials and bytes first as PLaMo's file has them."""
    rng = random.Random(seed)
    lines = [[s, 0.0, "CONTROL" if i else "UNKNOWN"] for i, s in enumerate(SPECIALS)]
    lines.append(["<|plamo:img|>", 0.0, "NORMAL"])  # the converter types any <|plamo:...|> piece CONTROL
    lines += [[f"<0x{b:02X}>", 0.0, "BYTE"] for b in range(256)]
    designed = dict(DESIGNED)
    seen = set(designed)
    for piece in WORDS + JAPANESE + SPACES + CODE + EMOJI + SINGLES:
        if piece not in seen:
            seen.add(piece)
            # longer pieces score better, as a unigram model's log-probabilities of frequent strings do
            lines.append([piece, round(rng.uniform(-13.0, -6.0) + 0.8 * len(piece), 6), "NORMAL"])
    lines += [[piece, score, "NORMAL"] for piece, score in DESIGNED]
    return lines


TEXTS = [
    "", " ", "Hello world", "The cat is on the mat.", "Hello  world\tand\t\tthe\n\n\ncat   ",
    "今日はいい天気ですね。東京へ行きます。", "日本語の大規模言語モデルを使います、こんにちは世界",
    "PLaMo2はPreferred Networksのモデルです 😀🎉🎉🎉",
    "def add(x, y):\n    return x + y\n\nprint(add(1, 0)) # -> 1\r\n",
    "        indented\n        more\n\t\ttabs", "tokenization tokenizer tokens",
    "👩\u200d💻 and 👨\u200d👩\u200d👧\u200d👦 family emoji", "Ωμέγα ß ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 Ꙭ \x00\x01\x7f é",
    "<|plamo:bos|>hello<|plamo:eos|>", "<|plamo:op|>user\nhi<|plamo:eos|>\n<|plamo:op|>assistant\n",
    "<|plamo:bo <|plamo:nope|> <|plamo:img|><|plamo:unk|><|plamo:pad|>", "text <0x41> <0xZZ>",
    "\ufeffa leading BOM", "<|plamo:bos|>\ufeffBOM after a control piece", "a\ufeffb mid BOM",
    "xy", "pq", "klm", "ŵŵ", "ŵŵŵ", "zz zzz", "qq jj", "1234567890 3.14 [x] {y}",
]
GGUF_ONLY_TEXTS = ["[PAD1]", "a [PAD2] b[PAD4]", "[PAD5]", " [PAD1]", "[PAD1][PAD2]", "x [PA[PAD3]y", "[PAD1 [PAD"]


def write_checkpoint(folder: Path) -> Path:
    """A tiny random PLaMo2 (its weights do not matter here) with this tokenizer.jsonl and tokenizer_config.json."""
    from mamba_checkpoints import make_plamo2

    lines = vocabulary_lines()
    path = make_plamo2(folder, vocab_size=len(lines) + PADDING, hidden_size=32, num_layers=2, num_heads=2,
                       head_dim=16, mamba_num_heads=2, intermediate_size=32)
    write_tokenizer_files(path, lines, TOKENIZER_CONFIG)
    return path


def write_tokenizer_files(folder: Path, lines: list[list], config: dict) -> None:
    # json.dumps writes NaN and -Infinity, which the converter's json.loads reads back
    (folder / "tokenizer.jsonl").write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines),
                                            encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")


def llama_cpp_ids(gguf_file: Path, texts: list[str]) -> dict[str, list[list[int]]]:
    """libllama's ids for each text: with parse_special (control pieces matched whole first) and without."""
    from llama_cpp_vocab import LlamaVocab

    with LlamaVocab(gguf_file) as vocab:
        return {"parse_special": [vocab.tokenize(t, parse_special=True) for t in texts],
                "plain": [vocab.tokenize(t, parse_special=False) for t in texts]}


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from llama_cpp_gguf import LLAMA_CPP, convert

    with tempfile.TemporaryDirectory() as tmp:
        hf = write_checkpoint(Path(tmp) / "hf")
        gguf_file = convert(hf, Path(tmp) / "plamo2.gguf")
        ids = llama_cpp_ids(gguf_file, TEXTS + GGUF_ONLY_TEXTS)
    fixture = {"about": "libllama's ids (llama_tokenize, add_special false) for a PLaMo2 GGUF file that llama.cpp's "
                        "convert_hf_to_gguf.py wrote from a checkpoint with this tokenizer.jsonl; recorded by "
                        "tests/make_plamo2_tokenizer_fixture.py",
               "llama_cpp": LLAMA_CPP.parent.parent.name, "vocab_size": len(vocabulary_lines()) + PADDING,
               "tokenizer_config": TOKENIZER_CONFIG, "vocabulary": vocabulary_lines(), "texts": TEXTS,
               "gguf_only_texts": GGUF_ONLY_TEXTS, "ids": ids}
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(fixture, ensure_ascii=False, indent=None) + "\n", encoding="utf-8")
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
