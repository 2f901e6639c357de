"""Solutions of chapter 10's exercises."""

from __future__ import annotations

import math


def flatten_step(entries):
    positions, sample_rows = [], []
    for num_tokens, num_computed, num_new in entries:
        start = len(positions)
        positions += range(num_computed, num_computed + num_new)
        done = num_computed + num_new == num_tokens      # the chunk reaches the last token
        sample_rows.append(start + num_new - 1 if done else None)
    return positions, sample_rows


def beam_step(beams, logits, width):
    candidates = []
    for parent, ((tokens, score), row) in enumerate(zip(beams, logits, strict=True)):
        top = max(row)
        lse = top + math.log(sum(math.exp(x - top) for x in row))
        for token, x in enumerate(row):
            candidates.append((score + x - lse, tokens + [token], parent))
    candidates.sort(key=lambda c: (-c[0], c[1]))          # best first; ties: smaller tokens
    return [(tokens, score, parent) for score, tokens, parent in candidates[:width]]


def sharing_predictions():
    # blocks of 16; saving = 1 - distinct blocks / table entries
    return {
        "a": 1 - 2 / 8,   # 4 tables of the same 2 blocks
        "b": 1 - 5 / 8,   # block 0 shared; the partial block 1: 3 copies + the original
        "c": 1 - 4 / 6,   # 2 full blocks shared; each sample opened a block of its own
        "d": 1 - 2 / 4,   # 2 live tables of the same 2 blocks
    }
