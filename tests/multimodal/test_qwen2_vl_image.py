"""Qwen2.5-VL's prompt side against transformers' Qwen2_5_VLProcessor and `get_rope_index`: token ids and patches
for images smaller than min_pixels, larger than max_pixels and of extreme aspect ratios, per-request bounds, the
prompt's M-RoPE positions; and how a step's positions are built from them (strata/layers/mrope.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from qwen2_5_vl_checkpoints import TOKEN, hf_processor, make_qwen2_5_vl, noise_image
from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

from strata.config import ModelConfig
from strata.errors import RequestError
from strata.layers.mrope import step_positions
from strata.layers.rotary import RotaryEmbedding
from strata.multimodal.chat import ImagePromptProcessor
from strata.multimodal.qwen2_vl_image import Qwen2VLImageInputs, smart_resize

PROMPT = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hi<|vision_start|><|image_pad|><|vision_end|>" \
         "Compare them.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl_image"), seed=1)


@pytest.fixture(scope="module")
def ours(checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return ImagePromptProcessor.for_model(ModelConfig.from_path(str(checkpoint)), tokenizer)


@pytest.mark.parametrize("sizes", [((60, 100), (150, 200)), ((10, 12), (500, 90)), ((28, 1400), (33, 57))])
def test_ids_patches_and_positions_equal_transformers(checkpoint, ours, monkeypatch, sizes):
    images = [noise_image(h, w, seed=i) for i, (h, w) in enumerate(sizes)]
    expected = hf_processor(checkpoint, monkeypatch)(text=[PROMPT], images=images, return_tensors="pt")
    ids, inputs = ours.process_text(PROMPT, images)
    assert ids == expected["input_ids"][0].tolist()
    assert [list(g) for g in inputs.grid_thw] == expected["image_grid_thw"].tolist()
    assert torch.equal(torch.cat(inputs.pixel_values), expected["pixel_values"])
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint)
    positions, delta = hf.model.get_rope_index(expected["input_ids"], expected["mm_token_type_ids"],
                                               expected["image_grid_thw"])
    positions, end = positions[:, 0].numpy(), inputs.mrope_positions.shape[1]
    assert inputs.mrope_delta == delta.item()
    assert np.array_equal(inputs.mrope_positions, positions[:, :end])
    assert np.array_equal(positions[:, end:], np.arange(end, len(ids))[None].repeat(3, 0) + inputs.mrope_delta)


def test_per_request_pixel_bounds_equal_the_processor_given_them(checkpoint, ours, monkeypatch):
    images = [noise_image(150, 200, seed=3), noise_image(40, 40, seed=4)]
    size = {"shortest_edge": 28 * 28 * 8, "longest_edge": 28 * 28 * 8}
    expected = hf_processor(checkpoint, monkeypatch)(text=[PROMPT], images=images, size=size, return_tensors="pt")
    ids, inputs = ours.process_text(PROMPT, images, {"min_pixels": 28 * 28 * 8, "max_pixels": 28 * 28 * 8})
    assert ids == expected["input_ids"][0].tolist()
    assert torch.equal(torch.cat(inputs.pixel_values), expected["pixel_values"])
    for bad, match in (({"fps": 1}, "not supported"), ({"max_pixels": 0}, "positive"),
                       ({"min_pixels": 5000, "max_pixels": 4000}, "exceeds")):
        with pytest.raises(RequestError, match=match):
            ours.process_text(PROMPT, images, bad)


def test_placeholder_count_and_aspect_ratio_are_checked(ours):
    with pytest.raises(RequestError, match="2 <|image_pad|> placeholders but 1 images"):
        ours.process_text(PROMPT, [noise_image(30, 30, seed=0)])
    with pytest.raises(RequestError, match="aspect ratio"):
        smart_resize(10, 2010, 28, 56 * 56, 28 * 28 * 1280)


def test_step_positions_are_plain_unless_a_row_is_inside_an_image():
    table = np.array([[0, 1, 1, 1, 1], [0, 1, 1, 2, 2], [0, 1, 2, 1, 2]])  # a 2 x 2 image at prompt index 1
    mm = Qwen2VLImageInputs([], [], b"", 1, table, -2)
    plain = torch.arange(3)
    assert step_positions([(0, 3)], [None], plain) is plain
    decode = step_positions([(9, 1), (4, 1)], [mm, None], torch.tensor([9, 4]))
    assert decode.tolist() == [7, 4]  # all three rows equal: one row, shifted by the delta
    prefill = step_positions([(0, 2), (3, 4)], [None, mm], torch.arange(6))
    assert prefill.tolist() == [[0, 1, 1, 1, 3, 4], [0, 1, 2, 2, 3, 4], [0, 1, 1, 2, 3, 4]]


def test_mrope_rotation_reads_each_section_from_its_row():
    rotary, plain = RotaryEmbedding(16, 10000.0, mrope_section=(2, 3, 3)), RotaryEmbedding(16, 10000.0)
    positions = torch.tensor([[3, 4], [5, 6], [7, 8]])
    cos, _ = rotary.cos_sin(positions, torch.float32)
    rows = [plain.cos_sin(positions[r], torch.float32)[0] for r in range(3)]
    assert torch.equal(cos, torch.cat([rows[0][:, :2], rows[1][:, 2:5], rows[2][:, 5:]], dim=1))
    assert torch.equal(rotary.cos_sin(positions[0], torch.float32)[0], rows[0])
    assert TOKEN["<|image_pad|>"] == 5
