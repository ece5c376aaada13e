"""Where a model's files are: a local checkpoint folder, a local GGUF file (with all its split parts), or a Hugging
Face Hub repo brought into huggingface_hub's cache. Resolved once, before ModelConfig: all after sees local paths."""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath

from strata import hub
from strata.errors import ConfigError

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "tokenizer.jsonl")  # PLaMo2's vocabulary
# What strata reads of a checkpoint besides its weights (preprocessor_config.json: Llama 4's image tiling).
CHECKPOINT_FILES = ("config.json", "generation_config.json", *TOKENIZER_FILES, "preprocessor_config.json")
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")

# llama.cpp's gguf-split names: NAME-00001-of-00003.gguf
_SPLIT_GGUF = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})(?P<suffix>\.gguf)$", re.IGNORECASE)
_QUANT_TAG = re.compile(r"[\w.+-]+")


@dataclass(frozen=True)
class ModelSource:
    """A model's local files, whatever the user named: all downstream code reads only these paths."""

    model: str  # what the user named: a folder, a .gguf file, ORG/NAME or ORG/NAME:QUANT
    folder: str  # local folder: the checkpoint (config.json...) or the folder of the GGUF file(s)
    gguf_files: tuple[str, ...] = ()  # local GGUF paths, all split parts in order; () for safetensors checkpoints
    tokenizer: str | None = None  # local folder of an explicit --tokenizer, else None (the model's own)


def resolve_model(model: str, *, revision: str | None = None, tokenizer: str | None = None,
                  tokenizer_revision: str | None = None, download_dir: str | None = None,
                  hf_token: str | None = None, gguf_file: str | None = None) -> ModelSource:
    """The local files of `model`: a local path as it is, a Hub ID downloaded (only what strata reads) into
    huggingface_hub's cache, or `download_dir`. Every problem is a ConfigError naming the model and the fix."""
    if Path(model).exists():
        if revision is not None:
            raise ConfigError(f"--revision {revision!r} selects a version of a Hub repo, but {model!r} is a local "
                              "path: drop --revision", param="revision")
        source = _local_source(model, gguf_file)
    else:
        repo_id, tag = _repo_id(model)
        source = _hub_source(model, hub.HubRepo(repo_id, model, revision, download_dir, hf_token), tag, gguf_file)
    if tokenizer is None and tokenizer_revision is not None:
        if Path(model).exists():
            raise ConfigError("--tokenizer-revision selects a version of a Hub repo's tokenizer: name the repo "
                              "with --tokenizer", param="tokenizer_revision")
        tokenizer = _repo_id(model)[0]
    if tokenizer is not None:
        source = replace(source, tokenizer=resolve_tokenizer(tokenizer, revision=tokenizer_revision,
                                                             download_dir=download_dir, hf_token=hf_token))
    logger.info("model %s: %s", model, ", ".join(source.gguf_files) or source.folder)
    return source


def resolve_tokenizer(tokenizer: str, *, revision: str | None = None, download_dir: str | None = None,
                      hf_token: str | None = None) -> str:
    """The local folder of a tokenizer given as a folder or a Hub ID (only its tokenizer files are downloaded)."""
    path = Path(tokenizer)
    if path.is_dir():
        if revision is not None:
            raise ConfigError(f"--tokenizer-revision {revision!r} selects a version of a Hub repo, but tokenizer "
                              f"{tokenizer!r} is a local folder: drop --tokenizer-revision", param="tokenizer_revision")
        return str(path)
    if path.exists():
        raise ConfigError(f"tokenizer {tokenizer!r} is a file: --tokenizer takes a folder or a Hub repo ID",
                          param="tokenizer")
    repo_id, tag = _repo_id(tokenizer)
    if tag is not None:
        raise ConfigError(f"tokenizer {tokenizer!r}: a :QUANT suffix names a GGUF file; --tokenizer takes a folder "
                          "or a Hub repo ID", param="tokenizer")
    repo = hub.HubRepo(repo_id, tokenizer, revision, download_dir, hf_token, revision_flag="--tokenizer-revision")
    listing = hub.list_files(repo)
    found = [name for name in TOKENIZER_FILES if name in listing.files]
    if not found:
        raise ConfigError(f"Hub repo {repo_id!r} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}): "
                          "give --tokenizer a repo or folder that has them", param="tokenizer")
    # config.json too: transformers reads the tokenizer class from it when tokenizer_config.json names none.
    return str(hub.download(repo, listing, [n for n in ("config.json", *found) if n in listing.files]))


