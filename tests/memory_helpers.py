"""Helpers shared by the block-manager tests (and the fault benches that compare states)."""

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


def canonical_state(tree) -> tuple:
    """A tree's cached blocks as data: (namespace, the tokens up to the block's end, block id,
    lock count, last access) per block, and the free list in order; equal for equal caches,
    however their edges happen to be split."""
    bs, pages = tree.page_size, []
    for n in tree.nodes():
        prefix: tuple = ()
        node = n.parent
        while node is not tree.root:
            prefix = node.key + prefix
            node = node.parent
        for i in range(0, len(n.value), bs):
            pages.append((n.extra_key, prefix + n.key[:i + bs], n.value[i] // bs, n.lock_ref,
                          n.last_access_time))
    return tuple(sorted(pages, key=repr)), tuple(tree.pool.free_blocks)


def v1_state(bm):
    """A V1 or radix manager's state, read through its fields and public structures: every
    plain attribute (block objects as their ids, tree nodes as their key and value: whatever
    fields the manager has today), then the pool or the tree."""
    fields = {k: _plain(v) for k, v in vars(bm).items()
              if k not in ("tree", "pool", "block_pool", "hash_fn")}
    if hasattr(bm, "block_pool"):
        pool = bm.block_pool
        return (fields, [(b.ref_cnt, b.block_hash) for b in pool.blocks],
                [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
                {h: sorted(bs) for h, bs in pool.cached_block_hash_to_block.items()})
    return fields, canonical_state(bm.tree)


def _plain(value):
    """``value`` as comparable data: blocks by id, tree nodes by (key, value, lock count)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted(value, key=repr)
    if hasattr(value, "block_id"):
        return ("block", value.block_id)
    if hasattr(value, "lock_ref") and hasattr(value, "key"):
        return ("node", value.key, list(value.value), value.lock_ref)
    if isinstance(value, int | float | str | bytes | bool | type(None)):
        return value
    return ("object", type(value).__name__)


def pool_state(manager):
    """A V1 or radix manager's pool (or tree), without its per-sequence maps."""
    return v1_state(manager)[1:]


def tables(manager):
    """Every sequence's block ids."""
    return {s: list(manager.get_block_table(s)) for s in manager.seq_ids()}


def load_fault_sites():
    """``bench/fault_sites.py`` as the module ``fault_sites`` (bench/ stays off sys.path:
    its scripts' names, engine.py or replay.py, would shadow others); loaded once."""
    import importlib.util
    import sys
    from pathlib import Path

    if "fault_sites" not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "bench" / "fault_sites.py"
        spec = importlib.util.spec_from_file_location("fault_sites", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["fault_sites"] = module
        spec.loader.exec_module(module)
    return sys.modules["fault_sites"]
