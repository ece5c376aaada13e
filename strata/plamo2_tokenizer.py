"""PLaMo2's tokenizer, from a checkpoint's tokenizer.jsonl or a GGUF file's `plamo2` vocabulary: the best-scoring
segmentation over code points that llama.cpp's PLaMo2 tokenizer computes, as a transformers slow tokenizer."""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizer

from strata.errors import ConfigError

logger = logging.getLogger(__name__)

# GGUF token types (gguf.TokenType); tokenizer.jsonl names them.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_JSONL_TYPES = {"UNKNOWN": UNKNOWN, "CONTROL": CONTROL, "BYTE": BYTE}
_TYPE_NAMES = {NORMAL: "NORMAL", UNKNOWN: "UNKNOWN", CONTROL: "CONTROL", USER_DEFINED: "USER_DEFINED",
               UNUSED: "UNUSED", BYTE: "BYTE"}
# The tokenizer_config.json classes of PLaMo2's remote code (PLaMo 3's adds boundary rules this one lacks).
PLAMO2_TOKENIZER_CLASSES = ("PlamoTokenizer", "Plamo2Tokenizer")
# The GGUF keys of the special ids (gguf-py's spelling), and llama.cpp's ids for PLaMo2 where a file names none.
_GGUF_SPECIAL_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "padding_token_id",
                      "unk": "unknown_token_id", "sep": "seperator_token_id"}
_GGUF_DEFAULT_IDS = {"unk": 0, "bos": 1, "eos": 2, "pad": 3}

# Scores are compared as integers, score * 1e4. A piece at or below INVALID is never chosen; a code point no piece
# covers costs UNKNOWN and is written as its UTF-8 byte tokens.
_INVALID = -20_000_000
_UNKNOWN = -10_000_000
_INT32_MAX = 2 ** 31 - 1
_ABSENT = object()


@dataclass(frozen=True)
class PlamoVocab:
    """The pieces, their float scores and GGUF token types, by token id."""
    pieces: tuple[str, ...]
    scores: tuple[float, ...]
    types: tuple[int, ...]

    @classmethod
    def from_jsonl(cls, path: Path) -> PlamoVocab:
        """tokenizer.jsonl's `[piece, score, type, ...]` lines, typed as llama.cpp's converter types them (an untyped
        `<|plamo:...|>` piece is a control token)."""
        pieces, scores, types = [], [], []
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    piece, score = str(row[0]), float(row[1])
                except (ValueError, TypeError, IndexError) as e:
                    raise ConfigError(f"{path}: line {number} is not a [piece, score, type] row: {e}",
                                      param="tokenizer") from e
                kind = _JSONL_TYPES.get(row[2] if len(row) > 2 else "NORMAL", NORMAL)
                if kind == NORMAL and piece.startswith("<|plamo:") and piece.endswith("|>"):
                    kind = CONTROL
                pieces.append(piece)
                scores.append(score)
                types.append(kind)
        return cls(tuple(pieces), tuple(scores), tuple(types))

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any]) -> PlamoVocab:
        pieces = tuple(str(p) for p in metadata["tokenizer.ggml.tokens"])
        scores = tuple(float(s) for s in metadata.get("tokenizer.ggml.scores") or [0.0] * len(pieces))
        types = tuple(int(t) for t in metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(pieces))
        return cls(pieces, scores, types)


def _byte_value(piece: str) -> int | None:
    """The byte a `<0xNN>` piece stands for (None if it is not written so)."""
    digits = piece[3:5]
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">") and all(
            c in "0123456789abcdefABCDEF" for c in digits):
        return int(digits, 16)
    return None


def byte_token_ids(vocab: PlamoVocab) -> list[int]:
    """The id of each byte's `<0xNN>` BYTE token (the last one, as llama.cpp); 0 where there is none."""
    ids = [0] * 256
    for token_id, (piece, kind) in enumerate(zip(vocab.pieces, vocab.types, strict=True)):
        value = _byte_value(piece) if kind == BYTE else None
        if value is not None:
            ids[value] = token_id
    return ids


def missing_byte_tokens(vocab: PlamoVocab) -> list[int]:
    """The bytes without a BYTE token; llama.cpp refuses such a vocabulary (id 0 counts as missing there too)."""
    return [value for value, token_id in enumerate(byte_token_ids(vocab)) if token_id == 0]


