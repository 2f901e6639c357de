"""Twins for vLLM V1 (tests/fidelity/harness.py): the course's
``course_lib.memory.v1`` and vLLM 0.33.0's ``vllm.v1.core`` driven by the same operations.

* :class:`CourseQueue` / :class:`RealQueue`: a ``FreeKVCacheBlockQueue`` of ``n`` blocks:
  ``popleft``, ``popleft_n``, ``remove``, ``append``, ``append_n``, ``prepend_n`` on any
  block, including ones that corrupt the queue (a block appended twice); the state compared is
  every link of every block (a cycle cannot hang it) and the free count.
* :class:`CourseManager` / :class:`RealManager`: a ``KVCacheManager`` for one full-attention
  group, driven the way the V1 scheduler drives it: requests are admitted (prefix lookup, then
  ``allocate_slots`` with the hit, a chunk at a time), stepped (the next chunk, or one decode
  token), preempted (freed, looked up again on re-admission), finished, and the prefix cache
  reset. The real side is vLLM's own ``KVCacheManager`` over ``UnitaryKVCacheCoordinator``,
  ``FullAttentionManager`` and ``BlockPool``, with its request's ``block_hashes`` computed by
  vLLM's ``get_request_block_hasher``. The state compared: the free queue front to back, every
  block's reference count and hash, the hash map, every request's block table, the
  prefix-cache counters and the usage.

Ids: vLLM's pool has one block more, block 0, its null block (never free, never in a table;
the course's pool has one only for a windowed group: hybrid_twins.py); vLLM's block ``i + 1``
is the course's block ``i``.
"""

from __future__ import annotations

from typing import Any

from harness import attempt

from course_lib.memory.v1 import block_pool as course_pool
from course_lib.memory.v1.kv_cache_manager import KVCacheManager


# --------------------------------------------------------------------------- the free queue
class _QueueTwin:
    offset = 0                           # real ids are course ids + offset

    def __init__(self, n: int) -> None:
        self.n = n

    def apply(self, op: tuple) -> Any:
        q, kind = self.queue, op[0]
        block = self.block
        if kind == "popleft":
            return attempt(lambda: self._id(q.popleft()))
        if kind == "popleft_n":
            return attempt(lambda: [self._id(b) for b in q.popleft_n(op[1])])
        if kind == "remove":
            return attempt(lambda: q.remove(block(op[1])))
        if kind == "append":
            return attempt(lambda: q.append(block(op[1])))
        if kind == "append_n":
            return attempt(lambda: q.append_n([block(i) for i in op[1]]))
        if kind == "prepend_n":
            return attempt(lambda: q.prepend_n([block(i) for i in op[1]]))
        raise ValueError(op)

    def _id(self, block) -> int | str:
        if block is self.head:
            return "head"
        if block is self.tail:
            return "tail"
        return None if block is None else block.block_id - self.offset

    def state(self) -> dict:
        links = {"head": (self._id(self.head.prev_free_block),
                          self._id(self.head.next_free_block)),
                 "tail": (self._id(self.tail.prev_free_block),
                          self._id(self.tail.next_free_block))}
        for i in range(self.n):
            b = self.block(i)
            links[i] = (self._id(b.prev_free_block), self._id(b.next_free_block))
        return {"num_free_blocks": self.queue.num_free_blocks, "links": links}


class CourseQueue(_QueueTwin):
    def __init__(self, n: int, queue_cls=course_pool.FreeKVCacheBlockQueue) -> None:
        super().__init__(n)
        self.blocks = [course_pool.KVCacheBlock(i) for i in range(n)]
        self.queue = queue_cls(self.blocks)
        self.head, self.tail = self.queue.fake_free_list_head, self.queue.fake_free_list_tail

    def block(self, i: int):
        return self.blocks[i]


class RealQueue(_QueueTwin):
    def __init__(self, n: int, vllm) -> None:
        super().__init__(n)
        utils = vllm.kv_cache_utils
        self.blocks = [utils.KVCacheBlock(i) for i in range(n)]
        self.queue = utils.FreeKVCacheBlockQueue(self.blocks)
        self.head, self.tail = self.queue.fake_free_list_head, self.queue.fake_free_list_tail

    def block(self, i: int):
        return self.blocks[i]


# ------------------------------------------------------------------------------ the manager
def _hex(block_hash: bytes | None) -> str | None:
    """A block hash as compared: all its bytes, in hex (readable in a failure message)."""
    return None if block_hash is None else block_hash.hex()


class _Req:
    """What the driver knows of a request (the same on both sides)."""

    def __init__(self, tokens: list[int], salt: str | None) -> None:
        self.tokens, self.salt = list(tokens), salt
        self.num_computed = 0
        self.running = False
        self.num_preemptions = 0


