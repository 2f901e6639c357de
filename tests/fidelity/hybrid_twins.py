"""Twins for a hybrid model (tests/fidelity/harness.py): the course's ``KVCacheManager`` with
``kv_cache_groups`` and vLLM 0.33.0's own ``KVCacheManager`` built from a hybrid
``KVCacheConfig``, both with one full-attention group (0) and one sliding-window group (1)
(or, with ``chunk``, one chunked-local-attention group of that chunk size), driven by the
scheduler's moves of vllm_twins.py (admit with a hit, chunk, decode, preempt, finish, reset).
vLLM's side runs ``HybridKVCacheCoordinator``, ``FullAttentionManager``,
``SlidingWindowManager`` (``ChunkedLocalAttentionManager``) and ``BlockPool`` unchanged.

Ids: both pools reserve block 0 as the null block (the course's because a group needs it),
so the ids are compared as they are, null block included. Hashes are compared as (hash,
group): vLLM appends the group id to every key, the course to every group's but group 0's
(declared: test_declared_differences.py). The state compared: the free queue front
to back, every block's ref count and (hash, group), the hash map, every sequence's table in
each group, the prefix-cache counters and the usage; the answers: hits per group with their
length, and tables per group.
"""

from __future__ import annotations

from vllm_twins import CourseManager, RealManager, VllmRequest, _hex

from course_lib.memory.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from course_lib.memory.v1.kv_cache_manager import KVCacheManager

HASH_BYTES = 32                          # sha256: the hybrid lockstep hashes with it


def course_key(key: bytes | None) -> tuple | None:
    """A course hash-map key as (hash hex, group): group 0's is the bare hash."""
    if key is None:
        return None
    if len(key) == HASH_BYTES:
        return _hex(key), 0
    return _hex(key[:-4]), int.from_bytes(key[-4:], "big")


def _groups(hits) -> list[list[int]]:
    return [[b.block_id for b in group] for group in hits]


class CourseHybrid(CourseManager):
    def __init__(self, prompts, block_size: int, num_blocks: int, window: int,
                 enable_caching: bool = True, watermark: float = 0.0, chunk: int = 0):
        super(CourseManager, self).__init__(prompts)
        local = ChunkedLocalAttentionSpec(block_size, attention_chunk_size=chunk) if chunk \
            else SlidingWindowSpec(block_size, sliding_window=window)
        groups = [KVCacheGroupSpec(("full",), FullAttentionSpec(block_size)),
                  KVCacheGroupSpec(("local",), local)]
        self.m = KVCacheManager(block_size, num_blocks, enable_caching, watermark, "sha256",
                                kv_cache_groups=groups)

    def _ids(self, hits):
        return _groups(hits)

    def _allocate(self, rid, num_new, hits, num_hit, admission):
        req = self.reqs[rid]
        num_computed = 0 if admission else req.num_computed
        out = self.m.allocate_slots(rid, req.tokens, num_computed, num_new, hits,
                                    admission=admission)
        return None if out is None else [list(t) for t in self.m.get_block_tables(rid)]

    def state(self) -> dict:
        pool = self.m.block_pool
        stats = self.m.prefix_cache_stats
        return {
            "free_queue": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            "num_free": pool.get_num_free_blocks(),
            "usage": pool.get_usage(),
            "blocks": [(b.ref_cnt, course_key(b.block_hash)) for b in pool.blocks],
            "hash_map": {course_key(h): list(bs)
                         for h, bs in pool.cached_block_hash_to_block.items()},
            "tables": {rid: [list(t) for t in self.m.get_block_tables(rid)]
                       for rid in self.reqs if self.m.has_seq(rid)},
            "stats": (stats.queries, stats.hits, stats.preempted_queries,
                      stats.preempted_hits),
        }


class RealHybrid(RealManager):
    def __init__(self, prompts, vllm, block_size: int, num_blocks: int, window: int,
                 enable_caching: bool = True, watermark: float = 0.0, chunk: int = 0):
        super(RealManager, self).__init__(prompts)
        self.vllm = vllm
        utils, iface = vllm.kv_cache_utils, vllm.kv_cache_interface
        hash_fn = vllm.hashing.get_hash_fn_by_name("sha256")
        utils.init_none_hash(hash_fn)
        self.hasher = utils.get_request_block_hasher(block_size, hash_fn)
        shape = {"block_size": block_size, "num_kv_heads": 1, "head_size": 1,
                 "dtype": "float32"}
        local = iface.ChunkedLocalAttentionSpec(**shape, attention_chunk_size=chunk) if chunk \
            else iface.SlidingWindowSpec(**shape, sliding_window=window)
        config = iface.KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[],
            kv_cache_groups=[iface.KVCacheGroupSpec(["full"], iface.FullAttentionSpec(**shape)),
                             iface.KVCacheGroupSpec(["local"], local)])
        self.m = vllm.kv_cache_manager.KVCacheManager(
            config, max_model_len=1 << 20, scheduler_block_size=block_size,
            hash_block_size=block_size, enable_caching=enable_caching, log_stats=True,
            watermark=watermark)
        status = vllm.kv_cache_manager.RequestStatus
        self.waiting, self.preempted, self.running_status = \
            status.WAITING, status.PREEMPTED, status.RUNNING
        self.requests: dict[int, VllmRequest] = {}
        self.totals = [0, 0, 0, 0]

    def _ids(self, hits):
        return _groups(hits)

    def _lookup(self, rid):
        blocks, num_hit, _ = self.m.get_computed_blocks(self.requests[rid])
        return blocks.blocks, num_hit

    def _tables(self, rid) -> list[list[int]]:
        return _groups(self.m.coordinator.get_blocks(str(rid)))

    def _allocate(self, rid, num_new, hits, num_hit, admission):
        r = self.requests[rid]
        r.num_computed_tokens = 0 if admission else self.reqs[rid].num_computed
        if admission:
            r.status = self.preempted if r.num_preemptions else self.waiting
        new = self.m.create_kv_cache_blocks(tuple(list(h) for h in hits)) \
            if admission else None
        out = self.m.allocate_slots(r, num_new, num_hit, new)
        if out is None:
            return None
        r.status = self.running_status
        return self._tables(rid)

    def state(self) -> dict:
        pool = self.m.block_pool
        utils = self.vllm.kv_cache_utils
        stats = self.m.make_prefix_cache_stats()
        for i, v in enumerate((stats.queries, stats.hits, stats.preempted_queries,
                               stats.preempted_hits)):
            self.totals[i] += v

        def key(k):
            return None if k is None else (_hex(utils.get_block_hash(k)), utils.get_group_id(k))

        hash_map = {}
        for k, value in pool.cached_block_hash_to_block._cache.items():
            blocks = value.values() if isinstance(value, dict) else [value]
            hash_map[key(k)] = [b.block_id for b in blocks]
        return {
            "free_queue": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            "num_free": pool.get_num_free_blocks(),
            "usage": pool.get_usage(),
            "blocks": [(b.ref_cnt, key(b.block_hash)) for b in pool.blocks],
            "hash_map": hash_map,
            "tables": {rid: self._tables(rid) for rid, r in self.requests.items()
                       if any(self.m.coordinator.get_blocks(r.request_id))},
            "stats": tuple(self.totals),
        }
