"""The sections of the one-GPU check (strata/bench/gpu_check.py): each takes a Context and returns a JSON-able dict
with a one-line "summary"."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from strata.bench import random_weights

HBM_BYTES_PER_S = 4.3e12  # H200
WRITERS = {"llama": random_weights.write_llama, "mamba2": random_weights.write_mamba2,
           "plamo2": random_weights.write_plamo2}


@dataclasses.dataclass(frozen=True)
class Workload:
    """Sizes of one run: the issue's (full) or a CPU smoke test's (quick)."""

    shapes: dict[str, dict]
    num_prompts: int = 256
    input_len: int = 512
    output_len: int = 256
    decode_prompt_len: int = 16
    decode_warm_tokens: int = 16
    decode_tokens: int = 128
    tokenizer_vocab: int = 32000
    tokenizer_corpus_bytes: int = 3_500_000
    copy_bytes: int = 2 << 30
    matmul_n: int = 8192
    hf_time_cap_s: float = 90.0


FULL = Workload({"llama": random_weights.LLAMA_1B, "mamba2": random_weights.MAMBA2_1B,
                 "plamo2": random_weights.PLAMO2_1B})
QUICK = Workload({"llama": random_weights.LLAMA_TINY, "mamba2": random_weights.MAMBA2_TINY,
                  "plamo2": random_weights.PLAMO2_TINY}, num_prompts=4, input_len=16, output_len=8,
                 decode_prompt_len=8, decode_warm_tokens=4, decode_tokens=8, tokenizer_vocab=512,
                 tokenizer_corpus_bytes=100_000, copy_bytes=16 << 20, matmul_n=128, hf_time_cap_s=30.0)


@dataclasses.dataclass(frozen=True)
class Context:
    """What a section sees: the options, a work folder shared by every section, and the end of the budget."""

    args: argparse.Namespace
    workdir: Path
    deadline: float  # time.monotonic()

    @property
    def work(self) -> Workload:
        return QUICK if self.args.quick else FULL

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.args.dtype)

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def checkpoint(self, family: str) -> tuple[str, int, float]:
        """(folder, weight bytes, seconds it took to write) of the random `family` model, written by the first
        section that needs it (a marker file tells later sections, in other processes, that it is complete)."""
        folder = self.workdir / family
        marker = folder / "gpu_check_written.json"
        if not marker.exists():
            started = time.perf_counter()
            weight_bytes = WRITERS[family](folder, self.work.shapes[family], device=self.args.device,
                                           dtype=self.dtype, seed=self.args.seed)
            random_weights.write_tokenizer(folder, self.work.tokenizer_vocab, self.work.tokenizer_corpus_bytes)
            marker.write_text(json.dumps({"weight_bytes": weight_bytes, "write_s": time.perf_counter() - started}))
        written = json.loads(marker.read_text())
        return str(folder), written["weight_bytes"], round(written["write_s"], 2)


def _timings(fn: Callable[[], object], device: str, repeats: int) -> list[float]:
    """Seconds per call after one warm-up call, the device synchronised around each."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    fn()
    times = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - started)
    return times


