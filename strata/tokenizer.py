"""Tokenizer loading, chat templates, incremental detokenization and stop strings."""
from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from strata.errors import ConfigError, RequestError

logger = logging.getLogger(__name__)

# Prompt tokens decoded before the first generated one, so that word boundaries come out right.
_CONTEXT_TOKENS = 5


def load_tokenizer(path: str, gguf_file: str | None = None) -> Any:
    """The tokenizer of a checkpoint folder, or the one a GGUF file describes in its `tokenizer.ggml.*` metadata
    (its vocabulary, merges or scores, special tokens and chat template), rebuilt by transformers; PLaMo2's
    (tokenizer.jsonl, or a `plamo2` GGUF vocabulary) is strata's own, which needs no remote code."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from strata import plamo2_tokenizer

    if gguf_file is not None:
        metadata = _refuse_unbuildable_gguf_tokenizer(gguf_file)
        if metadata.get("tokenizer.ggml.model") == "plamo2":
            return plamo2_tokenizer.plamo2_tokenizer_from_gguf(metadata)
    elif plamo2_tokenizer.is_plamo2_tokenizer_folder(Path(path)):
        return plamo2_tokenizer.load_plamo2_tokenizer(Path(path))
    try:
        if gguf_file is not None:
            gguf = Path(gguf_file)
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                                local_files_only=True)
            _space_prefix_as_sentencepiece(tokenizer, gguf_file)
            _split_digits_as_llama_cpp(tokenizer, gguf_file)
            return tokenizer
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; all mean "cannot load"
        missing = _missing_vocabulary(Path(path)) if gguf_file is None and Path(path).is_dir() else None
        if missing:
            raise ConfigError(f"folder {path!r} has no tokenizer: {missing}. Copy the model's tokenizer files into "
                              "it, or pass a tokenizer folder or Hub ID with --tokenizer", param="tokenizer") from e
        where = gguf_file or path
        raise ConfigError(f"cannot load the tokenizer from {where!r}: {e}; pass a tokenizer folder or Hub ID with "
                          "--tokenizer", param="model") from e


def _refuse_unbuildable_gguf_tokenizer(gguf_file: str) -> dict[str, Any]:
    """The file's metadata, once it is known to describe a tokenizer strata can build."""
    from strata.gguf.reader import read_metadata
    from strata.gguf.vocab import tokenizer_problem

    metadata = read_metadata(gguf_file)
    problem = tokenizer_problem(metadata)
    if problem:
        raise ConfigError(f"cannot build the tokenizer of {gguf_file!r}: {problem}. Pass the model's tokenizer folder "
                          "or Hub ID with --tokenizer (tokenizer=...)", param="tokenizer")
    return metadata


# The files one of which holds a tokenizer's vocabulary (tokenizer_config.json alone only configures one): the
# fast tokenizer's file, a SentencePiece model, a byte-level BPE's pair, a WordPiece list, PLaMo's pieces.
_VOCABULARIES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"), ("vocab.txt",),
                 ("tokenizer.jsonl",))


def _missing_vocabulary(folder: Path) -> str | None:
    """What is missing when `folder` holds no vocabulary file at all (None when it holds one: then the files are
    there and something else is wrong with them)."""
    if any(all((folder / name).is_file() for name in group) for group in _VOCABULARIES):
        return None
    if any(folder.glob("*.model")) or any(folder.glob("*.tiktoken")):
        return None
    wanted = ", ".join(" + ".join(group) for group in _VOCABULARIES) + ", *.model or *.tiktoken"
    present = sorted(p.name for p in folder.iterdir() if p.name.startswith(("tokenizer", "vocab", "merges",
                                                                            "special_tokens", "added_tokens")))
    return f"none of {wanted} is there (tokenizer files present: {', '.join(present) or 'none'})"


def _space_prefix_as_sentencepiece(tokenizer: Any, gguf_file: str) -> None:
    """A SentencePiece-style GGUF vocabulary ("llama") prefixes every text, and every piece of text after a special
    token, with a space, as sentencepiece and llama.cpp do (`tokenizer.ggml.add_space_prefix`, on by default), and as
    Llama 2's own tokenizer.json does (a Prepend normalizer). transformers' rebuilt tokenizer prefixes only text that
    does not start with a space already (a Metaspace pre-tokenizer): " a" lost a token."""
    from tokenizers import normalizers

    from strata.gguf.reader import read_metadata

    metadata = read_metadata(gguf_file)
    if metadata.get("tokenizer.ggml.model") != "llama":
        return
    spaces = normalizers.Replace(" ", "\u2581")
    prefix = metadata.get("tokenizer.ggml.add_space_prefix", True)
    backend = tokenizer.backend_tokenizer
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), spaces]) if prefix else spaces
    backend.pre_tokenizer = None


# Byte-level BPE vocabularies (`tokenizer.ggml.pre`) whose text llama.cpp splits into single digits before the GPT-2
# rule (llama-vocab.cpp: "\\p{N}" then the GPT-2 pattern), as their own tokenizer.json does (a Digits pre-tokenizer).
_DIGITS_THEN_GPT2 = ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva", "mellum2")


