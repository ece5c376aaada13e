"""`strata serve` from start to exit: build the engine, serve, and on SIGTERM/SIGINT drain (refuse new work, let
what runs finish up to --shutdown-timeout, then end the rest with an error); a second signal exits at once."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import signal
from typing import Any

from fastapi import FastAPI

from strata import __version__
from strata.config.engine_args import EngineArgs
from strata.engine.async_engine import AsyncEngine
from strata.errors import ConfigError, OverloadedError, RequestError
from strata.server.app import build_app
from strata.server.gate import Gate

logger = logging.getLogger(__name__)

# After the drain, what the clients are still owed (error events, last chunks) gets this long to go out.
_FLUSH_S = 5.0
# Where the API key comes from when --api-key is not given, in this order (vLLM reads VLLM_API_KEY).
API_KEY_VARIABLES = ("STRATA_API_KEY", "VLLM_API_KEY")


def _resolve_model(args: argparse.Namespace) -> tuple[str, list[str] | None]:
    """The checkpoint folder and served names; no model means the built-in demo, served as `strata-demo`."""
    model = args.model or getattr(args, "model_flag", None)
    if args.model and getattr(args, "model_flag", None) and args.model != args.model_flag:
        raise RequestError(f"two different models given: {args.model!r} and --model {args.model_flag!r}",
                           param="model")
    if model is not None:
        return model, args.served_model_name
    from strata.demo import DEMO_MODEL_NAME, demo_checkpoint_path

    return str(demo_checkpoint_path()), args.served_model_name or [DEMO_MODEL_NAME]


def resolve_api_key(flag: str | None) -> str | None:
    """--api-key, else the first of STRATA_API_KEY and VLLM_API_KEY that is set and not empty, else None."""
    if flag:
        return flag
    for variable in API_KEY_VARIABLES:
        if os.environ.get(variable):
            logger.info("API key from %s: /v1/* asks for `Authorization: Bearer KEY`", variable)
            return os.environ[variable]
    return None


def client_example(names: tuple[str, ...] | list[str], host: str, port: int, api_key: str | None) -> str:
    """A curl command that works against this server as started: its first served name, a reachable address, and
    when a key is asked for, its header naming the variable that holds the key (never the key itself, which
    would land in logs)."""
    address = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    address = f"[{address}]" if ":" in address else address
    body = json.dumps({"model": names[0], "prompt": "Hello", "max_tokens": 16})
    key = ""
    if api_key:
        variable = next((v for v in API_KEY_VARIABLES if os.environ.get(v) == api_key), None)
        key = f' -H "Authorization: Bearer ${variable}"' if variable else " -H 'Authorization: Bearer KEY'"
    return (f"curl http://{address}:{port}/v1/completions -H 'Content-Type: application/json'{key} "
            f"-d {shlex.quote(body)}")


def run_server(args: argparse.Namespace) -> int:
    """Build the engine, serve until drained or interrupted; non-zero exit when the engine died."""
    from strata.config import EngineConfig
    from strata.tokenizer import read_chat_template

    args = argparse.Namespace(**{**vars(args), "api_key": resolve_api_key(args.api_key)})
    model, names = _resolve_model(args)
    config = EngineConfig.from_args(EngineArgs.from_cli_args(args, model), served_model_name=names,
                                    chat_template=read_chat_template(args.chat_template))
    if getattr(args, "lora_modules", None) and config.lora is None:
        raise ConfigError("--lora-modules needs --enable-lora", param="lora_modules")
    if config.runner == "pooling":
        from strata.server.serving_embeddings import run_pooling_server

        return run_pooling_server(args, config)
    # Until the server runs (it drains on signals), SIGTERM stops start-up like Ctrl-C does.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    engine = None
    try:
        engine = AsyncEngine.from_config(config)
        gate = Gate(args.max_request_bytes, args.max_waiting_requests)
        asyncio.run(_serve(build_app(engine, args, gate), engine, gate, args))
    except KeyboardInterrupt:
        logger.info("interrupted; shutting down")
    finally:
        signal.signal(signal.SIGTERM, previous)
        if engine is not None:
            engine.shutdown()
    if engine is not None and engine.is_dead:
        logger.error("the engine died: %s", engine.dead_error)
        return 1
    return 0


async def _serve(app: FastAPI, engine: AsyncEngine, gate: Gate, args: argparse.Namespace) -> None:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:  # uvicorn's signal handler, on the loop's thread
            drain.on_signal(sig)

    level = getattr(args, "uvicorn_log_level", None) or str(getattr(args, "log_level", "INFO")).lower()
    access_log = not (args.disable_log_requests or getattr(args, "disable_uvicorn_access_log", False))
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=level,
                                           access_log=access_log,
                                           timeout_graceful_shutdown=_FLUSH_S))
    drain = Drain(server, engine, gate, args.shutdown_timeout)
    watchdog = asyncio.create_task(_watch(server, engine, args))
    try:
        await server.serve()
    finally:
        watchdog.cancel()
        drain.cancel()


class Drain:
    """The first signal starts a drain; the next one ends every request with an error and exits now."""

    def __init__(self, server: Any, engine: AsyncEngine, gate: Gate, timeout_s: float) -> None:
        self.server, self.engine, self.gate, self.timeout_s = server, engine, gate, timeout_s
        self.task: asyncio.Task | None = None

    def on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self.task is None:
            logger.info("%s: draining (new requests get 503; up to %.0f s for the %d in flight)", name,
                        self.timeout_s, self.gate.in_flight)
            self.task = asyncio.get_running_loop().create_task(self.run())
            return
        logger.warning("%s again: exiting now", name)
        self.gate.draining = True
        self.engine.fail_all(OverloadedError("the server is shutting down"))
        self.server.should_exit = self.server.force_exit = True

    async def run(self) -> None:
        self.gate.draining = True
        if not await self.gate.wait_idle(self.timeout_s):
            count = self.engine.fail_all(OverloadedError("the server shut down before this request finished "
                                                         "(--shutdown-timeout)"))
            logger.warning("drain timed out; ended %d unfinished requests with an error", count)
            await self.gate.wait_idle(_FLUSH_S)
        logger.info("drained; exiting")
        self.server.should_exit = True

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()


async def _watch(server: Any, engine: AsyncEngine, args: argparse.Namespace) -> None:
    """Announce the URL once listening; stop the server when the engine dies."""
    while not server.started:
        await asyncio.sleep(0.05)
    names = ", ".join(engine.config.served_model_names)
    logger.info("strata %s is serving %s at http://%s:%d/v1 (model %s)", __version__, names, args.host, args.port,
                engine.config.model.path)
    logger.info("try: %s", client_example(engine.config.served_model_names, args.host, args.port,
                                          getattr(args, "api_key", None)))
    while not engine.is_dead:
        await asyncio.sleep(0.5)
    logger.error("the engine died (%s); stopping the server", engine.dead_error)
    server.should_exit = True
