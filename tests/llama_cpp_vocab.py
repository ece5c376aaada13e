"""llama.cpp's own tokenizer through its C API (ctypes on the libllama.so a llama.cpp build leaves in build/bin): a GGUF
file's vocabulary loaded alone (`vocab_only`), text -> ids with `llama_tokenize`. The oracle for tokenizers strata
builds itself; without a built library the tests that need it are skipped."""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
from llama_cpp_gguf import LLAMA_CPP

LIBLLAMA = Path(os.environ.get("STRATA_LIBLLAMA", LLAMA_CPP / "build" / "bin" / "libllama.so"))
needs_libllama = pytest.mark.skipif(not LIBLLAMA.is_file(), reason=f"no built libllama.so at {LIBLLAMA} (build "
                                    "llama.cpp, or set STRATA_LIBLLAMA); the recorded fixture checks the same ids")


class _ModelParams(ctypes.Structure):
    """struct llama_model_params (include/llama.h)."""
    _fields_ = [("devices", ctypes.c_void_p), ("tensor_buft_overrides", ctypes.c_void_p),
                ("n_gpu_layers", ctypes.c_int32), ("split_mode", ctypes.c_int), ("load_mode", ctypes.c_int),
                ("lazy_mode", ctypes.c_int), ("main_gpu", ctypes.c_int32), ("tensor_split", ctypes.c_void_p),
                ("progress_callback", ctypes.c_void_p), ("progress_callback_user_data", ctypes.c_void_p),
                ("kv_overrides", ctypes.c_void_p), ("vocab_only", ctypes.c_bool), ("check_tensors", ctypes.c_bool),
                ("use_extra_bufts", ctypes.c_bool), ("no_host", ctypes.c_bool), ("no_alloc", ctypes.c_bool),
                ("load_mtp", ctypes.c_bool)]


_LOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_quiet = _LOG_CALLBACK(lambda level, text, user_data: None)  # kept alive: libllama holds the pointer


def _library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(LIBLLAMA))
    lib.llama_log_set.argtypes = [_LOG_CALLBACK, ctypes.c_void_p]
    lib.llama_log_set(_quiet, None)
    lib.llama_backend_init()
    lib.llama_model_default_params.restype = _ModelParams
    lib.llama_model_load_from_file.argtypes = [ctypes.c_char_p, _ModelParams]
    lib.llama_model_load_from_file.restype = ctypes.c_void_p
    lib.llama_model_get_vocab.argtypes = [ctypes.c_void_p]
    lib.llama_model_get_vocab.restype = ctypes.c_void_p
    lib.llama_model_free.argtypes = [ctypes.c_void_p]
    lib.llama_tokenize.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32),
                                   ctypes.c_int32, ctypes.c_bool, ctypes.c_bool]
    lib.llama_tokenize.restype = ctypes.c_int32
    return lib


class LlamaVocab:
    """The vocabulary of one GGUF file in libllama; `with LlamaVocab(path) as vocab: vocab.tokenize(text)`."""

    def __init__(self, gguf_file: Path) -> None:
        self._lib = _library()
        params = self._lib.llama_model_default_params()
        params.vocab_only = True
        self._model = self._lib.llama_model_load_from_file(str(gguf_file).encode(), params)
        if not self._model:
            raise RuntimeError(f"libllama could not load the vocabulary of {gguf_file}")
        self._vocab = self._lib.llama_model_get_vocab(self._model)

    def tokenize(self, text: str, parse_special: bool = True, add_special: bool = False) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8  # at most one token per byte, plus what add_special adds
        out = (ctypes.c_int32 * capacity)()
        n = self._lib.llama_tokenize(self._vocab, data, len(data), out, capacity, add_special, parse_special)
        if n < 0:
            raise RuntimeError(f"llama_tokenize needs {-n} tokens for {text!r}")
        return list(out[:n])

    def close(self) -> None:
        if self._model:
            self._lib.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> LlamaVocab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
