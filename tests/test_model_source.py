"""Where a model's files come from: Hub IDs through huggingface_hub (a fake Hub on 127.0.0.1, and a cache laid
out by hand read offline), local GGUF files with their split parts, and every refusal naming its fix."""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import pytest
import torch
from fake_hub import FakeHub, FakeRepo
from huggingface_hub import constants, try_to_load_from_cache
from transformers import AutoModelForCausalLM

from strata import LLM, ConfigError, SamplingParams
from strata.bench.throughput import bench_prompts
from strata.cli import build_parser, main
from strata.config import EngineConfig, ModelConfig
from strata.demo import demo_checkpoint_path
from strata.model_source import ModelSource, resolve_model

GGUF = b"GGUF\x03\x00\x00\x00"  # a .gguf file's first bytes: enough for finding files, which never parses them
CACHE_SHA = "0123456789abcdef0123456789abcdef01234567"


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def _point_hub_at(monkeypatch, url: str, cache: Path, offline: bool = False) -> None:
    """huggingface_hub reads HF_ENDPOINT, HF_HUB_CACHE and HF_HUB_OFFLINE once, at import: patch what it read."""
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(cache.parent / "no-saved-token"))
    monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(cache.parent / "agent-harnesses.json"))
    monkeypatch.delenv("HF_TOKEN", raising=False)


@pytest.fixture
def hub(tmp_path, monkeypatch, llama_gqa):
    fake = FakeHub()
    _point_hub_at(monkeypatch, fake.url, tmp_path / "hub-cache")
    checkpoint = _files(llama_gqa)
    extras = {"pytorch_model.bin": b"\0" * (1 << 20), "flax_model.msgpack": b"\0" * 1024, "README.md": b"# tiny"}
    older = {**checkpoint, "config.json": json.dumps({**json.loads(checkpoint["config.json"]),
                                                      "max_position_embeddings": 128}).encode()}
    tokenizer_config = {**json.loads(checkpoint["tokenizer_config.json"]), "model_max_length": 777}
    fake.repos.update({
        "org/tiny": FakeRepo({"main": {**checkpoint, **extras}, "v1": older}),
        "org/tok": FakeRepo({"main": {**checkpoint, "tokenizer_config.json": json.dumps(tokenizer_config).encode()}}),
        "org/gated": FakeRepo({"main": checkpoint}, gated=True),
        "org/private": FakeRepo({"main": checkpoint}, private=True),
        "org/pickles": FakeRepo({"main": {"config.json": checkpoint["config.json"], **extras}}),
        "org/readme": FakeRepo({"main": {"README.md": b"# nothing here"}}),
        "org/gguf": FakeRepo({"main": {name: GGUF for name in [
            "tiny-Q4_K_M.gguf", "tiny-Q4_K_S.gguf", "tiny-Q6_K-00001-of-00002.gguf", "tiny-Q6_K-00002-of-00002.gguf",
            "tiny.Q8_0.gguf", "q8/tiny-Q8_0.gguf"]} | {"README.md": b"# quants"}}),
    })
    yield fake
    fake.close()


def test_llm_on_a_hub_id_downloads_only_what_strata_reads_and_generates_as_transformers_on_the_folder(
        hub, llama_gqa):
    prompts = [[0, 17, 42, 99, 5], [0, 250, 3]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(model="org/tiny", tokenizer="org/tok", dtype="float32", device="cpu", max_model_len=64) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.engine.config.served_model_names == ("org/tiny",)
        assert llm.get_tokenizer().model_max_length == 777  # org/tok's tokenizer, not the model's own
    hf = AutoModelForCausalLM.from_pretrained(llama_gqa, dtype=torch.float32)
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                              eos_token_id=None, pad_token_id=1)[0, len(prompt):]
        assert out.outputs[0].token_ids == ref.tolist()
    assert hub.requested_files("org/tiny") == set(_files(llama_gqa))  # never the .bin, .msgpack or README
    assert "model.safetensors" not in hub.requested_files("org/tok")


