"""Command line: `strata serve | bench throughput | bench serve | plan` (flags follow vLLM's names)."""
from __future__ import annotations

import argparse
import logging
import sys

from strata.errors import StrataError


def _int_list(value: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None


def _bytes(value: str) -> int:
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    v = value.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if v and v[-1] in units:
            return int(float(v[:-1]) * units[v[-1]])
        return int(float(v))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size in bytes (e.g. 4G, 512M), got {value!r}") from None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine flags shared by serve, bench throughput and plan."""
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1)
    p.add_argument("--pp-layer-partition", type=_int_list, default=None,
                   help="layers per pipeline stage, e.g. 3,5 (default: even split, vLLM's rule)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "half", "float"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=_bytes, default=None, help="bytes for the KV cache per rank")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--mamba-ssm-cache-dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"],
                   help="dtype of the Mamba SSM state (auto = the model dtype)")
    p.add_argument("--quantization", "-q", default=None, choices=["experts_int8"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=None)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """Keyword arguments for EngineConfig.create / LLM from parsed engine flags."""
    kwargs = dict(tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
                  dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
                  gpu_memory_utilization=args.gpu_memory_utilization, quantization=args.quantization,
                  seed=args.seed, device=args.device, enable_prefix_caching=args.enable_prefix_caching,
                  block_size=args.block_size, mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype)
    if args.pp_layer_partition is not None:
        kwargs["pp_layer_partition"] = args.pp_layer_partition
    if args.nnodes > 1 or args.master_port is not None:
        kwargs.update(nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
                      master_port=args.master_port)
    return kwargs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    verbs = parser.add_subparsers(dest="verb", required=True)

    serve = verbs.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model", nargs="?", default=None, help="checkpoint folder (default: built-in strata-demo)")
    serve.add_argument("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", nargs="+", default=None)
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--chat-template", default=None, help="a Jinja template file (or the template text)")
    serve.add_argument("--allowed-local-media-path", default=None)
    serve.add_argument("--allow-remote-media", action="store_true")
    serve.add_argument("--disable-log-requests", action="store_true")
    add_engine_args(serve)

    bench = verbs.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    throughput = bench.add_parser("throughput", help="offline throughput on random prompts")
    throughput.add_argument("--model", required=True)
    throughput.add_argument("--input-len", type=int, default=128)
    throughput.add_argument("--output-len", type=int, default=128)
    throughput.add_argument("--num-prompts", type=int, default=64)
    throughput.add_argument("--output-json", default=None)
    throughput.add_argument("--backend", default="strata", choices=["strata", "hf"],
                            help="hf: transformers generate() with one static batch, as a baseline")
    add_engine_args(throughput)
    bench_serve = bench.add_parser("serve", help="online serving benchmark against any OpenAI-compatible server")
    _add_bench_serve_args(bench_serve)

    plan = verbs.add_parser("plan", help="show the per-rank layout of a TP x PP plan without starting workers")
    plan.add_argument("model")
    add_engine_args(plan)
    return parser


def _add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--tokenizer", default=None, help="checkpoint folder whose tokenizer builds the prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--ignore-eos", action="store_true", help="ask for exactly --output-len tokens (vLLM extension)")
    p.add_argument("--output-json", default=None)


def _run(args: argparse.Namespace) -> int:
    if args.verb == "serve" and args.node_rank > 0:
        return _run_headless(args)
    if args.verb == "serve":
        from strata.server.app import run_server

        return run_server(args)
    if args.verb == "bench" and args.bench == "throughput":
        from strata.bench.throughput import run_throughput

        return run_throughput(args)
    if args.verb == "bench" and args.bench == "serve":
        from strata.bench.serve import run_bench_serve

        return run_bench_serve(args)
    from strata.plan import run_plan

    return run_plan(args)


def _run_headless(args: argparse.Namespace) -> int:
    """`strata serve MODEL --nnodes N --node-rank R>0 ...`: this node only runs its workers, no server."""
    from strata.config import EngineConfig
    from strata.executor.multiproc import run_headless

    model = args.model or args.model_flag
    if model is None:
        from strata.demo import demo_checkpoint_path

        model = str(demo_checkpoint_path())
    return run_headless(EngineConfig.create(model, **engine_kwargs(args)))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _run(args) or 0
    except StrataError as e:
        logging.getLogger("strata").error("%s", e.message)
        return 2


if __name__ == "__main__":
    sys.exit(main())
