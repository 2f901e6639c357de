"""The one adapter between the model and the paged-KV kernels of :mod:`course_lib.kernels`.

Each attention layer of :class:`~course_lib.model.llama.TinyLlama` calls
:func:`paged_attention_layer` once per forward: it writes the new tokens' K/V into the layer's
paged cache (``reshape_and_cache``), then attends over each sequence's cached tokens through its
block table (``paged_attention``). Prefill, chunked prefill and decode are the same call; only
the metadata differ. Which kernels run is the
:class:`~course_lib.kernels.backends.AttentionBackend` the model resolved once
(``course_lib.kernels.backends``); this module only calls it.

A hybrid model (chapter 14) has several KV-cache groups, each with its own block table per
sequence over the one pool (``KVCacheManager.get_block_tables``): the metadata carry one block
table and one slot mapping per group, and each layer reads its group's and passes its own
sliding window to the kernels. vLLM 0.33.0 builds one metadata object per group instead
(from the group's block table and slot mapping) and hands it to each layer of the group by
name (``attn_metadata_dict[layer_name] = attn_metadata_i`` in
``vllm/v1/worker/gpu_model_runner.py``; ``ForwardContext.attn_metadata: dict[str,
AttentionMetadata]`` in ``vllm/forward_context.py``); the course, a declared choice, keeps one
object for the batch, whose group 0 is all a model of full attention only reads, unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
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

    * ``group_slot_mappings``: per KV-cache group, ``[num_tokens]``: the cache slot (``block *
      block_size + offset``) each new token's K/V is written to in that group's block; ``-1``
      means padding (not written). :attr:`slot_mapping` is group 0's.
    * ``group_block_tables``: per KV-cache group, ``[num_seqs, max_blocks]``: physical block of
      each logical block (a sliding-window group's leading entries may be the null block).
      :attr:`block_tables` is group 0's. A model of full attention only has one group.
    * ``seq_lens [num_seqs]``: tokens of each sequence in the cache after this step (cached
      context + new tokens).
    * ``query_start_loc [num_seqs + 1]``: prefix sums of the new-token counts.
    * ``max_query_len``, ``max_seq_len``: the longest of each, as host integers, so that no
      layer has to read them back from the device (a sync per layer on a GPU).

    :func:`make_attention_metadata` checks the batch once, on the host lists it is built from;
    each layer then calls the kernels without validating again.
    """

    group_slot_mappings: tuple[torch.Tensor, ...]
    group_block_tables: tuple[torch.Tensor, ...]
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int

    @property
    def slot_mapping(self) -> torch.Tensor:
        """Group 0's slot mapping ``[num_tokens]`` (the only one of a full-attention model)."""
        return self.group_slot_mappings[0]

    @property
    def block_tables(self) -> torch.Tensor:
        """Group 0's block tables ``[num_seqs, max_blocks]``."""
        return self.group_block_tables[0]

    @property
    def num_kv_cache_groups(self) -> int:
        return len(self.group_block_tables)

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
        return AttentionMetadata(tuple(t.to(device) for t in self.group_slot_mappings),
                                 tuple(t.to(device) for t in self.group_block_tables),
                                 self.seq_lens.to(device), self.query_start_loc.to(device),
                                 self.max_query_len, self.max_seq_len)