def test_a_downloaded_revision_resolves_again_offline_without_a_request(hub, monkeypatch):
    main_source = resolve_model("org/tiny")
    v1 = resolve_model("org/tiny", revision="v1")
    assert ModelConfig.from_path(v1).max_model_len == 128
    assert ModelConfig.from_path(main_source).max_model_len == 512
    asked = len(hub.requests)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert resolve_model("org/tiny") == main_source
    assert resolve_model("org/tiny", revision="v1") == v1
    assert len(hub.requests) == asked
    commit = hub.repos["org/tiny"].commit("v1")
    assert resolve_model("org/tiny", revision=commit).folder == v1.folder
    with pytest.raises(ConfigError, match=r"'org/tiny' \(revision 'v2'\) is not in the Hugging Face cache .*"
                                          r"HF_HUB_OFFLINE=1"):
        resolve_model("org/tiny", revision="v2")
    with pytest.raises(ConfigError, match="no folder 'org/never'.*HF_HUB_OFFLINE=1 forbids downloading"):
        resolve_model("org/never")


def test_a_hub_cache_laid_out_by_hand_serves_strata_plan_offline(tmp_path, monkeypatch, llama_gqa, capsys):
    cache = tmp_path / "cache"
    storage = cache / "models--org--cached"
    snapshot = storage / "snapshots" / CACHE_SHA
    snapshot.mkdir(parents=True)
    (storage / "blobs").mkdir()
    for name, data in _files(llama_gqa).items():
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(CACHE_SHA)
    _point_hub_at(monkeypatch, "http://127.0.0.1:9", cache, offline=True)  # nothing listens: offline must not ask
    # huggingface_hub itself finds files in this layout, so it is the layout it writes.
    assert try_to_load_from_cache("org/cached", "config.json") == str(snapshot / "config.json")
    assert main(["plan", "org/cached", "-tp", "2"]) == 0
    out = capsys.readouterr().out
    assert str(snapshot) in out and "LlamaForCausalLM" in out


def test_download_dir_takes_the_files_instead_of_the_default_cache(hub, tmp_path):
    source = resolve_model("org/tiny", download_dir=str(tmp_path / "elsewhere"))
    assert Path(source.folder).parent.parent == tmp_path / "elsewhere" / "models--org--tiny"
    assert (Path(source.folder) / "model.safetensors").is_file()
    assert not Path(constants.HF_HUB_CACHE, "models--org--tiny").exists()


def test_bench_and_serve_resolve_a_hub_id_and_keep_it_as_the_served_name(hub):
    args = build_parser().parse_args(["bench", "throughput", "--model", "org/tiny", "--revision", "v1",
                                      "--num-prompts", "3", "--input-len", "5"])
    prompts = bench_prompts(args)
    assert len(prompts) == 3 and all(0 <= t < 320 for p in prompts for t in p)
    assert any(f"/org/tiny/resolve/{hub.repos['org/tiny'].commit('v1')}/" in path for _, path in hub.requests)
    config = EngineConfig.create("org/tiny", device="cpu")
    assert config.served_model_names == ("org/tiny",)
    assert Path(config.model.path, "config.json").is_file()


