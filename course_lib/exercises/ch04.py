"""Chapter 04 exercises: slot mapping, the paged gather, and merging two partial attentions.

Each ``check_*`` runs the learner's function and the library's on the same cases (edge cases
included: a position on a block boundary, a sequence of one token, a split with no keys) and
returns a :class:`~course_lib.exercises.Verdict`; print it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from course_lib.exercises import Verdict, check
from course_lib.kernels import reference
from course_lib.kernels.batch import make_paged_batch

SLOT_MAPPING_CASES = [
    ([7, 3, 12], [0], 16),                      # the article's table, first token
    ([7, 3, 12], [15, 16], 16),                 # both sides of a block boundary
    ([7, 3, 12], [0, 1, 2, 31, 32, 47], 16),
    ([0], [0, 1, 2], 4),
    ([5, 2], [7], 4),                           # last slot of the last block
    ([9, 8, 1, 4], list(range(16)), 4),
    ([2, 0], [0, 1, 8, 9, 15], 8),
    ([3], [], 16),                              # no tokens
]


def _same_slots(got, want) -> bool:
    """A list, tuple or 1-D tensor of the same ints."""
    try:
        return [int(x) for x in got] == want
    except (TypeError, ValueError):
        return False


def check_slot_mapping(learner: Callable) -> Verdict:
    """Exercise 4.1: ``slot_mapping(block_table, positions, block_size) -> list[int]``."""
    return check("4.1 slot_mapping", learner, reference.slot_mapping, SLOT_MAPPING_CASES,
                 compare=_same_slots)


def _gather_cases() -> list[tuple]:
    cases = []
    for seq_lens, block_size, seed in (([1], 4, 0), ([4], 4, 1), ([5], 4, 2), ([37], 16, 3),
                                       ([16], 8, 4), ([23], 8, 5)):
        b = make_paged_batch(seq_lens, num_heads=2, num_kv_heads=2, head_dim=4,
                             block_size=block_size, seed=seed)
        cases.append((b.key_cache, b.value_cache, b.block_tables[0], seq_lens[0]))
    return cases


def _same_pair(got, want) -> bool:
    return (isinstance(got, (tuple, list)) and len(got) == 2
            and all(isinstance(g, torch.Tensor) and g.shape == w.shape and torch.equal(g, w)
                    for g, w in zip(got, want, strict=True)))


def check_gather_kv(learner: Callable) -> Verdict:
    """Exercise 4.2: ``gather_kv(key_cache, value_cache, block_table, seq_len) -> (k, v)``,
    each ``[seq_len, num_kv_heads, head_dim]`` (the caches hold NaN outside the sequence)."""
    return check("4.2 gather_kv", learner, reference.gather_kv, _gather_cases(),
                 compare=_same_pair)


def _merge_cases() -> list[tuple]:
    gen = torch.Generator().manual_seed(0)
    cases = []
    for heads, split in ((1, 3), (4, 1), (4, 7), (2, 5)):
        scores = torch.randn(heads, 8, generator=gen) * 3
        values = torch.randn(8, 4, generator=gen)
        parts = []
        for cols in (slice(0, split), slice(split, 8)):
            s = scores[:, cols]
            parts += [torch.softmax(s, -1) @ values[cols], torch.logsumexp(s, -1)]
        cases.append(tuple(parts))
    out = torch.randn(2, 4, generator=gen)
    cases.append((out, torch.tensor([0.5, -1.0]), torch.zeros(2, 4),
                  torch.full((2,), float("-inf"))))   # second split saw no keys
    cases.append((torch.zeros(2, 4), torch.tensor([0.5, float("-inf")]), torch.zeros(2, 4),
                  torch.full((2,), float("-inf"))))   # head 1: neither split saw a key
    return cases


def _same_merge(got, want) -> bool:
    return (isinstance(got, (tuple, list)) and len(got) == 2
            and all(isinstance(g, torch.Tensor) and g.shape == w.shape
                    and torch.allclose(g, w, atol=1e-5, rtol=1e-5)
                    for g, w in zip(got, want, strict=True)))


def check_merge_attn_states(learner: Callable) -> Verdict:
    """Exercise 4.3: ``merge_attn_states(out_a, lse_a, out_b, lse_b) -> (out, lse)``."""
    return check("4.3 merge_attn_states", learner, reference.merge_attn_states, _merge_cases(),
                 compare=_same_merge)