def make_attention_metadata(block_tables: list[list[int]], context_lens: list[int],
                            query_lens: list[int], block_size: int,
                            device: torch.device | str = "cpu",
                            num_blocks: int | None = None, *,
                            more_group_tables: Sequence[list[list[int]]] = ()
                            ) -> AttentionMetadata:
    """Metadata for a batch where sequence ``s`` already has ``context_lens[s]`` tokens cached
    and brings ``query_lens[s]`` new ones (prefill: context 0; decode: query 1).

    ``block_tables[s]`` must cover ``context_lens[s] + query_lens[s]`` tokens; rows are padded
    with ``-1`` to the longest. The new tokens' positions are ``context_len .. context_len +
    query_len - 1``; their slots come from the block table. ``num_blocks``: the cache's size,
    when known, so that every block a sequence uses is checked to lie in ``0..num_blocks - 1``
    (the kernels do not check again). ``more_group_tables``: a hybrid model's KV-cache groups
    1, 2, ... (chapter 14), each one table per sequence like ``block_tables`` (group 0's),
    checked the same way; each group gets its own slot mapping. Raises ``ValueError`` naming
    the bad sequence.
    """
    if not len(block_tables) == len(context_lens) == len(query_lens):
        raise ValueError(f"one block table, context_len and query_len per sequence, got "
                         f"{len(block_tables)}, {len(context_lens)}, {len(query_lens)}")
    if not block_tables:
        raise ValueError("empty batch: need at least one sequence")
    for ctx, q in zip(context_lens, query_lens, strict=True):
        if ctx < 0 or q < 1:
            raise ValueError(f"need context_len >= 0 and query_len >= 1, got {ctx}, {q}")
    for g, tables in enumerate(more_group_tables, start=1):
        if len(tables) != len(block_tables):
            raise ValueError(f"KV-cache group {g}: one block table per sequence, got "
                             f"{len(tables)} for {len(block_tables)} sequences")
    slot_mappings, padded_tables = [], []
    for tables in (block_tables, *more_group_tables):
        slots, padded = _slots_and_tables(tables, context_lens, query_lens, block_size,
                                          num_blocks)
        slot_mappings.append(torch.tensor(slots, dtype=torch.int64, device=device))
        padded_tables.append(torch.tensor(padded, dtype=torch.int32, device=device))
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    i32 = dict(dtype=torch.int32, device=device)
    return AttentionMetadata(
        group_slot_mappings=tuple(slot_mappings), group_block_tables=tuple(padded_tables),
        seq_lens=torch.tensor([c + q for c, q in zip(context_lens, query_lens, strict=True)],
                              **i32),
        query_start_loc=torch.tensor(starts, **i32), max_query_len=max(query_lens),
        max_seq_len=max(c + q for c, q in zip(context_lens, query_lens, strict=True)))


def _slots_and_tables(block_tables: list[list[int]], context_lens: list[int],
                      query_lens: list[int], block_size: int, num_blocks: int | None
                      ) -> tuple[list[int], list[list[int]]]:
    """One group's slot mapping (the new tokens' slots, from their blocks) and its block
    tables padded with ``-1`` to the longest; ``ValueError`` for a block out of range."""
    slots: list[int] = []
    for table, ctx, q in zip(block_tables, context_lens, query_lens, strict=True):
        used = table[:cdiv(ctx + q, block_size)] if block_size >= 1 else table
        if any(b < 0 or (num_blocks is not None and b >= num_blocks) for b in used):
            valid = "0.." + (str(num_blocks - 1) if num_blocks is not None else "")
            raise ValueError(f"block table {table}: the blocks of its {ctx + q} tokens must be "
                             f"in {valid}, got {used}")
        slots += slot_mapping(table, list(range(ctx, ctx + q)), block_size)
    width = max(len(t) for t in block_tables)
    return slots, [list(t) + [-1] * (width - len(t)) for t in block_tables]


def paged_attention_layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          key_cache: torch.Tensor, value_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float, attn: AttentionBackend,
                          kv_cache_group_id: int = 0,
                          sliding_window: int | None = None) -> torch.Tensor:
    """Write ``k, v [num_tokens, num_kv_heads, head_dim]`` into the caches, then attend, with
    the backend's kernels, through the block tables of the layer's KV-cache group
    (``kv_cache_group_id``; 0 for a model of full attention only). ``sliding_window``: None
    (full attention) or the layer's window ``W`` (the query at ``p`` sees keys ``p - W < j <=
    p``; table entries wholly before the window of a sequence's first new token may be the
    null block: the kernels never read them). ``q [num_tokens, num_heads, head_dim]``; caches
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` (modified in place). Returns
    ``[num_tokens, num_heads, head_dim]``."""
    slot_mapping = meta.group_slot_mappings[kv_cache_group_id]        # [num_tokens]
    block_tables = meta.group_block_tables[kv_cache_group_id]         # [num_seqs, max_blocks]
    # no device reads here: make_attention_metadata checked the batch once for every layer
    attn.reshape_and_cache(k, v, key_cache, value_cache, slot_mapping, validate=False)
    options = dict(max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
                   validate=False)
    if sliding_window is not None:      # a full-attention layer calls the kernels as before
        options["sliding_window"] = sliding_window
    return attn.paged_attention(q, key_cache, value_cache, block_tables, meta.seq_lens,
                                meta.query_start_loc, scale, **options)
