"""Read-only questions to :class:`~course_lib.memory.BlockManager`: what it holds, how full.

Free blocks per pool, the sequences and their block tables, a block's reference count, and
``usage()``, the occupancy figures the metrics, the replay and the widgets report. Nothing here
changes the manager; a question about a sequence it does not hold raises ValueError.
"""

from __future__ import annotations

from .block_table import BlockTable
from .pool import BlockAllocator
from .usage import BlockUsage


class ManagerQueries:
    """Mixed into ``BlockManager``: its read-only answers."""

    @property
    def num_free_gpu_blocks(self) -> int:
        """Blocks an allocation can take now: the free stack plus evictable cached blocks."""
        gpu = self.gpu
        return len(gpu._free) + len(gpu._evictable)

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu.num_free_blocks

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def seq_ids(self) -> list[int]:
        return list(self._tables)

    def get_table(self, seq_id: int) -> BlockTable:
        """The sequence's table (read it, do not mutate it)."""
        return self._get(seq_id)

    def get_block_table(self, seq_id: int) -> list[int]:
        """Physical block ids of the sequence, logical order (a copy)."""
        table = self._tables.get(seq_id)
        return (table or self._get(seq_id)).blocks[:]

    def pool(self, device: str) -> BlockAllocator:
        if device not in ("gpu", "cpu"):
            raise ValueError(f"device must be 'gpu' or 'cpu', got {device!r}")
        return self.gpu if device == "gpu" else self.cpu

    def ref_count(self, block: int, device: str = "gpu") -> int:
        pool = self.pool(device)
        if isinstance(block, bool) or not isinstance(block, int) \
                or not 0 <= block < pool.num_blocks:
            raise ValueError(f"{device} block ids are 0..{pool.num_blocks - 1}, got {block!r}")
        return pool.ref_counts[block]

    def _get(self, seq_id: int, device: str | None = None) -> BlockTable:
        table = self._tables.get(seq_id)
        if table is None:
            known = sorted(self._tables, key=repr)[:10]     # ids of any type: no TypeError
            raise ValueError(f"seq {seq_id!r} has no blocks (never allocated, or already freed); "
                             f"allocated seqs: {known}{' ...' if len(self._tables) > 10 else ''}")
        if device is not None and table.device != device:
            raise ValueError(f"seq {seq_id} is on {table.device}, this needs it on {device}")
        return table

    def usage(self, device: str = "gpu") -> BlockUsage:
        """Occupancy of one pool, O(sequences on it): only a sequence's last block can have
        empty slots, and a partial block shared by several tables has the same fill in each
        (a write into a shared block copies it first), so each last block counts once."""
        pool, bs = self.pool(device), self.block_size
        entries, empty = 0, {}
        for table in self._tables.values():
            if table.device == device:
                entries += len(table.blocks)
                empty[table.blocks[-1]] = -table.num_tokens % bs
        held = pool.num_blocks - pool.num_free_blocks
        return BlockUsage(device, bs, pool.num_blocks, pool.num_free_blocks,
                          pool.num_evictable_blocks, entries, held * bs - sum(empty.values()))
