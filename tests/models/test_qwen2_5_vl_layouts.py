"""Qwen2.5-VL with images under TP=2 (the vision tower's heads and MLPs sharded) and PP=2 (the tower on the first
stage): the greedy tokens of one process (checked against transformers in test_qwen2_5_vl.py) for one and two images
of different sizes."""
from __future__ import annotations

import pytest
from llama4_checkpoints import one_thread  # noqa: F401 (fixture)
from qwen2_5_vl_checkpoints import data_uri, make_qwen2_5_vl, noise_image

from strata import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def chat(*images, text: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_uri(i)}} for i in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


# 8 image tokens; then 20 and 6 (ragged windows in the first of the two)
CONVERSATIONS = [chat(noise_image(60, 100, seed=1), text="Describe this."),
                 chat(noise_image(150, 200, seed=2), noise_image(90, 40, seed=3), text="Compare them.")]


def greedy_tokens(checkpoint, **layout) -> list[list[int]]:
    # 16-token steps: the prefills are chunked through the images (the 20-token one spans two steps).
    with LLM(str(checkpoint), dtype="float32", device="cpu", max_num_batched_tokens=16, **layout) as llm:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.chat(CONVERSATIONS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl_layouts"), seed=5)


@pytest.fixture(scope="module")
def reference(checkpoint) -> list[list[int]]:
    tokens = greedy_tokens(checkpoint)
    assert tokens[0] != tokens[1]  # the images change the tokens, so a dropped image would show
    return tokens


def test_tp2_gives_one_process_tokens_with_images(checkpoint, reference):
    assert greedy_tokens(checkpoint, tensor_parallel_size=2) == reference


def test_pp2_gives_one_process_tokens_with_images(checkpoint, reference):
    assert greedy_tokens(checkpoint, pipeline_parallel_size=2) == reference
