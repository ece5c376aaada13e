"""LoRA adapters served by name (the app in-process, the openai client over ASGI): --lora-modules in both forms,
tokens equal to LLM's with the same adapter, streaming, /v1/models' adapter cards, 404 for an unknown name, runtime
load / unload behind VLLM_ALLOW_RUNTIME_LORA_UPDATING (400 for a bad folder or a name loaded twice), and nothing left
behind after 100 requests over 6 adapters with 2 slots."""
from __future__ import annotations

import argparse
import asyncio
import shutil
import time

import httpx
import openai
import pytest
import torch
from lora_checkpoints import edit_adapter_config, make_adapter
from safetensors.torch import load_file, save_file

from strata import LLM, LoRARequest, SamplingParams
from strata.config import EngineConfig
from strata.engine.async_engine import AsyncEngine
from strata.errors import ConfigError
from strata.server.app import build_app
from strata.server.lora_modules import LoRAModulePath, parse_lora_module

BASE = "tiny"
PROMPT = [5, 17, 42, 99, 7, 300]
ENGINE = dict(dtype="float32", device="cpu", max_model_len=64, block_size=4, kv_cache_memory=1 << 20,
              enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=3, seed=0)


def _variant(source, folder, seed: int):
    """A copy of an adapter with other random A and B (as cheap as copying: one PEFT adapter serves them all)."""
    shutil.copytree(source, folder)
    path = folder / "adapter_model.safetensors"
    generator = torch.Generator().manual_seed(seed)
    tensors = {k: torch.randn(v.shape, generator=generator) * 0.3 for k, v in load_file(path).items()}
    save_file(tensors, path)
    return folder


@pytest.fixture(scope="module")
def adapters(server_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("server_loras")
    first = make_adapter(server_checkpoint, root / "a0", r=8, alpha=16)
    return [first] + [_variant(first, root / f"a{i}", seed=i) for i in range(1, 7)]


@pytest.fixture(scope="module")
def engine(server_checkpoint):
    eng = AsyncEngine.from_config(EngineConfig.create(str(server_checkpoint), served_model_name=BASE, **ENGINE))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def app(engine, adapters):
    modules = [parse_lora_module(f"a0={adapters[0]}"),
               parse_lora_module(f'{{"name": "a1", "path": "{adapters[1]}", "base_model_name": "{BASE}"}}')]
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    try:
        return build_app(engine, argparse.Namespace(lora_modules=modules, disable_log_requests=True))
    finally:
        mp.undo()


def _client(app) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http, max_retries=0)


