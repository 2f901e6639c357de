"""One device's pool of KV-cache blocks: reference counts and the free-block policy.

A *physical block* is a slot in a preallocated KV tensor that holds ``block_size`` tokens'
keys and values (see ``course_lib.kernels``). The pool never touches those tensors: it hands
out block ids and counts how many block-table entries point at each one.

Every block is in exactly one of three states:

* **held**: ref count >= 1, in some block table;
* **free**: ref count 0, on the free stack (a Python list): ``pop()`` and ``append()`` are O(1)
  whatever the pool size, the whole point of paging compared with searching for a
  contiguous range;
* **evictable**: ref count 0 but still registered in the prefix cache, so a later request can
  find it; kept in LRU order (an ``OrderedDict``, O(1) to add, remove or pop the oldest).

The one free-block policy, owned here: an allocation takes a never-cached free block first and
evicts the least recently used cached one only when the stack is empty (calling ``on_evict``
so that the prefix cache forgets it). This is vLLM V0's ``BlockAllocator`` (its
``PrefixCachingBlockAllocator`` keeps the same free list + evictor pair); vLLM V1's
``BlockPool`` folds both into one doubly linked free-block queue.

Inside an engine step (all or nothing, ``engine/rollback.py``), the pool hands the step's
checkpoint what it is about to change (:meth:`BlockAllocator._save`: the blocks' ref counts and
states, the cuts of the free stack), so that a failed step is undone at the cost of what it
changed, not of the pool. Outside a step (the chapters, the benches) it hands nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container, Iterable
from typing import TYPE_CHECKING

from ..common import EVICTABLE, FREE, HELD

if TYPE_CHECKING:
    from ...checkpoint import Checkpoint


class NoFreeBlocksError(RuntimeError):
    """Raised when a pool has no free block left. The caller should have asked first
    (``BlockManager.can_allocate`` / ``can_append_slots`` / ``can_swap_in``, in
    ``course_lib/memory/v0/manager.py``)."""


class BlockAllocator:
    """Block ids ``0 .. num_blocks-1`` of one device ("gpu" or "cpu"): held, free or evictable.

    ``on_evict(block)`` is called when an allocation evicts a cached block (the prefix cache
    sets it to forget the block's hash).
    """

    #: not copied by a step's checkpoint: what the pool saves itself before changing it
    __rollback_skip__ = ("ref_counts", "_free", "_state", "checkpoint")

    def __init__(self, device: str, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks for {device} must be an int >= 0, got {num_blocks!r}")
        self.device = device
        self.num_blocks = num_blocks
        self.ref_counts: list[int] = [0] * num_blocks          # [num_blocks]
        # Reversed so that a fresh pool hands out 0, 1, 2, ... (easier to read in notebooks).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, cached; LRU first
        self._state = bytearray([FREE]) * num_blocks             # HELD / FREE / EVICTABLE
        self.on_evict: Callable[[int], None] | None = None
        self.checkpoint: Checkpoint | None = None     # the engine step's, while one runs

    # ------------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: the free stack plus the evictable blocks."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    def free_block_ids(self) -> list[int]:
        """A copy of the free stack, top last (for drawings and checks, not the hot path)."""
        return list(self._free)

    def evictable_block_ids(self) -> list[int]:
        """The evictable blocks, next victim first (for drawings and checks)."""
        return list(self._evictable)

    # ----------------------------------------------------------------- the hot path
    def allocate(self) -> int:
        """A block with ref count 1: the top of the free stack, else the LRU evictable block
        (evicted from the prefix cache). O(1)."""
        if self._free:
            if self.checkpoint is not None:     # the hottest call: outside a step, one test
                self._save((self._free[-1],), cut_free_to=len(self._free) - 1)
            block = self._free.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._save((block,))
            if self.on_evict is not None:
                self.on_evict(block)
        else:
            raise NoFreeBlocksError(f"no free {self.device} blocks (pool of {self.num_blocks})")
        self.ref_counts[block] = 1
        self._state[block] = HELD
        return block

    def allocate_n(self, n: int) -> list[int]:
        """``n`` blocks, exactly as ``n`` calls of :meth:`allocate` would hand them out (the
        free stack's top first, then the least recently used evictable ones), in one call.
        ``NoFreeBlocksError`` (nothing taken) if the pool has fewer."""
        free = self._free
        if n > len(free) + len(self._evictable):
            raise NoFreeBlocksError(f"no free {self.device} blocks (pool of {self.num_blocks})")
        k = min(n, len(free))
        blocks = free[len(free) - k:][::-1] if k else []
        self._save(blocks, cut_free_to=len(free) - k)
        del free[len(free) - k:]
        for _ in range(n - k):
            block, _ = self._evictable.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(block)
            blocks.append(block)
        self._save(blocks[k:])
        refs, state = self.ref_counts, self._state
        for block in blocks:
            refs[block] = 1
            state[block] = HELD
        return blocks

    def touch(self, blocks: Iterable[int]) -> None:
        """One more reference to each block (a fork, or a prefix-cache hit); an evictable
        block that is hit is held again and leaves the LRU."""
        blocks = list(blocks)
        self._save(blocks)
        refs, evictable, state = self.ref_counts, self._evictable, self._state
        for block in blocks:
            if refs[block] == 0:
                if state[block] != EVICTABLE:
                    raise ValueError(f"{self.device} block {block} is free: only a held or an "
                                     f"evictable block can gain a reference")
                del evictable[block]
                state[block] = HELD
            refs[block] += 1

    def release(self, blocks: Iterable[int], cached: Container[int] = ()) -> None:
        """Drop one reference to each block, in order. A block whose count reaches 0 becomes
        evictable (newest at the MRU end) if it is in ``cached``, else free."""
        blocks = list(blocks)
        self._save(blocks)
        refs, free, evictable, state = self.ref_counts, self._free, self._evictable, self._state
        for block in blocks:
            if refs[block] < 1:
                raise ValueError(f"{self.device} block {block} is not held: nothing to release")
            refs[block] -= 1
            if refs[block] == 0:
                if block in cached:
                    evictable[block] = None
                    state[block] = EVICTABLE
                else:
                    free.append(block)
                    state[block] = FREE

    def free(self, block: int) -> None:
        """Put an allocated block whose ref count is already 0 back on the free stack. O(1).
        ``ValueError``, changing nothing, for an id out of range, a block already free or
        evictable (a double free), or one still referenced."""
        if isinstance(block, bool) or not isinstance(block, int) \
                or not 0 <= block < self.num_blocks:
            raise ValueError(f"{self.device} block ids are 0..{self.num_blocks - 1}, "
                             f"got {block!r}")
        if self._state[block] != HELD:
            where = "free" if self._state[block] == FREE else "evictable"
            raise ValueError(f"{self.device} block {block} is already {where} (double free)")
        if self.ref_counts[block] != 0:
            raise ValueError(f"{self.device} block {block} still has ref count "
                             f"{self.ref_counts[block]}; only ref-0 blocks can be freed")
        self._save((block,))
        self._free.append(block)
        self._state[block] = FREE

    def drop_evictable(self) -> list[int]:
        """Move every evictable block to the free stack (the prefix cache was reset)."""
        dropped = list(self._evictable)
        self._save(dropped)
        self._evictable.clear()
        self._free.extend(dropped)
        for block in dropped:
            self._state[block] = FREE
        return dropped

    # ------------------------------------------------------------- inside a step
    def attach(self, checkpoint: Checkpoint) -> None:
        """Hand ``checkpoint`` what the pool changes from now until it closes."""
        self.checkpoint = checkpoint
        checkpoint.save_stack(self._free)             # its length now: pushes need no save

    def _save(self, blocks: Iterable[int], cut_free_to: int | None = None) -> None:
        """Before the ref counts and states of ``blocks`` change (and the free stack is cut
        to its first ``cut_free_to`` blocks): inside a step, the checkpoint keeps them
        (``Checkpoint.save_items``, ``save_stack``). Outside a step, nothing."""
        checkpoint = self.checkpoint
        if checkpoint is not None and not checkpoint.closed:
            checkpoint.save_items(self.ref_counts, blocks)
            checkpoint.save_items(self._state, blocks)
            if cut_free_to is not None:
                checkpoint.save_stack(self._free, cut_free_to)

    def check_invariants(self) -> None:
        """Each block is exactly one of held (ref >= 1), free or evictable (both ref 0)."""
        free, evictable = set(self._free), set(self._evictable)
        name = self.device
        assert len(free) == len(self._free), f"{name}: a block is on the free stack twice"
        assert not free & evictable, f"{name}: a block is both free and evictable"
        assert all(0 <= b < self.num_blocks for b in free | evictable), f"{name}: bad block id"
        assert min(self.ref_counts, default=0) >= 0, f"{name}: negative ref count"
        held = {b for b, r in enumerate(self.ref_counts) if r > 0}
        assert not held & (free | evictable), f"{name}: a held block is free or evictable"
        assert all(self._state[b] == FREE for b in free), f"{name}: free block not marked free"
        assert all(self._state[b] == EVICTABLE for b in evictable), \
            f"{name}: evictable block not marked evictable"
        assert all(self._state[b] == HELD for b in held), f"{name}: held block not marked held"
        assert len(held) + len(free) + len(evictable) == self.num_blocks, (
            f"{name}: {len(held)} held + {len(free)} free + {len(evictable)} evictable "
            f"!= {self.num_blocks} blocks")
