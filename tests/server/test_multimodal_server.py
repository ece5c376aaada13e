"""The seed scenario through the server: multimodal Llama 4 with PP=2 answers image chats like one process."""
from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
from conftest import start_server, stop_server
from llama4_checkpoints import make_llama4_multimodal
from PIL import Image

from strata import LLM, SamplingParams

pytestmark = pytest.mark.slow
FLAGS = ["--max-model-len", "512", "--kv-cache-memory", "8M", "--max-num-seqs", "8", "--seed", "0",
         "--served-model-name", "l4"]


def image_message(seed: int, size: tuple[int, int]) -> list[dict]:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is in this picture?"}]}]


CONVERSATIONS = [image_message(1, (60, 150)), image_message(2, (150, 60)),
                 [{"role": "user", "content": "Once upon a time"}]]
PARAMS = [{"temperature": 0.0, "max_tokens": 8, "ignore_eos": True},
          {"temperature": 1.0, "seed": 11, "max_tokens": 8, "ignore_eos": True}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_llama4_multimodal(tmp_path_factory.mktemp("l4_server"), seed=7,
                                  text_overrides=dict(attention_chunk_size=16, no_rope_layer_interval=2))


@pytest.fixture(scope="module")
def expected(checkpoint) -> list[list[str]]:
    with LLM(str(checkpoint), max_model_len=512, kv_cache_memory=8 << 20, max_num_seqs=8) as llm:
        return [[o.outputs[0].text for o in llm.chat(CONVERSATIONS, SamplingParams(**p), use_tqdm=False)]
                for p in PARAMS]


@pytest.fixture(scope="module")
def pp_server(checkpoint, tmp_path_factory):
    server = start_server(checkpoint, tmp_path_factory.mktemp("l4_server_log") / "server.log", "-pp", "2", *FLAGS)
    yield server
    stop_server(server)


def chat(url: str, messages: list[dict], params: dict, stream: bool) -> str:
    body = {"model": "l4", "messages": messages, "stream": stream, **params}
    if not stream:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]
    text = ""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"]
                text += (delta[0]["delta"].get("content") or "") if delta else ""
    return text


@pytest.mark.parametrize("stream", [False, True])
def test_pp2_server_answers_image_and_text_chats_like_one_process(pp_server, expected, stream):
    got = [[chat(pp_server.url, c, p, stream) for c in CONVERSATIONS] for p in PARAMS]
    assert got == expected
    assert expected[0][0] != expected[0][1]  # the pixels matter, so a dropped image would show


def test_remote_images_and_unlisted_local_files_are_refused(pp_server, tmp_path):
    for url, flag in (("https://example.com/cat.png", "--allow-remote-media"),
                      (str(tmp_path / "cat.png"), "--allowed-local-media-path")):
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
        r = httpx.post(f"{pp_server.url}/v1/chat/completions", json={"model": "l4", "messages": messages},
                       timeout=60)
        assert r.status_code == 400 and flag in r.json()["error"]["message"]
    assert chat(pp_server.url, CONVERSATIONS[2], PARAMS[0], stream=False)
