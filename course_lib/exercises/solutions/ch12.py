"""Solutions of chapter 12's exercises."""

from __future__ import annotations

from course_lib.sizing.units import cdiv


def free_queue_predictions():
    # new blocks come from the front; a freed block that is not cached goes to the front, a
    # cached one to the back; the table is freed from its last block to its first
    return {
        "a": 2,     # [2] + [5, 6] + [1, 0]
        "b": 0,     # the same queue: the first block of the table is freed last, at the back
        "c": 1,     # [1, 0] + [3]: freed tail first, the group keeps that order
        "d": 7,     # [7] + [2, 1, 0]: cached blocks queue behind the blocks already free
        "e": 5,     # [3] + [4, 5] + [2, 1, 0]: block 0 is the last to be evicted
    }


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