def describe_missing_bytes(missing: Sequence[int]) -> str:
    """`<0x00>, <0x01>, ... and N more`: the first few of the bytes without a byte token."""
    named = ", ".join(f"<0x{b:02X}>" for b in missing[:8])
    return named + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")


def scaled_scores(scores: Sequence[float]) -> list[int | None]:
    """llama.cpp's integer score of each piece: round(float32(score) * 1e4) computed in double, halves away from zero
    as C's round() takes them (Python's round() takes them to even); None for a piece never chosen (not finite, at or
    below the invalid score, or past int32, which the C cast turns into INT_MIN on x86)."""
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = np.asarray(scores, dtype=np.float64).astype(np.float32).astype(np.float64) * 1e4
        floor = np.floor(scaled)
        fraction = scaled - floor  # exact for doubles
        rounded = floor + ((fraction > 0.5) | ((fraction == 0.5) & (scaled > 0)))
        chosen = np.isfinite(rounded) & (rounded > _INVALID) & (rounded <= _INT32_MAX)
    return [int(r) if ok else None for r, ok in zip(rounded.tolist(), chosen.tolist(), strict=True)]


class PlamoSegmenter:
    """Text -> token ids: every piece that matches at a position (not byte tokens) and the one-code-point unknown
    piece compete; the smallest total of -score wins, ties going to the longer piece and to a piece over unknown.

    A piece scored exactly the unknown score (the [PADn] pieces llama.cpp's converter pads a vocabulary with) stands
    where llama.cpp's table has its unknown row: where it matches, no shorter candidate and no unknown piece follow
    it, and llama.cpp's search for the longest match one code point earlier stops there too, so that match is then
    cut short. Vocabularies with such pieces track llama.cpp's longest match (`_longest_match`)."""

    def __init__(self, vocab: PlamoVocab) -> None:
        missing = missing_byte_tokens(vocab)
        if missing:
            raise ConfigError(f"cannot build PLaMo2's tokenizer: its vocabulary lacks the byte tokens "
                              f"{describe_missing_bytes(missing)} (pieces of type BYTE), which it writes characters "
                              "outside the vocabulary with", param="tokenizer")
        self._bytes = byte_token_ids(vocab)
        ids: dict[str, int] = {}
        scores: dict[str, float] = {}
        for token_id, (piece, score, kind) in enumerate(zip(vocab.pieces, vocab.scores, vocab.types, strict=True)):
            ids[piece] = token_id  # duplicates: the last id and score, as llama.cpp
            if kind != BYTE:
                scores[piece] = score
        # Every prefix of a piece -> None, or (cost, token id, whether it scores exactly unknown) for a piece.
        self._prefixes: dict[str, tuple[int, int, bool] | None] = {}
        for piece, scaled in zip(scores, scaled_scores(list(scores.values())), strict=True):
            if scaled is None or not piece:
                continue
            for end in range(1, len(piece)):
                self._prefixes.setdefault(piece[:end], None)
            self._prefixes[piece] = (-scaled, ids[piece], scaled == _UNKNOWN)
        # llama.cpp's match states: every suffix of every piece, needed only where a piece scores exactly unknown.
        self._suffixes: set[str] | None = None
        if any(entry and entry[2] for entry in self._prefixes.values()):
            self._suffixes = {piece[k:] for piece in scores for k in range(len(piece))}

    def encode(self, text: str) -> list[int]:
        if text.startswith("\ufeff"):
            text = text[1:]
        n = len(text)
        cost = [0] * (n + 1)
        length = [1] * n
        token = [-1] * n
        prefixes, absent, suffixes = self._prefixes, _ABSENT, self._suffixes
        match, cut = 0, 0  # llama.cpp's longest match at i + 1, and its longest piece scoring exactly unknown
        for i in range(n - 1, -1, -1):
            end = n if suffixes is None else i + (match := self._longest_match(text, i, match, cut))
            # Candidates from the shortest up: the unknown piece first, then each longer piece replaces the best
            # when not worse, which keeps llama.cpp's order (longest first, strictly better to replace).
            best, best_length, best_token = cost[i + 1] - _UNKNOWN, 1, -1
            cut, j = 0, i + 1
            entry = prefixes.get(text[i:j], absent) if j <= end else absent
            while entry is not absent:
                if entry is not None:
                    total = cost[j] + entry[0]
                    if entry[2]:  # nothing shorter counts: llama.cpp's candidates end at this piece
                        best, best_length, best_token, cut = total, j - i, entry[1], j - i
                    elif total <= best:
                        best, best_length, best_token = total, j - i, entry[1]
                if j >= end:
                    break
                j += 1
                entry = prefixes.get(text[i:j], absent)
            cost[i], length[i], token[i] = best, best_length, best_token
        return self._path(text, length, token)

    def _longest_match(self, text: str, i: int, match: int, cut: int) -> int:
        """The length of llama.cpp's longest match at i: text[i] and the longest piece-suffix of the match at i + 1,
        no shorter than that match's piece scoring exactly unknown, that together form a piece-suffix (0: none)."""
        for k in range(match, cut - 1, -1):
            if text[i:i + 1 + k] in self._suffixes:
                return k + 1
        return 0

    def _path(self, text: str, length: list[int], token: list[int]) -> list[int]:
        out: list[int] = []
        i, n = 0, len(text)
        while i < n:
            if token[i] >= 0:
                out.append(token[i])
            else:  # surrogatepass: a lone surrogate is written as its 3 bytes, as llama.cpp's formula does
                out.extend(self._bytes[b] for b in text[i].encode("utf-8", "surrogatepass"))
            i += length[i]
        return out


