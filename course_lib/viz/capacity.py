"""Figures and a widget for chapters 01 (KV-cache cost) and 08 (capacity planning).

Every number drawn here comes from course_lib.capacity; this module only lays it out. The
functions return matplotlib Figures (not pyplot state), so a notebook shows them as the cell's
value and a test can count their bars. The source-article audit table and the capacity explorer
widget are here too: both are displays of library results.
"""

from __future__ import annotations

import html
import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import ipywidgets as widgets
from matplotlib.figure import Figure

from course_lib import capacity as cap
from course_lib.capacity import GiB, KiB
from course_lib.claims import sources

ATTENTION_COLORS = {"MHA": "C3", "GQA": "C0", "MQA": "C2", "MLA": "C1"}


# ------------------------------------------------------ the source articles' audit as a table

@dataclass(frozen=True)
class ClaimsTable:
    """Source-article claims as a table: HTML in Jupyter, aligned text in print() and in
    nbval's text/plain."""

    rows: tuple[sources.SourceClaim, ...]

    _HEAD = ("article", "where", "claim", "article says", "course computes", "unit", "verdict")

    def _cells(self, c: sources.SourceClaim) -> tuple[str, ...]:
        show = sources._show  # the audit's own number formatting, shared with audit_table()
        return (sources.cite(c.source), c.where, c.claim, show(c.source_value),
                show(c.course_value), c.unit,
                c.verdict)

    def __str__(self) -> str:
        lines = []
        for c in self.rows:
            article, where, claim, said, computed, unit, verdict = self._cells(c)
            lines.append(f"[{c.key}] {verdict.upper()}: {article} {where}: {claim}")
            lines.append(f"    the article says {said} {unit}, "
                         f"the course computes {computed} {unit}")
            lines.append(f"    {c.explanation}")
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{h}</th>" for h in (*self._HEAD, "why"))
        body = []
        for c in self.rows:
            cells = (*self._cells(c), c.explanation)
            body.append("<tr>" + "".join(f"<td style='text-align:left'>{html.escape(x)}</td>"
                                         for x in cells) + "</tr>")
        return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def claims_table(keys: Iterable[str]) -> ClaimsTable:
    """The audited source-article claims with these keys, in the order given
    (ValueError if unknown)."""
    claims = {c.key: c for c in sources.audit()}
    keys = list(keys)
    unknown = [k for k in keys if k not in claims]
    if unknown:
        raise ValueError(f"unknown claim keys {unknown}; known: {sorted(claims)}")
    return ClaimsTable(tuple(claims[k] for k in keys))


# ---------------------------------------------------------------- chapter 01

def draw_kv_projections(num_steps: int) -> Figure:
    """K/V projections computed per decode step without a cache (t) and with one (1)."""
    cap._check_int("num_steps", num_steps, 1)
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