def _split_digits_as_llama_cpp(tokenizer: Any, gguf_file: str) -> None:
    """transformers rebuilds these vocabularies with the GPT-2 rule alone, which keeps the whitespace before a digit
    apart from a run of spaces: SmolLM2 tokenized "\\n\\n  0." as "\\n\\n ", " ", "0" where llama.cpp and
    SmolLM2's own tokenizer give "\\n\\n  ", "0" (19 more tokens on the GPL v3 text)."""
    from tokenizers import pre_tokenizers

    from strata.gguf.reader import read_metadata

    metadata = read_metadata(gguf_file)
    if metadata.get("tokenizer.ggml.model") != "gpt2" or metadata.get("tokenizer.ggml.pre") not in _DIGITS_THEN_GPT2:
        return
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])


def read_chat_template(value: str | None) -> str | None:
    """--chat-template takes a file path or the template text itself."""
    if value is None:
        return None
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:
        pass
    return value


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]], chat_template: str | None = None,
                        add_generation_prompt: bool = True, **kwargs: Any) -> str:
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise RequestError("the model has no chat template; pass one with --chat-template "
                           "(or chat_template=...)", param="messages")
    try:
        return tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **kwargs)
    except Exception as e:  # noqa: BLE001 - jinja errors surface as many types
        raise RequestError(f"cannot apply the chat template to these messages: {e}", param="messages") from e


# apply_chat_template's own arguments, which a request's chat_template_kwargs may not set (as vLLM).
_NOT_TEMPLATE_KWARGS = ("chat_template", "tokenize", "conversation", "return_dict")


def chat_template_keywords(chat_template_kwargs: Mapping[str, Any] | None, add_generation_prompt: bool = True,
                           continue_final_message: bool = False, **fields: Any) -> tuple[bool, dict[str, Any]]:
    """(add_generation_prompt, the other keywords) a chat template renders with: the request's `fields` that are
    given (tools, documents), then its chat_template_kwargs (enable_thinking, ...), which win as in vLLM."""
    kwargs = {name: value for name, value in fields.items() if value is not None}
    extra = dict(chat_template_kwargs or {})
    reserved = sorted(set(extra) & set(_NOT_TEMPLATE_KWARGS))
    if reserved:
        raise RequestError(f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs")
    add_generation_prompt = bool(extra.pop("add_generation_prompt", add_generation_prompt))
    continue_final_message = bool(extra.pop("continue_final_message", continue_final_message))
    kwargs.update(extra)
    if continue_final_message:
        if add_generation_prompt:
            raise RequestError("continue_final_message and add_generation_prompt cannot both be true",
                               param="continue_final_message")
        kwargs["continue_final_message"] = True
    return add_generation_prompt, kwargs


def drops_special_markers(tokenizer: Any, markers: tuple[str, ...]) -> bool:
    """Whether decoding with skip_special_tokens loses any of `markers` (those that are special tokens)."""
    vocab = tokenizer.get_vocab()
    return any(marker in vocab and not tokenizer.decode([vocab[marker]], skip_special_tokens=True)
               for marker in markers)


def fast_decoder(tokenizer: Any, skip_special_tokens: bool = True):
    """ids -> text, through the Rust tokenizer directly when that gives the same text (6x faster)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns generated token ids into text one token at a time, handling stop strings.

    Text is only emitted once a token decodes to complete characters; with stop strings, the last
    few characters are held back from streaming until they cannot start a stop string.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: list[str],
                 include_stop: bool = False, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-(_CONTEXT_TOKENS + 1):])
        self.prefix_offset = max(len(self.ids) - _CONTEXT_TOKENS, 0)
        self.read_offset = len(self.ids)
        self.stop, self.include_stop = stop, include_stop
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self.holdback = max((len(s) for s in stop), default=1) - 1 if not include_stop else 0
        self._decode = fast_decoder(tokenizer, skip_special_tokens)

    def add(self, token_id: int) -> str | None:
        """Append one token; returns the stop string it completed, if any (text is then cut)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # an incomplete character: wait for more bytes
        new_text = full[len(prefix):]
        # Only ids from the new prefix on are decoded again: keep that window, not the whole output (its caller's).
        del self.ids[:self.read_offset]
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        search_from = max(len(self.text) - max((len(s) for s in self.stop), default=0) + 1, 0)
        self.text += new_text
        for stop in self.stop:
            at = self.text.find(stop, search_from)
            if at >= 0:
                self.text = self.text[: at + len(stop) if self.include_stop else at]
                return stop
        return None

    def flush(self) -> None:
        """At the end, keep whatever the last tokens decode to, incomplete characters included."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix):
            self.text += full[len(prefix):]
        self.prefix_offset = self.read_offset = len(self.ids)

    def visible_text(self, finished: bool) -> str:
        """The text that may be shown now: all of it once finished, else minus the held-back tail."""
        if finished or not self.stop or self.holdback == 0:
            return self.text
        return self.text[: max(len(self.text) - self.holdback, 0)]
