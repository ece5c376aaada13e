"""Qwen2.5-VL through `strata serve` and the openai client: a chat completion's `mm_processor_kwargs` (vLLM's
request field) sets the image's pixel bounds, so its image token count is transformers' processor's under the same
bounds; unknown keys, bad values and a model whose processor takes none are 400s."""
from __future__ import annotations

import openai
import pytest
from conftest import start_server, stop_server
from qwen2_5_vl_checkpoints import MIN_PIXELS, data_uri, hf_processor, make_qwen2_5_vl, noise_image

pytestmark = pytest.mark.slow
IMAGE = noise_image(150, 200, seed=4)  # 20 image tokens under the checkpoint's own max_pixels


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl_server"), seed=5)


@pytest.fixture(scope="module")
def qwen(checkpoint, tmp_path_factory):
    srv = start_server(checkpoint, tmp_path_factory.mktemp("qwen2_5_vl_server_log") / "server.log",
                       "--served-model-name", "qwen", "--max-model-len", "256", "--kv-cache-memory", "8M")
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)
    assert stop_server(srv) == 0


def messages(text: str = "Describe this.") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(IMAGE)}},
                                         {"type": "text", "text": text}]}]


def prompt_tokens(client, model: str = "qwen", **kwargs) -> int:
    extra = {"mm_processor_kwargs": kwargs} if kwargs else None
    out = client.chat.completions.create(model=model, messages=messages(), temperature=0, max_tokens=2,
                                         extra_body=extra)
    return out.usage.prompt_tokens


def transformers_prompt_tokens(checkpoint, monkeypatch, **size) -> int:
    processor = hf_processor(checkpoint, monkeypatch)
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this."}]}]
    text = processor.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return processor(text=[text], images=[IMAGE], return_tensors="pt", **size)["input_ids"].shape[1]


def test_max_pixels_sets_the_image_token_count_as_transformers_does(qwen, checkpoint, monkeypatch):
    default = prompt_tokens(qwen)
    assert default == transformers_prompt_tokens(checkpoint, monkeypatch)
    for max_pixels in (28 * 28 * 8, 28 * 28 * 4):
        bounded = transformers_prompt_tokens(checkpoint, monkeypatch,
                                             size={"shortest_edge": MIN_PIXELS, "longest_edge": max_pixels})
        assert prompt_tokens(qwen, max_pixels=max_pixels) == bounded
    assert default - bounded == 18  # 20 image tokens down to 2 (28 x 56 pixels)
    assert prompt_tokens(qwen, min_pixels=28 * 28, max_pixels=28 * 28 * 4) == bounded


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"fps": 2}, r"\['fps'\] are not supported"),
    ({"max_pixels": "1000"}, "must be a positive integer"),
    ({"max_pixels": 0}, "must be a positive integer"),
    ({"min_pixels": 28 * 28 * 8, "max_pixels": 28 * 28 * 4}, "exceeds max_pixels")])
def test_bad_processor_kwargs_are_400s(qwen, kwargs, message):
    with pytest.raises(openai.BadRequestError, match=message):
        prompt_tokens(qwen, **kwargs)


def test_a_model_without_processor_kwargs_refuses_them(client):
    """The session's text-only Llama: its (absent) processor takes no options, so even a text chat is refused."""
    with pytest.raises(openai.BadRequestError, match="mm_processor_kwargs is not supported"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                       extra_body={"mm_processor_kwargs": {"max_pixels": 1000}})
