"""The published numbers chapter 02 checks, beside what our simulation measures.

Two sources: the vLLM paper (Kwon et al., SOSP 2023: Fig. 2's share of KV memory holding
token states, OPT-13B on an A100-40GB over a ShareGPT trace, and the average batch sizes it
reports on ShareGPT), and the source articles' fragmentation ranges (not in
``course_lib.claims.sources``, which holds the capacity arithmetic; its static-vs-paged entry
``001-static`` is reused as is). Each row keeps the published range and our value apart: we
never tune the simulation to a row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from course_lib import capacity as cap
from course_lib.claims.sources_claim import cite
from course_lib.sim.static import POLICIES, MemoryTimeline, simulate_paged, simulate_static
from course_lib.sim.traces import TraceRequest
from course_lib.sizing.models import ModelSpec

# The vLLM paper's Fig. 2 setting: OPT-13B on one A100-40GB. num_params is approximate.
OPT_13B = ModelSpec("OPT-13B", num_layers=40, num_attention_heads=40, num_kv_heads=40,
                        head_dim=128, num_params=12_850_000_000)


def paper_kv_budget(gpu_gib: float = 40.0, gpu_memory_utilization: float = 0.9,
                    block_size: int = 16) -> cap.KVBudget:
    """OPT-13B's KV budget on a 40 GiB GPU (weights only, no activation reserve): ~12 GiB,
    what the paper's Fig. 1 shows. ``.num_gpu_tokens`` is the slot count we simulate."""
    return cap.plan_kv_cache(OPT_13B, gpu_gib, gpu_memory_utilization=gpu_memory_utilization,
                             block_size=block_size)


# vLLM paper, Fig. 2 (only the numbers our issue quotes) and its ShareGPT batch sizes.
PAPER_TOKEN_STATES_PCT = {"Orca-Max": 20.4, "Orca-Oracle": 38.2, "paged (vLLM)": 96.3}
PAPER_BATCH_SIZE = {"Orca-Max": 7.0, "paged (vLLM)": 30.0}   # "about 7 vs about 30"


class Row(NamedTuple):
    source: str      # "paper", or a source article as cite() writes it
    claim: str
    published: str   # as published: a value or a range
    ours: str        # what the simulation gives, and on which system(s)


def run_systems(trace: Sequence[TraceRequest], total_slots: int, *, block_size: int = 16,
                max_model_len: int = 2048, step_time_s: float | None = None,
                watermark: float = 0.01) -> list[MemoryTimeline]:
    """Orca-Max, Orca-Pow2, Orca-Oracle and paging on the same trace and memory (slots; the
    paged pool gets total_slots // block_size blocks)."""
    out = [simulate_static(trace, total_slots, p, max_model_len=max_model_len,
                           step_time_s=step_time_s) for p in POLICIES]
    out.append(simulate_paged(trace, total_slots // block_size, block_size,
                              watermark=watermark, step_time_s=step_time_s))
    for tl in out:
        tl.check_invariants()
    return out


def _pct_range(values: Sequence[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{100 * lo:.1f}%" if lo == hi else f"{100 * lo:.1f}%-{100 * hi:.1f}%"


def comparison_rows(timelines: Sequence[MemoryTimeline]) -> list[Row]:
    """Published claims beside our measurements (the static systems are every timeline
    except the one named 'paged (vLLM)')."""
    by_name = {t.system: t for t in timelines}
    paged = by_name["paged (vLLM)"]
    static = [t for t in timelines if t is not paged]
    frac = {t.system: t.fractions() for t in timelines}
    states = [frac[t.system]["token_states"] for t in static]
    internal = [frac[t.system]["internal"] for t in static if t.system != "Orca-Oracle"]
    external = [frac[t.system]["external"] for t in static]
    ratio = paged.mean_batch_size() / by_name["Orca-Max"].mean_batch_size()
    paged_pct = _pct_range([frac[paged.system]["token_states"]])
    return [
        Row("paper", "KV memory holding token states, prior systems (Orca)", "20.4%-38.2%",
            f"{_pct_range(states)} ({', '.join(t.system for t in static)})"),
        Row("paper", "KV memory holding token states, paging", "96.3%",
            paged_pct),
        Row("paper", "mean batch size, Orca-Max vs paging (ShareGPT)", "about 7 vs about 30",
            f"{by_name['Orca-Max'].mean_batch_size():.1f} vs {paged.mean_batch_size():.1f}"),
        Row(cite("003", "§1"), "internal fragmentation wastes", "60%-80%",
            f"{_pct_range(internal)} of all KV memory (Orca-Max, Orca-Pow2)"),
        Row(cite("003", "§1"), "external fragmentation wastes", "20%-40%",
            f"{_pct_range(external)} (incl. free memory too small for the next request)"),
        Row(cite("003", "§1"), "utilization of traditional systems, 'measured by vLLM'",
            "20%-40%", _pct_range(states)),
        Row(cite("001"), "static allocation: utilization often below", "60%",
            f"{_pct_range(states)}: all below 60%" if max(states) < 0.6 else _pct_range(states)),
        Row(cite("003", "§6"), "memory utilization HF / FasterTransformer / vLLM",
            "20-40% / 30-50% / 95-98%",
            f"{_pct_range(states)} (Orca) / - / {paged_pct}"),
        Row(cite("003", "§6"), "max concurrent requests, vLLM over HF", "5-8x",
            f"{ratio:.1f}x (paging over Orca-Max, mean batch)"),
    ]


def format_rows(rows: Sequence[Row]) -> str:
    """The rows as a fixed-width text table (the notebook prints it)."""
    head = Row("source", "claim", "published", "our simulation")
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(4)]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()
             for r in (head, *rows)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
