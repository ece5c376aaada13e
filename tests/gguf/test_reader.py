"""strata's GGUF reader against the `gguf` package's: metadata, tensor directory and bytes, split files, and the
files it must refuse."""
from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
from gguf_checkpoints import write_gguf

from strata.errors import ConfigError
from strata.gguf import types
from strata.gguf.reader import GGUFModel


def _same_metadata(ours: dict, reader: gguf.GGUFReader) -> None:
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        expected = field.contents()
        got = ours[key]
        if isinstance(expected, float):
            assert got == pytest.approx(expected), key
        else:
            assert got == expected, key


def test_metadata_and_tensor_bytes_match_the_gguf_package(gguf_all_types):
    ours, reference = GGUFModel([gguf_all_types]), gguf.GGUFReader(gguf_all_types)
    _same_metadata(ours.metadata, reference)
    assert set(ours.tensors) == {t.name for t in reference.tensors}
    for tensor in reference.tensors:
        entry = ours.tensors[tensor.name]
        assert entry.ggml_type == int(tensor.tensor_type)
        assert entry.shape == tuple(reversed([int(d) for d in tensor.shape]))
        assert np.array_equal(ours.raw(tensor.name).reshape(-1), np.asarray(tensor.data).view(np.uint8).reshape(-1))


def test_split_model_reads_every_part_and_refuses_a_missing_one(gguf_all_types, tmp_path):
    hf = gguf_all_types.parent / "hf"
    parts = write_gguf(hf, tmp_path / "split.gguf", lambda name, shape: types.Q8_0, split=3)
    whole = write_gguf(hf, tmp_path / "whole.gguf", lambda name, shape: types.Q8_0)[0]
    split, single = GGUFModel(parts), GGUFModel([whole])
    assert split.tensors.keys() == single.tensors.keys()
    for name in single.tensors:
        assert np.array_equal(split.raw(name), single.raw(name))
    with pytest.raises(ConfigError, match="split into 3 files, but 2 were given"):
        GGUFModel(parts[:2])


def test_truncated_and_foreign_files_are_refused(gguf_all_types, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    data = gguf_all_types.read_bytes()
    truncated.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ConfigError, match="past the end of the file"):
        GGUFModel([truncated])
    truncated.write_bytes(data[:300])
    with pytest.raises(ConfigError, match="ends early"):
        GGUFModel([truncated])
    foreign = tmp_path / "model.gguf"
    shutil.copy(hf_config := gguf_all_types.parent / "hf" / "config.json", foreign)
    with pytest.raises(ConfigError, match="not a GGUF file"):
        GGUFModel([foreign])
    assert hf_config.is_file()


@pytest.mark.parametrize("ggml_type, name", [(20, "IQ4_NL"), (34, "TQ1_0"), (11, "Q3_K"), (77, "unknown type 77")])
def test_tensor_types_strata_does_not_read_are_refused_naming_tensor_and_type(tmp_path, ggml_type, name):
    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 64), dtype=np.uint8), raw_shape=(4, 64 * 8),
                      raw_dtype=gguf.GGMLQuantizationType.I8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    raw = bytearray(path.read_bytes())
    at = raw.find(b"blk.0.attn_q.weight") + len("blk.0.attn_q.weight") + 4 + 2 * 8  # name, n_dims, two dims
    raw[at:at + 4] = ggml_type.to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match=rf"'blk\.0\.attn_q\.weight' has type {name} .*which strata does not run"):
        GGUFModel([path])
