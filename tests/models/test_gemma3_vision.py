"""Gemma 3 with images against transformers' own Gemma3ForConditionalGeneration and Gemma3Processor: the SigLIP tower
and projector, the processor's token ids and pixels, greedy tokens and logprobs through LLM.chat (data URIs) for one
and two images of different sizes, with the prefill chunked around the images, text-only prompts, a mixed batch."""
from __future__ import annotations

import json

import pytest
import torch
from gemma3_vision_checkpoints import TOKEN, TOKENS_PER_IMAGE, make_gemma3_vision
from llama4_checkpoints import data_uri, noise_image, one_thread  # noqa: F401 (fixture)
from transformers import AutoProcessor, Gemma3ForConditionalGeneration

from strata import LLM, SamplingParams
from strata.config import EngineConfig
from strata.distributed import ParallelContext
from strata.errors import ConfigError
from strata.executor.model_runner import ModelRunner
from strata.models.base import PPMissingLayer

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_gemma3_vision(tmp_path_factory.mktemp("gemma3_vision"), seed=3)


@pytest.fixture(scope="module")
def hf(checkpoint):
    return Gemma3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()


def conversation(*images, text: str = "Describe this.") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_uri(i)}} for i in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def hf_conversation(*images, text: str = "Describe this.") -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image", "image": i} for i in images),
                                         {"type": "text", "text": text}]}]


def transformers_run(hf, processor, messages, causal_only: bool = False, images_kwargs: dict | None = None) -> dict:
    """Greedy tokens of `generate`, and the logprob of each from one forward pass over prompt + output (the
    processor's token_type_ids mark the image tokens; `causal_only` drops them: no bidirectional image blocks).
    `images_kwargs`: the image processor's options for this call (pan-and-scan)."""
    options = {"processor_kwargs": {"images_kwargs": images_kwargs}} if images_kwargs else {}
    inputs = processor.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=True,
                                           return_tensors="pt", **options)
    extra = {} if causal_only else {"token_type_ids": inputs["token_type_ids"]}
    pixels = {"pixel_values": inputs["pixel_values"]} if "pixel_values" in inputs else {}
    n = inputs["input_ids"].shape[1]
    with torch.no_grad():
        out = hf.generate(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], **pixels, **extra,
                          max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
        full = out[:, :-1]
        if not causal_only:
            extra = {"token_type_ids": torch.nn.functional.pad(inputs["token_type_ids"], (0, full.shape[1] - n))}
        logits = hf(input_ids=full, **pixels, **extra).logits[0, n - 1:]
    tokens = out[0, n:].tolist()
    logprobs = torch.log_softmax(logits.float(), -1)[torch.arange(MAX_TOKENS), tokens].tolist()
    return {"prompt": inputs["input_ids"][0].tolist(), "tokens": tokens, "logprobs": logprobs}


def strata_runs(llm: LLM, conversations: list[list[dict]]) -> list[dict]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    return [as_run(o) for o in llm.chat(conversations, params, use_tqdm=False)]


def as_run(out) -> dict:
    tokens = out.outputs[0].token_ids
    return {"prompt": out.prompt_token_ids, "tokens": tokens,
            "logprobs": [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens, strict=True)]}


def assert_same(got: dict, expected: dict) -> None:
    assert got["prompt"] == expected["prompt"]
    assert got["tokens"] == expected["tokens"]
    assert max(abs(a - b) for a, b in zip(got["logprobs"], expected["logprobs"], strict=True)) < 1e-4


IMAGES = {"one": ((40, 50),), "two": ((20, 70), (90, 33))}


def test_vision_tower_and_projector_match_transformers(checkpoint, hf):
    config = EngineConfig.create(str(checkpoint), dtype="float32", device="cpu")
    model = ModelRunner(config, ParallelContext(), torch.device("cpu")).model
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = hf.model.get_image_features(pixels).pooler_output
        got = model.multi_modal_projector(model.vision_tower(pixels))
    assert got.shape == expected.shape == (2, TOKENS_PER_IMAGE, 64)
    assert (got - expected).abs().max().item() < 1e-5


