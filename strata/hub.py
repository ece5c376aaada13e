"""Hugging Face Hub repos through huggingface_hub: a revision's file list (from the Hub, or from its cache when
offline), the download of chosen files into that cache, and the Hub's errors as ConfigErrors naming the fix."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from strata.errors import ConfigError

logger = logging.getLogger(__name__)

# Weight files are fetched side by side (as snapshot_download does); small files one after another.
_PARALLEL_DOWNLOADS = 8
_WEIGHT_SUFFIXES = (".safetensors", ".gguf")


@dataclass(frozen=True)
class HubRepo:
    """A model repo at a revision, and where (cache folder) and as whom (token) to download it."""

    repo_id: str
    given: str  # what the user typed, which may also have meant a local path
    revision: str | None = None
    cache_dir: str | None = None
    token: str | None = field(default=None, repr=False)  # kept out of logs
    revision_flag: str = "--revision"  # the option that set `revision`, for messages

    @property
    def ref(self) -> str:
        return self.revision or "main"


@dataclass(frozen=True)
class RepoFiles:
    """The files of one commit of a repo; `cached_only` when they come from the cache (no download possible)."""

    commit: str
    files: tuple[str, ...]
    snapshot: Path  # the cache folder of this commit: where its files are, or will be once downloaded
    cached_only: bool


def offline() -> bool:
    """HF_HUB_OFFLINE=1, as huggingface_hub reads it."""
    from huggingface_hub import constants

    return constants.is_offline_mode()


def endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def cache_root(repo: HubRepo) -> Path:
    """--download-dir, else huggingface_hub's cache (HF_HUB_CACHE, or HF_HOME/hub)."""
    from huggingface_hub import constants

    return Path(repo.cache_dir or constants.HF_HUB_CACHE).expanduser().resolve()


def _storage(repo: HubRepo) -> Path:
    from huggingface_hub.file_download import repo_folder_name

    return cache_root(repo) / repo_folder_name(repo_id=repo.repo_id, repo_type="model")


def cached_files(repo: HubRepo) -> RepoFiles | None:
    """The files of the revision's snapshot in the cache (its layout: refs/<revision> holds the commit,
    snapshots/<commit>/ the files), or None when that revision was never downloaded."""
    from huggingface_hub.file_download import REGEX_COMMIT_HASH

    storage = _storage(repo)
    commit = repo.ref if REGEX_COMMIT_HASH.fullmatch(repo.ref) else None
    ref = storage / "refs" / repo.ref
    if commit is None and ref.is_file():
        commit = ref.read_text().strip()
    snapshot = storage / "snapshots" / commit if commit else None
    if snapshot is None or not snapshot.is_dir():
        return None
    files = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
    return RepoFiles(commit, tuple(files), snapshot, cached_only=True)


def _quiet_http_client() -> None:
    """huggingface_hub's HTTP client logs every request at INFO, which would bury the download's progress bars
    under a line per file; left alone when the user set its level."""
    from huggingface_hub.utils import httpx

    client_logger = logging.getLogger(httpx.__name__)
    if client_logger.level == logging.NOTSET:
        client_logger.setLevel(logging.WARNING)


def list_files(repo: HubRepo) -> RepoFiles:
    """The revision's files: asked of the Hub, or read from the cache when offline (or, with a warning, when
    the Hub cannot be reached). Nothing is downloaded."""
    _quiet_http_client()
    if offline():
        cached = cached_files(repo)
        if cached is None:
            raise ConfigError(f"no folder {repo.given!r}, and Hub repo {repo.repo_id!r} (revision {repo.ref!r}) is "
                              f"not in the Hugging Face cache {cache_root(repo)}, while HF_HUB_OFFLINE=1 forbids "
                              "downloading it: download it once with network access (unset HF_HUB_OFFLINE), or point "
                              "HF_HUB_CACHE or --download-dir at the cache that holds it", param="model")
        return cached
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.utils import httpx

    try:
        info = HfApi().model_info(repo.repo_id, revision=repo.ref, token=repo.token)
    except (httpx.ConnectError, httpx.TimeoutException) as e:
        cached = cached_files(repo)
        if cached is None:
            raise hub_error(repo, e) from e
        logger.warning("cannot reach the Hub at %s (%s): using the cached copy of %s (commit %s)",
                       endpoint(), e, repo.repo_id, cached.commit)
        return cached
    except HfHubHTTPError as e:
        raise hub_error(repo, e) from e
    files = tuple(sorted(s.rfilename for s in info.siblings or ()))
    return RepoFiles(info.sha, files, _storage(repo) / "snapshots" / info.sha, cached_only=False)


