"""`strata bench latency --image`: the time to the first token of one chat with an image and --input-len words, with
the vision encoder's and the language model's prefill printed apart; --hf-encoder also times transformers' vision
encoder (Qwen2.5-VL) on the same pixels, in rounds alternating with strata's."""
from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import time
from pathlib import Path

import torch
from PIL import Image

from strata.config.engine_args import engine_kwargs
from strata.sampling_params import SamplingParams

_SIZE = re.compile(r"^(\d+)x(\d+)$")
_WORDS = ("the", "river", "light", "stone", "quiet", "market", "window", "blue", "morning", "paper", "garden", "road",
          "small", "old", "city", "green", "table", "voice", "winter", "field")


def add_image_latency_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--image", default=None,
                        help="time one chat with this image and --input-len words instead of a text batch: an image "
                             "file, or WIDTHxHEIGHT (e.g. 1024x768) for generated noise; prints the vision encoder's "
                             "time apart from the prefill's")
    parser.add_argument("--hf-encoder", action="store_true",
                        help="with --image: also time transformers' vision encoder (Qwen2.5-VL) on the same pixels "
                             "and grid, in rounds alternating with strata's")


def load_bench_image(spec: str, seed: int) -> Image.Image:
    """WIDTHxHEIGHT: uniform noise of that size (a new image per seed); anything else: an image file."""
    size = _SIZE.match(spec)
    if size is None:
        if not Path(spec).is_file():
            raise SystemExit(f"--image {spec!r} is neither an image file nor WIDTHxHEIGHT (e.g. 1024x768)")
        return Image.open(spec).convert("RGB")
    width, height = int(size.group(1)), int(size.group(2))
    if not 0 < width * height <= 1 << 26:
        raise SystemExit(f"--image {spec}: a size of 1 to {1 << 26} pixels")
    pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return Image.fromarray(pixels.numpy(), "RGB")


def _words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n))


class ModuleClock:
    """Seconds spent in a module's forward calls (CUDA work waited for), summed until read by `take`."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.total, self._started = 0.0, 0.0
        self._hooks = (module.register_forward_pre_hook(self._start), module.register_forward_hook(self._stop))

    def _start(self, *_) -> None:
        _sync()
        self._started = time.perf_counter()

    def _stop(self, *_) -> None:
        _sync()
        self.total += time.perf_counter() - self._started

    def take(self) -> float:
        total, self.total = self.total, 0.0
        return total

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _vision_model(llm) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the whole model, its vision encoder) of an in-process engine."""
    model = getattr(getattr(llm.engine.executor, "runner", None), "model", None)
    if model is None:
        raise SystemExit("--image times the encoder in this process: use one rank (no --tensor-parallel-size or "
                         "--pipeline-parallel-size)")
    encoder = next((getattr(model, n) for n in ("visual", "vision_tower", "vision_model") if hasattr(model, n)), None)
    if encoder is None:
        raise SystemExit(f"--image: {type(model).__name__} takes no images")
    return model, encoder


def _one_chat(llm, image: Image.Image, text: str) -> float:
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                             {"type": "text", "text": text}]}]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    started = time.perf_counter()
    out = llm.chat(messages, params, use_tqdm=False)[0]
    elapsed = time.perf_counter() - started
    if len(out.outputs[0].token_ids) != 1:
        raise RuntimeError("expected one output token")
    return elapsed


def time_image_chats(llm, args: argparse.Namespace) -> dict[str, list[float]]:
    """Per run (a new generated image each, or the file's with new words; the prefix cache is off): the time to the
    first token, the vision encoder's and the language model's forward passes inside it."""
    model, encoder = _vision_model(llm)
    clocks = {"encoder": ModuleClock(encoder), "prefill": ModuleClock(model)}
    runs: dict[str, list[float]] = {"ttft": [], "encoder": [], "prefill": []}
    try:
        for i in range(args.num_iters_warmup + args.num_iters):
            ttft = _one_chat(llm, load_bench_image(args.image, args.seed + i), _words(args.input_len, args.seed + i))
            encoder_s, prefill_s = clocks["encoder"].take(), clocks["prefill"].take()
            if i >= args.num_iters_warmup:
                runs["ttft"].append(ttft)
                runs["encoder"].append(encoder_s)
                runs["prefill"].append(prefill_s)
    finally:
        for clock in clocks.values():
            clock.remove()
    return runs


