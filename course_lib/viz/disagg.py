"""Chapter 13's pictures of prefill/decode disaggregation.

* :func:`draw_request_path`: one request's path across the processes of a
  :class:`~course_lib.parallel.disagg.DisaggCluster` (a lane per process, the proxy's
  included), from its :meth:`~course_lib.parallel.disagg.DisaggCluster.timeline`.
* :func:`draw_deployments`: the model-free replay's figures
  (:mod:`course_lib.sim.disagg_replay`): TTFT, ITL and goodput of each deployment, one
  column of panels per workload.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from ..parallel.disagg import Hop
from ..sim.disagg_replay import SLO, DeploymentResult

LANE_COLORS = {"proxy": "#636363", "prefill": "#3182bd", "decode": "#e6550d"}


def _lane_color(lane: str) -> str:
    return LANE_COLORS[lane.split()[0]]


def _messages(hops: Sequence[Hop]) -> list[tuple[int, int]]:
    """(from, to) indices of the moments a message joins: the proxy's sends to an engine, a
    prefill engine's answer to the proxy, the decode side's read request, the blocks sent."""
    def next_on(i: int, ok) -> int | None:
        return next((j for j in range(i + 1, len(hops)) if ok(hops[j])), None)

    pairs = []
    for i, h in enumerate(hops):
        j = None
        if h.where == "proxy" and h.what.startswith("sent to "):
            lane = h.what.removeprefix("sent to ")
            j = next_on(i, lambda g, lane=lane: g.where == lane)
        elif h.what.startswith("prefill done"):
            j = next_on(i, lambda g: g.where == "proxy")
        elif h.what == "read request":
            j = next_on(i, lambda g: g.where.startswith("prefill") and g.what == "send")
        elif h.what == "send":
            j = next_on(i, lambda g: g.where.startswith("decode")
                        and g.what in ("loaded", "load failed"))
        if j is not None:
            pairs.append((i, j))
    return pairs


def draw_request_path(hops: Sequence[Hop], title: str = "one request across the processes"
                      ) -> Figure:
    """A lane per process the request touched (proxy on top, then the prefill engines, then
    the decode engines), a numbered dot per moment, times in milliseconds from its first
    moment; the moments are listed by number under the lanes (close moments would hide each
    other's labels). Arrows are the messages between them: the proxy's requests and the
    prefill engine's answer, the decode side's read request, the blocks."""
    if not hops:
        raise ValueError("no moments to draw: pass cluster.timeline(request_id)")
    hops = sorted(hops, key=lambda h: h.t)
    order = {"proxy": 0, "prefill": 1, "decode": 2}
    lanes = sorted({h.where for h in hops}, key=lambda w: (order[w.split()[0]], w))
    y = {w: len(lanes) - 1 - i for i, w in enumerate(lanes)}
    t0 = hops[0].t
    rows = -(-len(hops) // 2)                      # the list: two columns
    list_in, plot_in = 0.2 * rows + 0.75, 0.8 * len(lanes) + 0.5    # inches: list, lanes
    height = list_in + plot_in + 0.45
    fig = Figure(figsize=(9.3, height))
    ax = fig.subplots()
    fig.subplots_adjust(left=0.12, right=0.97, bottom=list_in / height, top=1 - 0.45 / height)
    for n, h in enumerate(hops, 1):
        x = (h.t - t0) * 1e3
        ax.plot([x], [y[h.where]], "o", color=_lane_color(h.where), ms=7, zorder=3)
        ax.annotate(str(n), (x, y[h.where]), xytext=(0, 7 if n % 2 else -14),
                    textcoords="offset points", fontsize=9, ha="center")
    for i, j in _messages(hops):
        ax.annotate("", xy=((hops[j].t - t0) * 1e3, y[hops[j].where]),
                    xytext=((hops[i].t - t0) * 1e3, y[hops[i].where]),
                    arrowprops={"arrowstyle": "->", "color": "#999999", "lw": 0.8})
    ax.set_yticks(list(y.values()), list(y.keys()), fontsize=9)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    span = max((hops[-1].t - t0) * 1e3, 1.0)
    ax.set_xlim(-0.04 * span, 1.04 * span)
    ax.set_xlabel("milliseconds since the proxy sent it", fontsize=9)
    ax.tick_params(axis="x", labelsize=9)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", lw=0.3)
    lines = [f"{n}. {h.where}: {h.what} ({(h.t - t0) * 1e3:.0f} ms)"
             for n, h in enumerate(hops, 1)]
    for col in range(2):
        fig.text(0.04 + 0.48 * col, 0.02, "\n".join(lines[col * rows:(col + 1) * rows]),
                 fontsize=9, va="bottom", ha="left")
    return fig


def draw_deployments(results: dict[str, Sequence[DeploymentResult]], slo: SLO) -> Figure:
    """Per workload (a column), per deployment (a bar): TTFT mean and p99, ITL mean and p99
    (log scales: they span decades), and goodput under ``slo`` (requests meeting it per
    second), each bar labelled with the share of requests that met it."""
    if not results:
        raise ValueError("no results to draw")
    fig = Figure(figsize=(9.3, 6.6))
    axes = fig.subplots(3, len(results), squeeze=False)
    for col, (workload, rows) in enumerate(results.items()):
        names = [r.name for r in rows]
        xs = range(len(rows))
        s = [r.summary(slo) for r in rows]
        panels = (("TTFT (s)", "ttft_mean_s", "ttft_p99_s", 1.0),
                  ("ITL (ms)", "itl_mean_s", "itl_p99_s", 1e3))
        for row, (label, mean, p99, scale) in enumerate(panels):
            ax = axes[row][col]
            ax.bar([x - 0.2 for x in xs], [v[mean] * scale for v in s], 0.4, label="mean",
                   color="#9ecae1")
            ax.bar([x + 0.2 for x in xs], [v[p99] * scale for v in s], 0.4, label="p99",
                   color="#08519c")
            ax.set_ylabel(label, fontsize=9)
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.set_xticks(list(xs), [""] * len(rows))
            ax.tick_params(labelsize=9)
            if row == 0:
                ax.set_title(workload, fontsize=10)
                ax.legend(fontsize=9)
        ax = axes[2][col]
        good = [r.goodput(slo) for r in rows]
        ax.bar(list(xs), good, color="#31a354")
        for x, r, g in zip(xs, rows, good, strict=True):
            ax.annotate(f"{r.slo_attainment(slo):.0%}", (x, g), xytext=(0, 2),
                        textcoords="offset points", ha="center", fontsize=9)
        ax.set_ylim(0, 1.2 * max(good + [1e-9]))
        ax.set_ylabel("goodput (req/s)", fontsize=9)
        ax.set_xticks(list(xs), names, fontsize=9)
        ax.tick_params(labelsize=9)
    fig.tight_layout()
    return fig
