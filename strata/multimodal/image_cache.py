"""ImageCache: decoded images keyed by the digest of their encoded bytes, least recently used dropped first, bounded
in bytes; a conversation that resends its images each turn decodes each image once."""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

from PIL import Image


def image_key(data: bytes) -> bytes:
    """The cache key of an encoded image: equal bytes decode to equal images, whatever URL carried them."""
    return hashlib.blake2b(data, digest_size=16).digest()


def image_bytes(image: Image.Image) -> int:
    """Bytes a decoded image holds (one byte per band and pixel for the RGB images cached)."""
    return image.width * image.height * len(image.getbands())


class ImageCache:
    """Thread-safe (the server renders chats on several threads). Cached images are shared between requests: the
    processors only read them (resizes make new images)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.queries = 0
        self.hits = 0
        self._images: OrderedDict[bytes, Image.Image] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._images)

    def get(self, key: bytes) -> Image.Image | None:
        with self._lock:
            self.queries += 1
            image = self._images.get(key)
            if image is not None:
                self.hits += 1
                self._images.move_to_end(key)
            return image

    def put(self, key: bytes, image: Image.Image) -> None:
        """Keep `image`, dropping the least recently used ones to stay within the bound; an image larger than the
        whole cache is not kept."""
        size = image_bytes(image)
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._images.pop(key, None)
            if old is not None:
                self.num_bytes -= image_bytes(old)
            while self._images and self.num_bytes + size > self.max_bytes:
                _, dropped = self._images.popitem(last=False)
                self.num_bytes -= image_bytes(dropped)
            self._images[key] = image
            self.num_bytes += size
