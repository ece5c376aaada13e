"""`strata bench latency --image`: the generated or file image, the figures of one image chat (encoder and prefill
inside the time to the first token) and transformers' Qwen2.5-VL encoder timed on the same pixels (same output)."""
from __future__ import annotations

import json

import pytest
from llama4_checkpoints import one_thread  # noqa: F401 (fixture)
from qwen2_5_vl_checkpoints import make_qwen2_5_vl

from strata.bench.image_latency import load_bench_image
from strata.cli import main


def test_image_is_generated_from_a_size_or_read_from_a_file(tmp_path):
    image = load_bench_image("64x48", seed=0)
    assert image.size == (64, 48) and image.mode == "RGB"
    assert image.tobytes() != load_bench_image("64x48", seed=1).tobytes()
    image.save(tmp_path / "a.png")
    assert load_bench_image(str(tmp_path / "a.png"), seed=5).tobytes() == image.tobytes()
    for bad in ("64x", "0x10", str(tmp_path / "missing.png")):
        with pytest.raises(SystemExit, match="--image"):
            load_bench_image(bad, seed=0)


def test_hf_encoder_needs_an_image(tmp_path):
    with pytest.raises(SystemExit, match="give --image"):
        main(["bench", "latency", "--model", str(tmp_path), "--hf-encoder"])


@pytest.mark.usefixtures("one_thread")
def test_image_chat_times_the_encoder_inside_the_first_token_and_beside_transformers(tmp_path, capsys):
    checkpoint = make_qwen2_5_vl(tmp_path / "qwen2_5_vl", seed=5)
    out = tmp_path / "image.json"
    assert main(["bench", "latency", "--model", str(checkpoint), "--image", "200x150", "--input-len", "8",
                 "--num-iters-warmup", "0", "--num-iters", "2", "--dtype", "float32", "--device", "cpu",
                 "--hf-encoder", "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert len(r["ttft"]) == len(r["encoder"]) == len(r["prefill"]) == 2
    assert all(0 < e and 0 < p and e + p < t for t, e, p in zip(r["ttft"], r["encoder"], r["prefill"], strict=True))
    assert r["patches"] == 80 and len(r["encoder_strata_s"]) == len(r["encoder_transformers_s"]) == 3
    assert r["encoder_max_abs_diff"] < 1e-4  # the same pixels and grid through both encoders
    printed = capsys.readouterr().out
    assert "vision encoder:" in printed and "time to first token:" in printed and "transformers' speed" in printed
