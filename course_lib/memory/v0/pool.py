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
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container, Iterable


class NoFreeBlocksError(RuntimeError):
    """Raised when a pool has no free block left. The caller should have asked first
    (``BlockManager.can_allocate`` / ``can_append_slots`` / ``can_swap_in``, in
    ``course_lib/memory/v0/manager.py``)."""


class BlockAllocator:
    """Block ids ``0 .. num_blocks-1`` of one device ("gpu" or "cpu"): held, free or evictable.

    ``on_evict(block)`` is called when an allocation evicts a cached block (the prefix cache
    sets it to forget the block's hash).
    """

    def __init__(self, device: str, num_blocks: int) -> None:
        self.device = device
        self.num_blocks = num_blocks
        self.ref_counts: list[int] = [0] * num_blocks          # [num_blocks]
        # Reversed so that a fresh pool hands out 0, 1, 2, ... (easier to read in notebooks).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, cached; LRU first
        self.on_evict: Callable[[int], None] | None = None

    # ------------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: the free stack plus the evictable blocks."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    def free_block_ids(self) -> list[int]:
        """A copy of the free stack, top last (for drawings and checks)."""
        return list(self._free)

    def evictable_block_ids(self) -> list[int]:
        """The evictable blocks, next victim first (for drawings and checks)."""
        return list(self._evictable)

    # -------------------------------------------------------------- take and give back
    def allocate(self) -> int:
        """A block with ref count 1: the top of the free stack, else the LRU evictable block
        (evicted from the prefix cache). O(1)."""
        if self._free:
            block = self._free.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(block)
        else:
            raise NoFreeBlocksError(f"no free {self.device} blocks (pool of {self.num_blocks})")
        self.ref_counts[block] = 1
        return block

    def allocate_n(self, n: int) -> list[int]:
        """``n`` blocks, one :meth:`allocate` after another."""
        return [self.allocate() for _ in range(n)]

    def touch(self, blocks: Iterable[int]) -> None:
        """One more reference to each block (a fork, or a prefix-cache hit); an evictable
        block that is hit is held again and leaves the LRU."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._evictable[block]
            self.ref_counts[block] += 1

    def release(self, blocks: Iterable[int], cached: Container[int] = ()) -> None:
        """Drop one reference to each block, in order. A block whose count reaches 0 becomes
        evictable (newest at the MRU end) if it is in ``cached``, else free."""
        for block in blocks:
            assert self.ref_counts[block] > 0, f"{self.device} block {block} is not held"
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if block in cached:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def free(self, block: int) -> None:
        """Put an allocated block whose ref count was set to 0 back on the free stack."""
        self._free.append(block)

    def drop_evictable(self) -> list[int]:
        """Move every evictable block to the free stack (the prefix cache was reset)."""
        dropped = list(self._evictable)
        self._evictable.clear()
        self._free.extend(dropped)
        return dropped

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
        assert len(held) + len(free) + len(evictable) == self.num_blocks, (
            f"{name}: {len(held)} held + {len(free)} free + {len(evictable)} evictable "
            f"!= {self.num_blocks} blocks")
