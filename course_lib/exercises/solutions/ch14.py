"""Solutions of chapter 14's exercises."""

from __future__ import annotations


def blocks_freed(num_computed_tokens, num_new_tokens, sliding_window, block_size):
    def skipped(n):
        # after n computed tokens, the next token (n) reads tokens n - w + 1 .. n - 1 and
        # itself: every token before n - w + 1 is never read again (none while n < w)
        return max(0, n - sliding_window + 1)

    # only blocks made wholly of skipped tokens are freed (round down); those before the
    # old count's were freed already, by the allocate_slots that came with it
    already = skipped(num_computed_tokens) // block_size
    now = skipped(num_computed_tokens + num_new_tokens) // block_size
    return list(range(already, now))


def longest_hit(full_cached, window_cached, sliding_window, block_size, prompt_len):
    def full_hit(length):
        # the leading run of cached blocks: hashes are chained, a miss ends the hit
        n = 0
        while n < length // block_size and full_cached[n]:
            n += 1
        return n * block_size

    def window_hit(length):
        # only the blocks the next token reads must be cached: scan from the right for the
        # first run of `need` cached blocks; the hit ends where that run ends
        need = -(-(sliding_window - 1) // block_size)
        run = 0
        for i in range(length // block_size - 1, -1, -1):
            if not window_cached[i]:
                run = 0
                continue
            run += 1
            if run >= need:
                return (i + run) * block_size
        # no such run: a hit shorter than the window needs every block, the run from block 0
        return run * block_size

    length = prompt_len - 1              # the last token is computed, for its logits
    while True:                          # each group cuts the length until none does
        cut = window_hit(full_hit(length))
        if cut == length:
            return length
        length = cut
