"""Where the radix tree's KV slots come from: SGLang's allocators, in miniature.

SGLang (0.5.23, ``python/sglang/srt/mem_cache/allocator/``) hands the tree token slots from
``TokenToKVPoolAllocator`` (``token.py``), one slot per token, or whole pages from
``PagedTokenToKVPoolAllocator`` (``paged.py``) when ``page_size > 1``. The course has one of
each, handing out in SGLang's order:

* :class:`SlotPool`: token slots ``0 .. num_slots-1`` (page size 1). SGLang's ``free_pages``
  starts as ``arange(1, size + 1)``; ``alloc(n)`` takes the first ``n``
  (``free_pages[:n]``) and ``free`` appends the freed slots at the *end*
  (``torch.cat((free_pages, free_index))``): first in, first out.
* :class:`BlockSlotPool`: slots handed out as whole KV-cache blocks, so that the tree's pages
  are the blocks of the paged cache (``RadixKVCacheManager``'s pool). SGLang's paged
  ``free_pages`` also starts in ascending order and ``alloc`` takes pages from the front, but
  ``free`` puts the freed pages *in front*, in the order given
  (``_release_page_ids``: ``torch.cat((page_ids, free_pages))``): the pages freed last are
  handed out first.

Both answer ``alloc(n)`` (None when short, changing nothing), ``free(slots)``,
``available_size()`` and ``free_slots()``: all the tree asks of an allocator.

What the course leaves out: SGLang reserves slot 0 (page 0) for the dummy writes of padded
tokens, so its ids are the course's plus one (as vLLM's null block shifts vLLM's); with
``need_sort`` (set only under prefill/decode disaggregation) freed pages wait in a release
list, merged and sorted into ``free_pages`` when an ``alloc`` runs short
(``merge_and_sort_free``), which the course does not model; ``free`` of a paged index list
takes its pages through ``torch.unique`` (ascending), ``free_segment`` (what the tree's
eviction and ``_insert_cache`` call) in the order given, which is what :meth:`BlockSlotPool.free`
does: the callers here give pages in table order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class SlotPool:
    """Token slots ``0 .. num_slots-1`` of the KV cache: a first-in, first-out free list
    (``TokenToKVPoolAllocator``), O(1) per slot."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = deque(range(num_slots))        # front: the next slot handed out
        self._is_free = bytearray([1]) * num_slots

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        out = [self._free.popleft() for _ in range(n)]
        for s in out:
            self._is_free[s] = 0
        return out

    def free(self, slots: Sequence[int]) -> None:
        for s in slots:
            assert not self._is_free[s], f"slot {s} is not allocated (double free)"
            self._is_free[s] = 1
            self._free.append(s)                    # at the back, as SGLang's free

    def free_slots(self) -> set[int]:
        return set(self._free)


class BlockSlotPool:
    """Token slots handed out as whole blocks: slot ``b * block_size + i`` is slot ``i`` of
    block ``b`` (SGLang's ``PagedTokenToKVPoolAllocator`` in ``allocator/paged.py``).
    ``alloc(n)`` takes ``n / block_size`` blocks from the front of the free list; ``free``
    gives whole blocks back to its front, in the order given (the module docstring).

    ``free_blocks`` is SGLang's ``free_pages`` stored back to front (a stack whose top,
    ``free_blocks[-1]``, is the next block handed out), so that both ends cost O(1)."""

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
        """``n`` slots (whole blocks), or None if fewer are free."""
        if n > self.available_size():
            return None
        bs, out = self.block_size, []
        for _ in range(n // bs):
            b = self.free_blocks.pop()
            self._is_free[b] = 0
            out += range(b * bs, (b + 1) * bs)
        return out

    def free(self, slots: Sequence[int]) -> None:
        """Give back whole blocks' slots (each block's, in order)."""
        blocks = [slots[i] // self.block_size for i in range(0, len(slots), self.block_size)]
        for b in blocks:
            assert not self._is_free[b], f"block {b} is not allocated (double free)"
            self._is_free[b] = 1
        self.free_blocks += reversed(blocks)           # to the front: blocks[0] goes out next

    def is_free(self, block: int) -> bool:
        return bool(self._is_free[block])

    def free_slots(self) -> set[int]:
        bs = self.block_size
        return {b * bs + i for b in self.free_blocks for i in range(bs)}
