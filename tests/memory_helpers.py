"""Helpers shared by the block-manager tests."""

from __future__ import annotations

from course_lib.memory.v0.manager import BlockManager


def snapshot(m: BlockManager):
    """Everything a rejected call must leave untouched, read through public state only: both
    pools (ref counts, free stack, evictable LRU), every table, the prefix cache's keys and
    generations, its collision count and the hit statistics."""
    pools = [(p.device, list(p.ref_counts), p.free_block_ids(), p.evictable_block_ids())
             for p in (m.gpu, m.cpu)]
    tables = {}
    for seq_id in m.seq_ids():
        t = m.get_table(seq_id)
        tables[seq_id] = (t.device, list(t.blocks), list(t.token_ids), list(t.block_hashes),
                          t.num_cached_blocks, t.cache_parent, t.extra_key)
    cache = None
    if m.cache is not None:
        cache = ({b: (m.cache.key_of(b), m.cache.identity(b)) for b in m.cache.cached_block_ids()},
                 m.cache.num_collisions)
    return pools, tables, cache, m.prefix_cache_stats