class _ManagerTwin:
    """The scheduler's moves, over two primitives sets (``_lookup``, ``_allocate``, ...)."""

    def __init__(self, prompts: list[list[int]]) -> None:
        self.prompts = prompts
        self.reqs: dict[int, _Req] = {}
        self.next_token = 10_000

    def apply(self, op: tuple) -> Any:
        kind = op[0]
        if kind == "add":                    # ("add", rid, prompt index, salt)
            _, rid, p, salt = op
            if rid in self.reqs:
                return "skipped: exists"
            self.reqs[rid] = _Req(self.prompts[p], salt)
            self._add(rid)
            return "added"
        if kind == "reset":
            return self._reset()
        rid = op[1]
        req = self.reqs.get(rid)
        if req is None:
            return "skipped: no such request"
        if kind == "schedule":               # ("schedule", rid, chunk)
            return self._schedule(rid, req, op[2])
        if kind == "preempt":
            if not req.running:
                return "skipped: not running"
            self._free(rid)
            req.running, req.num_computed = False, 0
            req.num_preemptions += 1
            return "preempted"
        if kind == "finish":
            if req.running:
                self._free(rid)
            self._forget(rid)
            del self.reqs[rid]
            return "finished"
        raise ValueError(op)

    def _schedule(self, rid: int, req: _Req, chunk: int) -> Any:
        if not req.running:                  # admission: look up the hit, then allocate
            hits, num_hit = self._lookup(rid)
            num_new = min(len(req.tokens) - num_hit, chunk)
            table = self._allocate(rid, num_new, hits, num_hit, admission=True)
            if table is not None:
                self._record(rid, num_hit)
                req.running, req.num_computed = True, num_hit + num_new
            return {"hit": (self._ids(hits), num_hit), "table": table}
        if req.num_computed == len(req.tokens):      # decode: one sampled token
            self.next_token += 1
            req.tokens.append(self.next_token)
            self._append(rid, self.next_token)
        num_new = min(len(req.tokens) - req.num_computed, chunk)
        table = self._allocate(rid, num_new, (), 0, admission=False)
        if table is not None:
            req.num_computed += num_new
        return {"table": table}


class CourseManager(_ManagerTwin):
    def __init__(self, prompts, block_size: int, num_blocks: int, enable_caching: bool = True,
                 watermark: float = 0.0, algo: str = "sha256", manager_cls=KVCacheManager):
        super().__init__(prompts)
        self.m = manager_cls(block_size, num_blocks, enable_caching, watermark, algo)

    def _add(self, rid):
        pass

    def _ids(self, blocks) -> list[int]:
        return [b.block_id for b in blocks]

    def _lookup(self, rid):
        req = self.reqs[rid]
        return self.m.get_computed_blocks(rid, req.tokens, req.salt)

    def _allocate(self, rid, num_new, hits, num_hit, admission):
        req = self.reqs[rid]
        num_computed = 0 if admission else req.num_computed
        return self.m.allocate_slots(rid, req.tokens, num_computed, num_new, hits,
                                     admission=admission)

    def _record(self, rid, num_hit):
        req = self.reqs[rid]
        self.m.record_prefix_cache_stats(len(req.tokens), num_hit,
                                         preempted=req.num_preemptions > 0)

    def _append(self, rid, token):
        pass

    def _free(self, rid):
        self.m.free(rid)

    def _forget(self, rid):
        self.m.forget(rid)

    def _reset(self):
        return self.m.reset_prefix_cache()

    def state(self) -> dict:
        pool = self.m.block_pool
        stats = self.m.prefix_cache_stats
        return {
            "free_queue": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            "num_free": pool.get_num_free_blocks(),
            "usage": pool.get_usage(),
            "blocks": [(b.ref_cnt, _hex(b.block_hash)) for b in pool.blocks],
            "hash_map": {_hex(h): list(bs)
                         for h, bs in pool.cached_block_hash_to_block.items()},
            "tables": {rid: self.m.get_block_table(rid) for rid in self.reqs
                       if self.m.has_seq(rid)},
            "stats": (stats.queries, stats.hits, stats.preempted_queries,
                      stats.preempted_hits),
        }


class VllmRequest:
    """The fields of ``vllm.v1.request.Request`` the KV-cache manager reads; ``block_hashes``
    grows as vLLM's does (``update_block_hashes`` with vLLM's own block hasher). Also what
    ``bench/peers.py`` hands vLLM's manager."""

    def __init__(self, request_id: str, tokens: list[int], salt, hasher, waiting) -> None:
        self.request_id = request_id
        self.all_token_ids = list(tokens)
        self.num_prompt_tokens = len(tokens)
        self.cache_salt = salt
        self.mm_features = []
        self.lora_request = None
        self.prompt_embeds = None
        self.num_computed_tokens = 0
        self.num_in_flight_tokens = 0
        self.shared_prefix_boundary = 0
        self.skip_reading_prefix_cache = False
        self.num_preemptions = 0
        self.status = waiting
        self.block_hashes: list[bytes] = []
        self._hasher = hasher
        self.block_hashes.extend(hasher(self))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_output_token_ids(self, token: int) -> None:
        self.all_token_ids.append(token)
        self.block_hashes.extend(self._hasher(self))


