"""When :class:`~course_lib.memory.BlockManager`'s blocks enter the prefix cache, and
emptying the cache.

A full block is offered to the cache only once its K/V are written: the engine calls
``mark_blocks_as_computed`` after each prefill chunk has run (``append_slots`` does the same
for the tokens before the ones it appends). ``reset_prefix_cache`` forgets every cached block,
only while no GPU block is held.
"""

from __future__ import annotations


class PrefixCacheControl:
    """Mixed into ``BlockManager``: ``mark_blocks_as_computed`` and ``reset_prefix_cache``."""

    def mark_blocks_as_computed(self, seq_id: int, num_computed_tokens: int) -> None:
        """Tell the cache that the first ``num_computed_tokens`` tokens' K/V are written.

        Call it after the step that computed them ran (e.g. after each prefill chunk): only
        then may another request reuse those blocks. ``append_slots`` does this implicitly
        for every token before the ones it appends.
        """
        table = self._tables.get(seq_id)
        if table is None or table.device != "gpu":
            table = self._get(seq_id, "gpu")             # raises the explanatory error
        if not 0 <= num_computed_tokens <= len(table.token_ids):
            raise ValueError(f"num_computed_tokens must be in [0, {table.num_tokens}], "
                             f"got {num_computed_tokens}")
        if self.cache is not None and num_computed_tokens // self.block_size \
                > table.num_cached_blocks:
            self.cache.register(table, num_computed_tokens // self.block_size)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks. Only possible while no GPU block is held (vLLM's rule:
        a held block may be mid-use); returns whether the reset happened."""
        if self.cache is None:
            return True
        if self.gpu.num_free_blocks != self.num_gpu_blocks:
            return False
        self.gpu.drop_evictable()
        self.cache.clear()
        return True
