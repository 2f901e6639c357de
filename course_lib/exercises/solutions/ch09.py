"""Solutions of chapter 09's exercises."""

from __future__ import annotations

import torch

from course_lib.parallel.merge import partial_attention


def place_tokens(prompt_len, num_steps, cp_size, interleave_size):
    def rank_of(position):
        if interleave_size:                               # vLLM: chunks dealt round-robin
            return (position // interleave_size) % cp_size
        if position >= prompt_len:                        # contiguous: decode on the last rank
            return cp_size - 1
        return next(r for r in range(cp_size)             # the prompt in balanced ranges
                    if r * prompt_len // cp_size <= position < (r + 1) * prompt_len // cp_size)

    ranks = [[] for _ in range(cp_size)]
    for position in range(prompt_len + num_steps):
        ranks[rank_of(position)].append(position)
    return ranks


def cp_decode(q, k, v, owner, cp_size):
    outs, lses = [], []
    for r in range(cp_size):                              # each rank, its own tokens
        mine = [i for i, o in enumerate(owner) if o == r]
        out, lse = partial_attention(q, k[mine], v[mine])
        outs.append(out)
        lses.append(lse)
    m = torch.stack(lses).max(dim=0).values               # all_reduce(MAX)
    w = [torch.exp(lse - m) for lse in lses]              # an empty rank: exp(-inf) = 0
    num = sum(wi[:, None] * out for wi, out in zip(w, outs, strict=True))   # all_reduce(SUM)
    den = sum(w)                                          # all_reduce(SUM)
    return num / den[:, None], m + torch.log(den)


def max_decode_steps(prompt_len, cp_size, interleave_size, num_gpu_blocks, block_size):
    def rank_of(position):
        if interleave_size:
            return (position // interleave_size) % cp_size
        if position >= prompt_len:
            return cp_size - 1
        return next(r for r in range(cp_size)
                    if r * prompt_len // cp_size <= position < (r + 1) * prompt_len // cp_size)

    held = [0] * cp_size
    for position in range(prompt_len):
        held[rank_of(position)] += 1
    room, steps = num_gpu_blocks * block_size, 0          # tokens one rank's pool holds
    while held[rank_of(prompt_len + steps)] < room:       # the next token's rank has room
        held[rank_of(prompt_len + steps)] += 1
        steps += 1
    return steps