def test_a_sharded_checkpoint_downloads_only_the_files_its_index_names(hub, tmp_path):
    index = {"metadata": {}, "weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                                            "b.weight": "model-00002-of-00002.safetensors"}}
    hub.repos["org/sharded"] = FakeRepo({"main": {
        "config.json": b"{}", "model.safetensors.index.json": json.dumps(index).encode(),
        "model-00001-of-00002.safetensors": b"1", "model-00002-of-00002.safetensors": b"2",
        "consolidated.safetensors": b"stale copy"}})
    source = resolve_model("org/sharded")
    assert hub.requested_files("org/sharded") == {"config.json", "model.safetensors.index.json",
                                                  "model-00001-of-00002.safetensors",
                                                  "model-00002-of-00002.safetensors"}
    assert sorted(p.name for p in Path(source.folder).iterdir())[-1] == "model.safetensors.index.json"


def test_a_gguf_quantization_tag_picks_its_files_case_insensitively(hub):
    source = resolve_model("org/gguf:q4_k_m")
    assert [Path(f).name for f in source.gguf_files] == ["tiny-Q4_K_M.gguf"]
    split = resolve_model("org/gguf:Q6_K")
    assert [Path(f).name for f in split.gguf_files] == ["tiny-Q6_K-00001-of-00002.gguf",
                                                         "tiny-Q6_K-00002-of-00002.gguf"]
    assert all(Path(f).read_bytes() == GGUF and Path(f).parent == Path(split.folder) for f in split.gguf_files)
    chosen = resolve_model("org/gguf", gguf_file="q8/tiny-Q8_0.gguf")
    assert chosen.gguf_files == (str(Path(chosen.folder) / "tiny-Q8_0.gguf"),)
    assert hub.requested_files("org/gguf") == {"tiny-Q4_K_M.gguf", "tiny-Q6_K-00001-of-00002.gguf",
                                               "tiny-Q6_K-00002-of-00002.gguf", "q8/tiny-Q8_0.gguf"}


@pytest.mark.parametrize(("model", "gguf_file", "message"), [
    ("org/gguf:Q4_K", None, r"no GGUF files of Hub repo 'org/gguf' match 'Q4_K'.*its GGUF files are: q8/tiny-Q8_0"),
    ("org/gguf:Q8_0", None, r"2 GGUF files of Hub repo 'org/gguf' match 'Q8_0'.*tiny-Q4_K_S.gguf"),
    ("org/gguf", None, r"Hub repo 'org/gguf' has 5 GGUF files: choose one with org/gguf:QUANT"),
    ("org/gguf", "tiny-Q5_K.gguf", r"Hub repo 'org/gguf' has no file 'tiny-Q5_K.gguf' \(its GGUF files: "),
    ("org/gguf:Q4_K_M", "tiny-Q4_K_S.gguf", "give one of them"),
])
def test_an_unclear_gguf_choice_is_refused_listing_the_repos_gguf_files(hub, model, gguf_file, message):
    with pytest.raises(ConfigError, match=message):
        resolve_model(model, gguf_file=gguf_file)


def test_the_engine_config_reads_the_model_from_the_resolved_local_gguf_files(hub, monkeypatch):
    seen = []

    def capture(source, *args):
        seen.append(source)
        raise RuntimeError("captured")

    monkeypatch.setattr(ModelConfig, "from_path", staticmethod(capture))
    with pytest.raises(RuntimeError, match="captured"):
        LLM(model="org/gguf:Q6_K", device="cpu")
    assert [Path(f).name for f in seen[0].gguf_files] == ["tiny-Q6_K-00001-of-00002.gguf",
                                                          "tiny-Q6_K-00002-of-00002.gguf"]
    assert all(Path(f).is_file() for f in seen[0].gguf_files) and seen[0].model == "org/gguf:Q6_K"


@pytest.mark.parametrize(("model", "options", "message"), [
    ("org/missing", {}, r"no folder 'org/missing', and no Hub repo 'org/missing' at http://127\.0\.0\.1:\d+: "
                        r"check the name .*--hf-token"),
    ("org/private", {}, r"no Hub repo 'org/private'.*pass --hf-token TOKEN or set HF_TOKEN"),
    ("org/gated", {}, r"Hub repo 'org/gated' is gated: accept its licence on http://127\.0\.0\.1:\d+/org/gated "
                      r"while logged in, then pass --hf-token TOKEN or set HF_TOKEN"),
    ("org/gated", {"hf_token": "hf_wrong"}, r"'org/gated' is gated.*check that the token given"),
    ("org/tiny", {"revision": "v9"}, r"Hub repo 'org/tiny' has no revision 'v9': give --revision an existing branch"),
    ("org/tiny", {"tokenizer": "org/tok", "tokenizer_revision": "t9"}, r"'org/tok' has no revision 't9': give "
                                                                      r"--tokenizer-revision"),
    ("org/readme", {}, r"Hub repo 'org/readme' \(revision 'main'\) has no config.json and no .gguf file"),
    ("org/tiny", {"tokenizer": "org/readme"}, r"Hub repo 'org/readme' has no tokenizer files \(none of tokenizer.json"),
    ("models/llama-7b", {}, r"no folder 'models/llama-7b', and no Hub repo 'models/llama-7b'"),
    ("./no/such/folder", {}, r"no folder or file './no/such/folder', and it is not a Hub repo ID either"),
    ("no-such.gguf", {}, r"no GGUF file 'no-such.gguf' \(a GGUF file of a Hub repo is named ORG/NAME:QUANT"),
])
def test_a_model_that_cannot_be_had_is_refused_naming_it_and_the_fix(hub, model, options, message):
    with pytest.raises(ConfigError, match=message):
        resolve_model(model, **options)


def test_a_repo_of_pickled_weights_is_refused_before_any_download(hub):
    with pytest.raises(ConfigError, match=r"'org/pickles' has its weights only as pickle files \(pytorch_model.bin\)"
                                          r".*refuses.*nothing was downloaded"):
        LLM(model="org/pickles", device="cpu")
    assert hub.requested_files("org/pickles") == set()


def test_a_token_from_hf_token_or_the_option_opens_a_gated_repo(hub, monkeypatch):
    assert (Path(resolve_model("org/gated", hf_token=FakeHub.TOKEN).folder) / "model.safetensors").is_file()
    monkeypatch.setenv("HF_TOKEN", FakeHub.TOKEN)
    assert resolve_model("org/private").folder.endswith(hub.repos["org/private"].commit("main"))


def test_an_unreachable_hub_falls_back_to_the_cache_with_a_warning(hub, monkeypatch, caplog):
    cached = resolve_model("org/tiny")
    _point_hub_at(monkeypatch, "http://127.0.0.1:9", Path(constants.HF_HUB_CACHE))
    with caplog.at_level(logging.WARNING, logger="strata.hub"):
        assert resolve_model("org/tiny") == cached
    assert "cannot reach the Hub at http://127.0.0.1:9" in caplog.text
    with pytest.raises(ConfigError, match=r"no folder 'org/other', and the Hub at http://127.0.0.1:9 cannot be "
                                          r"reached .*not cached either"):
        resolve_model("org/other")


def test_a_tokenizer_id_downloads_only_tokenizer_files(hub):
    source = resolve_model("org/gguf:Q4_K_M", tokenizer="org/tok")
    assert Path(source.tokenizer, "tokenizer.json").is_file()
    assert hub.requested_files("org/tok") == {"config.json", "tokenizer.json", "tokenizer_config.json"}


def _touch(folder: Path, *names: str) -> None:
    for name in names:
        (folder / name).write_bytes(GGUF)


def test_a_local_gguf_file_brings_all_its_split_parts_in_order(tmp_path):
    _touch(tmp_path, "m-00002-of-00003.gguf", "m-00001-of-00003.gguf", "m-00003-of-00003.gguf", "single.gguf")
    parts = tuple(str(tmp_path / f"m-0000{i}-of-00003.gguf") for i in (1, 2, 3))
    for given in ("m-00001-of-00003.gguf", "m-00003-of-00003.gguf"):
        assert resolve_model(str(tmp_path / given)) == ModelSource(str(tmp_path / given), str(tmp_path), parts)
    assert resolve_model(str(tmp_path), gguf_file="single.gguf").gguf_files == (str(tmp_path / "single.gguf"),)
    (tmp_path / "m-00002-of-00003.gguf").unlink()
    with pytest.raises(ConfigError, match=r"one of 3 split GGUF parts, and m-00002-of-00003.gguf is missing"):
        resolve_model(str(tmp_path / "m-00001-of-00003.gguf"))


def test_a_local_folder_of_gguf_files_needs_one_chosen(tmp_path):
    _touch(tmp_path, "a-Q4_0.gguf", "a-Q8_0.gguf")
    with pytest.raises(ConfigError, match=r"folder .* has 2 GGUF files: name one as the model, or pass --gguf-file; "
                                          r"its GGUF files are: a-Q4_0.gguf, a-Q8_0.gguf"):
        resolve_model(str(tmp_path))
    with pytest.raises(ConfigError, match=r"no GGUF file .*a-Q5_0.gguf' \(GGUF files in .*: a-Q4_0.gguf, a-Q8_0"):
        resolve_model(str(tmp_path), gguf_file="a-Q5_0.gguf")
    with pytest.raises(ConfigError, match="--revision 'v1' selects a version of a Hub repo, but .* is a local path"):
        resolve_model(str(tmp_path), revision="v1")


def test_local_folders_and_the_demo_resolve_as_they_are_without_the_hub(llama_gqa, monkeypatch):
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    demo = str(demo_checkpoint_path())
    assert resolve_model(demo) == ModelSource(demo, demo)
    assert resolve_model(str(llama_gqa)) == ModelSource(str(llama_gqa), str(llama_gqa))
    assert resolve_model(str(llama_gqa), tokenizer=str(llama_gqa)).tokenizer == str(llama_gqa)
