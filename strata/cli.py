"""Command line: `strata serve | bench throughput | bench latency | bench serve | plan` (flags follow vLLM's names)."""
from __future__ import annotations

import argparse
import logging
import sys

from strata import __version__
from strata.bench.embed import add_embed_args
from strata.bench.kernels import add_kernels_args
from strata.bench.latency import add_latency_args
from strata.bench.perplexity import add_perplexity_args
from strata.bench.speculative import add_speculative_args
from strata.bench.throughput import add_throughput_args
from strata.cli_common import finish_parser, log_level, parse_command_line, warn_ignored_flags
from strata.config.engine_args import EngineArgs, byte_size
from strata.errors import StrataError
from strata.server.lora_modules import parse_lora_module
from strata.server.tool_parsers import TOOL_CALL_PARSERS


def _add_bench_verbs(bench: argparse._SubParsersAction) -> None:
    add_throughput_args(bench.add_parser("throughput", help="offline throughput on random prompts"))
    add_latency_args(bench.add_parser("latency", help="time per output token of one batch, and weight GB/s"))
    add_perplexity_args(bench.add_parser("perplexity", help="perplexity of a text, as llama-perplexity computes it"))
    add_kernels_args(bench.add_parser("kernels", help="CPU kernel choices measured here (--recalibrate)"))
    add_speculative_args(bench.add_parser("speculative", help="tokens/s with and without speculative decoding on an "
                                                              "input-grounded workload from Python's own source"))
    add_embed_args(bench.add_parser("embed", help="sentences/s of an embedding model (vs sentence-transformers)"))
    _add_bench_serve_args(bench.add_parser("serve", help="online serving benchmark against any OpenAI-compatible "
                                                         "server"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description=__doc__)
    parser.add_argument("--version", action="version", version=f"strata {__version__}")
    parser.add_argument("--log-level", type=log_level, default="INFO",
                        help="logging level, any case: debug, info, warning, error or critical (also accepted after "
                             "the verb)")
    verbs = parser.add_subparsers(dest="verb", required=True)

    serve = verbs.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model", nargs="?", default=None,
                       help="checkpoint folder, .gguf file, Hub ID (ORG/NAME, or ORG/NAME:QUANT for a GGUF file) "
                            "(default: built-in strata-demo)")
    serve.add_argument("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="the names clients give as `model` (default: the model argument as given)")
    serve.add_argument("--api-key", default=None,
                       help="require `Authorization: Bearer KEY` on /v1/* (default: $STRATA_API_KEY, else "
                            "$VLLM_API_KEY, else no key)")
    serve.add_argument("--uvicorn-log-level", default=None, type=str.lower,
                       choices=("critical", "error", "warning", "info", "debug", "trace"),
                       help="log level of the HTTP server (default: --log-level's)")
    serve.add_argument("--disable-uvicorn-access-log", action="store_true",
                       help="no access-log line per request (requests are still logged "
                            "unless --disable-log-requests)")
    serve.add_argument("--chat-template", default=None, help="a Jinja template file (or the template text)")
    serve.add_argument("--allowed-local-media-path", default=None)
    serve.add_argument("--allow-remote-media", action="store_true")
    serve.add_argument("--disable-log-requests", action="store_true",
                       help="log no line per request (neither the access log nor the request's parameters)")
    serve.add_argument("--max-waiting-requests", type=int, default=None,
                       help="answer 503 (with Retry-After) to new requests while this many wait (default: no bound)")
    serve.add_argument("--max-request-bytes", type=byte_size, default=4 * 2**20,
                       help="largest request body; bigger ones get 413 (default 4M)")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="on SIGTERM, seconds running requests get to finish before they are ended with an "
                            "error (a second signal exits at once)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let chat requests use tool_choice "auto" (needs --tool-call-parser)')
    serve.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                       help="how tool calls are found in model output: llama3_json (Llama 3.1/3.2), "
                            "llama4_pythonic (Llama 4), hermes (Qwen, Hermes), mistral, granite, openai (gpt-oss)")
    serve.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=None,
                       help="LoRA adapters served as model names (needs --enable-lora): name=path, or vLLM's JSON "
                            "form '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'")
    EngineArgs.add_cli_args(serve)

    _add_bench_verbs(verbs.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True))
    plan = verbs.add_parser("plan", help="show the per-rank layout of a TP x PP plan without starting workers")
    plan.add_argument("model", help="checkpoint folder, .gguf file or Hub ID")
    EngineArgs.add_cli_args(plan)
    finish_parser(parser)
    return parser


def _add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    p.add_argument("--num-prompts", type=int, default=100, help="requests in all")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (words without --tokenizer)")
    p.add_argument("--output-len", type=int, default=128, help="most output tokens per request")
    p.add_argument("--prefix-len", type=int, default=0, help="tokens (or words) of a shared prefix before each prompt")
    p.add_argument("--num-prefixes", type=int, default=1, help="distinct shared prefixes (with --prefix-len)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no bound)")
    p.add_argument("--tokenizer", default=None,
                   help="checkpoint folder, Hub ID or GGUF file whose tokenizer builds the prompts")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    p.add_argument("--ignore-eos", action="store_true", help="ask for exactly --output-len tokens (vLLM extension)")
    p.add_argument("--output-json", default=None, help="also write the figures to this JSON file")


def _run(args: argparse.Namespace) -> int:
    if args.verb == "serve" and args.node_rank > 0:
        return _run_headless(args)
    if args.verb == "serve":
        from strata.server.lifecycle import run_server

        return run_server(args)
    if args.verb == "bench" and args.bench == "throughput":
        from strata.bench.throughput import run_throughput

        return run_throughput(args)
    if args.verb == "bench" and args.bench == "latency":
        from strata.bench.latency import run_latency

        return run_latency(args)
    if args.verb == "bench" and args.bench == "perplexity":
        from strata.bench.perplexity import run_perplexity

        return run_perplexity(args)
    if args.verb == "bench" and args.bench == "kernels":
        from strata.bench.kernels import run_kernels

        return run_kernels(args)
    if args.verb == "bench" and args.bench == "speculative":
        from strata.bench.speculative import run_speculative

        return run_speculative(args)
    if args.verb == "bench" and args.bench == "embed":
        from strata.bench.embed import run_embed

        return run_embed(args)
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
    return run_headless(EngineConfig.from_args(EngineArgs.from_cli_args(args, model)))


def main(argv: list[str] | None = None) -> int:
    args = parse_command_line(build_parser(), argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    warn_ignored_flags(args)
    try:
        return _run(args) or 0
    except StrataError as e:
        logging.getLogger("strata").error("%s", e.message)
        return 2


if __name__ == "__main__":
    sys.exit(main())
