"""Paged attention for a whole batch in a few torch ops: the serving engine's CPU path.

:func:`course_lib.kernels.reference.paged_attention_ref` is the spec: a Python loop over the
sequences, clear but ~0.1 ms per sequence per layer, so a bigger batch buys nothing. Triton's
interpreter is far slower still. This function does the same maths for every sequence at
once: gather each sequence's blocks into a padded ``[num_seqs, max_len]`` K/V, pad the packed
queries to ``[num_seqs, max_query_len]``, mask (causal, sliding window, padding), one
softmax. It is what lets continuous batching pay off on a CPU; on a GPU the engine uses the
Triton kernels.
"""

from __future__ import annotations

import torch

from ..sizing.units import cdiv
from . import check_sliding_window


def paged_attention_batched(query: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                            scale: float, *, max_query_len: int | None = None,
                            max_seq_len: int | None = None, validate: bool = True,
                            sliding_window: int | None = None) -> torch.Tensor:
    """Same contract as ``paged_attention_ref``: ``query [num_tokens, H, d]``, caches
    ``[num_blocks, block_size, H_kv, d]``, ``block_tables [S, max_blocks]`` (-1 padded),
    ``seq_lens [S]``, ``query_start_loc [S + 1]``. Returns ``[num_tokens, H, d]``.
    ``max_query_len`` / ``max_seq_len``: host-side bounds, read from the tensors when not given;
    ``validate`` is accepted for the backends' common signature (torch indexing checks
    bounds itself). ``sliding_window``: ``None`` or ``W >= 1``, query ``p`` sees keys
    ``p - W < j <= p``; the slots before the window of a sequence's first new token are
    gathered (whole blocks) but zeroed before any arithmetic: in a hybrid model they are
    the null block's garbage."""
    sliding_window = check_sliding_window(sliding_window)
    starts = query_start_loc.to(query.device).long()
    q_lens = starts[1:] - starts[:-1]                                   # [S]
    decode = q_lens == 1
    if bool(decode.any()) and not bool(decode.all()):   # mixed batch: decodes apart, so that
        out = torch.empty_like(query)                   # they are not padded to a prefill
        for part in (decode, ~decode):
            rows = torch.repeat_interleave(part, q_lens)                # tokens of the part
            lens_p = q_lens[part]
            loc = torch.zeros(lens_p.shape[0] + 1, dtype=torch.long, device=query.device)
            loc[1:] = torch.cumsum(lens_p, 0)
            out[rows] = paged_attention_batched(query[rows], key_cache, value_cache,
                                                block_tables[part.to(block_tables.device)],
                                                seq_lens[part.to(seq_lens.device)], loc, scale,
                                                sliding_window=sliding_window)
        return out
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    dev = query.device
    lens = seq_lens.to(dev).long()
    num_seqs = lens.shape[0]
    max_len = int(lens.max()) if max_seq_len is None else max_seq_len
    max_q = int(q_lens.max()) if max_query_len is None else max_query_len
    num_blocks = cdiv(max_len, block_size)
    tables = block_tables[:, :num_blocks].to(dev).long().clamp(min=0)  # [S, nb]
    # K/V of every sequence, padded: [S, nb * block_size, H_kv, d] (slots past a length:
    # garbage, masked below)
    k = key_cache[tables].flatten(1, 2)[:, :max_len]
    v = value_cache[tables].flatten(1, 2)[:, :max_len]
    # zero the slots past each length (and, with a window, before the window of each
    # sequence's first new token): a masked score is exp(-inf) = 0, but 0 * NaN is NaN
    k_pos = torch.arange(max_len, device=dev)
    unread = k_pos[None, :] >= lens[:, None]                            # [S, max_len]
    if sliding_window is not None:
        unread |= k_pos[None, :] <= (lens - q_lens)[:, None] - sliding_window
    k = k.masked_fill(unread[:, :, None, None], 0.0)
    v = v.masked_fill(unread[:, :, None, None], 0.0)
    # the packed queries into [S, max_q]: token t of sequence s sits in row s, column i
    seq_of = torch.repeat_interleave(torch.arange(num_seqs, device=dev), q_lens)   # [T]
    col = torch.arange(num_tokens, device=dev) - starts[seq_of]                   # [T]
    q = query.new_zeros(num_seqs, max_q, num_heads, head_dim)
    q[seq_of, col] = query
    # query i of sequence s sits at position seq_len - q_len + i and sees keys <= it
    q_pos = (lens - q_lens)[:, None] + torch.arange(max_q, device=dev)[None, :]    # [S, max_q]
    allowed = k_pos[None, None, :] <= q_pos[:, :, None]                 # [S, max_q, max_len]
    if sliding_window is not None:                                       # p - W < j
        allowed &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    # padded query rows see key 0 (their output is dropped): no row is all -inf
    allowed[:, :, 0] |= torch.arange(max_q, device=dev)[None, :] >= q_lens[:, None]
    # GQA without copying K/V: the g query heads of one KV head are stacked along the rows
    group = num_heads // num_kv_heads
    qh = q.float().view(num_seqs, max_q, num_kv_heads, group, head_dim) \
        .permute(0, 2, 3, 1, 4)                                          # [S, Hkv, g, max_q, d]
    kh = k.float().transpose(1, 2).unsqueeze(2)                         # [S, Hkv, 1, L, d]
    vh = v.float().transpose(1, 2).unsqueeze(2)
    scores = (qh @ kh.transpose(-1, -2)) * scale                        # [S, Hkv, g, max_q, L]
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vh                            # [S, Hkv, g, max_q, d]
    out = out.permute(0, 3, 1, 2, 4).reshape(num_seqs, max_q, num_heads, head_dim)
    return out[seq_of, col].to(query.dtype)                             # [T, H, d]