def compare_hf_encoder(llm, args: argparse.Namespace, rounds: int) -> dict[str, float | list[float]]:
    """strata's and transformers' Qwen2.5-VL vision encoders on the same pixel_values and grid_thw, alternating
    (strata first, then transformers, each round), float32 unless --dtype says otherwise."""
    import transformers

    from strata.multimodal.qwen2_vl_image import Qwen2VLImagePromptProcessor, preprocess_image

    _, encoder = _vision_model(llm)
    processor = llm.engine.input.mm_processor
    if not isinstance(processor, Qwen2VLImagePromptProcessor):
        raise SystemExit("--hf-encoder compares Qwen2.5-VL's vision encoder only")
    dtype = encoder.patch_embed.proj.weight.dtype
    device = encoder.patch_embed.proj.weight.device
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(args.model, dtype=dtype).eval().to(device)
    hf_encoder = getattr(hf.model, "visual", None) or hf.visual
    patches, grid = preprocess_image(load_bench_image(args.image, args.seed), processor.config)
    patches = patches.to(device)
    grid_thw = torch.tensor([grid], device=device)
    times: dict[str, list[float]] = {"strata": [], "transformers": []}
    outputs = {}
    with torch.inference_mode():
        for _ in range(rounds + 1):  # the first round warms both up
            for name, run in (("strata", lambda: encoder(patches, [grid])),
                              ("transformers", lambda: hf_encoder(patches, grid_thw=grid_thw))):
                _sync()
                started = time.perf_counter()
                outputs[name] = run()
                _sync()
                times[name].append(time.perf_counter() - started)
    hf_out = outputs["transformers"]
    hf_out = hf_out if isinstance(hf_out, torch.Tensor) else hf_out.pooler_output
    diff = (outputs["strata"].float() - hf_out.float()).abs().max().item()
    strata_s, hf_s = (times[k][1:] for k in ("strata", "transformers"))
    return {"encoder_strata_s": strata_s, "encoder_transformers_s": hf_s, "encoder_max_abs_diff": diff,
            "encoder_speed_vs_transformers": min(hf_s) / min(strata_s), "patches": patches.shape[0]}


def run_image_latency(args: argparse.Namespace) -> dict:
    """The --image run: the figures, printed, and returned for --output-json."""
    from strata.llm import LLM

    kwargs = {**engine_kwargs(args), "enable_prefix_caching": False}  # every run encodes and prefills its image
    llm = LLM(args.model, **kwargs)
    try:
        runs = time_image_chats(llm, args)
        result: dict = {**runs, "input_words": args.input_len, "image": args.image, "threads": torch.get_num_threads()}
        if args.hf_encoder:
            result.update(compare_hf_encoder(llm, args, max(3, args.num_iters)))
    finally:
        llm.shutdown()
    sys.stdout.write(image_report(result))
    return result


def _ms(values: list[float]) -> str:
    return f"{min(values) * 1e3:.1f} ms (mean {statistics.mean(values) * 1e3:.1f})"


def image_report(r: dict) -> str:
    """Best of N, then the mean of the same runs, for each figure."""
    n = len(r["ttft"])
    other = [t - e - p for t, e, p in zip(r["ttft"], r["encoder"], r["prefill"], strict=True)]
    lines = [f"One chat with image {r['image']} and {r['input_words']} words, best of {n} ({r['threads']} threads):",
             f"  vision encoder: {_ms(r['encoder'])}",
             f"  prefill (the language model's forward passes): {_ms(r['prefill'])}",
             f"  time to first token: {_ms(r['ttft'])} (the rest, {_ms(other)}: image preprocessing, scheduling, "
             "sampling)"]
    if "encoder_strata_s" in r:
        lines.append(f"Vision encoder alone on {r['patches']} patches, alternating rounds: strata "
                     f"{_ms(r['encoder_strata_s'])}, transformers {_ms(r['encoder_transformers_s'])}; strata at "
                     f"{r['encoder_speed_vs_transformers']:.2f}x transformers' speed (best of each); outputs differ "
                     f"by at most {r['encoder_max_abs_diff']:.2e}")
    return "".join(line + "\n" for line in lines)
