"""Chapter 08's figures (capacity planning): where a GPU's memory goes, TP and block_size.

Every number drawn comes from ``course_lib.capacity``; this module only lays it out. One GPU's
budget cut into parts (``budget_parts``, ``draw_memory_budget``), per-rank bytes per token as TP
grows (``draw_tp_sweep``), and block_size's waste against block-table length
(``block_size_tradeoff``, ``draw_block_size_tradeoff``). Functions return matplotlib Figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from matplotlib.figure import Figure

from course_lib import capacity as cap
from course_lib.sizing.blocks import (
    expected_internal_waste_tokens,
    max_internal_waste_tokens,
    num_blocks_for_tokens,
)
from course_lib.sizing.models import ModelSpec
from course_lib.sizing.units import GiB, KiB

BUDGET_PARTS = ("weights", "activations", "overhead", "KV blocks", "left over",
                "not used (1 - utilization)")
BUDGET_COLORS = ("C7", "C4", "C5", "C0", "C8", "white")


def budget_parts(budget: cap.KVBudget) -> dict[str, int]:
    """One GPU's memory cut into BUDGET_PARTS, in bytes; they add up to the total."""
    usable = round(budget.total_gpu_memory_bytes * budget.gpu_memory_utilization)
    blocks = budget.num_gpu_blocks * budget.block_bytes
    values = (budget.weight_bytes, budget.activation_bytes, budget.overhead_bytes, blocks,
              budget.available_kv_bytes - blocks, budget.total_gpu_memory_bytes - usable)
    return dict(zip(BUDGET_PARTS, values, strict=True))


def draw_memory_budget(budgets: Sequence[tuple[str, cap.KVBudget]]) -> Figure:
    """One stacked bar per (label, budget): where each GPU's memory goes."""
    if not budgets:
        raise ValueError("budgets must hold at least one (label, KVBudget)")
    fig = Figure(figsize=(7.5, 1.2 + 0.9 * len(budgets)))
    ax = fig.add_subplot()
    labels = [label for label, _ in budgets]
    lefts = [0.0] * len(budgets)
    for part, color in zip(BUDGET_PARTS, BUDGET_COLORS, strict=True):
        sizes = [budget_parts(b)[part] / GiB for _, b in budgets]
        ax.barh(labels, sizes, left=lefts, color=color, edgecolor="black", linewidth=0.5,
                label=part)
        lefts = [a + b for a, b in zip(lefts, sizes, strict=True)]
    for y, (_, b) in enumerate(budgets):
        ax.annotate(f"{b.num_gpu_blocks:,} blocks", (lefts[y], y), xytext=(4, 0),
                    textcoords="offset points", va="center", fontsize=9.5)
    ax.invert_yaxis()
    ax.set_xlim(0, max(lefts) * 1.25)
    ax.set_xlabel("GiB on one GPU")
    ax.legend(fontsize=9, ncols=3, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout()
    return fig


def draw_tp_sweep(specs: Sequence[ModelSpec], tp_sizes: Sequence[int]) -> Figure:
    """Per-rank KV bytes per token as TP grows: GQA heads split (then replicate), MLA does not."""
    if not specs or not tp_sizes:
        raise ValueError("specs and tp_sizes must both be non-empty")
    fig = Figure(figsize=(7.5, 3.2))
    ax = fig.add_subplot()
    for i, spec in enumerate(specs):
        values = [cap.kv_bytes_per_token(spec, tp) / KiB for tp in tp_sizes]
        what = "one latent" if spec.is_mla else f"{spec.num_kv_heads} KV heads"
        ax.plot(tp_sizes, values, "os^vD"[i % 5] + "-", color=f"C{i}",
                label=f"{spec.name} ({spec.attention_type}, {what})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(tp_sizes), [str(t) for t in tp_sizes])
    ax.set(xlabel="tensor_parallel_size", ylabel="KiB per token per rank", ylim=(0, None))
    ax.set_title("What one rank caches per token", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


@dataclass(frozen=True)
class BlockSizeRow:
    """block_size's cost on one sample of sequence lengths (see block_size_tradeoff)."""

    block_size: int
    mean_waste_tokens: float      # empty slots in the last block, averaged over sequences
    expected_waste_tokens: float  # (block_size - 1) / 2
    max_waste_tokens: int         # block_size - 1
    wasted_fraction: float        # empty slots / slots held
    mean_blocks_per_seq: float    # block-table entries per sequence


def block_size_tradeoff(lengths: Sequence[int], block_sizes: Sequence[int]) -> list[BlockSizeRow]:
    """Internal waste vs block-table length for each block size, measured on lengths."""
    if not lengths:
        raise ValueError("lengths must hold at least one sequence length")
    if not block_sizes:
        raise ValueError("block_sizes must hold at least one block size")
    if not any(lengths):
        raise ValueError(f"lengths must hold at least one length >= 1 (no token, no block, "
                         f"no waste ratio), got {list(lengths)}")
    rows = []
    for bs in block_sizes:
        blocks = [num_blocks_for_tokens(n, bs) for n in lengths]
        waste = [b * bs - n for b, n in zip(blocks, lengths, strict=True)]
        rows.append(BlockSizeRow(bs, sum(waste) / len(lengths),
                                 expected_internal_waste_tokens(bs),
                                 max_internal_waste_tokens(bs),
                                 sum(waste) / (sum(blocks) * bs), sum(blocks) / len(lengths)))
    return rows


def draw_block_size_tradeoff(rows: Sequence[BlockSizeRow]) -> Figure:
    """Two bar panels over block sizes: wasted slots per sequence, block-table entries."""
    if not rows:
        raise ValueError("rows must hold at least one BlockSizeRow")
    names = [str(r.block_size) for r in rows]
    xs = range(len(rows))
    fig = Figure(figsize=(7.5, 3))
    left, right = fig.subplots(1, 2)
    for dx, key, color, label in ((-0.27, "mean_waste_tokens", "C3", "measured mean"),
                                  (0.0, "expected_waste_tokens", "C7", "(block_size - 1) / 2"),
                                  (0.27, "max_waste_tokens", "white", "worst: block_size - 1")):
        left.bar([x + dx for x in xs], [getattr(r, key) for r in rows], width=0.27,
                 color=color, edgecolor="black", linewidth=0.5, label=label)
    left.set_xticks(list(xs), names)
    left.set(xlabel="block_size", ylabel="empty slots per sequence", title="internal waste")
    left.legend(fontsize=7)
    right.bar(names, [r.mean_blocks_per_seq for r in rows], color="C0")
    right.set(xlabel="block_size", ylabel="blocks per sequence", title="block-table entries")
    fig.tight_layout()
    return fig
