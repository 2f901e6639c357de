"""Swapping of :class:`~course_lib.memory.BlockManager`: a preempted group's blocks to the CPU
pool and back (the paper's and vLLM V0's swap preemption; vLLM V1 only recomputes).

A group (one request's samples or beams) moves together: a block shared inside the group moves
once and stays shared. The engine runs the returned ``[(src, dst)]`` copies before any other
cache operation of the step (a freed GPU block may be handed out again at once).
"""

from __future__ import annotations

from collections.abc import Iterable

from .block_table import BlockTable
from .pool import BlockAllocator, NoFreeBlocksError
from .usage import AllocStatus


class SwapPath:
    """Mixed into ``BlockManager``: swap a group of sequences out to the CPU pool and in."""

    def _group(self, seq_ids: Iterable[int], device: str) -> tuple[list[BlockTable], list[int]]:
        """Tables of a group of sequences (e.g. one request's samples) and their distinct
        blocks: a block shared inside the group moves once and stays shared."""
        seq_ids = list(seq_ids)
        if not seq_ids or len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids must be a non-empty list of distinct ids, got {seq_ids}")
        tables = [self._get(s, device) for s in seq_ids]
        return tables, list(dict.fromkeys(b for t in tables for b in t.blocks))

    def can_swap_out(self, seq_ids: Iterable[int]) -> bool:
        return len(self._group(seq_ids, "gpu")[1]) <= self.num_free_cpu_blocks

    def swap_out(self, seq_ids: Iterable[int]) -> list[tuple[int, int]]:
        """Move the group's blocks to the CPU pool; returns ``[(gpu_block, cpu_block)]``.
        The engine must run these copies before any other cache op of the same step: the
        freed GPU blocks may be handed out again right away."""
        tables, distinct = self._group(seq_ids, "gpu")
        if len(distinct) > self.num_free_cpu_blocks:
            raise NoFreeBlocksError(f"swap out needs {len(distinct)} CPU blocks, "
                                    f"{self.num_free_cpu_blocks} are free (raise swap_space)")
        mapping = {b: self.cpu.allocate() for b in distinct}
        self._move(tables, mapping, self.gpu, self.cpu)
        for table in tables:
            table.num_cached_blocks, table.cache_parent = 0, None   # re-offered after swap-in
        return list(mapping.items())

    def swap_in_need(self, seq_ids: Iterable[int]) -> int:
        """GPU blocks a swapped-out group needs to come back and decode one step: its
        distinct blocks plus :meth:`num_blocks_to_append`."""
        seq_ids = list(seq_ids)
        return len(self._group(seq_ids, "cpu")[1]) + self.num_blocks_to_append(seq_ids)

    def can_swap_in(self, seq_ids: Iterable[int]) -> AllocStatus:
        """Room to swap the group in and run its next decode step, keeping the watermark?"""
        need = self.swap_in_need(seq_ids)
        if need > self.num_gpu_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        return AllocStatus.OK if self.num_free_gpu_blocks - need >= self.watermark_blocks \
            else AllocStatus.LATER

    def swap_in(self, seq_ids: Iterable[int]) -> list[tuple[int, int]]:
        """Bring a swapped-out group back to the GPU; returns ``[(cpu_block, gpu_block)]``."""
        tables, distinct = self._group(seq_ids, "cpu")
        if len(distinct) > self.num_free_gpu_blocks:
            raise NoFreeBlocksError(f"swap in needs {len(distinct)} GPU blocks, "
                                    f"{self.num_free_gpu_blocks} are free")
        mapping = {b: self.gpu.allocate() for b in distinct}
        self._move(tables, mapping, self.cpu, self.gpu)
        return list(mapping.items())

    def _move(self, tables: list[BlockTable], mapping: dict[int, int], src: BlockAllocator,
              dst: BlockAllocator) -> None:
        """Point the tables at the destination blocks (each allocated once, ref 1) and release
        the source ones; a destination block gets one reference per entry in the group."""
        seen: set[int] = set()
        for table in tables:
            old = table.blocks
            table.blocks, table.handed_out = [mapping[b] for b in old], False
            table.device = dst.device
            src.release(reversed(old), self._cached if src is self.gpu else ())
            dst.touch([b for b in table.blocks if b in seen or seen.add(b)])