def download(repo: HubRepo, listing: RepoFiles, names: list[str]) -> Path:
    """Bring `names` of the listed commit into the cache (huggingface_hub's progress bars; files already
    there are not fetched again) and return the snapshot folder that holds them."""
    if listing.cached_only:
        missing = [n for n in names if not (listing.snapshot / n).is_file()]
        if missing:
            raise ConfigError(f"the cached copy of Hub repo {repo.repo_id!r} (commit {listing.commit}) lacks "
                              f"{', '.join(missing)}, and it cannot be downloaded now (HF_HUB_OFFLINE=1 or the Hub "
                              "is unreachable): download it once with network access", param="model")
        return listing.snapshot
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    from huggingface_hub.utils import httpx
    from huggingface_hub.utils import tqdm as hf_tqdm
    from tqdm.contrib.concurrent import thread_map

    def fetch(name: str) -> str:
        # The commit, not the branch: every file comes from the one commit that was listed.
        return hf_hub_download(repo.repo_id, name, revision=listing.commit, cache_dir=repo.cache_dir,
                               token=repo.token)

    weights = [n for n in names if n.endswith(_WEIGHT_SUFFIXES)]
    try:
        for name in names:
            if name not in weights:
                fetch(name)
        if len(weights) > 1:
            thread_map(fetch, weights, max_workers=_PARALLEL_DOWNLOADS, tqdm_class=hf_tqdm,
                       desc=f"Fetching {len(weights)} weight files of {repo.repo_id}")
        elif weights:
            fetch(weights[0])
    except (HfHubHTTPError, LocalEntryNotFoundError, httpx.ConnectError, httpx.TimeoutException) as e:
        raise hub_error(repo, e, downloading=True) from e
    _remember_revision(repo, listing.commit)
    return listing.snapshot


def _remember_revision(repo: HubRepo, commit: str) -> None:
    """Write refs/<revision> -> commit, as huggingface_hub does, so that an offline run finds this snapshot by
    its branch or tag (downloads by commit hash do not write it)."""
    if repo.ref == commit:
        return
    ref = _storage(repo) / "refs" / repo.ref
    if ref.is_file() and ref.read_text().strip() == commit:
        return
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(commit)


def hub_error(repo: HubRepo, error: Exception, downloading: bool = False) -> ConfigError:
    """A huggingface_hub error (or a failed connection) as a ConfigError naming the repo and what to do."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(error, LocalEntryNotFoundError) and isinstance(error.__cause__, HfHubHTTPError):
        error = error.__cause__  # a refused download surfaces as "not in the cache"; its cause says why
    url = endpoint()
    token = (f"pass --hf-token TOKEN or set HF_TOKEN (a read token from {url}/settings/tokens)" if repo.token is None
             else "check that the token given (--hf-token or HF_TOKEN) can read it")
    if isinstance(error, GatedRepoError):
        message = (f"Hub repo {repo.repo_id!r} is gated: accept its licence on {url}/{repo.repo_id} while logged in, "
                   f"then {token}")
    elif isinstance(error, RepositoryNotFoundError):
        message = (f"no folder {repo.given!r}, and no Hub repo {repo.repo_id!r} at {url}: check the name (a private "
                   f"or gated repo also reads as missing to whom cannot see it: {token})")
    elif isinstance(error, RevisionNotFoundError):
        message = (f"Hub repo {repo.repo_id!r} has no revision {repo.ref!r}: give {repo.revision_flag} an existing "
                   "branch, tag or commit hash")
    elif isinstance(error, EntryNotFoundError) and isinstance(error, HfHubHTTPError):
        message = f"Hub repo {repo.repo_id!r} lists a file it cannot serve ({error}); try again later"
    elif isinstance(error, HfHubHTTPError) and error.response is not None \
            and error.response.status_code in (401, 403):
        message = (f"the Hub refused access to {repo.repo_id!r} (HTTP {error.response.status_code}): {token}, and "
                   f"accept the licence on {url}/{repo.repo_id} if the repo is gated")
    elif isinstance(error, HfHubHTTPError):
        message = f"the Hub at {url} failed to serve {repo.repo_id!r}: {error}"
    elif downloading:
        message = (f"downloading {repo.repo_id!r} from {url} failed ({type(error).__name__}: {error}): check the "
                   "network and HF_ENDPOINT, then run again (the files downloaded stay in the cache)")
    else:
        message = (f"no folder {repo.given!r}, and the Hub at {url} cannot be reached to look up repo "
                   f"{repo.repo_id!r} ({type(error).__name__}: {error}), which is not cached either: check the "
                   "network and HF_ENDPOINT")
    return ConfigError(message, param="model")
