"""Gemma 3 with images under TP=2 (the SigLIP tower's heads and MLP sharded) and PP=2 (the tower on the first stage):
the greedy tokens of one process (checked against transformers in test_gemma3_vision.py) for one and two images."""
from __future__ import annotations

import pytest
from gemma3_vision_checkpoints import make_gemma3_vision
from llama4_checkpoints import data_uri, noise_image, one_thread  # noqa: F401 (fixture)

from strata import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def chat(*images, text: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_uri(i)}} for i in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


CONVERSATIONS = [chat(noise_image(40, 50, seed=1), text="Describe this."),
                 chat(noise_image(20, 70, seed=2), noise_image(90, 33, seed=3), text="Compare them.")]


def greedy_tokens(checkpoint, **layout) -> list[list[int]]:
    # 20-token steps: an image's 16 tokens fit one, so prefills are chunked around the images.
    with LLM(str(checkpoint), dtype="float32", device="cpu", max_num_batched_tokens=20, **layout) as llm:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.chat(CONVERSATIONS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_gemma3_vision(tmp_path_factory.mktemp("gemma3_vision_layouts"), seed=3)


@pytest.fixture(scope="module")
def reference(checkpoint) -> list[list[int]]:
    tokens = greedy_tokens(checkpoint)
    assert tokens[0] != tokens[1]  # the images change the tokens, so a dropped image would show
    return tokens


def test_tp2_gives_one_process_tokens_with_images(checkpoint, reference):
    assert greedy_tokens(checkpoint, tensor_parallel_size=2) == reference


def test_pp2_gives_one_process_tokens_with_images(checkpoint, reference):
    assert greedy_tokens(checkpoint, pipeline_parallel_size=2) == reference
