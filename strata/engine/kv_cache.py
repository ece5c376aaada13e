"""The KV block pool: block tables per request, LRU free list and a prefix cache of full blocks.

A full block is identified by a chained hash (its parent's hash and its own token ids), so equal
prefixes share blocks. Freed blocks keep their hash and stay reusable until they are evicted.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from strata.engine.request import Request

_ROOT_HASH = b"strata-prefix-root"


def block_hash(parent: bytes, token_ids: list[int], extra: bytes = b"") -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    h.update(extra)
    return h.digest()


def _root_hash(request: Request) -> bytes:
    """What a request's chain of block hashes starts from: the adapter, if any, so that requests of two adapters (or
    of one and the base model) never share a block."""
    lora = request.lora_request
    return _ROOT_HASH if lora is None else block_hash(_ROOT_HASH, [], lora.cache_key)


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    def take(self, n: int) -> list[int]:
        blocks = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)  # least recently freed first
            if self.hash_of[block] is not None:
                self.cached.pop(self.hash_of[block], None)
                self.hash_of[block] = None
            self.ref_count[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: list[int]) -> None:
        for block in blocks:
            if self.ref_count[block] == 0:
                del self.free[block]
            self.ref_count[block] += 1

    def release(self, blocks: list[int]) -> None:
        # Reverse order: a chain's tail is evicted before its head, which more requests share.
        for block in reversed(blocks):
            self.ref_count[block] -= 1
            assert self.ref_count[block] >= 0, f"block {block} released twice"
            if self.ref_count[block] == 0:
                self.free[block] = None

    def register(self, block: int, digest: bytes) -> None:
        if digest not in self.cached:
            self.cached[digest] = block
            self.hash_of[block] = digest


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found in the cache

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _update_hashes(self, request: Request) -> None:
        bs = self.block_size
        while (len(request.block_hashes) + 1) * bs <= request.num_tokens:
            i = len(request.block_hashes)
            parent = request.block_hashes[-1] if i else _root_hash(request)
            # A block holding image tokens also depends on the image's pixels (chained into later blocks).
            mm = request.mm_inputs
            extra = mm.cache_key if mm is not None and (i + 1) * bs > mm.first_position else b""
            request.block_hashes.append(block_hash(parent, request.token_ids[i * bs:(i + 1) * bs], extra))

    def computed_blocks(self, request: Request) -> list[int]:
        """Leading cached blocks of a new request; the last token is always recomputed for its logits."""
        # Prompt logprobs need the logits of every prompt position, so such requests compute them all.
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        self._update_hashes(request)
        usable = (request.num_tokens - 1) // self.block_size
        blocks = []
        for digest in request.block_hashes[:usable]:
            block = self.pool.cached.get(digest)
            if block is None:
                break
            blocks.append(block)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(blocks) * self.block_size
        return blocks

    def allocate(self, request: Request, num_new_tokens: int, computed: list[int] = ()) -> bool:
        """Give `request` blocks for `num_new_tokens` more tokens (after `computed` cached blocks)."""
        held = len(request.block_ids) + len(computed)
        need = self.blocks_needed(request.num_computed_tokens + len(computed) * self.block_size
                                  + num_new_tokens) - held
        # Cached blocks that are free right now would leave the free list when touched.
        evictable_hits = sum(1 for b in computed if self.pool.ref_count[b] == 0)
        if need > self.pool.num_free - evictable_hits:
            return False
        if computed:
            self.pool.touch(list(computed))
            request.block_ids.extend(computed)
            request.num_computed_tokens += len(computed) * self.block_size
            request.num_hashed_blocks_cached = len(request.block_ids)
        if need > 0:
            request.block_ids.extend(self.pool.take(need))
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Register blocks that are now fully computed, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        self._update_hashes(request)
        full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        for i in range(request.num_hashed_blocks_cached, full):
            self.pool.register(request.block_ids[i], request.block_hashes[i])
        request.num_hashed_blocks_cached = max(request.num_hashed_blocks_cached, full)

    def free(self, request: Request) -> None:
        self.pool.release(request.block_ids)
        request.block_ids = []
        request.num_hashed_blocks_cached = 0