def test_chat_with_images_gives_transformers_tokens_and_logprobs(checkpoint, hf):
    """One and two images of different sizes and a text-only prompt, batched, the prefill cut into 20-token chunks
    (an image is 16): each gives what transformers gives it alone; the image blocks' bidirectional attention
    matters (transformers without it gives other logprobs)."""
    processor = AutoProcessor.from_pretrained(checkpoint)
    images = {name: [noise_image(*size, seed=i + len(name)) for i, size in enumerate(sizes)]
              for name, sizes in IMAGES.items()}
    conversations = [conversation(*images["one"]), conversation(*images["two"], text="Compare them."),
                     [{"role": "user", "content": "The quick brown fox"}]]
    expected = [transformers_run(hf, processor, hf_conversation(*images["one"])),
                transformers_run(hf, processor, hf_conversation(*images["two"], text="Compare them.")),
                transformers_run(hf, processor, [{"role": "user", "content": [
                    {"type": "text", "text": "The quick brown fox"}]}])]
    assert expected[1]["prompt"].count(TOKEN["<image_soft_token>"]) == 2 * TOKENS_PER_IMAGE
    llm = LLM(str(checkpoint), dtype="float32", device="cpu", max_num_batched_tokens=20, max_num_seqs=3)
    for got, want in zip(strata_runs(llm, conversations), expected, strict=True):
        assert_same(got, want)
    causal = transformers_run(hf, processor, hf_conversation(*images["one"]), causal_only=True)
    assert max(abs(a - b) for a, b in zip(causal["logprobs"], expected[0]["logprobs"], strict=True)) > 1e-3


def test_prefix_cache_hit_ending_inside_an_image(checkpoint, hf):
    """Whole prompts in one step; then the same image with other text: the cached 8-token blocks end at position
    24, inside the image (9-25), and the rest of the image is prefilled attending to the cached part."""
    processor = AutoProcessor.from_pretrained(checkpoint)
    image = noise_image(64, 48, seed=9)
    llm = LLM(str(checkpoint), dtype="float32", device="cpu", enable_prefix_caching=True, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    for text, cached in (("Describe this.", 0), ("Compare them.", 24)):
        expected = transformers_run(hf, processor, hf_conversation(image, text=text))
        assert expected["prompt"].index(TOKEN["<image_soft_token>"]) == 9
        out = llm.chat(conversation(image, text=text), params, use_tqdm=False)[0]
        assert out.num_cached_tokens == cached
        assert_same(as_run(out), expected)


def test_pipeline_stages_hold_the_vision_tower_first(checkpoint):
    config = EngineConfig.create(str(checkpoint), dtype="float32", device="cpu", pipeline_parallel_size=2)
    first, last = (ModelRunner(config, ParallelContext(pp_rank=r, pp_size=2), torch.device("cpu")).model
                   for r in range(2))
    assert not isinstance(first.vision_tower, PPMissingLayer) and isinstance(last.vision_tower, PPMissingLayer)
    assert isinstance(first.lm_head, PPMissingLayer) and "multi_modal_projector" in last.missing_prefixes


def test_max_num_batched_tokens_must_hold_one_image(checkpoint):
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        EngineConfig.create(str(checkpoint), dtype="float32", device="cpu", max_num_batched_tokens=8)


def test_bad_pan_and_scan_setting_is_refused(checkpoint, tmp_path):
    """Pan-and-scan itself is served (test_gemma3_pan_and_scan.py); a setting it cannot use stops start-up."""
    import shutil

    folder = tmp_path / "pas"
    shutil.copytree(checkpoint, folder)
    processor = json.loads((folder / "processor_config.json").read_text())
    processor["image_processor"].update(do_pan_and_scan=True, pan_and_scan_max_num_crops=0)
    (folder / "processor_config.json").write_text(json.dumps(processor))
    with pytest.raises(ConfigError, match="pan_and_scan_max_num_crops must be a positive integer"):
        LLM(str(folder), dtype="float32", device="cpu")