async def _post(app, path: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        return await c.post(path, json=body)


async def _models(app) -> dict:
    return {m.id: m for m in (await _client(app).models.list()).data}


async def _tokens(client, model: str, max_tokens: int = 4) -> list[int]:
    out = await client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
    return out.choices[0].token_ids


def test_lora_modules_parse_both_forms():
    assert parse_lora_module("sql=/a/b") == LoRAModulePath("sql", "/a/b")
    assert parse_lora_module('{"name": "x", "path": "/p", "base_model_name": "m"}') == LoRAModulePath("x", "/p", "m")
    for bad in ("nopath", '{"name": "x"}', "{not json"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_lora_module(bad)


def test_serve_takes_vllm_lora_flags():
    from strata.cli import build_parser
    from strata.cli_common import parse_command_line
    from strata.config.engine_args import EngineArgs

    args = parse_command_line(build_parser(), [
        "serve", "m", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "32", "--max-cpu-loras", "5",
        "--lora-modules", "a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}'])
    assert args.lora_modules == [LoRAModulePath("a", "/x"), LoRAModulePath("b", "/y", "m")]
    engine_args = EngineArgs.from_cli_args(args, "m")
    assert (engine_args.enable_lora, engine_args.max_loras, engine_args.max_lora_rank,
            engine_args.max_cpu_loras) == (True, 2, 32, 5)


def test_requests_pick_adapters_by_name_with_the_offline_tokens(app, adapters, server_checkpoint):
    client = _client(app)
    served = {name: asyncio.run(_tokens(client, name)) for name in (BASE, "a0", "a1")}
    with LLM(str(server_checkpoint), **ENGINE) as llm:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        loras = [None, LoRARequest("a0", 1, str(adapters[0])), LoRARequest("a1", 2, str(adapters[1]))]
        offline = llm.generate([{"prompt_token_ids": PROMPT}] * 3, params, use_tqdm=False, lora_request=loras)
    assert [served[n] for n in (BASE, "a0", "a1")] == [list(o.outputs[0].token_ids) for o in offline]
    assert served["a0"] != served[BASE] and served["a1"] != served[BASE]


def test_streamed_chat_with_an_adapter_matches_the_whole_answer(app):
    async def run():
        client = _client(app)
        kw = dict(model="a1", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
        whole = await client.chat.completions.create(**kw)
        chunks = [c async for c in await client.chat.completions.create(stream=True, **kw) if c.choices]
        return whole, chunks

    whole, chunks = asyncio.run(run())
    assert whole.model == "a1" and all(c.model == "a1" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content


def test_models_lists_each_adapter_with_its_parent_and_path(app, adapters):
    cards = asyncio.run(_models(app))
    assert cards["a0"].parent == BASE and cards["a0"].root == str(adapters[0])
    assert cards["a1"].parent == BASE and cards["a1"].root == str(adapters[1])
    assert cards[BASE].parent is None


def test_unknown_model_is_404_naming_the_served_ones(app):
    with pytest.raises(openai.NotFoundError) as info:
        asyncio.run(_tokens(_client(app), "nope"))
    message = info.value.body["message"]
    assert "`nope` does not exist" in message and "`a0`" in message and f"`{BASE}`" in message


def test_adapters_load_and_unload_at_run_time(app, adapters):
    client = _client(app)
    loaded = asyncio.run(_post(app, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters[2])}))
    assert loaded.status_code == 200 and "late" in loaded.text
    assert len(asyncio.run(_tokens(client, "late"))) == 4
    again = asyncio.run(_post(app, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters[3])}))
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    unloaded = asyncio.run(_post(app, "/v1/unload_lora_adapter", {"lora_name": "late"}))
    assert unloaded.status_code == 200
    with pytest.raises(openai.NotFoundError):
        asyncio.run(_tokens(client, "late"))
    assert asyncio.run(_post(app, "/v1/unload_lora_adapter", {"lora_name": "late"})).status_code == 404


def test_bad_adapter_folder_is_400_with_the_reason(app, adapters, tmp_path):
    missing = asyncio.run(_post(app, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)}))
    assert missing.status_code == 400 and "adapter_config.json" in missing.json()["error"]["message"]
    dora = _variant(adapters[0], tmp_path / "dora", seed=9)
    edit_adapter_config(dora, use_dora=True)
    refused = asyncio.run(_post(app, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(dora)}))
    assert refused.status_code == 400 and "DoRA" in refused.json()["error"]["message"]
    assert "x" not in asyncio.run(_models(app))


def test_bad_lora_module_stops_start_up(server_checkpoint, tmp_path):
    engine = AsyncEngine.from_config(EngineConfig.create(str(server_checkpoint), **ENGINE))
    try:
        with pytest.raises(ConfigError, match="--lora-modules bad=.*adapter_config.json"):
            build_app(engine, argparse.Namespace(lora_modules=[LoRAModulePath("bad", str(tmp_path))]))
    finally:
        engine.shutdown()


def test_runtime_routes_are_absent_unless_enabled(engine, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    monkeypatch.delenv("STRATA_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    plain = build_app(engine, argparse.Namespace(disable_log_requests=True))
    assert asyncio.run(_post(plain, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x"})).status_code == 404


def test_many_requests_over_more_adapters_than_slots_leave_nothing_behind(app, engine, adapters):
    names = ["a0", "a1"]
    for i in range(2, 6):
        response = asyncio.run(_post(app, "/v1/load_lora_adapter", {"lora_name": f"m{i}",
                                                                    "lora_path": str(adapters[i])}))
        assert response.status_code == 200, response.text
        names.append(f"m{i}")
    before = engine.stats()["free_blocks"]

    async def run():
        client = _client(app)
        return await asyncio.gather(*(_tokens(client, names[i % 6], max_tokens=2) for i in range(100)))

    results = asyncio.run(run())
    assert all(len(r) == 2 for r in results)
    deadline = time.monotonic() + 10
    while engine.stats()["running"] + engine.stats()["waiting"] and time.monotonic() < deadline:
        time.sleep(0.05)
    stats, manager = engine.stats(), engine.core.executor.runner.lora
    assert stats["running"] == stats["waiting"] == 0 and stats["free_blocks"] == before
    assert len(manager.slot_of) <= 2 and len(manager.loaded) <= 3
    assert set(manager.slot_of.values()) <= {0, 1}
