"""Loading request images: data URIs, local files under the allowed folder, remote URLs only when enabled."""
from __future__ import annotations

import base64
import http.server
import io
import threading

import pytest
from PIL import Image

from strata.errors import RequestError
from strata.multimodal.image_loading import decode_image, load_image


def encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def data_uri(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def test_png_data_uri_decodes_to_rgb_with_exact_pixels():
    image = Image.new("RGB", (7, 5), (10, 20, 30))
    image.putpixel((6, 4), (255, 0, 128))
    loaded = load_image(data_uri(encoded(image, "PNG"), "image/png"))
    assert loaded.mode == "RGB" and loaded.size == (7, 5)
    assert loaded.getpixel((0, 0)) == (10, 20, 30) and loaded.getpixel((6, 4)) == (255, 0, 128)


def test_jpeg_data_uri_decodes_to_rgb():
    image = Image.new("RGB", (16, 8), (200, 100, 50))
    loaded = load_image(data_uri(encoded(image, "JPEG"), "image/jpeg"))
    assert loaded.mode == "RGB" and loaded.size == (16, 8)
    assert all(abs(a - b) <= 3 for a, b in zip(loaded.getpixel((4, 4)), (200, 100, 50), strict=True))


def test_grayscale_and_transparent_images_become_rgb():
    gray = load_image(data_uri(encoded(Image.new("L", (3, 3), 77), "PNG"), "image/png"))
    assert gray.mode == "RGB" and gray.getpixel((1, 1)) == (77, 77, 77)
    clear = load_image(data_uri(encoded(Image.new("RGBA", (3, 3), (0, 0, 0, 0)), "PNG"), "image/png"))
    assert clear.getpixel((1, 1)) == (255, 255, 255)


@pytest.mark.parametrize(
    "url",
    [
        "data:image/png;base64,%%%not-base64%%%",
        "data:image/png;base64," + base64.b64encode(b"definitely not an image").decode(),
        "data:text/plain;base64,aGVsbG8=",
        "data:image/png;base64",
        "",
        "ftp://example.com/cat.png",
    ],
)
def test_bad_image_urls_are_request_errors(url):
    with pytest.raises(RequestError):
        load_image(url)


def test_truncated_png_is_a_request_error():
    data = encoded(Image.new("RGB", (64, 64), (1, 2, 3)), "PNG")
    with pytest.raises(RequestError):
        decode_image(data[: len(data) // 2])


@pytest.mark.parametrize("url", ["http://example.com/cat.png", "https://example.com/cat.png"])
def test_remote_urls_are_refused_by_default_naming_the_flag(url):
    with pytest.raises(RequestError, match="--allow-remote-media"):
        load_image(url)


@pytest.fixture
def image_server():
    png = encoded(Image.new("RGB", (4, 4), (9, 8, 7)), "PNG")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - name fixed by BaseHTTPRequestHandler
            if self.path != "/cat.png":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(png)))
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_remote_url_is_fetched_when_allowed(image_server):
    loaded = load_image(f"{image_server}/cat.png", allow_remote_media=True)
    assert loaded.size == (4, 4) and loaded.getpixel((0, 0)) == (9, 8, 7)


def test_remote_fetch_failure_is_a_request_error(image_server):
    with pytest.raises(RequestError, match="could not fetch"):
        load_image(f"{image_server}/missing.png", allow_remote_media=True, timeout_s=5)


@pytest.fixture
def media_dir(tmp_path):
    allowed = tmp_path / "media"
    (allowed / "sub").mkdir(parents=True)
    Image.new("RGB", (5, 6), (1, 2, 3)).save(allowed / "sub" / "inside.png")
    Image.new("RGB", (5, 6), (4, 5, 6)).save(tmp_path / "outside.png")
    return allowed


def test_local_path_inside_allowed_folder_is_loaded(media_dir):
    inside = media_dir / "sub" / "inside.png"
    for url in [str(inside), inside.as_uri(), "sub/inside.png"]:
        loaded = load_image(url, allowed_local_media_path=str(media_dir))
        assert loaded.size == (5, 6) and loaded.getpixel((0, 0)) == (1, 2, 3)


def test_local_paths_are_refused_without_the_flag(media_dir):
    with pytest.raises(RequestError, match="--allowed-local-media-path"):
        load_image(str(media_dir / "sub" / "inside.png"))
    with pytest.raises(RequestError, match="--allowed-local-media-path"):
        load_image((media_dir / "sub" / "inside.png").as_uri())


def test_local_path_outside_allowed_folder_is_refused(media_dir):
    outside = media_dir.parent / "outside.png"
    dotted = str(media_dir / "sub" / ".." / ".." / "outside.png")
    for url in [str(outside), outside.as_uri(), "../outside.png", dotted]:
        with pytest.raises(RequestError, match="outside"):
            load_image(url, allowed_local_media_path=str(media_dir))


def test_symlink_escaping_the_allowed_folder_is_refused(media_dir):
    (media_dir / "link.png").symlink_to(media_dir.parent / "outside.png")
    with pytest.raises(RequestError, match="outside"):
        load_image(str(media_dir / "link.png"), allowed_local_media_path=str(media_dir))


def test_missing_local_file_is_a_request_error(media_dir):
    with pytest.raises(RequestError, match="cannot read"):
        load_image(str(media_dir / "nope.png"), allowed_local_media_path=str(media_dir))
