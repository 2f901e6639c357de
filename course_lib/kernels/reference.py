"""Plain torch references: the specification every Triton kernel of the course is checked against.

Layout (vLLM's): one layer's cache is two tensors ``key_cache`` and ``value_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. A sequence's tokens live in the physical
blocks listed by its row of ``block_tables [num_seqs, max_blocks]``: token ``j`` is in block
``block_tables[s, j // block_size]`` at offset ``j % block_size``.

A batch packs the new (query) tokens of all sequences into one tensor ``query [num_tokens,
num_heads, head_dim]``; sequence ``s`` owns rows ``query_start_loc[s]:query_start_loc[s + 1]``.
``seq_lens[s]`` counts every token of the sequence, the new ones included, and its new tokens
already sit in the cache (``reshape_and_cache`` wrote them). So ``context_len = seq_len -
query_len`` tokens were cached earlier, and new token ``i`` (position ``context_len + i``) attends
to positions ``0 .. context_len + i`` (causal). Decode is the case ``query_len == 1``.

Sliding window (vLLM's meaning, ``SlidingWindowSpec`` in ``vllm/v1/kv_cache_interface.py``,
0.33.0): with ``sliding_window = W`` the query at position ``p`` attends to the ``W`` keys
``p - W < j <= p`` only (itself included). In a hybrid model the table slots of blocks wholly
before the window of a step's first query hold the null block (block 0, garbage): vLLM's
``SlidingWindowManager.remove_skipped_blocks`` freed them. So the spec never reads them either:
it gathers the keys from the first one in that window on.

These functions loop over sequences in Python and compute in float32: slow, obvious, correct.
"""

from __future__ import annotations

import torch


