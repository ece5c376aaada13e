"""Qwen2.5-VL against transformers' own Qwen2_5_VLForConditionalGeneration and Qwen2_5_VLProcessor: the vision tower
(window and full attention), greedy tokens and logprobs through LLM.chat (data URIs) for one and two images of
different sizes with the prefill chunked through the images, text-only prompts, a mixed batch, per-request
min/max pixels, prefix caching keyed by the images, M-RoPE decode on the fused CPU path, and PP placement."""
from __future__ import annotations

import pytest
import torch
from llama4_checkpoints import one_thread  # noqa: F401 (fixture)
from qwen2_5_vl_checkpoints import TOKEN, data_uri, hf_processor, make_qwen2_5_vl, noise_image
from transformers import Qwen2_5_VLForConditionalGeneration

from strata import LLM, SamplingParams
from strata.config import EngineConfig
from strata.distributed import ParallelContext
from strata.errors import RequestError
from strata.executor.model_runner import ModelRunner
from strata.models.base import PPMissingLayer

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_TOKENS = 5
PAD = TOKEN["<|image_pad|>"]
SIZES = {"one": ((60, 100),), "two": ((150, 200), (90, 40))}  # (height, width): 8, 20 and 6 image tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"), seed=5)


@pytest.fixture(scope="module")
def hf(checkpoint):
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture
def processor(checkpoint, monkeypatch):
    return hf_processor(checkpoint, monkeypatch)


def conversation(*images, text: str = "Describe this.") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_uri(i)}} for i in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def transformers_run(hf, processor, images, text: str = "Describe this.", **kwargs) -> dict:
    """The processor's ids, then transformers' greedy tokens and the logprob of each (decode steps included)."""
    messages = [{"role": "user", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": text}]}]
    prompt = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[prompt], images=list(images) or None, return_tensors="pt", **kwargs)
    n = inputs["input_ids"].shape[1]
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, n:].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens, strict=True)]
    return {"prompt": inputs["input_ids"][0].tolist(), "tokens": tokens, "logprobs": logprobs}


def as_run(out) -> dict:
    tokens = out.outputs[0].token_ids
    return {"prompt": out.prompt_token_ids, "tokens": tokens,
            "logprobs": [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens, strict=True)]}


PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)


def assert_same(got: dict, expected: dict) -> None:
    assert got["prompt"] == expected["prompt"]
    assert got["tokens"] == expected["tokens"]
    assert max(abs(a - b) for a, b in zip(got["logprobs"], expected["logprobs"], strict=True)) < 1e-4


def test_vision_tower_matches_transformers(checkpoint, hf, processor):
    """Two images through the tower at once: ragged 2 x 2 windows in blocks 0 and 2, whole images in block 1."""
    images = [noise_image(150, 200, 1), noise_image(90, 40, 2)]
    inputs = processor(text=["<|image_pad|><|image_pad|>"], images=images, return_tensors="pt")
    model = ModelRunner(EngineConfig.create(str(checkpoint), dtype="float32", device="cpu"), ParallelContext(),
                        torch.device("cpu")).model
    with torch.no_grad():
        expected = hf.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
        got = model.visual(inputs["pixel_values"], [tuple(g) for g in inputs["image_grid_thw"].tolist()])
    assert got.shape == expected.shape == (26, 64)
    assert (got - expected).abs().max().item() < 1e-4


def test_chat_with_images_gives_transformers_tokens_and_logprobs(checkpoint, hf, processor):
    """One image, two of other sizes and aspect ratios, and text only, batched, the prefill cut into 16-token chunks
    (through the 20-token image): each gives what transformers gives it alone, decode steps included (their M-RoPE
    positions are shifted by the images); the fused CPU decode path serves the decode steps."""
    images = {name: [noise_image(*size, seed=i + len(name)) for i, size in enumerate(sizes)]
              for name, sizes in SIZES.items()}
    expected = [transformers_run(hf, processor, images["one"]),
                transformers_run(hf, processor, images["two"], text="Compare them."),
                transformers_run(hf, processor, [], text="The quick brown fox")]
    assert [e["prompt"].count(PAD) for e in expected] == [8, 26, 0]
    llm = LLM(str(checkpoint), dtype="float32", device="cpu", max_num_batched_tokens=16, max_num_seqs=3)
    conversations = [conversation(*images["one"]), conversation(*images["two"], text="Compare them."),
                     [{"role": "user", "content": "The quick brown fox"}]]
    for got, want in zip(llm.chat(conversations, PARAMS, use_tqdm=False), expected, strict=True):
        assert_same(as_run(got), want)
    alone = llm.chat(conversation(*images["two"], text="Compare them."), PARAMS, use_tqdm=False)[0]
    assert_same(as_run(alone), expected[1])
    assert llm.engine.executor.runner.cpu_decode.served["whole step"] > 0