def gguf_parts(name: str) -> list[str]:
    """Every part of a split GGUF file, in order (`name` may be any of them), or [name] for a single file."""
    directory, _, base = name.rpartition("/")
    match = _SPLIT_GGUF.match(base)
    if match is None or int(match["count"]) < 1:
        return [name]
    prefix = f"{directory}/" if directory else ""
    return [f"{prefix}{match['stem']}-{i:05d}-of-{match['count']}{match['suffix']}"
            for i in range(1, int(match["count"]) + 1)]


def choose_gguf(names: list[str], tag: str | None, where: str, how_to_choose: str) -> list[str]:
    """The parts of the one GGUF file among `names` whose name carries the quantization `tag` (case-insensitive,
    as a whole word: Q4_K does not match Q4_K_M), or of the only GGUF file when no tag is given."""
    candidates: dict[str, list[str]] = {}
    for name in names:
        if name.lower().endswith(".gguf"):
            parts = gguf_parts(name)
            candidates.setdefault(parts[0], parts)
    chosen = [first for first in candidates if tag is None or _has_tag(first, tag)]
    if len(chosen) != 1:
        listing = ", ".join(sorted(n for n in names if n.lower().endswith(".gguf"))) or "none"
        if tag is None:
            why = f"{where} has {len(chosen)} GGUF files: {how_to_choose}"
        else:
            why = f"{'no' if not chosen else len(chosen)} GGUF files of {where} match {tag!r}: {how_to_choose}"
        raise ConfigError(f"{why}; its GGUF files are: {listing}", param="model")
    parts = candidates[chosen[0]]
    missing = [p for p in parts if p not in names]
    if missing:
        raise ConfigError(f"{where} has only some of the {len(parts)} parts of split GGUF file {parts[0]!r}: "
                          f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing", param="model")
    return parts


def _has_tag(name: str, tag: str) -> bool:
    stem = PurePosixPath(name).name
    match = _SPLIT_GGUF.match(stem)
    stem = match["stem"] if match else stem[: -len(".gguf")]
    return re.search(rf"(?<![a-z0-9_]){re.escape(tag.lower())}(?![a-z0-9_])", stem.lower()) is not None


def _repo_id(model: str) -> tuple[str, str | None]:
    """(ORG/NAME, QUANT or None) of `ORG/NAME[:QUANT]`; a ConfigError saying both readings when `model` is
    neither an existing path nor a valid Hub ID."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if model.lower().endswith(".gguf"):
        raise ConfigError(f"no GGUF file {model!r} (a GGUF file of a Hub repo is named ORG/NAME:QUANT, e.g. "
                          "ORG/NAME:Q4_K_M, or ORG/NAME with --gguf-file FILE.gguf)", param="model")
    repo_id, colon, tag = model.partition(":")
    try:
        validate_repo_id(repo_id)
        valid_tag = not colon or _QUANT_TAG.fullmatch(tag) is not None
    except HFValidationError:
        valid_tag = False
    if not valid_tag:
        raise ConfigError(f"no folder or file {model!r}, and it is not a Hub repo ID either (ORG/NAME, or "
                          "ORG/NAME:QUANT for a GGUF file of the repo)", param="model")
    return repo_id, tag if colon else None


def _local_source(model: str, gguf_file: str | None) -> ModelSource:
    path = Path(model)
    if path.is_file():
        if gguf_file is not None:
            raise ConfigError(f"--gguf-file names a file in a folder or Hub repo, but {model!r} is a file itself: "
                              "drop --gguf-file", param="gguf_file")
        if not path.name.lower().endswith(".gguf"):
            raise ConfigError(f"{model!r} is a file, but neither a checkpoint folder (config.json + *.safetensors) "
                              "nor a .gguf file", param="model")
        return ModelSource(model, str(path.parent), _local_parts(path))
    if gguf_file is not None:
        return ModelSource(model, str(path), _local_parts(path / gguf_file))
    if (path / "config.json").is_file():
        return ModelSource(model, str(path))
    names = sorted(p.name for p in path.iterdir() if p.is_file())
    if not any(n.lower().endswith(".gguf") for n in names):
        raise ConfigError(f"folder {model!r} has no config.json and no .gguf file: give a Hugging Face checkpoint "
                          "folder (config.json + *.safetensors), a .gguf file or a Hub repo ID", param="model")
    parts = choose_gguf(names, None, f"folder {model!r}", "name one as the model, or pass --gguf-file")
    return ModelSource(model, str(path), tuple(str(path / p) for p in parts))


def _local_parts(path: Path) -> tuple[str, ...]:
    if not path.is_file():
        present = sorted(p.name for p in path.parent.glob("*") if p.name.lower().endswith(".gguf"))
        raise ConfigError(f"no GGUF file {str(path)!r} (GGUF files in {str(path.parent)!r}: "
                          f"{', '.join(present) or 'none'})", param="model")
    parts = gguf_parts(path.name)
    missing = [p for p in parts if not (path.parent / p).is_file()]
    if missing:
        raise ConfigError(f"{str(path)!r} is one of {len(parts)} split GGUF parts, and {', '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} missing from {str(path.parent)!r}: all parts "
                          "must sit in one folder", param="model")
    return tuple(str(path.parent / p) for p in parts)


def _hub_source(model: str, repo: hub.HubRepo, tag: str | None, gguf_file: str | None) -> ModelSource:
    if tag is not None and gguf_file is not None:
        raise ConfigError(f"{model!r} names a GGUF file by its quantization and --gguf-file names another: give "
                          "one of them", param="gguf_file")
    listing = hub.list_files(repo)
    top = [f for f in listing.files if "/" not in f]  # strata reads a checkpoint's top level only
    has_weights = SAFETENSORS_INDEX in top or any(f.endswith(".safetensors") for f in top)
    if tag is None and gguf_file is None and "config.json" in top and has_weights:
        return ModelSource(model, str(_download_checkpoint(repo, listing, top)))
    if gguf_file is not None and gguf_file not in listing.files:
        ggufs = ", ".join(f for f in listing.files if f.lower().endswith(".gguf")) or "none"
        raise ConfigError(f"Hub repo {repo.repo_id!r} has no file {gguf_file!r} (its GGUF files: {ggufs})",
                          param="gguf_file")
    if tag is not None or gguf_file is not None or any(f.lower().endswith(".gguf") for f in listing.files):
        parts = gguf_parts(gguf_file) if gguf_file is not None else choose_gguf(
            list(listing.files), tag, f"Hub repo {repo.repo_id!r}",
            f"choose one with {repo.repo_id}:QUANT (e.g. {repo.repo_id}:Q4_K_M) or --gguf-file FILE.gguf")
        missing = [p for p in parts if p not in listing.files]
        if missing:
            raise ConfigError(f"Hub repo {repo.repo_id!r} lacks split GGUF parts {', '.join(missing)}", param="model")
        snapshot = hub.download(repo, listing, parts)
        return ModelSource(model, str((snapshot / parts[0]).parent), tuple(str(snapshot / p) for p in parts))
    pickles = [f for f in top if f.endswith(PICKLE_SUFFIXES)]
    if "config.json" in top and pickles:
        raise ConfigError(f"Hub repo {repo.repo_id!r} has its weights only as pickle files ({', '.join(pickles)}), "
                          "which strata refuses to load because they can run arbitrary code; nothing was downloaded. "
                          "Pick a repo with *.safetensors weights or a GGUF file (or convert these to safetensors)",
                          param="model")
    what = "no *.safetensors weights" if "config.json" in top else "no config.json and no .gguf file"
    raise ConfigError(f"Hub repo {repo.repo_id!r} (revision {repo.ref!r}) has {what}: it is not a model strata "
                      "can load (strata reads Hugging Face checkpoints with safetensors weights, and GGUF files)",
                      param="model")


def _download_checkpoint(repo: hub.HubRepo, listing: hub.RepoFiles, top: list[str]) -> Path:
    """config, tokenizer and chat template files, then the weights: with an index, only the files it names."""
    wanted = [f for f in CHECKPOINT_FILES if f in top]
    if SAFETENSORS_INDEX not in top:
        return hub.download(repo, listing, wanted + [f for f in top if f.endswith(".safetensors")])
    snapshot = hub.download(repo, listing, [*wanted, SAFETENSORS_INDEX])
    try:
        weight_map = json.loads((snapshot / SAFETENSORS_INDEX).read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"Hub repo {repo.repo_id!r} has an unreadable {SAFETENSORS_INDEX}: {e}",
                          param="model") from e
    shards = sorted(set(weight_map.values()))
    missing = [f for f in shards if f not in listing.files]
    if missing and not listing.cached_only:  # a cached copy missing shards is hub.download's to report
        raise ConfigError(f"Hub repo {repo.repo_id!r}: {SAFETENSORS_INDEX} names files the repo lacks: "
                          f"{', '.join(missing)}", param="model")
    return hub.download(repo, listing, shards)
