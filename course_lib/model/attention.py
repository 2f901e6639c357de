"""The one adapter between the model and the paged-KV kernels of :mod:`course_lib.kernels`.

Each attention layer of :class:`~course_lib.model.llama.TinyLlama` calls
:func:`paged_attention_layer` once per forward: it writes the new tokens' K/V into the layer's
paged cache (``reshape_and_cache``), then attends over each sequence's cached tokens through its
block table (``paged_attention``). Prefill, chunked prefill and decode are the same call; only
the metadata differ. Which kernels run is the
:class:`~course_lib.kernels.backends.AttentionBackend` the model resolved once
(``course_lib.kernels.backends``); this module only calls it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from course_lib.kernels.backends import AttentionBackend
from course_lib.kernels.reference import slot_mapping
from course_lib.sizing.units import cdiv


@dataclass
class AttentionMetadata:
    """Where the packed new tokens of one forward pass live in the paged cache.

    The batch packs ``num_tokens`` new tokens of ``num_seqs`` sequences; sequence ``s`` owns rows
    ``query_start_loc[s]:query_start_loc[s + 1]`` (vLLM's names and shapes).

    * ``slot_mapping [num_tokens]``: the cache slot (``block * block_size + offset``) each new
      token's K/V is written to; ``-1`` means padding (not written).
    * ``block_tables [num_seqs, max_blocks]``: physical block of each logical block.
    * ``seq_lens [num_seqs]``: tokens of each sequence in the cache after this step (cached
      context + new tokens).
    * ``query_start_loc [num_seqs + 1]``: prefix sums of the new-token counts.
    * ``max_query_len``, ``max_seq_len``: the longest of each, as host integers, so that no
      layer has to read them back from the device (a sync per layer on a GPU).

    :func:`make_attention_metadata` checks the batch once, on the host lists it is built from;
    each layer then calls the kernels without validating again.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    def last_token_indices(self) -> torch.Tensor:
        """Row of each sequence's last new token: where its next-token logits are."""
        return self.query_start_loc[1:].long() - 1

    def to(self, device: torch.device | str) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping.to(device), self.block_tables.to(device),
                                 self.seq_lens.to(device), self.query_start_loc.to(device),
                                 self.max_query_len, self.max_seq_len)


def make_attention_metadata(block_tables: list[list[int]], context_lens: list[int],
                            query_lens: list[int], block_size: int,
                            device: torch.device | str = "cpu",
                            num_blocks: int | None = None) -> AttentionMetadata:
    """Metadata for a batch where sequence ``s`` already has ``context_lens[s]`` tokens cached
    and brings ``query_lens[s]`` new ones (prefill: context 0; decode: query 1).

    ``block_tables[s]`` must cover ``context_lens[s] + query_lens[s]`` tokens; rows are padded
    with ``-1`` to the longest. The new tokens' positions are ``context_len .. context_len +
    query_len - 1``; their slots come from the block table. ``num_blocks``: the cache's size,
    when known, so that every block a sequence uses is checked to lie in ``0..num_blocks - 1``
    (the kernels do not check again). Raises ``ValueError`` naming the bad sequence.
    """
    if not len(block_tables) == len(context_lens) == len(query_lens):
        raise ValueError(f"one block table, context_len and query_len per sequence, got "
                         f"{len(block_tables)}, {len(context_lens)}, {len(query_lens)}")
    if not block_tables:
        raise ValueError("empty batch: need at least one sequence")
    slots: list[int] = []
    for table, ctx, q in zip(block_tables, context_lens, query_lens, strict=True):
        if ctx < 0 or q < 1:
            raise ValueError(f"need context_len >= 0 and query_len >= 1, got {ctx}, {q}")
        used = table[:cdiv(ctx + q, block_size)] if block_size >= 1 else table
        if any(b < 0 or (num_blocks is not None and b >= num_blocks) for b in used):
            valid = "0.." + (str(num_blocks - 1) if num_blocks is not None else "")
            raise ValueError(f"block table {table}: the blocks of its {ctx + q} tokens must be "
                             f"in {valid}, got {used}")
        slots += slot_mapping(table, list(range(ctx, ctx + q)), block_size)
    width = max(len(t) for t in block_tables)
    padded = [list(t) + [-1] * (width - len(t)) for t in block_tables]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    i32 = dict(dtype=torch.int32, device=device)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(padded, **i32),
        seq_lens=torch.tensor([c + q for c, q in zip(context_lens, query_lens, strict=True)],
                              **i32),
        query_start_loc=torch.tensor(starts, **i32), max_query_len=max(query_lens),
        max_seq_len=max(c + q for c, q in zip(context_lens, query_lens, strict=True)))


def paged_attention_layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          key_cache: torch.Tensor, value_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float,
                          attn: AttentionBackend) -> torch.Tensor:
    """Write ``k, v [num_tokens, num_kv_heads, head_dim]`` into the caches, then attend, with
    the backend's kernels. ``q [num_tokens, num_heads, head_dim]``; caches ``[num_blocks,
    block_size, num_kv_heads, head_dim]`` (modified in place). Returns ``[num_tokens,
    num_heads, head_dim]``."""
    # no device reads here: make_attention_metadata checked the batch once for every layer
    attn.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping, validate=False)
    return attn.paged_attention(q, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                                meta.query_start_loc, scale, max_query_len=meta.max_query_len,
                                max_seq_len=meta.max_seq_len, validate=False)
