"""Gemma 3 with images through `strata serve` and the openai client: data URIs and allowed local files, streaming,
the 400s of images over the limits (count, pixels, corrupt, video parts), and the decoded-image cache held within
--mm-processor-cache-gb across 200 requests with distinct images."""
from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from conftest import read_metrics, start_server, stop_server
from gemma3_vision_checkpoints import make_gemma3_vision
from llama4_checkpoints import data_uri, noise_image

CACHE_GB = 0.00005  # 53687 bytes: 69 of the 16 x 16 RGB images sent below (768 bytes each)
CACHE_BYTES = int(CACHE_GB * (1 << 30))
GREEDY = {"temperature": 0, "max_tokens": 4}


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    return tmp_path_factory.mktemp("gemma3_media")


@pytest.fixture(scope="module")
def server(tmp_path_factory, media):
    checkpoint = make_gemma3_vision(tmp_path_factory.mktemp("gemma3_server"), seed=3)
    srv = start_server(checkpoint, tmp_path_factory.mktemp("gemma3_server_log") / "server.log",
                       "--served-model-name", "g3", "--max-model-len", "256", "--kv-cache-memory", "8M",
                       "--limit-mm-per-prompt", '{"image": 2}', "--max-image-pixels", "10000",
                       "--mm-processor-cache-gb", str(CACHE_GB), "--allowed-local-media-path", str(media))
    yield srv
    assert stop_server(srv) == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def chat_messages(*urls: str, video: bool = False) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    if video:
        parts.append({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}})
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "Describe this."}]}]


def answer(client, messages: list[dict], **params) -> str:
    return client.chat.completions.create(model="g3", messages=messages, **{**GREEDY, **params}).choices[0] \
        .message.content


def test_data_uris_and_local_files_stream_like_whole_responses(client, media):
    images = [noise_image(40, 50, seed=1), noise_image(30, 20, seed=2)]
    images[1].save(media / "second.png")
    messages = chat_messages(data_uri(images[0]), str(media / "second.png"))
    whole = answer(client, messages)
    stream = client.chat.completions.create(model="g3", messages=messages, stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole
    assert answer(client, chat_messages(*map(data_uri, images))) == whole  # the file is the same image
    assert answer(client, chat_messages(data_uri(images[1]), data_uri(images[0]))) != whole


def corrupt_png() -> str:
    buf = io.BytesIO()
    noise_image(20, 20, seed=4).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()[:-40]).decode()


@pytest.mark.parametrize(("urls", "video", "message"), [
    ((data_uri(noise_image(8, 8, seed=5)),) * 3, False, "3 images, over this server's limit of 2"),
    ((data_uri(noise_image(100, 101, seed=6)),), False, r"over this server's limit of 10000 \(max_image_pixels\)"),
    ((corrupt_png(),), False, "could not decode the image"),
    ((), True, "video inputs are not supported")])
def test_requests_over_the_image_limits_are_400s(client, urls, video, message):
    with pytest.raises(openai.BadRequestError, match=message):
        answer(client, chat_messages(*urls, video=video))


def test_the_image_cache_stays_within_its_bound_across_200_distinct_images(client, server):
    before = read_metrics(server.url)
    urls = [data_uri(noise_image(16, 16, seed=1000 + i)) for i in range(200)]
    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(lambda u: answer(client, chat_messages(u), max_tokens=1) is not None, urls))
    answer(client, chat_messages(urls[-1]), max_tokens=1)  # the most recent image is still cached
    after = read_metrics(server.url)
    assert after["strata:mm_cache_queries_total"] - before["strata:mm_cache_queries_total"] == 201
    assert after["strata:mm_cache_hits_total"] - before["strata:mm_cache_hits_total"] == 1
    assert after["strata:mm_cache_bytes"] <= CACHE_BYTES
    assert after["strata:mm_cache_items"] == CACHE_BYTES // (16 * 16 * 3)