def copy_gb_per_s(nbytes: int, device: str) -> float:
    """Bandwidth of a device-to-device copy of `nbytes`, counting the bytes read and the bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    seconds = statistics.median(_timings(lambda: dst.copy_(src), device, 10))
    return round(2 * nbytes / seconds / 1e9, 1)


def _sig(x: float) -> float:
    """Four significant digits, however small (a tiny model's fraction of the floor is still > 0)."""
    return float(f"{x:.4g}")


def matmul_tflops(n: int, device: str) -> float:
    """Median bf16 TFLOP/s of an n x n x n matmul."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    seconds = statistics.median(_timings(lambda: a @ b, device, 5))
    return _sig(2 * n**3 / seconds / 1e12)


def section_environment(ctx: Context) -> dict:
    import transformers

    device, work = ctx.args.device, ctx.work
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "transformers": transformers.__version__, "cpu_count": os.cpu_count(),
           "triton_interpret": os.environ.get("TRITON_INTERPRET")}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError as e:
        env["triton"] = f"not importable: {e}"
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   capability=f"{props.major}.{props.minor}")
    env["copy_gb_per_s"] = copy_gb_per_s(work.copy_bytes, device)
    env["bf16_matmul_tflops"] = matmul_tflops(work.matmul_n, device)
    env["summary"] = (f"{env.get('gpu', device)}: copy {env['copy_gb_per_s']:.0f} GB/s, "
                      f"bf16 matmul {env['bf16_matmul_tflops']:.1f} TFLOP/s")
    return env


def section_gpu_tests(ctx: Context) -> dict:
    from strata.bench.gpu_tests import run_gpu_tests

    root = Path(__file__).resolve().parents[2]
    timeout = max(10.0, min(ctx.args.pytest_timeout_s, ctx.left_s()))
    return run_gpu_tests(root, ctx.args.gpu_tests.split(","), timeout, ctx.workdir)


def _throughput_args(ctx: Context, path: str) -> argparse.Namespace:
    """The flags of `strata bench throughput` for this model, parsed by strata's own parser."""
    from strata.bench.throughput import add_throughput_args

    work, out = ctx.work, ctx.workdir / f"throughput-{Path(path).name}.json"
    parser = argparse.ArgumentParser()
    add_throughput_args(parser)
    return parser.parse_args([
        "--model", path, "--input-len", str(work.input_len), "--output-len",
        str(work.output_len), "--num-prompts", str(work.num_prompts), "--dtype", ctx.args.dtype, "--device",
        ctx.args.device, "--seed", str(ctx.args.seed), "--output-json", str(out), "--max-model-len",
        str(work.input_len + work.output_len)])


def strata_throughput(family: str) -> Callable[[Context], dict]:
    def section(ctx: Context) -> dict:
        from strata.bench.throughput import run_throughput

        path, weight_bytes, write_s = ctx.checkpoint(family)
        args = _throughput_args(ctx, path)
        run_throughput(args)
        result = json.loads(Path(args.output_json).read_text())
        result.update(shape=ctx.work.shapes[family], weight_bytes=weight_bytes, checkpoint_write_s=write_s,
                      kernels=getattr(args, "kernels", "no such option yet"))
        result["summary"] = (f"{result['output_tokens_per_second']:.0f} output tok/s, "
                             f"{result['tokens_per_second']:.0f} total tok/s in {result['elapsed_time']:.1f} s")
        return result

    return section


def transformers_throughput(family: str) -> Callable[[Context], dict]:
    def section(ctx: Context) -> dict:
        from strata.bench.hf_baseline import hf_generate_throughput
        from strata.bench.throughput import bench_prompts

        path, _, _ = ctx.checkpoint(family)
        prompts = bench_prompts(_throughput_args(ctx, path))  # the very prompts strata was given
        deadline = time.monotonic() + min(ctx.work.hf_time_cap_s, max(ctx.left_s(), 0.0))
        hf = hf_generate_throughput(path, prompts, ctx.work.output_len, device=ctx.args.device, dtype=ctx.dtype,
                                    deadline=deadline)
        hf["summary"] = (f"{hf['output_tokens_per_s']:.0f} output tok/s, {hf['total_tokens_per_s']:.0f} total "
                         f"tok/s ({hf['prompts_run']} prompts in batches of {hf['batch_size']})")
        return hf

    return section


def section_decode_batch1(ctx: Context) -> dict:
    """Time per output token of one sequence, prefill excluded: (time of W+N tokens - time of W tokens) / N."""
    from strata.bench.throughput import random_prompts
    from strata.llm import LLM
    from strata.sampling_params import SamplingParams

    work = ctx.work
    path, weight_bytes, _ = ctx.checkpoint("llama")
    llm = LLM(path, dtype=ctx.args.dtype, device=ctx.args.device, max_num_seqs=4,
              max_model_len=work.decode_prompt_len + work.decode_warm_tokens + work.decode_tokens,
              kv_cache_memory=(64 << 20) if ctx.args.quick else (2 << 30))
    vocab = work.shapes["llama"]["vocab_size"]
    prompt = {"prompt_token_ids": random_prompts(1, work.decode_prompt_len, vocab, ctx.args.seed, avoid={0, 1})[0]}

    def seconds(tokens: int) -> float:
        started = time.perf_counter()
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == tokens
        return time.perf_counter() - started

    try:
        seconds(work.decode_warm_tokens)  # warm-up: allocator, kernels, prefix cache of the prompt
        short = statistics.median(seconds(work.decode_warm_tokens) for _ in range(3))
        long = statistics.median(seconds(work.decode_warm_tokens + work.decode_tokens) for _ in range(3))
    finally:
        llm.shutdown()
    per_token, floor = (long - short) / work.decode_tokens, weight_bytes / HBM_BYTES_PER_S
    return {"weight_bytes": weight_bytes, "ms_per_token": _sig(per_token * 1e3),
            "hbm_floor_ms_per_token": _sig(floor * 1e3), "fraction_of_floor": _sig(floor / per_token),
            "tokens_per_s": _sig(1 / per_token), "short_run_s": _sig(short), "long_run_s": _sig(long),
            "summary": f"{per_token * 1e3:.2f} ms/token, HBM floor {floor * 1e3:.2f} ms "
                       f"({floor / per_token:.0%} of the floor)"}


def section_kernels(ctx: Context) -> dict:
    """Milliseconds per call of the Triton kernels (attention decode and prefill, the Mamba2 kernels beside
    their torch references) at realistic sizes, or tiny ones with --quick."""
    if ctx.args.device == "cpu":
        return {"summary": "not run: kernel timings (triton.testing.do_bench) need a GPU"}
    from strata.bench.mamba_kernels import benchmark as mamba_benchmark
    from strata.kernels.triton.attention import benchmark as attention_benchmark

    device, dtype = ctx.args.device, ctx.dtype
    small = dict(num_seqs=2, context_len=32, query_len=16, num_heads=4, num_kv_heads=2, head_dim=16) \
        if ctx.args.quick else {}
    result = {f"attention_{kind}_ms": _sig(attention_benchmark(kind, dtype=dtype, device=device, **small))
              for kind in ("decode", "prefill")}
    result["attention_shape"] = small or "64 sequences x 4096 keys (decode), 64 x 512 queries after 4096 (prefill)"
    mamba_small = dict(num_tokens=64, num_seqs=2, heads=4, head_dim=16, groups=2, dstate=16, chunk_size=16,
                       decode_batch=4) if ctx.args.quick else {}
    result["mamba_ms"] = {k: _sig(v) for k, v in mamba_benchmark(dtype=dtype, device=device, **mamba_small).items()}
    result["summary"] = (f"attention decode {result['attention_decode_ms']} ms, prefill "
                         f"{result['attention_prefill_ms']} ms; mamba {result['mamba_ms']}")
    return result


# Most important first. Name -> (section, seconds it needs at least, seconds it may take at most) on the GPU.
SECTIONS: dict[str, tuple[Callable[[Context], dict], float, float]] = {
    "environment": (section_environment, 0, 60),
    "gpu_tests": (section_gpu_tests, 30, 240),
    "llama_strata": (strata_throughput("llama"), 30, 150),
    "llama_transformers": (transformers_throughput("llama"), 20, 120),
    "llama_decode_batch1": (section_decode_batch1, 20, 90),
    "mamba2_strata": (strata_throughput("mamba2"), 30, 150),
    "mamba2_transformers": (transformers_throughput("mamba2"), 20, 120),
    "plamo2_strata": (strata_throughput("plamo2"), 30, 150),
    "kernel_benchmarks": (section_kernels, 10, 90),
}
