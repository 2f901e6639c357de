"""The decode hot path of :class:`~course_lib.memory.BlockManager`: one token per sequence.

Each decode step the scheduler asks, for every running request, whether there is room for one
more token per sequence, reserves the slots, and reads the block tables it hands to the model.
vLLM V0 asks this in three calls per sequence (``can_append_slots``, ``append_slots``,
``get_block_table``); here it is one call per request (:meth:`DecodePath.append_decode`), with
exactly the results of the three calls, in the same order. (One call per step for all requests
was tried: no faster, since the work per sequence stays the same.)

The common cases are decided up front: a sequence whose last block is private and partial
takes the token there (hashing the block if it just filled up), one whose last block is full
takes a new block. Anything else (a shared partial block to copy, blocks still waiting to be
cached, a sequence that is not on the GPU) goes through ``append_slots``. The block ids are
handed out without a copy (``BlockTable.hand_out``). The loops are written out rather than
factored into helpers: they run for every generated token.
"""

from __future__ import annotations

from collections.abc import Sequence

Grown = tuple[list[tuple[int, int]], list[list[int]]]     # (CoW copies, each table's block ids)


class DecodePath:
    """Mixed into ``BlockManager``: the decode call the scheduler makes for every request."""

    def append_decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> Grown | None:
        """One decode step of a group (a request's samples or beams) in one call: the room
        check of :meth:`num_blocks_to_append`, then ``append_slots(seq, [token])`` for each
        sequence in order, then each one's block ids (handed out without a copy: the table
        copies its list before it next changes it, see ``BlockTable.hand_out``). Returns
        ``(CoW copies, block ids)``, or None, changing nothing, when the GPU pool is short
        (preempt something)."""
        tables, bs, cache, gpu = self._tables, self.block_size, self.cache, self.gpu
        if len(seq_ids) == 1 == len(token_ids):          # most requests: one sequence
            table = tables.get(seq_ids[0])
            if table is not None and table.device == "gpu":
                tokens = table.token_ids
                n = len(tokens)
                r = n % bs
                if cache is None or table.num_cached_blocks == n // bs:
                    if r == 0:                           # the last block is full: a new one
                        if not gpu._free and not gpu._evictable:
                            return None
                        table.writable_blocks().append(gpu.allocate())
                    elif gpu.ref_counts[table.blocks[-1]] != 1:
                        return self._append_general(seq_ids, token_ids)   # copy-on-write
                    tokens.append(token_ids[0])
                    if cache is not None and r == bs - 1:
                        cache.hash_blocks(table, n // bs + 1)          # it just filled up
                    table.handed_out = True
                    return [], [table.blocks]
        elif len(seq_ids) == len(token_ids):             # a group: plan all, then grow all
            refs, plan, need = gpu.ref_counts, [], 0
            for seq_id in seq_ids:
                table = tables.get(seq_id)
                if table is None or table.device != "gpu":
                    break
                n = len(table.token_ids)
                if cache is not None and table.num_cached_blocks != n // bs:
                    break                                # blocks waiting to be cached
                if n % bs == 0:
                    need += 1                            # the last block is full: a new one
                elif refs[table.blocks[-1]] != 1:
                    break                                # shared partial block: copy-on-write
                plan.append(table)
            else:
                if need > len(gpu._free) + len(gpu._evictable):
                    return None
                out = []
                for table, token in zip(plan, token_ids, strict=True):
                    tokens = table.token_ids
                    if len(tokens) % bs == 0:
                        table.writable_blocks().append(gpu.allocate())
                    tokens.append(token)
                    if cache is not None and len(tokens) % bs == 0:
                        cache.hash_blocks(table, len(tokens) // bs)    # it just filled up
                    table.handed_out = True
                    out.append(table.blocks)
                return [], out
        else:
            raise ValueError(f"one token per sequence: {len(seq_ids)} sequences, "
                             f"{len(token_ids)} tokens")
        return self._append_general(seq_ids, token_ids)

    def _append_general(self, seq_ids: Sequence[int], token_ids: Sequence[int]
                        ) -> Grown | None:
        """Any case: the room check, then ``append_slots`` sequence by sequence."""
        for seq_id in seq_ids:
            self._get(seq_id, "gpu")                     # all checked before any change
        if self.num_blocks_to_append(seq_ids) > self.num_free_gpu_blocks:
            return None
        copies: list[tuple[int, int]] = []
        for seq_id, token in zip(seq_ids, token_ids, strict=True):
            copies += self.append_slots(seq_id, [token])
        return copies, [self._tables[s].hand_out() for s in seq_ids]
