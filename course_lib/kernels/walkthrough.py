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

Two helpers put the chapter's kernel beside vLLM's, with numbers:

* :func:`v0_decode_grid` / :func:`course_decode_grid` -- the programs a decode step launches:
  vLLM 0.6.3's CUDA kernels (``vllm/attention/ops/paged_attn.py`` picks v1 or v2: one thread
  block per (query head, sequence), and per 512-token partition in v2) and the course's
  Triton kernel (one program per (sequence, KV head, split)).
* :func:`block_table_costs` -- what the block table costs per decode step at each block size:
  lookups, the int32 table a step copies to the GPU, K/V bytes read, slots left empty.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from course_lib.kernels.tiles import decode_tiles
from course_lib.sizing.units import cdiv


def _num_logical_blocks(seq_len: int, block_size: int) -> int:
    return cdiv(seq_len, block_size)


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


# ------------------------------------------------------------------ kernel grids compared
V0_PARTITION_SIZE = 512   # vLLM 0.6.3 paged_attn.py: _PARTITION_SIZE, tokens per v2 program


class KernelGrid(NamedTuple):
    """The programs (CUDA thread blocks) one decode step launches for one layer."""

    kernel: str
    grid: tuple[int, ...]
    query_heads_per_program: int
    tokens_per_program: int       # at most: a program's slice of the longest context

    @property
    def programs(self) -> int:
        return math.prod(self.grid)


def v0_decode_grid(num_seqs: int, num_heads: int, max_seq_len: int) -> KernelGrid:
    """vLLM 0.6.3's choice between its two CUDA decode kernels (``PagedAttention
    .forward_decode``): v1, grid ``(num_heads, num_seqs, 1)``, when ``max_seq_len <= 8192``
    and either one partition suffices or ``num_seqs * num_heads > 512``; otherwise v2, grid
    ``(num_heads, num_seqs, partitions)`` plus a reduce kernel over the partitions."""
    partitions = cdiv(max_seq_len, V0_PARTITION_SIZE)
    if max_seq_len <= 8192 and (partitions == 1 or num_seqs * num_heads > 512):
        return KernelGrid("vLLM 0.6.3 paged_attention_v1", (num_heads, num_seqs, 1), 1,
                          max_seq_len)
    return KernelGrid("vLLM 0.6.3 paged_attention_v2", (num_heads, num_seqs, partitions), 1,
                      min(max_seq_len, V0_PARTITION_SIZE))


def course_decode_grid(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                       max_seq_len: int, num_sms: int = 132) -> KernelGrid:
    """The course's Triton decode kernel on a GPU with ``num_sms`` SMs (``tiles.decode_tiles``):
    grid ``(num_seqs, num_kv_heads, num_splits)``; a program serves its KV head's whole GQA
    group of query heads (plus a small log-sum-exp reduce kernel when it splits)."""
    t = decode_tiles(head_dim=head_dim, group=num_heads // num_kv_heads,
                     max_seq_len=max_seq_len, num_seqs=num_seqs, num_kv_heads=num_kv_heads,
                     interpreted=False, num_sms=num_sms)
    return KernelGrid("course paged_decode", (num_seqs, num_kv_heads, t.num_splits),
                      num_heads // num_kv_heads, min(max_seq_len, t.tokens_per_split))


# ---------------------------------------------------------------- block-table overhead
class BlockTableCost(NamedTuple):
    """One decode step of a batch at one block size."""

    block_size: int
    entries: int          # block-table entries the batch uses: sum of ceil(len / block_size)
    table_bytes: int      # int32 table of num_seqs rows x ceil(max_model_len / block_size)
    kv_bytes: int         # K/V bytes the step reads (every cached token, every layer)
    waste_fraction: float  # slots held but empty (the last block of each sequence)

    @property
    def table_to_kv(self) -> float:
        """Table bytes copied per step over K/V bytes read per step."""
        return self.table_bytes / self.kv_bytes


def block_table_costs(seq_lens: Sequence[int], block_sizes: Sequence[int],
                      kv_bytes_per_token: int, max_model_len: int) -> list[BlockTableCost]:
    """The block table's size against the K/V a decode step reads, per block size.

    The table a step hands the kernels is int32, one row per sequence, padded to
    ``ceil(max_model_len / block_size)`` columns (what vLLM V1's ``BlockTable`` keeps and
    copies to the GPU each step). ``kv_bytes_per_token``: all layers
    (``capacity.kv_bytes_per_token``)."""
    if not seq_lens or min(seq_lens) < 1:
        raise ValueError("seq_lens must hold at least one length, each >= 1")
    if max(seq_lens) > max_model_len:
        raise ValueError(f"a sequence is longer than max_model_len={max_model_len}")
    rows = []
    for bs in block_sizes:
        if bs < 1:
            raise ValueError(f"block sizes must be >= 1, got {bs}")
        entries = sum(cdiv(n, bs) for n in seq_lens)
        rows.append(BlockTableCost(bs, entries, 4 * len(seq_lens) * cdiv(max_model_len, bs),
                                   kv_bytes_per_token * sum(seq_lens),
                                   1 - sum(seq_lens) / (entries * bs)))
    return rows


def decode_kernel_loop() -> str:
    """The main loop of the Triton decode kernel, as written in ``paged_decode.py`` (read from
    the file, so it is the same text whether or not Triton is installed)."""
    from pathlib import Path

    lines = (Path(__file__).parent / "paged_decode.py").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if "page = load_pages(table, pos, pos < end"
                 in line)
    end = next(i for i in range(start, len(lines)) if lines[i].strip() == "m_i = m_new")
    body = lines[start - 1:end + 1]
    indent = min(len(line) - len(line.lstrip()) for line in body if line.strip())
    return "\n".join(line[indent:] for line in body)


def compiled_for_sm90(label: str) -> dict[str, str]:
    """The row of ``bench/results/aot_sm90.md`` (written by ``python -m course_lib.kernels.aot``)
    whose variant is ``label``, as {column: value}."""
    from pathlib import Path

    table = Path(__file__).resolve().parents[2] / "bench" / "results" / "aot_sm90.md"
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in table.read_text().splitlines() if line.startswith("|")]
    header = rows[0]
    for row in rows[2:]:
        if row[0] == label:
            return dict(zip(header, row, strict=True))
    raise KeyError(f"no variant {label!r} in {table}")
