"""Figures of a hybrid model's KV cache (chapters 01 and 08): bytes per layer, and the pool's
blocks and concurrency as the context grows, each against the same model with every layer full
attention.

Every number drawn comes from ``course_lib.sizing.hybrid``; this module only lays it out. The
functions return matplotlib Figures, so a notebook shows them as the cell's value and a test
can count their bars and read their lines.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from course_lib.sizing import hybrid
from course_lib.sizing.models import LAYER_TYPES, ModelSpec
from course_lib.sizing.units import MiB, check_int, format_bytes

LAYER_COLORS = dict(zip(LAYER_TYPES, ("C3", "C0", "C2", "C1"), strict=True))


def draw_layer_kv_bytes(spec: ModelSpec, num_tokens: int) -> Figure:
    """One bar per layer: the bytes it keeps for one sequence of num_tokens tokens, coloured by
    layer type; the dashed line is one full-attention layer's bytes."""
    check_int("num_tokens", num_tokens, 1)
    per_layer = hybrid.layer_kv_bytes(spec, num_tokens)
    full = hybrid.all_full_kv_bytes(spec, num_tokens) // spec.num_layers
    fig = Figure(figsize=(7.5, 3.2))
    ax = fig.add_subplot()
    types = spec.per_layer_types
    ax.bar(range(spec.num_layers), [b / MiB for b in per_layer],
           color=[LAYER_COLORS[t] for t in types])
    ax.axhline(full / MiB, color="C3", linestyle="--", linewidth=1)
    handles = [Patch(color=LAYER_COLORS[t], label=t) for t in dict.fromkeys(types)]
    handles.append(Line2D([], [], color="C3", linestyle="--", linewidth=1,
                          label=f"a full-attention layer: {format_bytes(full)}"))
    total, all_full = sum(per_layer), hybrid.all_full_kv_bytes(spec, num_tokens)
    ax.set_ylim(0, max(full, *per_layer) / MiB * 1.5)      # room for the legend on top
    ax.set(xlabel="layer", ylabel="MiB for one sequence",
           title=f"{spec.name}, {num_tokens:,} tokens: {format_bytes(total)} in all, "
                 f"{format_bytes(all_full)} if every layer were full")
    ax.title.set_fontsize(10)
    ax.legend(handles=handles, fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig


def draw_hybrid_capacity(capacities: Sequence[hybrid.HybridCapacity]) -> Figure:
    """For capacities of one model at several max_model_len: left, the pool bytes vLLM reserves
    per request (blocks x block bytes); right, the maximum concurrency; hybrid (solid) against
    every layer full attention (dashed)."""
    if not capacities:
        raise ValueError("capacities must hold at least one HybridCapacity")
    names = {c.grouping.model.name for c in capacities}
    if len(names) != 1:
        raise ValueError(f"capacities must all be of one model, got {sorted(names)}")
    lengths = [c.max_model_len for c in capacities]
    hybrid_bytes = [c.blocks_per_request * c.grouping.bytes_per_block / MiB for c in capacities]
    full_bytes = [c.all_full_blocks_per_request * c.all_full_bytes_per_block / MiB
                  for c in capacities]
    fig = Figure(figsize=(7.5, 3.2))
    left, right = fig.subplots(1, 2)
    left.plot(lengths, hybrid_bytes, "o-", color="C0", label="hybrid groups")
    left.plot(lengths, full_bytes, "o--", color="C3", label="every layer full")
    left.set(xscale="log", yscale="log", xlabel="max_model_len",
             ylabel="MiB reserved per request", title="one request")
    right.plot(lengths, [c.max_concurrency for c in capacities], "o-", color="C0",
               label="hybrid groups")
    right.plot(lengths, [c.all_full_max_concurrency for c in capacities], "o--", color="C3",
               label="every layer full")
    right.set(xscale="log", yscale="log", xlabel="max_model_len",
              ylabel="maximum concurrency", title="requests the pool holds")
    for ax in (left, right):
        ax.minorticks_off()
        ax.set_xticks(lengths, [f"{n / 1024:g}K" if n >= 1024 else str(n) for n in lengths])
        ax.title.set_fontsize(10)
        ax.legend(fontsize=8)
    fig.suptitle(f"{next(iter(names))}: {format_bytes(capacities[0].available_kv_bytes)} "
                 f"of KV cache", fontsize=10)
    fig.tight_layout()
    return fig