def slot_mapping(block_table: list[int], positions: list[int], block_size: int) -> list[int]:
    """Cache slot of each token position: ``block_table[pos // block_size] * block_size + pos %
    block_size`` (the flat index into ``num_blocks * block_size`` slots)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    slots = []
    for pos in positions:
        logical = pos // block_size
        if pos < 0 or logical >= len(block_table):
            raise ValueError(f"position {pos} is outside the {len(block_table)} blocks of the "
                             f"block table (valid: 0..{len(block_table) * block_size - 1})")
        if block_table[logical] < 0:      # a negative slot means padding: the write is lost
            raise ValueError(f"position {pos}: block table entry {logical} must be a block "
                             f"number >= 0, got {block_table[logical]}")
        slots.append(block_table[logical] * block_size + pos % block_size)
    return slots


def gather_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
              seq_len: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of positions ``start .. seq_len - 1`` of one sequence, contiguous.

    ``block_table``: that sequence's row ``[max_blocks]``. Returns two ``[seq_len - start,
    num_kv_heads, head_dim]`` tensors. Only the blocks that hold those tokens are read (the rest
    may be garbage: past the sequence, or before ``start``'s block in a sliding-window layer).
    """
    block_size, num_blocks = key_cache.shape[1], key_cache.shape[0]
    capacity = block_table.shape[0] * block_size
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 0 <= seq_len <= capacity:
        raise ValueError(f"seq_len must be an integer in 0..{capacity} (block table of "
                         f"{block_table.shape[0]} blocks x {block_size}), got {seq_len!r}")
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= seq_len:
        raise ValueError(f"start must be an integer in 0..{seq_len} (seq_len), got {start!r}")
    used = block_table[start // block_size:-(-seq_len // block_size)]
    if used.numel() and not (0 <= int(used.min()) and int(used.max()) < num_blocks):
        raise ValueError(f"block table entries must be in 0..{num_blocks - 1}, got "
                         f"{used.tolist()}")
    positions = torch.arange(start, seq_len, device=key_cache.device)
    blocks = block_table.to(key_cache.device).long()[positions // block_size]  # [seq_len - start]
    offsets = positions % block_size
    return key_cache[blocks, offsets], value_cache[blocks, offsets]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    context_len: int = 0, *, sliding_window: int | None = None,
                    first_key: int = 0) -> torch.Tensor:
    """Attention of ``q [q_len, num_heads, d]`` over ``k, v [kv_len, num_kv_heads, d]``.

    Query ``i`` sits at position ``p = context_len + i``; ``k, v`` hold the keys of positions
    ``first_key .. first_key + kv_len - 1``. The query sees the keys ``j <= p`` (causal), and
    with a ``sliding_window`` ``W`` only those with ``p - W < j`` (every query must see at least
    one of the keys given). Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``
    (GQA). Float32 inside, result in ``q.dtype``: ``[q_len, num_heads, d]``.
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    qf = q.float().transpose(0, 1)                                    # [H, q_len, d]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)    # [H, kv_len, d]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (qf @ kf.transpose(1, 2)) * scale                        # [H, q_len, kv_len]
    q_pos = context_len + torch.arange(q.shape[0], device=q.device)[:, None]
    k_pos = first_key + torch.arange(k.shape[0], device=q.device)[None, :]
    hidden = k_pos > q_pos                                            # [q_len, kv_len]
    if sliding_window is not None:
        hidden |= k_pos <= q_pos - sliding_window                     # before the window
    scores = scores.masked_fill(hidden, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vf                          # [H, q_len, d]
    return out.transpose(0, 1).to(q.dtype)


def paged_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor | None = None,
                        scale: float | None = None, *,
                        sliding_window: int | None = None) -> torch.Tensor:
    """Paged attention, the spec: gather each sequence's K/V through its block table, then
    :func:`dense_attention`. ``query_start_loc=None`` means decode (one query per sequence).
    ``sliding_window``: ``None`` (full attention) or ``W >= 1`` (see the module docstring): the
    keys are gathered from the first one in the window of the sequence's first new token.
    Returns ``[num_tokens, num_heads, head_dim]`` in ``query.dtype``."""
    num_seqs = block_tables.shape[0]
    if query_start_loc is None:
        query_start_loc = torch.arange(num_seqs + 1)
    if scale is None:
        scale = query.shape[-1] ** -0.5
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    out = torch.empty_like(query)
    for s in range(num_seqs):
        q = query[starts[s]:starts[s + 1]]
        context_len = lens[s] - q.shape[0]
        first_key = 0 if sliding_window is None else max(0, context_len - sliding_window + 1)
        k, v = gather_kv(key_cache, value_cache, block_tables[s], lens[s], first_key)
        out[starts[s]:starts[s + 1]] = dense_attention(q, k, v, scale, context_len,
                                                       sliding_window=sliding_window,
                                                       first_key=first_key)
    return out


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                          validate: bool = True) -> None:
    """Write new ``key, value [num_tokens, num_kv_heads, head_dim]`` into the caches, in place:
    token ``t`` goes to slot ``slot_mapping[t]``; a negative slot (padding) is skipped.
    (``validate``: the backends' common signature; torch's indexing checks the slots.)"""
    block_size = key_cache.shape[1]
    slots = slot_mapping.to(key_cache.device).long()
    keep = slots >= 0
    slots = slots[keep]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[keep.to(key.device)].to(key_cache)
    value_cache[blocks, offsets] = value[keep.to(value.device)].to(value_cache)


def copy_blocks_ref(key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_mapping: torch.Tensor) -> None:
    """Copy-on-write copies, in place: for each row ``(src, dst)`` of ``block_mapping [n, 2]``,
    block ``dst`` becomes a copy of block ``src`` in both caches."""
    for src, dst in block_mapping.tolist():
        key_cache[dst] = key_cache[src]
        value_cache[dst] = value_cache[src]


def swap_blocks_ref(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Swap out / in, in place: for each ``(src_block, dst_block)`` row, copy ``src[src_block]``
    (e.g. a GPU cache) into ``dst[dst_block]`` (e.g. a CPU cache); devices may differ."""
    for s, d in block_mapping.tolist():
        dst[d].copy_(src[s])


def merge_attn_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                      lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint sets of keys into attention over their union.

    ``out_x [..., head_dim]`` is softmax-normalised over set x alone; ``lse_x [...]`` is
    ``log(sum(exp(scores)))`` over set x (natural log; ``-inf`` for an empty set). The union's
    output is the two outputs weighted by ``exp(lse_x - lse)``, where ``lse = logaddexp(lse_a,
    lse_b)``. Split-K decode merges its splits this way (in base 2).
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - safe).unsqueeze(-1)
    w_b = torch.exp(lse_b - safe).unsqueeze(-1)
    return w_a * out_a + w_b * out_b, lse
