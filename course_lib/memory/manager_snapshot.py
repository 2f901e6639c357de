"""Snapshot and restore of :class:`~course_lib.memory.BlockManager`: a copy of everything it
holds (both pools, the prefix cache, every block table, the counters), and putting it back.

``LLMEngine.step`` takes a snapshot before a step and restores it when the step fails, so that
a failed step leaves the manager exactly as it was (``engine/rollback.py``).
"""

from __future__ import annotations

from typing import NamedTuple

from .block_table import BlockTable
from .pool import PoolSnapshot


class ManagerSnapshot(NamedTuple):
    """``BlockManager.snapshot()``: copies of everything the manager holds."""
    gpu: PoolSnapshot
    cpu: PoolSnapshot
    cache: tuple | None
    tables: dict[int, BlockTable]
    queries: int
    hits: int


class SnapshotRestore:
    """Mixed into ``BlockManager``: ``snapshot()`` and ``restore()``."""

    def snapshot(self) -> ManagerSnapshot:
        """A copy of every table, both pools, the prefix cache and the counters: what
        ``LLMEngine.step`` restores when a step fails (O(blocks + tokens held))."""
        return ManagerSnapshot(self.gpu.snapshot(), self.cpu.snapshot(),
                               self.cache.snapshot() if self.cache is not None else None,
                               {s: t.copy(s) for s, t in self._tables.items()},
                               self.prefix_cache_queries, self.prefix_cache_hits)

    def restore(self, snap: ManagerSnapshot) -> None:
        """Put the manager back exactly as it was when ``snap`` was taken."""
        self.gpu.restore(snap.gpu)
        self.cpu.restore(snap.cpu)
        if self.cache is not None:
            self.cache.restore(snap.cache)
        self._tables = {s: t.copy(s) for s, t in snap.tables.items()}
        self.prefix_cache_queries, self.prefix_cache_hits = snap.queries, snap.hits
