"""Solutions of chapter 05's exercises."""

from __future__ import annotations

from course_lib.sizing.units import cdiv


def beam_blocks(tables, num_tokens, picks, block_size):
    refs = {}                                     # a block's count: the tables that hold it
    for table in tables.values():
        for block in table:
            refs[block] = refs.get(block, 0) + 1
    freed = []
    for beam, table in tables.items():            # a beam nobody picked is dropped
        if beam not in picks:
            for block in table:
                refs[block] -= 1
                if refs[block] == 0:
                    freed.append(block)
    for beam in set(picks):                       # picked k times: k - 1 forks
        for block in tables[beam]:
            refs[block] += picks.count(beam) - 1
    held = sum(1 for count in refs.values() if count > 0)
    copied = []
    if num_tokens % block_size == 0:              # full last blocks: each beam opens a new one
        held += len(picks)
    else:                                         # r beams on one partial block: r - 1 copies
        for last in {tables[beam][-1] for beam in picks}:
            copied += [last] * (refs[last] - 1)
        held += len(copied)
    return freed, copied, held


def blocks_held(num_samples, prompt_len, gen_len, block_size):
    if gen_len == 0:                          # nobody wrote: every sample shares every block
        return cdiv(prompt_len, block_size)
    full = prompt_len // block_size           # full prompt blocks stay shared
    return full + num_samples * (cdiv(prompt_len + gen_len, block_size) - full)


def cow_predictions():
    return {
        # 18 tokens: 4 full blocks + 1 partial, all shared. The parent copies the partial one
        # (5 + 1); the child is then its only owner and writes in place.
        "a": 6,
        # 16 tokens: 4 full blocks. A full block is never written again: each sequence opens
        # a block of its own for its new token (4 + 2), no copy.
        "b": 6,
        # 6 tokens: 1 full + 1 partial block with 3 owners. The first two writers copy it;
        # the parent is its last owner and writes in place: 2 copies.
        "c": 2,
        # 10 tokens: 3 blocks. Freeing the parent drops one reference each; the child still
        # holds all 3 and, their only owner now, writes into its partial block in place.
        "d": 3,
        # A fresh pool gives 0, 1, 2. free pushes from the last block to the first, so 0 ends
        # on top of the stack and is handed out next.
        "e": 0,
    }
