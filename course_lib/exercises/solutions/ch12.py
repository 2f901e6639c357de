"""Solutions of chapter 12's exercises."""

from __future__ import annotations

from course_lib.sizing.units import cdiv


def free_queue_after(queue, table):
    front, back = [], []
    for block, cached in reversed(table):          # the tail of the table is freed first
        (back if cached else front).append(block)
    # the uncached ones go to the front as a group (reused first), tail first; the cached
    # ones to the back (evicted last), tail first too
    return front + list(queue) + back


def radix_hit(prompt, earlier, page_size):
    best = 0
    for other in earlier:                           # the tree holds every earlier prompt
        n = 0
        while n < min(len(prompt), len(other)) and prompt[n] == other[n]:
            n += 1
        best = max(best, n)
    return best - best % page_size                  # only whole pages are matched


def allocate_slots(pool, req, num_new_tokens, hits, block_size, watermark_blocks):
    # every token computed so far, the hit tokens and the new ones need a slot
    total = req.num_computed_tokens + len(hits) * block_size + num_new_tokens
    num_new_blocks = cdiv(total, block_size) - len(req.blocks) - len(hits)
    # a hit nobody holds (ref_cnt 0) sits in the free queue: taking it costs a free block
    evictable = sum(1 for block in hits if block.ref_cnt == 0)
    # the watermark holds blocks back from admissions (a request holding no blocks) only
    reserve = watermark_blocks if not req.blocks else 0
    if num_new_blocks + evictable > pool.get_num_free_blocks() - reserve:
        return None                                  # all or nothing: nothing changed yet
    pool.touch(hits)                                 # before taking new blocks from the front
    new_blocks = pool.get_new_blocks(num_new_blocks)
    req.blocks = req.blocks + hits + new_blocks
    num_full = total // block_size                   # only full blocks enter the cache
    pool.cache_full_blocks(req.blocks, req.block_hashes, req.num_cached_block, num_full)
    req.num_cached_block = num_full
    return new_blocks
