"""One device's pool of KV-cache blocks: O(1) allocate and free, reference counts.

A *physical block* is a slot in a preallocated KV tensor that holds ``block_size`` tokens'
keys and values (see ``course_lib.kernels``). The allocator never touches those tensors: it
only hands out block ids and counts how many block-table entries point at each one.

Free blocks sit on a stack (a Python list): ``pop()`` and ``append()`` are O(1) whatever the
pool size, which is the whole point of paging compared with searching for a contiguous range.
This mirrors vLLM's ``BlockAllocator`` / ``BlockPool`` for one device ("gpu" or "cpu").
"""

from __future__ import annotations


class NoFreeBlocksError(RuntimeError):
    """Raised when a pool has no free block left. The caller should have asked first
    (``BlockManager.can_allocate`` / ``can_append_slots`` / ``can_swap_in``)."""


class BlockAllocator:
    """Block ids ``0 .. num_blocks-1`` of one device, each free (ref 0) or held (ref >= 1).

    Invariant: every block is either on the free stack with ref 0, or off it; blocks off the
    stack with ref 0 are owned by someone else (the prefix cache's evictor) and the owner
    gives them back with :meth:`free`.
    """

    def __init__(self, device: str, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks for {device} must be an int >= 0, got {num_blocks!r}")
        self.device = device
        self.num_blocks = num_blocks
        self.ref_counts: list[int] = [0] * num_blocks          # [num_blocks]
        # Reversed so that a fresh pool hands out 0, 1, 2, ... (easier to read in notebooks).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        """Blocks on the free stack (not counting cached blocks parked in an evictor)."""
        return len(self._free)

    def allocate(self) -> int:
        """Take a free block and give it ref count 1. O(1)."""
        if not self._free:
            raise NoFreeBlocksError(f"no free {self.device} blocks (pool of {self.num_blocks})")
        block = self._free.pop()
        self.ref_counts[block] = 1
        return block

    def free(self, block: int) -> None:
        """Return a block whose ref count reached 0 to the free stack. O(1)."""
        if self.ref_counts[block] != 0:
            raise ValueError(f"{self.device} block {block} still has ref count "
                             f"{self.ref_counts[block]}; only ref-0 blocks can be freed")
        self._free.append(block)

    def free_block_ids(self) -> list[int]:
        """A copy of the free stack, top last (for drawings and checks, not the hot path)."""
        return list(self._free)

    def check_invariants(self) -> None:
        """Free stack: unique ids, all in range, all ref 0. Ref counts never negative."""
        free = set(self._free)
        assert len(free) == len(self._free), f"{self.device}: a block is on the free stack twice"
        assert all(0 <= b < self.num_blocks for b in free), f"{self.device}: bad id on free stack"
        assert all(self.ref_counts[b] == 0 for b in free), f"{self.device}: held block is free"
        assert min(self.ref_counts, default=0) >= 0, f"{self.device}: negative ref count"
