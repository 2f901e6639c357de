"""Paged attention for one decode query, written three ways, for chapter 04.

1. :func:`article_paged_attention` — the source article's pseudo-code translated line by line. It
   applies ``softmax`` to each token's single score inside the loop; the softmax of one number
   is 1, so every token gets weight 1 and the "attention" is the plain sum of the values. Wrong.
2. :func:`two_pass_paged_attention` — the fix with two passes over the block table: all scores
   first, one softmax over all of them, then the weighted sum of the values.
3. :func:`online_paged_attention` — one pass, block by block, with a running maximum ``m``, a
   running sum ``l`` and an accumulator rescaled by ``exp(m_old - m_new)`` whenever the maximum
   grows (online softmax, as in FlashAttention). This is the loop the Triton kernels run.

All three take ``query [num_heads, head_dim]``, the caches ``[num_blocks, block_size,
num_kv_heads, head_dim]``, one sequence's ``block_table`` (a list) and ``seq_len``, and return
``[num_heads, head_dim]`` in float32. Plain Python loops: written to be read, not to be fast.
"""

from __future__ import annotations

import math

import torch


def _num_logical_blocks(seq_len: int, block_size: int) -> int:
    return -(-seq_len // block_size)


def article_paged_attention(query: torch.Tensor, key_cache: torch.Tensor,
                         value_cache: torch.Tensor, block_table: list[int],
                         seq_len: int) -> torch.Tensor:
    """The article's loop, literally (wrong: softmax over one score at a time)."""
    num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    output = torch.zeros(num_heads, head_dim)
    for logical_block_idx in range(_num_logical_blocks(seq_len, block_size)):
        physical_block_idx = block_table[logical_block_idx]
        block_keys = key_cache[physical_block_idx].float()     # [block_size, kv_heads, d]
        block_values = value_cache[physical_block_idx].float()
        for token_idx in range(block_size):
            if logical_block_idx * block_size + token_idx >= seq_len:
                break                                          # last block may be partial
            for h in range(num_heads):
                k = block_keys[token_idx, h // group]
                score = torch.dot(query[h].float(), k) / math.sqrt(head_dim)
                score = torch.softmax(score.reshape(1), dim=0)  # one number -> always 1.0
                output[h] += score[0] * block_values[token_idx, h // group]
    return output


def _scores_and_values(query, key_cache, value_cache, block_table, seq_len, h):
    """Scores and values of head ``h`` for every token, read through the block table."""
    block_size = key_cache.shape[1]
    group = query.shape[0] // key_cache.shape[2]
    scores, values = [], []
    for pos in range(seq_len):
        block, offset = block_table[pos // block_size], pos % block_size
        k = key_cache[block, offset, h // group].float()
        scores.append(torch.dot(query[h].float(), k) / math.sqrt(query.shape[1]))
        values.append(value_cache[block, offset, h // group].float())
    return torch.stack(scores), torch.stack(values)


def two_pass_paged_attention(query: torch.Tensor, key_cache: torch.Tensor,
                             value_cache: torch.Tensor, block_table: list[int],
                             seq_len: int) -> torch.Tensor:
    """Pass 1: every score; softmax over all of them; pass 2: weighted sum of the values."""
    out = torch.zeros(query.shape[0], query.shape[1])
    for h in range(query.shape[0]):
        scores, values = _scores_and_values(query, key_cache, value_cache, block_table,
                                            seq_len, h)
        out[h] = torch.softmax(scores, dim=0) @ values
    return out


def online_paged_attention(query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, block_table: list[int],
                           seq_len: int) -> torch.Tensor:
    """One pass over the blocks with a running max / sum (online softmax)."""
    num_heads, head_dim = query.shape
    block_size = key_cache.shape[1]
    group = num_heads // key_cache.shape[2]
    out = torch.zeros(num_heads, head_dim)
    for h in range(num_heads):
        m, l_sum, acc = float("-inf"), 0.0, torch.zeros(head_dim)
        for logical in range(_num_logical_blocks(seq_len, block_size)):
            n = min(block_size, seq_len - logical * block_size)  # tokens in this block
            block = block_table[logical]
            k = key_cache[block, :n, h // group].float()          # [n, d]
            v = value_cache[block, :n, h // group].float()
            s = (k @ query[h].float()) / math.sqrt(head_dim)      # [n]
            m_new = max(m, s.max().item())
            rescale = math.exp(m - m_new)                         # 0.0 on the first block
            p = torch.exp(s - m_new)
            l_sum = l_sum * rescale + p.sum().item()
            acc = acc * rescale + p @ v
            m = m_new
        out[h] = acc / l_sum
    return out
