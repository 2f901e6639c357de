"""Allocating the sequences of one request together (:class:`~course_lib.memory.BlockManager`).

A parallel-sampling or beam-search request preempted by recompute comes back as several
sequences whose tokens share a prefix. Allocated one by one they would each take their own
blocks for it; allocated as a group, each shares the full blocks of its longest common prefix
with an earlier one, as they shared them before (and as vLLM V0's forks did).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from .block_table import BlockTable, common_full_blocks
from .pool import NoFreeBlocksError
from .usage import AllocStatus


class GroupAllocation:
    """Mixed into ``BlockManager``: room for, and allocation of, a group sharing a prefix."""

    def _group_plan(self, token_lists: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
        """For each sequence of a group: (the earlier one it shares the most leading full
        blocks with, how many), sharing at most its ``(len - 1) // block_size`` blocks (at
        least one token is computed). (-1, 0) for the first."""
        bs, plan = self.block_size, [(-1, 0)]
        for i in range(1, len(token_lists)):
            limit = (len(token_lists[i]) - 1) // bs
            best = max(((min(common_full_blocks(token_lists[i], token_lists[j], bs), limit), -j)
                        for j in range(i)), default=(0, 0))
            plan.append((-best[1], best[0]) if best[0] else (-1, 0))
        return plan

    def group_blocks_needed(self, token_lists: Sequence[Sequence[int]]) -> int:
        """GPU blocks a group of sequences takes when each shares the full blocks of its
        longest common prefix with an earlier one (prefix-cache hits not counted)."""
        plan = self._group_plan(token_lists)
        return sum(self._blocks_needed(len(t)) - shared
                   for t, (_, shared) in zip(token_lists, plan, strict=True))

    def can_allocate_group(self, token_lists: Sequence[Sequence[int]],
                           extra_key: Hashable = ()) -> AllocStatus:
        """``can_allocate`` for a group that shares prefixes (see :meth:`allocate_group`)."""
        if len(token_lists) == 1:
            return self.can_allocate(token_lists[0], extra_key)
        need = self.group_blocks_needed(token_lists)
        if need > self.num_gpu_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        return AllocStatus.OK if self.num_free_gpu_blocks - need >= self.watermark_blocks \
            else AllocStatus.LATER

    def allocate_group(self, seqs: Sequence[tuple[int, Sequence[int]]],
                       extra_key: Hashable = ()) -> list[tuple[int, int | None]]:
        """Allocate the sequences of one request together (samples or beams prefilled again
        after a recompute preemption): the first as :meth:`allocate` does, each later one
        sharing the full blocks of its longest common prefix with an earlier one, the way they
        shared them before. Returns, per sequence, ``(tokens it need not compute, the seq id
        that computes them or None)``: prefix-cache hits for the first (already computed),
        the shared prefix for the others, whose K/V the named sequence writes (the caller
        must not run a sharer before that). All or nothing: ``NoFreeBlocksError`` if the
        group does not fit now, nothing allocated."""
        if len(seqs) == 1:                               # one sequence: allocate() it
            seq_id, tokens = seqs[0]
            return [(self.allocate(seq_id, tokens, extra_key), None)]
        if not seqs:
            raise ValueError("allocate_group needs at least one sequence")
        ids = [s for s, _ in seqs]
        if len(set(ids)) != len(ids) or any(s in self._tables for s in ids):
            raise ValueError(f"seq ids must be new and distinct, got {ids}")
        token_lists = [list(t) for _, t in seqs]
        if len(seqs) == 1:
            return [(self.allocate(ids[0], token_lists[0], extra_key), None)]
        for t in token_lists:
            self._blocks_needed(len(t))                     # >= 1 token each
        need = self.group_blocks_needed(token_lists)        # as can_allocate_group counts
        if need > self.num_free_gpu_blocks:
            raise NoFreeBlocksError(f"the group needs {need} GPU blocks, "
                                    f"{self.num_free_gpu_blocks} are free")
        plan = self._group_plan(token_lists)
        out = [(self.allocate(ids[0], token_lists[0], extra_key), None)]
        for i in range(1, len(ids)):
            seq_id, tokens, (j, shared) = ids[i], token_lists[i], plan[i]
            if not shared:
                out.append((self.allocate(seq_id, tokens, extra_key), None))
                continue
            source = self._tables[ids[j]]
            table = BlockTable(seq_id, self.block_size, token_ids=tokens,
                               extra_key=source.extra_key)
            self.gpu.touch(source.blocks[:shared])
            table.blocks = source.blocks[:shared] + self.gpu.allocate_n(
                self._blocks_needed(len(tokens)) - shared)
            if self.cache is not None:
                table.block_hashes = source.block_hashes[:shared]
                self.cache.hash_blocks(table, len(tokens) // self.block_size)
            self._tables[seq_id] = table
            out.append((shared * self.block_size, ids[j]))
        return out
