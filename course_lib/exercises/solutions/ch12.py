"""Solutions of chapter 12's exercises."""

from __future__ import annotations


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
