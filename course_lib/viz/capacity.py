"""Chapter 01's figures: what a KV cache costs, per token and against the weights.

Every number drawn here comes from course_lib.capacity; this module only lays it out. The
functions return matplotlib Figures (not pyplot state), so a notebook shows them as the cell's
value and a test can count their bars. The capacity views of the other chapters have modules of
their own: the source-article audit table (``viz/claims_table.py``), chapter 08's figures
(``viz/capacity_planning.py``) and its capacity explorer widget (``viz/capacity_explorer.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure

from course_lib import capacity as cap
from course_lib.sizing.models import ModelSpec
from course_lib.sizing.units import GiB, KiB, check_int, format_bytes

ATTENTION_COLORS = {"MHA": "C3", "GQA": "C0", "MQA": "C2", "MLA": "C1"}


def draw_kv_projections(num_steps: int) -> Figure:
    """K/V projections computed per decode step without a cache (t) and with one (1)."""
    check_int("num_steps", num_steps, 1)
    steps = list(range(1, num_steps + 1))
    fig = Figure(figsize=(7.5, 3))
    left, right = fig.subplots(1, 2)
    left.bar([s - 0.2 for s in steps], steps, width=0.4, color="C3", label="no cache")
    left.bar([s + 0.2 for s in steps], [1] * num_steps, width=0.4, color="C0", label="cache")
    left.set(xlabel="decode step t", ylabel="K/V projections this step",
             title="per step: t vs 1")
    left.legend(fontsize=8)
    right.plot(steps, [s * (s + 1) // 2 for s in steps], "o-", color="C3", label="no cache")
    right.plot(steps, steps, "o-", color="C0", label="cache")
    right.set(xlabel="tokens generated n", ylabel="total projections",
              title="total: n(n+1)/2 vs n")
    right.legend(fontsize=8)
    fig.tight_layout()
    return fig


def draw_kv_bytes_per_token(specs: Sequence[ModelSpec],
                            tensor_parallel_size: int = 1) -> Figure:
    """One bar per model: KV-cache bytes per token (one rank), coloured by attention type."""
    if not specs:
        raise ValueError("specs must name at least one model")
    values = [cap.kv_bytes_per_token(s, tensor_parallel_size) for s in specs]
    fig = Figure(figsize=(7.5, 3.2))
    ax = fig.add_subplot()
    bars = ax.bar([s.name for s in specs], [v / KiB for v in values],
                  color=[ATTENTION_COLORS[s.attention_type] for s in specs])
    for bar, spec, value in zip(bars, specs, values, strict=True):
        ax.annotate(f"{spec.attention_type}\n{format_bytes(value)}",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("KiB per token")
    ax.set_ylim(0, max(values) / KiB * 1.3)
    tp = f", TP={tensor_parallel_size} (per rank)" if tensor_parallel_size > 1 else ""
    ax.set_title(f"KV cache per token, all layers, 16-bit{tp}", fontsize=10)
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    return fig


def weights_kv_crossing_tokens(spec: ModelSpec) -> int:
    """Fewest cached tokens whose KV cache outweighs the model's weights (TP=1)."""
    return spec.weight_bytes // cap.kv_bytes_per_token(spec) + 1


def draw_kv_vs_weights(specs: Sequence[ModelSpec], max_tokens: int) -> Figure:
    """KV cache of 0..max_tokens cached tokens (lines) against each model's weights (dashed)."""
    check_int("max_tokens", max_tokens, 1)
    if not specs:
        raise ValueError("specs must name at least one model")
    fig = Figure(figsize=(7.5, 3.6))
    ax = fig.add_subplot()
    for i, spec in enumerate(specs):
        color = f"C{i}"
        kv_end = cap.contiguous_kv_bytes(spec, max_tokens) / GiB
        ax.plot([0, max_tokens], [0, kv_end], color=color, label=f"{spec.name} KV cache")
        ax.axhline(spec.weight_bytes / GiB, color=color, linestyle="--", linewidth=1)
        cross = weights_kv_crossing_tokens(spec)
        if cross <= max_tokens:
            ax.plot([cross], [spec.weight_bytes / GiB], "o", color=color)
            right = cross > 0.7 * max_tokens  # keep the label inside the axes
            ax.annotate(f"{cross:,} tokens", (cross, spec.weight_bytes / GiB),
                        textcoords="offset points", xytext=(-6 if right else 6, 8 + 10 * i),
                        ha="right" if right else "left", fontsize=8, color=color,
                        bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
    top = 2.5 * max(s.weight_bytes for s in specs) / GiB
    ax.set(xlabel="tokens in the cache (all requests together)", ylabel="GiB",
           xlim=(0, max_tokens), ylim=(0, top))
    ax.xaxis.set_major_formatter(lambda v, _: f"{v / 1000:,.0f}K")
    ax.set_title("KV cache grows with tokens; weights (dashed) do not", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