class Plamo2Tokenizer(PreTrainedTokenizer):
    """PLaMo2's tokenizer as transformers' slow tokenizers are: control and unknown pieces are matched whole before
    the segmentation (llama.cpp's parse_special), byte tokens decode back into UTF-8, chat templates apply."""

    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab: PlamoVocab, *, add_bos_token: bool = False, add_eos_token: bool = False,
                 **kwargs: Any) -> None:
        self.plamo_vocab = vocab
        self._segmenter = PlamoSegmenter(vocab)
        self._ids = {piece: token_id for token_id, piece in enumerate(vocab.pieces)}
        self._piece_bytes = [bytes([value]) if kind == BYTE and (value := _byte_value(piece)) is not None
                             else piece.encode("utf-8", "surrogatepass")
                             for piece, kind in zip(vocab.pieces, vocab.types, strict=True)]
        self._byte_pieces = {piece: self._piece_bytes[token_id] for token_id, (piece, kind)
                             in enumerate(zip(vocab.pieces, vocab.types, strict=True)) if kind == BYTE}
        named = {kwargs.get(f"{key}_token") for key in ("bos", "eos", "unk", "pad", "sep")}
        kwargs.setdefault("extra_special_tokens", [piece for piece, kind in zip(vocab.pieces, vocab.types, strict=True)
                                                   if kind in (CONTROL, UNKNOWN) and piece not in named])
        super().__init__(clean_up_tokenization_spaces=False, **kwargs)
        self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
        user_defined = [piece for piece, kind in zip(vocab.pieces, vocab.types, strict=True) if kind == USER_DEFINED]
        if user_defined:  # llama.cpp matches these whole too, even without parse_special
            from tokenizers import AddedToken

            self._add_tokens([AddedToken(p, special=False, normalized=False) for p in user_defined])

    @property
    def vocab_size(self) -> int:
        return len(self.plamo_vocab.pieces)

    @property
    def token_bytes(self) -> list[bytes]:
        """Each id's bytes as decoding writes them (a byte token's one byte): the raw vocabulary a grammar engine
        needs (xgrammar: `TokenizerInfo(token_bytes, VocabType.RAW, ...)`)."""
        return list(self._piece_bytes)

    def get_vocab(self) -> dict[str, int]:
        return {**self._ids, **self._added_tokens_encoder}

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        pieces = self.plamo_vocab.pieces
        return [pieces[token_id] for token_id in self._segmenter.encode(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return self._ids.get(token, self.unk_token_id if self.unk_token_id is not None else 0)

    def _convert_id_to_token(self, index: int) -> str:
        return self.plamo_vocab.pieces[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        data = b"".join(self._byte_pieces.get(t) or t.encode("utf-8", "surrogatepass") for t in tokens)
        return data.decode("utf-8", "replace")

    def _decode(self, token_ids: int | list[int], skip_special_tokens: bool = False,
                clean_up_tokenization_spaces: bool | None = None, **kwargs: Any) -> str:
        """The pieces' bytes joined, then read as UTF-8 (an incomplete character becomes U+FFFD). Ids past the
        vocabulary (a checkpoint's padded embedding rows) decode to nothing, as in fast tokenizers."""
        ids = [token_ids] if isinstance(token_ids, int) else token_ids
        skip = frozenset(self.all_special_ids) if skip_special_tokens else frozenset()
        pieces, size = self._piece_bytes, len(self._piece_bytes)
        data = b"".join(pieces[i] for i in map(int, ids) if 0 <= i < size and i not in skip)
        return data.decode("utf-8", "replace")

    def build_inputs_with_special_tokens(self, token_ids_0: list[int],
                                         token_ids_1: list[int] | None = None) -> list[int]:
        bos = [self.bos_token_id] if self.add_bos_token and self.bos_token_id is not None else []
        eos = [self.eos_token_id] if self.add_eos_token and self.eos_token_id is not None else []
        out = bos + token_ids_0 + eos
        return out if token_ids_1 is None else out + bos + token_ids_1 + eos

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        path = Path(save_directory) / f"{filename_prefix + '-' if filename_prefix else ''}tokenizer.jsonl"
        vocab = self.plamo_vocab
        with open(path, "w", encoding="utf-8") as f:
            for row in zip(vocab.pieces, vocab.scores, (_TYPE_NAMES[t] for t in vocab.types), strict=True):
                f.write(json.dumps(list(row), ensure_ascii=False) + "\n")
        return (str(path),)


def is_plamo2_tokenizer_folder(folder: Path) -> bool:
    """Whether `folder`'s tokenizer_config.json names PLaMo2's tokenizer class."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("tokenizer_class") in PLAMO2_TOKENIZER_CLASSES


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or a serialized AddedToken."""
    return value.get("content") if isinstance(value, dict) else value


def load_plamo2_tokenizer(folder: Path) -> Plamo2Tokenizer:
    """The tokenizer of a PLaMo2 checkpoint folder: tokenizer.jsonl, tokenizer_config.json's special tokens and
    add_bos_token (PlamoTokenizer's defaults where it names none), and its chat template (chat_template.jinja
    first, as llama.cpp's converter reads them)."""
    vocabulary = folder / "tokenizer.jsonl"
    if not vocabulary.is_file():
        raise ConfigError(f"folder {str(folder)!r} names PLaMo's tokenizer in tokenizer_config.json but has no "
                          "tokenizer.jsonl; copy the model's tokenizer.jsonl into it, or pass --tokenizer",
                          param="tokenizer")
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    template_file = folder / "chat_template.jinja"
    template = template_file.read_text(encoding="utf-8") if template_file.is_file() else config.get("chat_template")
    specials = {f"{key}_token": _token_text(config.get(f"{key}_token", f"<|plamo:{key}|>"))
                for key in ("bos", "eos", "pad", "unk")}
    if config.get("sep_token") is not None:
        specials["sep_token"] = _token_text(config["sep_token"])
    return Plamo2Tokenizer(PlamoVocab.from_jsonl(vocabulary), add_bos_token=bool(config.get("add_bos_token", False)),
                           add_eos_token=bool(config.get("add_eos_token", False)), chat_template=template, **specials)


def plamo2_tokenizer_from_gguf(metadata: Mapping[str, Any]) -> Plamo2Tokenizer:
    """The tokenizer a GGUF file's `plamo2` vocabulary describes: its pieces, scores and types, special ids
    (llama.cpp's defaults where it names none), add_bos/add_eos flags and chat template."""
    vocab = PlamoVocab.from_gguf(metadata)

    def piece(key: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{_GGUF_SPECIAL_KEYS[key]}", _GGUF_DEFAULT_IDS.get(key))
        return vocab.pieces[token_id] if token_id is not None and 0 <= token_id < len(vocab.pieces) else None

    specials = {f"{key}_token": piece(key) for key in _GGUF_SPECIAL_KEYS}
    return Plamo2Tokenizer(vocab, add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
                           add_eos_token=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
                           chat_template=metadata.get("tokenizer.chat_template"), **specials)
