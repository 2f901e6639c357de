"""One context-parallel rank's paged KV cache: its own block manager and K/V tensors.

A rank holds only *its* tokens of a sequence (which ones is the placement's business, see
:mod:`course_lib.parallel.cp_decode`), in the vLLM layout of chapter 04: ``key_cache`` and
``value_cache`` of ``[num_blocks, block_size, num_kv_heads, head_dim]``, addressed through the
sequence's block table from a :class:`~course_lib.memory.v0.manager.BlockManager`
(chapter 03). Writing uses
the kernels' ``reshape_and_cache`` reference, reading their ``gather_kv``; attention over the
rank's tokens returns the partial output *and* its log-sum-exp, for the merge.
"""

from __future__ import annotations

import torch

from course_lib.kernels.reference import gather_kv, reshape_and_cache_ref
from course_lib.memory.common import AllocStatus
from course_lib.memory.v0.manager import BlockManager
from course_lib.parallel.merge import partial_attention


class RankKVCache:
    """One rank's paged KV cache: a block manager plus its K/V tensors, for its tokens only.

    ``positions[seq_id]`` lists the global positions this rank holds, in the order they were
    stored (local token i of the block table is global position ``positions[seq_id][i]``).
    Decode attention needs no positions (the new token sees every cached token), but a
    prefill would, for its causal mask.
    """

    def __init__(self, num_kv_heads: int, head_dim: int, block_size: int, num_gpu_blocks: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 rank: int = 0) -> None:
        self.rank = rank
        self.manager = BlockManager(block_size, num_gpu_blocks, watermark=0.0)
        shape = (num_gpu_blocks, block_size, num_kv_heads, head_dim)
        self.key_cache = torch.zeros(shape, dtype=dtype, device=device)    # [blocks, bs, kvh, d]
        self.value_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.positions: dict[int, list[int]] = {}

    def num_tokens(self, seq_id: int) -> int:
        return len(self.positions.get(seq_id, ()))

    def append(self, seq_id: int, positions: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the K/V ``[n, num_kv_heads, head_dim]`` of tokens at ``positions`` (may be [])."""
        if not positions:
            return
        # every check before the block manager allocates: a failed append changes nothing
        row = tuple(self.key_cache.shape[2:])
        if len(positions) != k.shape[0] or k.shape != v.shape or tuple(k.shape[1:]) != row:
            raise ValueError(f"{len(positions)} positions need k and v of [{len(positions)}, "
                             f"{row[0]}, {row[1]}], got {tuple(k.shape)} and {tuple(v.shape)}")
        bad = [p for p in positions if isinstance(p, bool) or not isinstance(p, int) or p < 0]
        if bad:
            raise ValueError(f"positions must be integers >= 0, got {bad}")
        old = self.num_tokens(seq_id)
        m = self.manager
        if old == 0:
            if m.can_allocate(len(positions)) != AllocStatus.OK:
                raise ValueError(self._full(seq_id, len(positions)))
            m.allocate(seq_id, positions)
        else:
            if not m.can_append_slots(seq_id, len(positions)):
                raise ValueError(self._full(seq_id, len(positions)))
            m.append_slots(seq_id, positions)      # no forks here, so never a CoW copy
        self.positions.setdefault(seq_id, []).extend(positions)
        slots = torch.tensor(m.get_table(seq_id).slot_mapping(old), device=k.device)
        reshape_and_cache_ref(k, v, self.key_cache, self.value_cache, slots)

    def _full(self, seq_id: int, n: int) -> str:
        m = self.manager
        return (f"rank {self.rank}: no room for {n} more tokens of seq {seq_id} "
                f"({self.num_tokens(seq_id)} held, {m.num_free_gpu_blocks} of "
                f"{m.num_gpu_blocks} blocks of {m.block_size} free); add context-parallel "
                "ranks or blocks")

    def local_kv(self, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's K and V of the sequence, ``[n_local, num_kv_heads, head_dim]`` each."""
        n = self.num_tokens(seq_id)
        if n == 0:
            empty = self.key_cache.new_zeros(0, *self.key_cache.shape[2:])
            return empty, empty.clone()
        table = torch.tensor(self.manager.get_block_table(seq_id))
        return gather_kv(self.key_cache, self.value_cache, table, n)

    def partial(self, seq_id: int, q: torch.Tensor, scale: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of ``q [num_heads, head_dim]`` over this rank's tokens: ``(out, lse)``."""
        k, v = self.local_kv(seq_id)
        return partial_attention(q, k, v, scale)

    def free(self, seq_id: int) -> None:
        if self.positions.pop(seq_id, None) is not None:
            self.manager.free(seq_id)

    def check_invariants(self) -> None:
        self.manager.check_invariants()
        for seq_id, pos in self.positions.items():
            assert self.manager.get_table(seq_id).num_tokens == len(pos), (
                f"rank {self.rank}: seq {seq_id} has {len(pos)} positions but its block table "
                f"holds {self.manager.get_table(seq_id).num_tokens} tokens")