def draw_kv_bytes_per_token(specs: Sequence[cap.ModelSpec],
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
        ax.annotate(f"{spec.attention_type}\n{cap.format_bytes(value)}",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("KiB per token")
    ax.set_ylim(0, max(values) / KiB * 1.3)
    tp = f", TP={tensor_parallel_size} (per rank)" if tensor_parallel_size > 1 else ""
    ax.set_title(f"KV cache per token, all layers, 16-bit{tp}", fontsize=10)
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    return fig


def weights_kv_crossing_tokens(spec: cap.ModelSpec) -> int:
    """Fewest cached tokens whose KV cache outweighs the model's weights (TP=1)."""
    return spec.weight_bytes // cap.kv_bytes_per_token(spec) + 1


def draw_kv_vs_weights(specs: Sequence[cap.ModelSpec], max_tokens: int) -> Figure:
    """KV cache of 0..max_tokens cached tokens (lines) against each model's weights (dashed)."""
    cap._check_int("max_tokens", max_tokens, 1)
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


# ---------------------------------------------------------------- chapter 08

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


def draw_tp_sweep(specs: Sequence[cap.ModelSpec], tp_sizes: Sequence[int]) -> Figure:
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
    rows = []
    for bs in block_sizes:
        blocks = [cap.num_blocks_for_tokens(n, bs) for n in lengths]
        waste = [b * bs - n for b, n in zip(blocks, lengths, strict=True)]
        rows.append(BlockSizeRow(bs, sum(waste) / len(lengths),
                                 cap.expected_internal_waste_tokens(bs),
                                 cap.max_internal_waste_tokens(bs),
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


# ---------------------------------------------------------------- the capacity explorer

@dataclass(frozen=True)
class ExplorerState:
    """The explorer's inputs; plan() turns them into a KVBudget (or an error to show)."""

    preset: str = "llama-3-8b"
    total_gpu_memory_gib: float = 80.0
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    block_size: int = 16
    max_model_len: int = 8192

    def plan(self) -> cap.KVBudget:
        return cap.plan_kv_cache(cap.get_preset(self.preset), self.total_gpu_memory_gib,
                                 gpu_memory_utilization=self.gpu_memory_utilization,
                                 block_size=self.block_size,
                                 tensor_parallel_size=self.tensor_parallel_size)

    def max_model_len_warning(self) -> str:
        """'' when vLLM accepts max_model_len for this model; otherwise why it refuses
        (course_lib.capacity.verify_max_model_len)."""
        try:
            cap.verify_max_model_len(cap.get_preset(self.preset), self.max_model_len)
        except ValueError as exc:
            return f"warning: {exc}"
        return ""

    def summary(self) -> str:
        """vLLM-style sizing lines, or the library's error when the model does not fit; a
        last line warns when max_model_len is longer than the model allows."""
        try:
            text = self.plan().summary(self.max_model_len)
        except ValueError as exc:
            text = f"does not start: {exc}"
        warning = self.max_model_len_warning()
        return f"{text}\n{warning}" if warning else text


def figure_png(fig: Figure, dpi: int = 96) -> bytes:
    """PNG bytes of fig, without the Software tag (so bytes depend on the drawing only); at
    96 dpi a figure point is a CSS point at 100% zoom (``course_lib.viz.blocks.EXPLORER_DPI``)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()


def draw_explorer_state(state: ExplorerState) -> Figure:
    """The state's stacked budget bar; when the model does not fit, weights vs usable memory."""
    try:
        budget = state.plan()
    except ValueError:
        spec = cap.get_preset(state.preset)
        usable = state.total_gpu_memory_gib * state.gpu_memory_utilization
        fig = Figure(figsize=(7.5, 2.1))
        ax = fig.add_subplot()
        ax.barh(["weights per GPU", "usable"],
                [spec.weight_bytes / state.tensor_parallel_size / GiB, usable],
                color=["C3", "C0"])
        ax.set_xlabel("GiB")
        ax.set_title(f"{spec.name} at TP={state.tensor_parallel_size} does not fit", fontsize=10)
        fig.tight_layout()
        return fig
    return draw_memory_budget([(f"{budget.model.name} TP={state.tensor_parallel_size}", budget)])


class CapacityExplorer:
    """Dropdown and sliders over ExplorerState; the picture is a widgets.Image (PNG bytes).

    All state lives in self.state; widget callbacks only replace it and redraw, so a test can
    set a slider's value and read state, summary.value and image.value back.
    """

    def __init__(self, state: ExplorerState | None = None) -> None:
        self.state = state or ExplorerState()
        self.preset = widgets.Dropdown(options=[(s.name, k) for k, s in cap.PRESETS.items()],
                                       value=self.state.preset, description="model")
        self.memory = widgets.IntSlider(value=int(self.state.total_gpu_memory_gib), min=16,
                                        max=192, step=8, description="GPU GiB")
        self.utilization = widgets.FloatSlider(value=self.state.gpu_memory_utilization,
                                               min=0.5, max=1.0, step=0.01,
                                               description="utilization")
        self.tp = widgets.Dropdown(options=self._tp_options(self.state.preset),
                                   value=self.state.tensor_parallel_size, description="TP")
        self.block_size = widgets.Dropdown(options=[8, 16, 32], value=self.state.block_size,
                                           description="block_size")
        self.max_model_len = widgets.Dropdown(options=[2048, 4096, 8192, 32768, 131072],
                                              value=self.state.max_model_len,
                                              description="max_model_len")
        self.image = widgets.Image(format="png")
        self.summary = widgets.HTML()
        for w in (self.preset, self.memory, self.utilization, self.tp, self.block_size,
                  self.max_model_len):
            w.observe(self._on_change, names="value")
        self.widget = widgets.VBox([
            widgets.HBox([self.preset, self.tp, self.block_size]),
            widgets.HBox([self.memory, self.utilization, self.max_model_len]),
            self.image, self.summary])
        self._redraw()

    @staticmethod
    def _tp_options(preset: str) -> list[int]:
        return [t for t in cap._valid_tp_sizes(cap.get_preset(preset)) if t <= 16]

    def _on_change(self, change: dict) -> None:
        if change["owner"] is self.preset:
            options = self._tp_options(self.preset.value)
            tp = self.tp.value if self.tp.value in options else 1
            self.tp.unobserve(self._on_change, names="value")
            self.tp.options, self.tp.value = options, tp
            self.tp.observe(self._on_change, names="value")
        self.state = replace(self.state, preset=self.preset.value,
                             total_gpu_memory_gib=float(self.memory.value),
                             gpu_memory_utilization=round(self.utilization.value, 2),
                             tensor_parallel_size=self.tp.value,
                             block_size=self.block_size.value,
                             max_model_len=self.max_model_len.value)
        self._redraw()

    def _redraw(self) -> None:
        self.image.value = figure_png(draw_explorer_state(self.state))
        self.summary.value = f"<pre>{html.escape(self.state.summary())}</pre>"
