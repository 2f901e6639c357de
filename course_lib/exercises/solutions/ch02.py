"""Solutions of chapter 02's exercises."""

from __future__ import annotations


def split_memory(residents, holes, head_need):
    split = {"token_states": 0, "reserved": 0, "internal": 0, "external": 0, "free": 0}
    for held, tokens_now, final_len in residents:
        split["token_states"] += tokens_now            # KV already computed
        split["reserved"] += final_len - tokens_now    # held for tokens still to come
        split["internal"] += held - final_len          # held, never to be used
    free = sum(holes)
    blocked = head_need is not None and max(holes, default=0) < head_need
    split["external"] = free if blocked else 0
    split["free"] = free - split["external"]
    return split


def failing_events(num_slots):
    # slots 0 and 1 are taken, then freed: 0 first, then 1. Freeing 1 finds no hole right
    # after it (or merges with one), but never with the hole [0, 1) right before it, so
    # two holes touch at slot 1. An alloc of 2 must start at slot 0; the broken allocator
    # sees no hole of 2 there.
    return [("alloc", 1), ("alloc", 1), ("free", 0), ("free", 1), ("alloc", 2)]
