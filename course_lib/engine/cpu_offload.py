"""A CPU offload tier behind the KV-connector interface: vLLM 0.33.0's native KV offloading
(``OffloadingConnector``, ``vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py``
and ``offloading/``), in one page.

The GPU pool is the first tier of the prefix cache; when it is full, vLLM V1 evicts cached
blocks (least recently used first) and a later request that shares the prefix recomputes
it. With ``CacheConfig.kv_offloading_size`` (GiB, vLLM's knob in ``vllm/config/cache.py``;
``cpu_offload_gb`` in ``vllm/config/offload.py`` is something else: *weights* kept in CPU
memory) a second tier holds copies of full prefix blocks in CPU memory:

* **Store when computed.** Every full *prompt* block a step computes is copied to the CPU
  tier after the forward (``save_kv_layer``), keyed by the same block hash V1's prefix cache
  uses (:meth:`~course_lib.memory.v1.kv_cache_manager.KVCacheManager._hashes`: the chain
  carries the prefix and the cache salt), unless the tier has it already. The tier is an LRU
  of its own (:class:`CPUBlockPool`): a full tier evicts its least recently stored or hit
  block. vLLM 0.33.0's offloading connector stores the same way (on compute, not on GPU
  eviction, so the copy exists before the GPU block can be reused), and by the same two rules:

  - **prompt blocks only**, by default: blocks of generated tokens are not stored
    (``offload_prompt_only``, True unless the connector's ``extra_config`` says otherwise:
    ``OffloadingSpec`` in ``vllm/v1/kv_offload/base.py``, applied by
    ``_calc_num_offloadable_tokens`` in ``.../kv_connector/v1/offloading/scheduler.py``);
    ``offload_prompt_only=False`` stores them too;
  - **the offer starts at block 0** when a sequence is admitted: its lookup resets it
    (``next_stored_chunk_idx = 0`` in ``get_num_new_matched_tokens``), so the blocks of its
    *GPU* hit that the tier has lost (evicted meanwhile) are stored again by its first step;
    the blocks it loads from the tier are not offered again (``update_state_after_alloc``
    moves the offer past them: the default ``OffloadPolicy.CHUNK_LEVEL``). A block offered
    that the tier holds is not copied again; the course touches it (the most recently used),
    where vLLM's manager only keeps it from that store's evictions (``prepare_store`` in
    ``vllm/v1/kv_offload/cpu/manager.py``).
* **Load on a hit.** A waiting request whose local (GPU) prefix hit stops short asks the tier
  (``get_num_new_matched_tokens``): the consecutive blocks after the GPU hit that the tier
  holds are loaded into freshly allocated GPU blocks before the forward, instead of being
  recomputed; the request starts with them computed. A hit on a block another request is
  loading asynchronously this step answers ``None`` ("ask me again"): the request waits a
  step and finds the block in the GPU prefix cache then, rather than loading it twice (vLLM
  0.33.0's ``_chunks_being_loaded`` in ``_lookup_complete_chunks``, ``offloading/scheduler.py``).
* **Synchronous by default.** Loads complete before the step's forward, saves before it
  returns (``wait_for_save``), so a request never waits and its blocks are never kept past
  its end. ``load_async=True`` takes vLLM's asynchronous path instead: the request waits in
  ``WAITING_FOR_REMOTE_KVS`` for a step while its blocks load, and ``get_finished`` reports
  it (the course still copies within that step: the path, not the overlap, is what is shown).
  vLLM's ``OffloadingConnector`` is asynchronous by default (its ``sync_load_budget_bytes``
  is 0) and never reports a load of the whole prompt as synchronous (``_reserve_sync_load``).

**What the course declares different from vLLM 0.33.0.**

* *One token short.* The lookup reports at most ``len(seq) - 1`` tokens: the last token's
  block is never loaded, as vLLM's other CPU connector does (``SimpleCPUOffloadScheduler``:
  ``max_hit_len = request.num_tokens - 1 - num_computed_tokens`` in
  ``vllm/v1/simple_kv_offload/manager.py``). The ``OffloadingConnector`` this tier follows may
  report the whole prompt (``_lookup_complete_chunks`` in ``offloading/scheduler.py``:
  ``max_hit_size_tokens = req.num_tokens``, less one only with sliding-window groups), and
  vLLM's scheduler then computes the last token again (``_update_waiting_for_remote_kv`` in
  ``vllm/v1/core/sched/scheduler.py``). The course's ``SchedulerV1`` takes such an answer
  too; this tier just does not give it.
* *Copies inside the step, layer by layer.* The course copies each layer's loads in
  ``wait_for_layer_load`` and its stores in ``save_kv_layer`` (the runner calls them around
  its one forward call). vLLM's ``OffloadingConnector`` has both as no-ops
  (``offloading_connector.py``): ``start_load_kv`` submits the step's loads
  (``start_kv_transfers``), and ``wait_for_save`` defers the step's stores to the next step's
  submission (``prepare_store_kv``), so the copies overlap the GPU's work; the course shows
  the protocol, not the overlap.
* *An offer the tier cannot take whole.* The course stores its blocks one by one while the
  tier has a block to give (free, or held and not loaded from or written this step), and the
  offer moves on. vLLM stores an offer whole or not at all: ``prepare_store``
  (``vllm/v1/kv_offload/cpu/manager.py``) answers None when the tier cannot take all its new
  blocks, and ``_build_store_jobs`` (``offloading/scheduler.py``) leaves
  ``next_stored_chunk_idx`` where it was, so the next step offers them again, and the step
  after a request finished too (it walks ``finished_req_ids``, reading the freed GPU
  blocks). A tier of a few blocks then stores nothing of a long prompt, where the course's
  keeps its head; with room to spare the two are the same. The tier's eviction order differs
  too (:class:`CPUBlockPool`: vLLM evicts a request's tail first).

After a failed step the engine's recovery empties the tier
(:meth:`CPUOffloadConnector.reset_cache`): a store the step planned may not have been copied,
so the map could name a CPU block that holds another prefix; an empty tier is always right,
and costs only the recomputation of what it held (vLLM 0.33.0 empties it the same way:
``CPUOffloadingManager.reset_cache`` in ``vllm/v1/kv_offload/cpu/manager.py``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..scheduler.output import KVConnectorMetadata
from ..sequence import is_int
from .kv_connector import KVConnectorBase_V1, KVConnectorRole

if TYPE_CHECKING:
    from ..memory.v1.kv_cache_manager import KVCacheManager
    from ..model.attention import AttentionMetadata
    from ..model.llama import KVCache
    from ..scheduler.output import SchedulerOutput
    from ..sequence import Sequence

GiB = 1 << 30


def num_offload_blocks(kv_offloading_size: float, block_bytes: int) -> int:
    """Blocks of ``block_bytes`` (all layers, K and V) that ``kv_offloading_size`` GiB hold."""
    if isinstance(kv_offloading_size, bool) or not isinstance(kv_offloading_size, (int, float)) \
            or not 0 < kv_offloading_size < float("inf"):
        raise ValueError(f"kv_offloading_size must be a finite number of GiB > 0, got "
                         f"{kv_offloading_size!r}")
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < 1:
        raise ValueError(f"block_bytes must be an int >= 1, got {block_bytes!r}")
    num = int(kv_offloading_size * GiB // block_bytes)
    if num < 1:
        raise ValueError(f"kv_offloading_size={kv_offloading_size} GiB holds no block of "
                         f"{block_bytes} bytes: give at least {block_bytes / GiB:.3g} GiB")
    return num


class CPUBlockPool:
    """The CPU tier's blocks: which block holds which hash, least recently used first
    (vLLM 0.33.0's ``CPUOffloadingManager`` in ``vllm/v1/kv_offload/cpu/manager.py`` with its
    default policy, ``LRUCachePolicy`` in ``vllm/v1/kv_offload/cpu/policies/lru.py``, reduced
    to one medium).

    * ``hash_to_block``: hash -> CPU block id, an ``OrderedDict`` kept in LRU order: a hit or
      a store moves the hash to the end (``move_to_end``, O(1)), an eviction takes the first
      one not pinned (O(1), passing over at most the step's pinned blocks).
    * ``num_allocated``: blocks ``0 .. num_allocated - 1`` have held a hash, the others are
      fresh, handed out in order (block 0 first) by counting, as vLLM's manager hands out
      fresh chunks (``_num_allocated_chunks``). A block never becomes fresh again: a full tier
      reuses its least recently used block in place; only :meth:`reset` frees them all. A
      counter, not a list of free ids: a tier of a million blocks costs nothing until it
      fills, and a count too large for the machine is refused by the engine
      (``LLMEngine._check_kv_memory``) before its tensors are allocated.

    **What differs from vLLM.** Its ``LRUCachePolicy`` keeps recency as ranks in a lazily
    invalidated min-heap (``_ranks``, ``_heap``, ``_evictable``): a request's blocks share one
    rank, so a request's tail is evicted before its head; pinning is a ref count on
    ``ChunkStatus`` (``vllm/v1/kv_offload/cpu/policies/base.py``), set by ``prepare_load`` and
    cleared by ``complete_load``; ``CPUOffloadingManager`` hands out fresh chunks by a counter
    before its free list (of chunks freed by a failed store; the course's stores cannot
    fail). The course keeps the plain LRU order (a hit or a store is the most
    recent use; pinned = this step's loads and stores, passed in), which one ``OrderedDict``
    holds (vLLM's other policy, ``ARCCachePolicy`` in ``policies/arc.py``, keeps its lists in
    ``OrderedDict`` objects too)."""

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 1, "the CPU tier needs a block"
        self.num_blocks = num_blocks
        self.hash_to_block: OrderedDict[bytes, int] = OrderedDict()     # LRU first
        self.num_allocated = 0                       # blocks handed out so far, 0 first
        self.num_evictions = 0

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.hash_to_block

    def lookup(self, block_hash: bytes) -> int | None:
        return self.hash_to_block.get(block_hash)

    def lru_hashes(self) -> list[bytes]:
        """The held hashes, least recently used first (the eviction order; O(tier))."""
        return list(self.hash_to_block)

    def touch(self, block_hash: bytes) -> None:
        """A hit: the most recently used now."""
        self.hash_to_block.move_to_end(block_hash)

    def allocate(self, block_hash: bytes, pinned: set[int]) -> tuple[int, bytes | None] | None:
        """A block for ``block_hash`` (not already held): a free one, else the least recently
        used one not in ``pinned`` (evicted). Returns (block, the hash it held or None), or
        None when every block is pinned (nothing changes)."""
        if self.num_allocated < self.num_blocks:          # a fresh block
            block_id, evicted = self.num_allocated, None
            self.num_allocated += 1
        else:
            evicted = next((h for h, b in self.hash_to_block.items() if b not in pinned), None)
            if evicted is None:
                return None
            block_id = self.hash_to_block.pop(evicted)
            self.num_evictions += 1
        self.hash_to_block[block_hash] = block_id
        return block_id, evicted

    def reset(self) -> None:
        """Empty the tier: every block free, no hash held (``num_evictions`` keeps its
        total)."""
        self.hash_to_block.clear()
        self.num_allocated = 0

    def check_invariants(self) -> None:
        held = sorted(self.hash_to_block.values())
        assert held == list(range(self.num_allocated)), \
            "the CPU blocks held are not the blocks handed out (or one is held twice)"


@dataclass
class CPUOffloadMetadata(KVConnectorMetadata):
    """One step's CPU-tier transfers (plain data)."""

    loads: list[tuple[int, int]] = field(default_factory=list)     # (cpu block, gpu block)
    async_seq_ids: list[int] = field(default_factory=list)         # loads reported as done
    stores: list[tuple[int, int]] = field(default_factory=list)    # (gpu block, cpu block)


class CPUOffloadConnector(KVConnectorBase_V1):
    """The CPU offload tier (module docstring). ``num_cpu_blocks``: the tier's size, an int
    >= 1 (numpy's too; or :meth:`from_kv_offloading_size`); its tensors are allocated when an
    engine registers its caches, once the engine has checked them against the host's memory
    (as it checks ``kv_offloading_size``). ``load_async``: a bool. Needs V1's hash prefix
    cache (its block hashes are the tier's keys). ``offload_prompt_only``: a bool, True by
    default (vLLM's): store prompt blocks only; False stores blocks of generated tokens too."""

    def __init__(self, num_cpu_blocks: int, *, load_async: bool = False,
                 offload_prompt_only: bool = True) -> None:
        if not is_int(num_cpu_blocks) or num_cpu_blocks < 1:
            raise ValueError(f"num_cpu_blocks must be an int >= 1, got {num_cpu_blocks!r:.60}")
        if not isinstance(load_async, (bool, np.bool_)):
            raise ValueError(f"load_async must be a bool, got {load_async!r:.60}")
        if not isinstance(offload_prompt_only, (bool, np.bool_)):
            raise ValueError(f"offload_prompt_only must be a bool, got "
                             f"{offload_prompt_only!r:.60}")
        super().__init__(KVConnectorRole.SCHEDULER)
        self.offload_prompt_only = bool(offload_prompt_only)
        self.cpu_pool = CPUBlockPool(int(num_cpu_blocks))
        self.load_async = bool(load_async)
        self.block_size = 0                       # the manager's, once bound
        self.cpu_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # scheduler side, this step
        self._lookup: dict[int, int] = {}          # seq_id -> its local hit (tokens)
        self._loads: list[tuple[int, int]] = []
        self._async_seq_ids: list[int] = []
        self._loading: set[bytes] = set()          # hashes of this step's asynchronous loads
        self._next_stored: dict[int, int] = {}     # seq_id -> first block its stores offer
        #                               (vLLM's next_stored_chunk_idx; per live sequence)
        # worker side
        self._finished_recving: set[int] = set()
        # counters (reports, and the tests' figures)
        self.num_queried_tokens = 0     # tokens past the GPU hit asked about, per admission
        self.num_hit_tokens = 0         # of them, loaded from the tier (prefill saved)
        self.num_loaded_blocks = self.num_stored_blocks = 0

    @classmethod
    def from_kv_offloading_size(cls, kv_offloading_size: float, block_bytes: int,
                                **kwargs: Any) -> CPUOffloadConnector:
        """A tier of ``kv_offloading_size`` GiB (vLLM's ``--kv-offloading-size``) of blocks of
        ``block_bytes`` (``ModelRunner.kv_bytes_per_block``)."""
        return cls(num_offload_blocks(kv_offloading_size, block_bytes), **kwargs)

    @property
    def hit_rate(self) -> float:
        """Tokens loaded from the tier / tokens asked about past the GPU hit."""
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    # ------------------------------------------------------------------ binding
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        from ..memory.v1.kv_cache_manager import KVCacheManager

        if not isinstance(kv_cache_manager, KVCacheManager) or \
                not kv_cache_manager.enable_caching:
            raise ValueError("the CPU offload tier is keyed by V1's block hashes: it needs "
                             "design='v1' with CacheConfig(enable_prefix_caching=True, "
                             "prefix_cache='hash')")
        super().bind_kv_cache_manager(kv_cache_manager)
        self.block_size = kv_cache_manager.block_size

    def register_kv_caches(self, kv_caches: list[KVCache]) -> None:
        """Allocate the tier's tensors: per layer, K and V of ``num_cpu_blocks`` blocks shaped
        as the GPU caches' blocks, in CPU memory."""
        super().register_kv_caches(kv_caches)
        n = self.cpu_pool.num_blocks
        self.cpu_caches = [tuple(torch.zeros((n, *c.shape[1:]), dtype=c.dtype, device="cpu")
                                 for c in layer) for layer in kv_caches]

    # ------------------------------------------------------------ scheduler side
    def _hashes(self, seq: Sequence) -> list:
        return self.kv_cache_manager.req_to_block_hashes.get(seq.seq_id, [])

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """The full blocks right after the GPU hit that the tier holds, at most up to
        ``len(seq) - 1`` tokens (the block hashes were computed by the GPU lookup; "one token
        short" in the module docstring), or None when one of them is being loaded for another
        request this step (module docstring); the sequence's store offer restarts at block 0."""
        bs, hashes = self.block_size, self._hashes(seq)
        first, last = num_computed_tokens // bs, (len(seq) - 1) // bs
        n = 0
        for i in range(first, min(last, len(hashes))):
            if hashes[i] not in self.cpu_pool:
                break
            n += 1
        self._lookup[seq.seq_id] = num_computed_tokens
        self._next_stored[seq.seq_id] = 0          # the offer restarts at block 0 (docstring)
        if any(hashes[i] in self._loading for i in range(first, first + n)):
            return None, False                     # loading for another request: ask again
        return n * bs, self.load_async and n > 0

    def update_state_after_alloc(self, seq: Sequence, block_ids: SequenceABC[int],
                                 num_external_tokens: int) -> None:
        """Plan the loads of the tier's blocks into the blocks allocated after the GPU hit."""
        local = self._lookup.pop(seq.seq_id, 0)
        self.num_queried_tokens += len(seq) - 1 - local
        if num_external_tokens == 0:
            return
        bs, hashes, pool = self.block_size, self._hashes(seq), self.cpu_pool
        first = local // bs
        for i in range(first, first + num_external_tokens // bs):
            cpu = pool.lookup(hashes[i])
            if cpu is None:
                raise RuntimeError(f"seq {seq.seq_id}: block {i} left the CPU tier between "
                                   "get_num_new_matched_tokens and update_state_after_alloc")
            pool.touch(hashes[i])
            self._loads.append((cpu, block_ids[i]))
        self._next_stored[seq.seq_id] = first + num_external_tokens // bs   # not stored again
        self.num_hit_tokens += num_external_tokens
        self.num_loaded_blocks += num_external_tokens // bs
        if self.load_async:
            self._async_seq_ids.append(seq.seq_id)
            self._loading.update(hashes[first:first + num_external_tokens // bs])

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> CPUOffloadMetadata:
        """This step's loads, and a store for each full block offered whose hash the tier
        lacks (evicting its least recently used blocks, never one this step loads from or
        stores into); resets the per-step state. A scheduled sequence offers its full blocks
        from where its offer stands (block 0 at admission, past the blocks it loaded; for a
        sequence the tier was never asked about, the first block this step computes) to the
        last one full after this step, prompt blocks only unless ``offload_prompt_only`` is
        False (module docstring)."""
        bs, pool = self.block_size, self.cpu_pool
        pinned = {cpu for cpu, _ in self._loads}
        stores, seen = [], set()
        for e in scheduler_output.scheduled:
            ctx = e.seq.num_computed_tokens                 # before update() advances it
            hashes = self._hashes(e.seq)
            end = ctx + e.num_tokens
            if self.offload_prompt_only:
                end = min(end, len(e.seq.prompt_token_ids))
            start = self._next_stored.get(e.seq.seq_id, ctx // bs)
            if end // bs > start:
                self._next_stored[e.seq.seq_id] = end // bs
            for i in range(start, end // bs):
                h = hashes[i]
                if h in seen:
                    continue
                seen.add(h)
                if h in pool:
                    pool.touch(h)
                    continue
                got = pool.allocate(h, pinned)
                if got is None:                             # the tier is all pinned
                    continue
                cpu = got[0]
                pinned.add(cpu)
                stores.append((e.block_ids[i], cpu))
        self.num_stored_blocks += len(stores)
        meta = CPUOffloadMetadata(self._loads, self._async_seq_ids, stores)
        self._loads, self._async_seq_ids, self._lookup = [], [], {}
        self._loading = set()           # loaded by the step's end (the copies run in the step)
        return meta

    def request_finished(self, seq: Sequence, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Forget the sequence's offer; its blocks are free at once (every copy is done within
        its step)."""
        self._next_stored.pop(seq.seq_id, None)
        return False, None

    # --------------------------------------------------------------- worker side
    def start_load_kv(self, **kwargs: Any) -> None:
        """Nothing before the forward: the loads run per layer (:meth:`wait_for_layer_load`)."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Copy this step's loads of ``layer`` into the GPU cache (synchronous)."""
        meta = self._get_connector_metadata()
        if not meta.loads:
            return
        gk, gv = self.kv_caches[layer]
        ck, cv = self.cpu_caches[layer]
        cpu = torch.tensor([c for c, _ in meta.loads], dtype=torch.int64)
        gpu = torch.tensor([g for _, g in meta.loads], dtype=torch.int64, device=gk.device)
        gk.index_copy_(0, gpu, ck.index_select(0, cpu).to(gk.device))
        gv.index_copy_(0, gpu, cv.index_select(0, cpu).to(gv.device))

    def save_kv_layer(self, layer: int, kv_layer: KVCache, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        """Copy this step's stores of ``layer`` into the tier (synchronous)."""
        meta = self._get_connector_metadata()
        if not meta.stores:
            return
        gk, gv = kv_layer
        ck, cv = self.cpu_caches[layer]
        gpu = torch.tensor([g for g, _ in meta.stores], dtype=torch.int64, device=gk.device)
        cpu = torch.tensor([c for _, c in meta.stores], dtype=torch.int64)
        ck.index_copy_(0, cpu, gk.index_select(0, gpu).cpu())
        cv.index_copy_(0, cpu, gv.index_select(0, gpu).cpu())

    def wait_for_save(self) -> None:
        """The saves are done (they are synchronous); the step's asynchronous loads too, to be
        reported by :meth:`get_finished`."""
        self._finished_recving.update(self._get_connector_metadata().async_seq_ids)

    def get_finished(self, finished_req_ids: set[int]
                     ) -> tuple[set[int] | None, set[int] | None]:
        """Nothing is ever sent late (saves are synchronous); the loads of ``load_async``."""
        recving, self._finished_recving = self._finished_recving, set()
        return None, recving or None

    # ------------------------------------------------------------------ recovery
    def reset_cache(self) -> None:
        """After a failed step (the contract:
        :meth:`~course_lib.scheduler.kv_connector.KVConnectorScheduler.reset_cache`): the tier
        emptied (module docstring: a store the step planned may not have been copied), the
        loads planned or done but not reported forgotten (their requests are recomputed), the
        metadata unbound. The hit and store counters keep their totals."""
        super().reset_cache()
        self.cpu_pool.reset()
        self._lookup, self._loads, self._async_seq_ids = {}, [], []
        self._loading, self._next_stored = set(), {}
        self._finished_recving = set()

    def check_invariants(self) -> None:
        self.cpu_pool.check_invariants()
