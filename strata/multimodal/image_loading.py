"""Turning an image reference from a request (data URI, local file, remote URL) into an RGB PIL image.

Local files and remote URLs are off unless the server enables them; refusals are `RequestError`s (HTTP 400).
"""
from __future__ import annotations

import base64
import binascii
import http.client
import io
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from PIL import Image, ImageOps, UnidentifiedImageError

from strata.errors import RequestError
from strata.multimodal.image_cache import ImageCache, image_key

# Bounds what one request can make the server download and hold in memory.
MAX_REMOTE_IMAGE_BYTES = 64 * 1024 * 1024
REMOTE_TIMEOUT_S = 10.0
_PARAM = "image_url"


def load_image(
    url: str,
    *,
    allowed_local_media_path: str | None = None,
    allow_remote_media: bool = False,
    timeout_s: float = REMOTE_TIMEOUT_S,
    max_pixels: int | None = None,
    cache: ImageCache | None = None,
) -> Image.Image:
    """Load the image `url` refers to and return it decoded, upright (EXIF orientation applied) and RGB.

    Accepted: `data:image/...;base64,...` URIs; `file://` URLs and plain paths inside
    `allowed_local_media_path` (relative paths are taken relative to that folder); `http(s)://` URLs
    when `allow_remote_media`. Images over `max_pixels` are refused before decoding; with a `cache`, bytes
    decoded before give the image decoded then.
    """
    if not isinstance(url, str) or not url.strip():
        raise RequestError("image URL must be a non-empty string", param=_PARAM)
    url = url.strip()
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == "data":
        data = _data_uri_bytes(url)
    elif scheme in ("http", "https"):
        if not allow_remote_media:
            raise RequestError(
                "remote image URLs are disabled on this server (start it with --allow-remote-media to "
                "fetch http(s) images); send the image as a base64 data URI instead",
                param=_PARAM,
            )
        data = _fetch_remote(url, timeout_s)
    elif scheme == "file":
        data = _read_local(_file_url_path(url), allowed_local_media_path)
    elif scheme == "":
        data = _read_local(url, allowed_local_media_path)
    else:
        raise RequestError(f"unsupported image URL scheme {scheme!r}; use a data URI", param=_PARAM)
    if cache is None:
        return decode_image(data, max_pixels)
    key = image_key(data)
    image = cache.get(key)
    if image is None:
        image = decode_image(data, max_pixels)
        cache.put(key, image)
    return image


def decode_image(data: bytes, max_pixels: int | None = None) -> Image.Image:
    """Decode encoded image bytes (PNG, JPEG, ...) into an upright RGB image of at most `max_pixels` pixels."""
    try:
        image = Image.open(io.BytesIO(data))
        if max_pixels is not None and image.width * image.height > max_pixels:
            # Read from the header: a small file can declare a huge image (a decompression bomb).
            raise RequestError(f"the image is {image.width}x{image.height} = {image.width * image.height} pixels, "
                               f"over this server's limit of {max_pixels} (max_image_pixels)", param=_PARAM)
        # Decoding is lazy; force it here so truncated or corrupt files fail as a bad request.
        image.load()
        image = ImageOps.exif_transpose(image)
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError, SyntaxError) as exc:
        raise RequestError(f"could not decode the image: {exc}", param=_PARAM) from exc
    return to_rgb(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """Return `image` as RGB; transparent pixels are composited onto white (as HF processors do)."""
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _data_uri_bytes(url: str) -> bytes:
    header, sep, payload = url[len("data:"):].partition(",")
    if not sep:
        raise RequestError("malformed data URI: no ',' before the data", param=_PARAM)
    params = [p.strip().lower() for p in header.split(";")]
    media_type = params[0]
    if media_type and not media_type.startswith("image/"):
        raise RequestError(f"data URI media type {media_type!r} is not an image", param=_PARAM)
    if "base64" not in params[1:]:
        return urllib.parse.unquote_to_bytes(payload)
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError(f"data URI is not valid base64: {exc}", param=_PARAM) from exc


def _file_url_path(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise RequestError("file:// URLs must not name a host", param=_PARAM)
    return urllib.request.url2pathname(parts.path)


def _read_local(path: str, allowed_local_media_path: str | None) -> bytes:
    if allowed_local_media_path is None:
        raise RequestError(
            "local image paths are disabled on this server (start it with "
            "--allowed-local-media-path DIR to allow files under DIR)",
            param=_PARAM,
        )
    root = Path(allowed_local_media_path).resolve()
    # resolve() follows symlinks and removes '..', so the containment check sees the real file.
    target = (root / Path(path).expanduser()).resolve()
    if not target.is_relative_to(root):
        raise RequestError(
            f"local image path {path!r} is outside the folder allowed by --allowed-local-media-path",
            param=_PARAM,
        )
    try:
        return target.read_bytes()
    except OSError as exc:
        raise RequestError(f"cannot read local image {path!r}: {exc.strerror or exc}", param=_PARAM) from exc


def _fetch_remote(url: str, timeout_s: float) -> bytes:
    request = urllib.request.Request(url, headers={"User-Agent": "strata"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            data = response.read(MAX_REMOTE_IMAGE_BYTES + 1)
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise RequestError(f"could not fetch image {url!r}: {reason}", param=_PARAM) from exc
    if len(data) > MAX_REMOTE_IMAGE_BYTES:
        raise RequestError(
            f"image at {url!r} is larger than {MAX_REMOTE_IMAGE_BYTES // (1024 * 1024)} MiB", param=_PARAM
        )
    return data


def refuse_unknown_processor_kwargs(kwargs: Mapping[str, Any], supported: Sequence[str]) -> None:
    """A request's `mm_processor_kwargs` may name only the keys its model's processor reads (a 400 otherwise)."""
    unknown = sorted(set(kwargs) - set(supported))
    if unknown:
        raise RequestError(f"mm_processor_kwargs {unknown} are not supported (supported: {', '.join(supported)})",
                           param="mm_processor_kwargs")


def images_of(data: Any) -> list[Image.Image]:
    """The RGB images of a prompt's `multi_modal_data` ({"image": image or list of them}); a 400 for anything else
    (video included)."""
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise RequestError("multi_modal_data must be {'image': <PIL image or list of them>} (video input is not "
                           "supported)", param="multi_modal_data")
    images = data.get("image")
    images = [] if images is None else images if isinstance(images, (list, tuple)) else [images]
    if not all(isinstance(i, Image.Image) for i in images):
        raise RequestError("multi_modal_data['image'] must hold PIL images", param="multi_modal_data")
    return [to_rgb(i) for i in images]


def image_token_runs(token_ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """(start, end) of each maximal run of image tokens: one per image (or crop) in a processor-built prompt."""
    runs, start = [], None
    for i, t in enumerate([*token_ids, -1]):
        if t == image_token_id and start is None:
            start = i
        elif t != image_token_id and start is not None:
            runs.append((start, i))
            start = None
    return runs
