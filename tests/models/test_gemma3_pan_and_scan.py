"""Gemma 3 pan-and-scan crops against transformers: the crop boxes of Gemma3ImageProcessor, the prompt ids of
Gemma3Processor, and greedy tokens and logprobs of Gemma3ForConditionalGeneration, with crops enabled by
preprocessor_config.json or per request (vLLM's `mm_processor_kwargs`)."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from gemma3_vision_checkpoints import TOKEN, TOKENS_PER_IMAGE, make_gemma3_vision
from llama4_checkpoints import noise_image, one_thread  # noqa: F401 (fixture)
from test_gemma3_vision import MAX_TOKENS, as_run, assert_same, conversation, hf_conversation, transformers_run
from transformers import AutoProcessor, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil

from strata import LLM, SamplingParams
from strata.errors import ConfigError, RequestError
from strata.multimodal.gemma3_image import Gemma3ImageConfig, pan_and_scan_boxes

pytestmark = pytest.mark.usefixtures("one_thread")
# Crops of 64 pixels and more: a 640x200 image gives three (the default 256 needs far larger images).
PANNED = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 64}
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
SOFT = TOKEN["<image_soft_token>"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_gemma3_vision(tmp_path_factory.mktemp("gemma3_pas"), seed=5)


@pytest.fixture(scope="module")
def panned(checkpoint, tmp_path_factory):
    """The checkpoint with PANNED in its image processor's config."""
    folder = tmp_path_factory.mktemp("gemma3_pas_config") / "model"
    shutil.copytree(checkpoint, folder)
    processor = json.loads((folder / "processor_config.json").read_text())
    processor["image_processor"].update(PANNED)
    (folder / "processor_config.json").write_text(json.dumps(processor))
    return folder


@pytest.fixture(scope="module")
def hf(checkpoint):
    return Gemma3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.mark.parametrize("options", [PANNED, {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 32,
                                              "pan_and_scan_max_num_crops": 3},
                                     {"do_pan_and_scan": True, "pan_and_scan_min_ratio_to_activate": 2.5}])
def test_crop_boxes_are_transformers_crops(options):
    config = Gemma3ImageConfig(32, 16, 0, 0, 0, pan_and_scan_min_crop_size=64).with_kwargs(options)
    reference = Gemma3ImageProcessorPil()
    keys = ("pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops", "pan_and_scan_min_ratio_to_activate")
    for height, width in ((200, 640), (640, 200), (199, 641), (280, 900), (250, 300), (100, 1000), (60, 60),
                          (300, 5000), (64, 100), (70, 1000)):
        pixels = np.random.default_rng(width).integers(0, 256, (3, height, width), dtype=np.uint8)
        expected = reference.pan_and_scan(pixels, **{k: getattr(config, k) for k in keys})
        got = [pixels[:, top:bottom, left:right] for left, top, right, bottom in pan_and_scan_boxes(width, height,
                                                                                                    config)]
        assert len(got) == len(expected), (height, width)
        assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))


def test_options_come_from_the_preprocessor_config_over_the_processor_defaults():
    config = {"vision_config": {"image_size": 32}, "image_token_index": 7, "boi_token_index": 5,
              "eoi_token_index": 6}
    nulls = Gemma3ImageConfig.from_hf_config(config, {"do_pan_and_scan": None, "pan_and_scan_max_num_crops": None})
    assert (nulls.do_pan_and_scan, nulls.pan_and_scan_min_crop_size, nulls.pan_and_scan_max_num_crops,
            nulls.pan_and_scan_min_ratio_to_activate) == (False, 256, 4, 1.2)
    set_ = Gemma3ImageConfig.from_hf_config(config, {"do_pan_and_scan": True, "pan_and_scan_min_ratio_to_activate": 2})
    assert set_.do_pan_and_scan and set_.pan_and_scan_min_ratio_to_activate == 2.0
    assert set_.with_kwargs({"do_pan_and_scan": False}).do_pan_and_scan is False
    with pytest.raises(ConfigError, match="do_pan_and_scan must be true or false"):
        Gemma3ImageConfig.from_hf_config(config, {"do_pan_and_scan": "yes"})
    with pytest.raises(RequestError, match=r"mm_processor_kwargs \['min_pixels'\] are not supported"):
        nulls.with_kwargs({"min_pixels": 10})
    with pytest.raises(RequestError, match="pan_and_scan_min_crop_size must be a positive integer"):
        nulls.with_kwargs({"pan_and_scan_min_crop_size": 0})


