"""A checkpoint's config.json that is not a JSON object is refused in one line naming the file and where parsing
stopped, from ModelConfig and from the command line alike (no traceback)."""
from __future__ import annotations

import logging
import shutil

import pytest

from strata.cli import main
from strata.config import ModelConfig
from strata.config.hf_config import HFConfig, apply_hf_overrides, read_config_json
from strata.errors import ConfigError


@pytest.fixture
def broken(llama_tied, tmp_path):
    """A copy of a good checkpoint whose config.json has a stray comma after the first line's that ends in one: the
    line and column (1-based) of the second comma are worked out from the text here, not by a JSON parser."""
    folder = tmp_path / "broken"
    shutil.copytree(llama_tied, folder)
    lines = (folder / "config.json").read_text().splitlines()
    index = next(i for i, text in enumerate(lines) if text.endswith(","))
    lines[index] += ","
    (folder / "config.json").write_text("\n".join(lines))
    return folder, index + 1, len(lines[index])


def test_malformed_config_json_names_file_line_and_column(broken):
    folder, line, column = broken
    with pytest.raises(ConfigError) as caught:
        ModelConfig.from_path(str(folder))
    message = caught.value.message
    assert str(folder / "config.json") in message and f"line {line} column {column}" in message
    assert "\n" not in message


@pytest.mark.parametrize("text, what", [("[1, 2]", "list"), ('"x"', "str"), (b"\xff\xfe{}", "UTF-8")])
def test_config_json_must_be_an_object_of_utf8_text(tmp_path, text, what):
    path = tmp_path / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError, match=what):
        read_config_json(path)


def test_the_command_line_reports_it_in_one_line_and_exits_2(broken, caplog, capsys):
    folder, line, column = broken
    with caplog.at_level(logging.ERROR):
        assert main(["plan", str(folder)]) == 2
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is None
    assert "config.json is not valid JSON" in errors[0].getMessage()
    assert "Traceback" not in capsys.readouterr().err


def test_hf_overrides_are_applied_before_the_architecture_is_read(llama_tied):
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "is_matryoshka": True}
    config = ModelConfig.from_path(str(llama_tied), hf_overrides=overrides)
    assert config.architecture == "Qwen3ForSequenceClassification"
    assert config.hf_config.is_matryoshka is True and config.hf_config.hidden_size == 64


def test_hf_overrides_update_a_nested_section_key_by_key_and_replace_other_values():
    config = HFConfig({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "architectures": ["A"]})
    got = apply_hf_overrides(config, {"rope_scaling": {"factor": 2.0}, "architectures": ["B"], "new": 1})
    assert got.to_dict() == {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}, "architectures": ["B"], "new": 1}
    assert config.to_dict()["rope_scaling"]["factor"] == 4.0  # the original is left as it was


def test_hf_overrides_must_be_an_object(llama_tied):
    with pytest.raises(ConfigError, match="hf_overrides must be a JSON object"):
        ModelConfig.from_path(str(llama_tied), hf_overrides=["is_matryoshka"])