def test_mm_processor_kwargs_set_the_pixel_bounds_per_request(checkpoint, hf, processor):
    """Through LLM.chat and through a prompt dict with multi_modal_data, as transformers' processor given them."""
    image = noise_image(150, 200, seed=4)
    bounds = {"min_pixels": 28 * 28, "max_pixels": 28 * 28 * 8}
    expected = transformers_run(hf, processor, [image], size={"shortest_edge": bounds["min_pixels"],
                                                              "longest_edge": bounds["max_pixels"]})
    assert expected["prompt"].count(PAD) == 6
    llm = LLM(str(checkpoint), dtype="float32", device="cpu")
    out = llm.chat(conversation(image), PARAMS, use_tqdm=False, mm_processor_kwargs=bounds)[0]
    assert_same(as_run(out), expected)
    text = processor.tokenizer.decode(expected["prompt"]).replace("<|image_pad|>" * 6, "<|image_pad|>")
    prompt = {"prompt": text, "multi_modal_data": {"image": image}, "mm_processor_kwargs": bounds}
    assert_same(as_run(llm.generate(prompt, PARAMS, use_tqdm=False)[0]), expected)
    with pytest.raises(RequestError, match="not supported"):
        llm.chat(conversation(image), PARAMS, use_tqdm=False, mm_processor_kwargs={"fps": 2})


def test_prefix_cache_is_keyed_by_the_image(checkpoint, hf, processor):
    """The same image with other text reuses the cached blocks of its image tokens; another image of the same size
    (the same tokens) reuses only the blocks before its first image token."""
    first, other = noise_image(60, 100, seed=7), noise_image(60, 100, seed=8)
    llm = LLM(str(checkpoint), dtype="float32", device="cpu", enable_prefix_caching=True, block_size=4)
    cached_prompt = transformers_run(hf, processor, [first])["prompt"]
    llm.chat(conversation(first), PARAMS, use_tqdm=False)
    for image, text in ((first, "Compare them."), (other, "Describe this.")):
        expected = transformers_run(hf, processor, [image], text=text)
        common = next(i for i, (a, b) in enumerate(zip(expected["prompt"], cached_prompt, strict=False)) if a != b) \
            if image is first else cached_prompt.index(PAD)
        out = llm.chat(conversation(image, text=text), PARAMS, use_tqdm=False)[0]
        assert out.num_cached_tokens == common // 4 * 4
        if image is first:
            assert out.num_cached_tokens > cached_prompt.index(PAD) + 4  # blocks of image tokens reused
        assert_same(as_run(out), expected)


def test_pipeline_stages_hold_the_vision_tower_first(checkpoint):
    config = EngineConfig.create(str(checkpoint), dtype="float32", device="cpu", pipeline_parallel_size=2)
    first, last = (ModelRunner(config, ParallelContext(pp_rank=r, pp_size=2), torch.device("cpu")).model
                   for r in range(2))
    assert not isinstance(first.visual, PPMissingLayer) and isinstance(last.visual, PPMissingLayer)
    assert isinstance(first.lm_head, PPMissingLayer) and "visual" in last.missing_prefixes


def test_video_parts_are_refused(checkpoint):
    llm = LLM(str(checkpoint), dtype="float32", device="cpu")
    video = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AA=="}}]}]
    with pytest.raises(RequestError, match="video"):
        llm.chat(video, PARAMS, use_tqdm=False)
