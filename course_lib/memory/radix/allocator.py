"""Where the radix tree's KV slots come from: SGLang's allocators, in miniature.

SGLang (0.5.23, ``python/sglang/srt/mem_cache/allocator/``) hands the tree token slots from
``TokenToKVPoolAllocator``, one slot per token, or whole pages from
``PagedTokenToKVPoolAllocator`` (``allocator/paged.py``) when ``page_size > 1``. The course
has one of each:

* :class:`SlotPool`: token slots ``0 .. num_slots-1`` on a free list (page size 1);
* :class:`BlockSlotPool`: slots handed out as whole KV-cache blocks, so that the tree's pages
  are the blocks of the paged cache (``RadixKVCacheManager``'s pool).

Both answer ``alloc(n)`` (None when short, changing nothing), ``free(slots)``,
``available_size()`` and ``free_slots()``: all the tree asks of an allocator.
"""

from __future__ import annotations

from collections.abc import Sequence


class SlotPool:
    """Token slots ``0 .. num_slots-1`` of the KV cache: a free list, O(1) per slot."""

    def __init__(self, num_slots: int) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._is_free = bytearray([1]) * num_slots

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        out = [self._free.pop() for _ in range(n)]
        for s in out:
            self._is_free[s] = 0
        return out

    def free(self, slots: Sequence[int]) -> None:
        for s in slots:
            if not 0 <= s < self.num_slots or self._is_free[s]:
                raise ValueError(f"slot {s} is not allocated (double free?)")
        for s in slots:
            self._is_free[s] = 1
            self._free.append(s)

    def free_slots(self) -> set[int]:
        return set(self._free)


class BlockSlotPool:
    """Token slots handed out as whole blocks: slot ``b * block_size + i`` is slot ``i`` of
    block ``b`` (SGLang's ``PagedTokenToKVPoolAllocator`` in ``allocator/paged.py``).
    ``alloc(n)`` takes ``n / block_size`` blocks from a stack; ``free`` gives whole blocks
    back."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks = list(range(num_blocks - 1, -1, -1))    # pop() gives 0 first
        self._is_free = bytearray([1]) * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def available_size(self) -> int:
        return len(self.free_blocks) * self.block_size

    def alloc(self, n: int) -> list[int] | None:
        if n % self.block_size:
            raise ValueError(f"allocate whole blocks: {n} is not a multiple of "
                             f"{self.block_size}")
        if n > self.available_size():
            return None
        bs, out = self.block_size, []
        for _ in range(n // bs):
            b = self.free_blocks.pop()
            self._is_free[b] = 0
            out += range(b * bs, (b + 1) * bs)
        return out

    def free(self, slots: Sequence[int]) -> None:
        bs = self.block_size
        blocks = [slots[i] // bs for i in range(0, len(slots), bs)]
        for i, b in enumerate(blocks):
            if list(slots[i * bs:(i + 1) * bs]) != list(range(b * bs, (b + 1) * bs)):
                raise ValueError(f"slots {list(slots[i * bs:(i + 1) * bs])} are not one block")
            if not 0 <= b < self.num_blocks or self._is_free[b]:
                raise ValueError(f"block {b} is not allocated (double free?)")
        for b in blocks:
            self._is_free[b] = 1
            self.free_blocks.append(b)

    def is_free(self, block: int) -> bool:
        return bool(self._is_free[block])

    def free_slots(self) -> set[int]:
        bs = self.block_size
        return {b * bs + i for b in self.free_blocks for i in range(bs)}