class RealManager(_ManagerTwin):
    def __init__(self, prompts, vllm, block_size: int, num_blocks: int,
                 enable_caching: bool = True, watermark: float = 0.0, algo: str = "sha256"):
        super().__init__(prompts)
        self.vllm = vllm
        utils, iface = vllm.kv_cache_utils, vllm.kv_cache_interface
        hash_fn = vllm.hashing.get_hash_fn_by_name(algo)
        utils.init_none_hash(hash_fn)
        self.hasher = utils.get_request_block_hasher(block_size, hash_fn)
        spec = iface.FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1,
                                       dtype="float32")
        config = iface.KVCacheConfig(
            num_blocks=num_blocks + 1, kv_cache_tensors=[],
            kv_cache_groups=[iface.KVCacheGroupSpec(["layer"], spec)])
        self.m = vllm.kv_cache_manager.KVCacheManager(
            config, max_model_len=1 << 20, scheduler_block_size=block_size,
            hash_block_size=block_size, enable_caching=enable_caching, log_stats=True,
            watermark=watermark)
        status = vllm.kv_cache_manager.RequestStatus
        self.waiting, self.preempted, self.running_status = \
            status.WAITING, status.PREEMPTED, status.RUNNING
        self.requests: dict[int, VllmRequest] = {}
        self.totals = [0, 0, 0, 0]           # the stats, summed over every step's snapshot

    def _add(self, rid):
        req = self.reqs[rid]
        self.requests[rid] = VllmRequest(str(rid), req.tokens, req.salt, self.hasher,
                                          self.waiting)

    def _ids(self, blocks) -> list[int]:
        return [b.block_id - 1 for b in blocks]

    def _lookup(self, rid):
        blocks, num_hit, _ = self.m.get_computed_blocks(self.requests[rid])
        return blocks.blocks[0], num_hit

    def _allocate(self, rid, num_new, hits, num_hit, admission):
        r = self.requests[rid]
        r.num_computed_tokens = 0 if admission else self.reqs[rid].num_computed
        if admission:
            r.status = self.preempted if r.num_preemptions else self.waiting
        new = self.m.create_kv_cache_blocks((list(hits),)) if admission else None
        out = self.m.allocate_slots(r, num_new, num_hit, new)
        if out is None:
            return None
        r.status = self.running_status
        return self._ids(self.m.get_blocks(r.request_id).blocks[0])

    def _record(self, rid, num_hit):
        self.m.record_prefix_cache_stats(self.requests[rid], num_hit)

    def _append(self, rid, token):
        self.requests[rid].append_output_token_ids(token)

    def _free(self, rid):
        self.m.free(self.requests[rid])
        self.requests[rid].num_preemptions += 1

    def apply(self, op):
        answer = super().apply(op)
        if op[0] == "finish" and answer == "finished":
            del self.requests[op[1]]
        return answer

    def _forget(self, rid):
        pass

    def _reset(self):
        return self.m.reset_prefix_cache()

    def state(self) -> dict:
        pool = self.m.block_pool
        get_hash = self.vllm.kv_cache_utils.get_block_hash
        stats = self.m.make_prefix_cache_stats()      # this step's, reset: sum them up
        for i, v in enumerate((stats.queries, stats.hits, stats.preempted_queries,
                               stats.preempted_hits)):
            self.totals[i] += v
        hash_map = {}
        for key, value in pool.cached_block_hash_to_block._cache.items():
            blocks = value.values() if isinstance(value, dict) else [value]
            hash_map[_hex(get_hash(key))] = [b.block_id - 1 for b in blocks]
        return {
            "free_queue": [b.block_id - 1 for b in pool.free_block_queue.get_all_free_blocks()],
            "num_free": pool.get_num_free_blocks(),
            "usage": pool.get_usage(),
            "blocks": [(b.ref_cnt, None if b.block_hash is None
                        else _hex(get_hash(b.block_hash))) for b in pool.blocks[1:]],
            "hash_map": hash_map,
            "tables": {rid: self._ids(self.m.get_blocks(r.request_id).blocks[0])
                       for rid, r in self.requests.items()
                       if self.m.get_blocks(r.request_id).blocks[0]},
            "stats": tuple(self.totals),
        }
