"""What a request may send a multimodal model: limit_mm_per_prompt (vLLM's option), the pixel bound checked from an
image's header before decoding, video parts refused, and the decoded-image cache's byte bound."""
from __future__ import annotations

import base64
import struct
import warnings
import zlib

import pytest
from gemma3_vision_checkpoints import make_gemma3_vision
from llama4_checkpoints import data_uri, noise_image
from PIL import Image

from strata import LLM, SamplingParams
from strata.config.multimodal_config import DEFAULT_MAX_IMAGE_PIXELS, multimodal_config
from strata.errors import ConfigError, RequestError
from strata.multimodal.image_cache import ImageCache, image_key
from strata.multimodal.image_loading import load_image


def png_header_only(width: int, height: int) -> bytes:
    """A 69-byte PNG that declares width x height pixels: decoding it would allocate them all."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


def as_data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_chat(*urls: str, extra: list[dict] | None = None) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, *(extra or []), {"type": "text", "text": "Describe this."}]}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    checkpoint = make_gemma3_vision(tmp_path_factory.mktemp("gemma3_limits"), seed=3)
    with LLM(str(checkpoint), dtype="float32", device="cpu", limit_mm_per_prompt={"image": 1},
             max_image_pixels=64 * 64) as llm:
        yield llm


PARAMS = SamplingParams(temperature=0, max_tokens=2)


def test_more_images_than_the_limit_are_refused_naming_it(llm):
    two = [noise_image(20, 20, seed=1), noise_image(20, 20, seed=2)]
    with pytest.raises(RequestError, match=r"2 images, over this server's limit of 1 .*limit_mm_per_prompt"):
        llm.chat(image_chat(*map(data_uri, two)), PARAMS, use_tqdm=False)
    with pytest.raises(RequestError, match="limit_mm_per_prompt"):
        llm.generate({"prompt": "<start_of_image><start_of_image>", "multi_modal_data": {"image": two}}, PARAMS,
                     use_tqdm=False)
    assert llm.chat(image_chat(data_uri(two[0])), PARAMS, use_tqdm=False)[0].outputs[0].token_ids


def test_video_parts_are_refused_as_unsupported(llm):
    video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    with pytest.raises(RequestError, match="video inputs are not supported") as err:
        llm.chat(image_chat(extra=[video]), PARAMS, use_tqdm=False)
    assert err.value.param == "messages.0.content.0"


def test_images_over_the_pixel_bound_are_refused(llm):
    with pytest.raises(RequestError, match="65x64 = 4160 pixels, over this server's limit of 4096"):
        llm.chat(image_chat(data_uri(noise_image(64, 65, seed=1))), PARAMS, use_tqdm=False)


def test_a_header_declaring_too_many_pixels_is_refused_before_decoding():
    """100M pixels: over the default bound, under twice Pillow's, where Pillow itself only warns and decodes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with pytest.raises(RequestError, match="10000x10000 = 100000000 pixels.*max_image_pixels"):
            load_image(as_data_uri(png_header_only(10_000, 10_000)), max_pixels=DEFAULT_MAX_IMAGE_PIXELS)


def test_decoded_images_are_cached_by_their_bytes_within_the_byte_bound():
    cache = ImageCache(max_bytes=3 * 16 * 16 * 3)  # three 16 x 16 RGB images
    urls = [data_uri(noise_image(16, 16, seed=i)) for i in range(5)]
    first = load_image(urls[0], cache=cache)
    assert load_image(urls[0], cache=cache) is first and (cache.queries, cache.hits) == (2, 1)
    for url in urls[1:]:
        load_image(url, cache=cache)
    assert len(cache) == 3 and cache.num_bytes == 3 * 16 * 16 * 3
    assert cache.get(image_key(base64.b64decode(urls[0].split(",")[1]))) is None  # the least recently used went
    cache.put(b"big", noise_image(64, 64, seed=9))  # larger than the whole cache: not kept
    assert len(cache) == 3


@pytest.mark.parametrize(("limits", "message"), [
    ({"video": 1}, "takes images only"), ({"image": -1}, "non-negative integer"),
    ({"3d": 1}, "unknown modality"), ({"image": "2"}, "non-negative integer")])
def test_bad_limit_mm_per_prompt_is_refused(limits, message):
    with pytest.raises(ConfigError, match=message):
        multimodal_config(limits, 4.0, DEFAULT_MAX_IMAGE_PIXELS, is_multimodal=True)
    assert multimodal_config({"image": 2, "video": 0}, 0, 100, True).image_limit == 2
