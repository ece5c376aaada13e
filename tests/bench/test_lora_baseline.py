"""The LoRA baseline bench's requests and servers: llama-server loads every adapter and a request sets each one's
scale with the "lora" field (its own at 1, all at 0 for the base); strata serves each adapter by name."""
from __future__ import annotations

from pathlib import Path

from strata.bench.lora_baseline import Files, _body, llama_server_command, main, strata_server_command


def _args(**changes):
    import argparse

    values = dict(num_loras=4, output_len=128, threads=2, concurrency=16, input_len=256, port=8131, llama_args="",
                  rank=16, dtype="float32")
    return argparse.Namespace(**{**values, **changes})


FILES = Files(Path("/m"), [Path(f"/a{i}") for i in range(4)], Path("/m.gguf"), [Path(f"/a{i}.gguf") for i in range(4)])


def test_llama_server_requests_pick_one_adapter_by_its_scale():
    body = _body("llama-server", [5, 6], _args(), adapter=2)
    assert body["lora"] == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}, {"id": 2, "scale": 1.0},
                            {"id": 3, "scale": 0.0}]
    assert body["n_predict"] == body["max_tokens"] == 128 and body["ignore_eos"] and body["prompt"] == [5, 6]
    # The base turns every adapter off (without the field a request gets them all at the server's scale).
    assert [a["scale"] for a in _body("llama-server", [5], _args(), adapter=None)["lora"]] == [0.0] * 4
    assert body["cache_prompt"] is False


def test_strata_requests_name_the_adapter():
    assert _body("strata", [5], _args(), adapter=3)["model"] == "lora3"
    assert _body("strata", [5], _args(), adapter=None)["model"] == "base"


def test_servers_load_every_adapter():
    llama = llama_server_command(FILES, _args(llama_args="--poll 0"))
    assert llama[llama.index("-np") + 1] == "16" and "--lora-init-without-apply" in llama
    assert [llama[i + 1] for i, a in enumerate(llama) if a == "--lora"] == [",".join(f"/a{i}.gguf" for i in range(4))]
    assert llama[-2:] == ["--poll", "0"]
    strata = strata_server_command(FILES, _args())
    assert strata[strata.index("--lora-modules") + 1:] == [f"lora{i}=/a{i}" for i in range(4)]
    assert strata[strata.index("--max-loras") + 1] == "4" and strata[strata.index("--max-lora-rank") + 1] == "16"


def test_help_describes_the_bench(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["--help"])
    assert "llama-server" in capsys.readouterr().out