def test_crops_from_the_preprocessor_config_give_transformers_tokens_and_logprobs(panned, hf):
    """A wide image (3 crops) alone, and with a square one that stays whole, batched, the prefill cut into 20-token
    chunks (each image and crop is a 16-token bidirectional block): prompts, greedy tokens and logprobs as
    transformers gives them with the same options. limit_mm_per_prompt counts the images (2), not the crops (5)."""
    processor = AutoProcessor.from_pretrained(panned)
    wide, square = noise_image(200, 640, seed=1), noise_image(60, 60, seed=2)
    expected = [transformers_run(hf, processor, hf_conversation(wide), images_kwargs=PANNED),
                transformers_run(hf, processor, hf_conversation(wide, square, text="Compare them."),
                                 images_kwargs=PANNED)]
    assert [e["prompt"].count(SOFT) for e in expected] == [4 * TOKENS_PER_IMAGE, 5 * TOKENS_PER_IMAGE]
    with LLM(str(panned), dtype="float32", device="cpu", max_num_batched_tokens=20, max_num_seqs=2,
             limit_mm_per_prompt={"image": 2}) as llm:
        outputs = llm.chat([conversation(wide), conversation(wide, square, text="Compare them.")], PARAMS,
                           use_tqdm=False)
    for got, want in zip(outputs, expected, strict=True):
        assert_same(as_run(got), want)


def test_mm_processor_kwargs_turn_pan_and_scan_on_per_request(checkpoint, hf):
    """{"do_pan_and_scan": true} (the processor's 256-pixel crops: three of a 900x280 image) through LLM.chat and in
    a prompt's mm_processor_kwargs; without it the image stays whole; other keys and bad values are refused."""
    processor = AutoProcessor.from_pretrained(checkpoint)
    image, on = noise_image(280, 900, seed=3), {"do_pan_and_scan": True}
    expected = transformers_run(hf, processor, hf_conversation(image), images_kwargs=on)
    assert expected["prompt"].count(SOFT) == 4 * TOKENS_PER_IMAGE
    whole = processor.apply_chat_template(hf_conversation(image), tokenize=True, return_dict=True,
                                          add_generation_prompt=True)["input_ids"][0]
    text = processor.apply_chat_template(hf_conversation(image), tokenize=False, add_generation_prompt=True)
    with LLM(str(checkpoint), dtype="float32", device="cpu") as llm:
        assert_same(as_run(llm.chat(conversation(image), PARAMS, use_tqdm=False, mm_processor_kwargs=on)[0]),
                    expected)
        prompt = {"prompt": text, "multi_modal_data": {"image": image}, "mm_processor_kwargs": on}
        assert_same(as_run(llm.generate(prompt, PARAMS, use_tqdm=False)[0]), expected)
        plain = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, PARAMS, use_tqdm=False)[0]
        assert plain.prompt_token_ids == list(whole) and list(whole).count(SOFT) == TOKENS_PER_IMAGE
        with pytest.raises(RequestError, match="not supported"):
            llm.chat(conversation(image), PARAMS, use_tqdm=False, mm_processor_kwargs={"fps": 2})
        with pytest.raises(RequestError, match="do_pan_and_scan must be true or false"):
            llm.chat(conversation(image), PARAMS, use_tqdm=False, mm_processor_kwargs={"do_pan_and_scan": 1})
