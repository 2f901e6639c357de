"""Tile sizes for the paged-attention kernels, chosen by a small Python heuristic.

Why not ``triton.autotune``: its multi-config search crashes Triton's interpreter, and on a GPU
it would hide from a learner which tile actually ran. The rules here are few and printable:

* **GPU**: tiles of 64 KV tokens (``TILE_N``) keep a warp group busy and the loads wide;
  query heads that share a KV head are packed into the rows of one ``tl.dot`` (GQA), padded to
  16 rows (``tl.dot`` needs M >= 16 on NVIDIA GPUs). Decode splits each sequence's context over
  several programs (split-K, "flash-decoding") until the grid has about four programs per SM;
  with one split there is no reduce launch. ``python -m course_lib.kernels.aot`` compiles every
  choice for sm_90 and checks it (no spills, 16-byte async K/V copies, two K/V tiles in
  flight); ``bench/kernels.py --sweep`` measures the alternatives on a GPU.
* **Interpreter** (``TRITON_INTERPRET=1``, CPU): every ``tl`` operation is a numpy call, so the
  cost is the number of operations, not their size: one big tile of up to 128 tokens and no
  split. Loads are upcast to float32 (``UPCAST``) because the interpreter's bf16 dot products
  are wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from course_lib.sizing.units import cdiv, next_power_of_two


def dot_precision(dtype: torch.dtype) -> str:
    """``ieee`` for float32 inputs: the GPU default (tf32) would lose ~3 decimal digits."""
    return "ieee" if dtype == torch.float32 else "tf32"


@dataclass(frozen=True)
class DecodeTiles:
    """Launch configuration of the split-K decode kernel."""

    tile_n: int            # KV tokens per loop iteration
    head_pad: int          # head_dim rounded up to a power of two
    group_pad: int         # query heads per KV head, padded (rows of the dot)
    num_splits: int        # programs per (sequence, KV head) along the context
    tokens_per_split: int  # multiple of tile_n
    upcast: bool           # load in float32 (interpreter)
    num_warps: int = 4
    num_stages: int = 2

    @property
    def splits_pad(self) -> int:
        return next_power_of_two(self.num_splits)


@dataclass(frozen=True)
class PrefillTiles:
    """Launch configuration of the prefill (packed queries, causal) kernel."""

    block_m: int           # rows per program = query tokens x padded query heads
    group_pad: int         # padded query heads per KV head
    tile_n: int            # KV tokens per loop iteration
    head_pad: int
    upcast: bool
    num_warps: int = 4
    num_stages: int = 2

    @property
    def block_q(self) -> int:
        """Query tokens per program."""
        return self.block_m // self.group_pad


def decode_tiles(*, head_dim: int, group: int, max_seq_len: int, num_seqs: int,
                 num_kv_heads: int, interpreted: bool, num_sms: int = 132,
                 tile_n: int | None = None, num_warps: int = 4,
                 num_stages: int = 3) -> DecodeTiles:
    """Tiles for decode. ``group`` = num_heads // num_kv_heads; ``num_sms`` of the GPU.
    ``tile_n``, ``num_warps``, ``num_stages`` override the GPU defaults (``bench/kernels.py
    --sweep`` measures the alternatives); the split rule is the same for any of them."""
    head_pad = next_power_of_two(head_dim)
    if interpreted:
        tile_n = min(128, next_power_of_two(max(max_seq_len, 1)))
        return DecodeTiles(tile_n, head_pad, next_power_of_two(group), 1,
                           cdiv(max_seq_len, tile_n) * tile_n, upcast=True)
    head_pad = max(16, head_pad)  # tl.dot needs K >= 16 on a GPU
    if tile_n is None:
        tile_n = 64 if head_pad <= 128 else 32
    group_pad = max(16, next_power_of_two(group))
    tiles_per_seq = cdiv(max_seq_len, tile_n)
    programs = num_seqs * num_kv_heads
    # Enough programs for ~4 per SM (a small batch must still fill the GPU: 1 x 4096 tokens,
    # 8 KV heads -> 32 splits, 256 programs), but each split keeps >= 2 tiles of work (the
    # pipeline has two in flight), and <= 64 splits (the reduce reads every split).
    num_splits = max(1, min(64, cdiv(4 * num_sms, programs), tiles_per_seq // 2))
    tokens_per_split = cdiv(tiles_per_seq, num_splits) * tile_n
    num_splits = cdiv(max_seq_len, tokens_per_split)
    return DecodeTiles(tile_n, head_pad, group_pad, num_splits, tokens_per_split, upcast=False,
                       num_warps=num_warps, num_stages=num_stages)


def prefill_tiles(*, head_dim: int, group: int, max_query_len: int, max_seq_len: int,
                  interpreted: bool, dtype_bytes: int = 2) -> PrefillTiles:
    """Tiles for prefill: ``block_m`` rows hold ``block_q`` query tokens x all their heads.

    On a GPU a program holds its queries and accumulator (``block_m x head_pad`` each) in
    registers: float32 inputs (``dtype_bytes == 4``) double the bytes of Q, K and V, so they take
    narrower K/V tiles, and at head_dim 128 also 8 warps (with 4, registers spill: measured by
    ``python -m course_lib.kernels.aot``)."""
    head_pad = next_power_of_two(head_dim)
    group_pad = next_power_of_two(group)
    if interpreted:
        block_m = max(group_pad, min(128, group_pad * next_power_of_two(max(max_query_len, 1))))
        tile_n = min(128, next_power_of_two(max(max_seq_len, 1)))
        return PrefillTiles(block_m, group_pad, tile_n, head_pad, upcast=True)
    head_pad = max(16, head_pad)  # tl.dot needs K >= 16 on a GPU
    block_m = max(64, group_pad) if head_pad <= 128 else max(32, group_pad)
    row_bytes = head_pad * dtype_bytes
    if row_bytes >= 512:              # float32 x 128: 8 warps and 16-token tiles, else spills
        return PrefillTiles(block_m, group_pad, 16, head_pad, upcast=False, num_warps=8,
                            num_stages=2)
    tile_n = 64 if row_bytes <= 64 or (dtype_bytes == 2 and head_pad <= 64) else 32
    return PrefillTiles(block_m, group_pad, tile_n, head_pad, upcast=False, num_warps=4,
                        num_stages=2)
