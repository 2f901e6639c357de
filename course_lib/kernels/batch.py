"""Random paged batches for tests, notebooks and benchmarks: contiguous K/V scattered into pages.

:func:`make_paged_batch` first draws each sequence's keys and values as ordinary contiguous
tensors, then scatters them into a block pool through a randomly permuted block table. Every
slot no sequence owns (free blocks, the tail of each last block, the cache's spare blocks) is
filled with ``fill`` (NaN by default) and block-table entries past a sequence's last block hold
``-1``: a kernel that reads anything it should not returns NaN and fails its test.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..sizing.units import cdiv


class PagedBatch(NamedTuple):
    query: torch.Tensor            # [num_tokens, num_heads, head_dim], packed new tokens
    key_cache: torch.Tensor        # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor     # [num_seqs, max_blocks] int32, -1 past the last block
    seq_lens: torch.Tensor         # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    keys: list[torch.Tensor]       # per sequence, contiguous [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]

    @property
    def max_query_len(self) -> int:
        return int((self.query_start_loc[1:] - self.query_start_loc[:-1]).max())

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max())


def make_paged_batch(seq_lens: list[int], query_lens: list[int] | None = None, *,
                     num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 32,
                     block_size: int = 16, dtype: torch.dtype = torch.float32,
                     spare_blocks: int = 3, fill: float = float("nan"), seed: int = 0,
                     device: str | torch.device = "cpu") -> PagedBatch:
    """A batch of ``len(seq_lens)`` sequences; ``query_lens`` new tokens each (default 1:
    decode). Block numbers are a random permutation of the pool (``seed``)."""
    if not seq_lens:
        raise ValueError("seq_lens must list at least one sequence, got []")
    for name, value, low in (("num_heads", num_heads, 1), ("num_kv_heads", num_kv_heads, 1),
                             ("head_dim", head_dim, 1), ("block_size", block_size, 1),
                             ("spare_blocks", spare_blocks, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads must be a multiple of num_kv_heads={num_kv_heads} (GQA), "
                         f"got {num_heads}")
    if query_lens is None:
        query_lens = [1] * len(seq_lens)
    if len(query_lens) != len(seq_lens):
        raise ValueError(f"{len(seq_lens)} seq_lens but {len(query_lens)} query_lens")
    for n, q in zip(seq_lens, query_lens, strict=True):
        if not 1 <= q <= n:
            raise ValueError(f"need 1 <= query_len <= seq_len, got {q} and {n}")
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, fill, dtype=dtype)
    value_cache = torch.full(shape, fill, dtype=dtype)
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq)), -1, dtype=torch.int32)
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    keys, values = [], []
    for s, n in enumerate(seq_lens):
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        table = [pool.pop() for _ in range(blocks_per_seq[s])]
        block_tables[s, :len(table)] = torch.tensor(table, dtype=torch.int32)
        pos = torch.arange(n)
        blocks = torch.tensor(table, dtype=torch.long)[pos // block_size]
        key_cache[blocks, pos % block_size] = k
        value_cache[blocks, pos % block_size] = v
        keys.append(k)
        values.append(v)
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    query = torch.randn(int(qsl[-1]), num_heads, head_dim, generator=gen).to(dtype)
    move = [t.to(device) for t in (query, key_cache, value_cache, block_tables)]
    return PagedBatch(*move, torch.tensor(seq_lens, dtype=torch.int32, device=device),
                      qsl.to(device), [k.to(device) for k in keys],
                      [v.to(device) for v in values])
