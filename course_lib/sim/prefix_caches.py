"""Three prefix caches served the same prompts: vLLM V0's verified hash chain, vLLM V1's
sha256 chain, SGLang's radix tree (chapter 12 and ``bench/prefix_caches.py``).

Each ``serve_*`` function runs prompts one after another through a KV cache of ``slots``
token slots the way that system's scheduler drives its cache (look up, allocate the rest,
enter the prompt in the cache, finish) and returns a :class:`PrefixRun`: prompt tokens hit,
CPU seconds, and bytes of Python metadata the cache holds per cached token.
"""

from __future__ import annotations

import random
import sys
import time
from typing import NamedTuple

from ..memory.radix.radix_cache import RadixCache
from ..memory.v0.manager import BlockManager
from ..memory.v1.kv_cache_manager import KVCacheManager
from ..sizing.blocks import check_block_size
from ..sizing.units import check_int


class PrefixRun(NamedTuple):
    hit_tokens: int
    cpu_s: float
    metadata_bytes_per_token: float


def deep_sizeof(root) -> int:
    """Bytes of Python objects reachable from ``root`` (each counted once)."""
    seen, todo, total = set(), [root], 0
    while todo:
        obj = todo.pop()
        if id(obj) in seen or obj is None or isinstance(obj, type):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, dict):
            todo += list(obj.keys()) + list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo += list(obj)
        elif hasattr(obj, "__slots__"):       # links to other nodes are not this one's bytes
            todo += [getattr(obj, s) for s in obj.__slots__ if hasattr(obj, s)
                     and s not in ("prev_free_block", "next_free_block", "parent")]
        elif hasattr(obj, "__dict__") and not callable(obj):
            todo += list(vars(obj).values())
    return total


def _check_pool(slots: int, block: int) -> None:
    """A pool of at least one block of ``block`` (a power of two) tokens."""
    check_block_size(block)
    check_int("slots", slots, block)


def rag_like(num: int, seed: int = 0) -> list[list[int]]:
    """Eight 512-token documents; each prompt is one of them plus a question."""
    check_int("num", num, 0)
    check_int("seed", seed, 0)
    rng = random.Random(seed)
    docs = [[rng.randrange(32000) for _ in range(512)] for _ in range(8)]
    return [rng.choice(docs) + [rng.randrange(32000) for _ in range(rng.randint(8, 48))]
            for _ in range(num)]


def serve_v0(prompts, slots: int = 8192, block: int = 16) -> PrefixRun:
    """vLLM V0 / the paper: ``BlockManager`` with verified chained hashes."""
    _check_pool(slots, block)
    m = BlockManager(block, slots // block, watermark=0.0, enable_prefix_caching=True)
    hits = 0
    t0 = time.process_time()
    for i, p in enumerate(prompts):
        m.can_allocate(p)
        hits += m.allocate(i, p)
        m.mark_blocks_as_computed(i, len(p))
        m.free(i)
    cpu = time.process_time() - t0
    cached = len(m.cache.cached_block_ids()) * block
    return PrefixRun(hits, cpu, deep_sizeof(m.cache) / max(1, cached))


def serve_v1(prompts, slots: int = 8192, block: int = 16) -> PrefixRun:
    """vLLM V1: ``KVCacheManager``, sha256 chain, hits trusted."""
    _check_pool(slots, block)
    m = KVCacheManager(block, slots // block, enable_caching=True)
    hits = 0
    t0 = time.process_time()
    for i, p in enumerate(prompts):
        blocks, n = m.get_computed_blocks(i, p)
        m.allocate_slots(i, p, 0, len(p) - n, blocks, admission=True)
        m.record_prefix_cache_stats(len(p), n)
        hits += n
        m.forget(i)
    cpu = time.process_time() - t0
    pool = m.block_pool
    cached = sum(len(b) for b in pool.cached_block_hash_to_block.values()) * block
    return PrefixRun(hits, cpu, deep_sizeof(pool.cached_block_hash_to_block) / max(1, cached))


def serve_radix(prompts, slots: int = 8192, page_size: int = 1) -> PrefixRun:
    """SGLang: a radix tree over token ids, ``page_size`` tokens per page."""
    check_int("page_size", page_size, 1)
    check_int("slots", slots, page_size)
    cache = RadixCache(slots, page_size)
    hits = 0
    t0 = time.process_time()
    for p in prompts:
        value, node = cache.match_prefix(p)
        cache.inc_lock_ref(node)
        slots = value + cache.alloc(len(p) - len(value))
        done = cache.insert(p, slots)
        cache.pool.free(slots[len(value):done])
        n = len(p) - len(p) % page_size
        cache.pool.free(slots[n:])
        cache.dec_lock_ref(node)
        hits += len(value)
    cpu = time.process_time() - t0
    return PrefixRun(hits, cpu, deep_sizeof(cache.root) / max(1, cache.total_size()))
