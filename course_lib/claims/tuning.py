"""Chapter 07's checks of the source articles: the tuning table, metric names, defaults.

* The tuning table of the "Block Manager tutorial" (§13.3), each row replayed: symptom, fix.
  Every row is a small trace and a configuration that produces the row's symptom, and the
  configuration the row recommends. :func:`run_row` replays both and reports the signals a
  person would read off the metrics (``symptoms``). The traces are chosen to show the
  symptom; the numbers are what our cost model gives for them, not measurements of a GPU.
  The "high TTFT + normal ITL" row's other remedy, prefill/decode disaggregation, needs more
  GPUs than a row's one engine: ``course_lib.sim.disagg_replay`` replays it against colocated
  serving on the same GPUs (chapter 13, ``bench/disagg.py``).
* :func:`audit_metric_names`: the Prometheus names the articles tell you to watch, looked up in
  the collectors the course exports with vLLM V0's and V1's names.
* :func:`vllm_scheduler_defaults` and :func:`vllm_preemption_mode`: what vLLM 0.6.3 (V0) and
  0.33.0 (V1) pick when you set nothing, read from their sources.
* :func:`batching_before_paging`: continuous batching with contiguous reservations (Orca)
  against the same trace on a paged pool.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..config import CacheConfig, SchedulerConfig
from ..scheduler.metrics import Metrics
from ..scheduler.scheduler import Scheduler
from ..scheduler.v1 import SchedulerV1
from ..sim.replay import ReplayResult, replay
from ..sim.static import MemoryTimeline, simulate_paged, simulate_static
from ..sim.traces import TraceRequest, few_shot, sharegpt_like
from .sources_claim import cite


def symptoms(r: ReplayResult) -> dict[str, float]:
    """What the metrics show: cache usage (mean, and share of steps above 90%), preemptions,
    TTFT and inter-token latency (p50, p99), throughput."""
    busy = [s for s in r.steps if s.num_seqs]
    return {
        "cache_usage_mean": sum(s.gpu_block_usage for s in busy) / len(busy),
        "steps_over_90pct": sum(s.gpu_block_usage > 0.9 for s in busy) / len(busy),
        "preemptions": r.num_preemptions,
        "rejected": r.num_ignored,
        "ttft_mean_s": r.ttft_mean,
        "ttft_p99_s": r.ttft_p99,
        "itl_p50_s": r.itl_percentile(50),
        "itl_p99_s": r.itl_percentile(99),
        "throughput_tok_s": r.throughput_tokens_s,
    }


@dataclass(frozen=True)
class TuningRow:
    symptom: str
    diagnosis: str
    tuning: str
    trace: Callable[[], list[TraceRequest]]
    before: tuple[SchedulerConfig, CacheConfig]
    after: dict[str, tuple[SchedulerConfig, CacheConfig]]   # name -> tuned configuration
    watch: tuple[str, ...]                                    # the signals that tell the story


ROWS: tuple[TuningRow, ...] = (
    TuningRow("cache usage > 90% + frequent preemption",
              "too many sequences, or too long ones, for the KV cache",
              "lower max-model-len, or add GPUs (more KV memory)",
              lambda: sharegpt_like(300, seed=1, rate=8.0),
              (SchedulerConfig(), CacheConfig(num_gpu_blocks=800)),
              {"max_model_len 1024": (SchedulerConfig(max_model_len=1024),
                                      CacheConfig(num_gpu_blocks=800)),
               "2x GPU blocks": (SchedulerConfig(), CacheConfig(num_gpu_blocks=1600))},
              ("steps_over_90pct", "preemptions", "rejected", "ttft_p99_s")),
    TuningRow("cache usage < 50% + high latency",
              "prefill is too slow: too few prompt tokens per step",
              "chunked prefill with a larger max-num-batched-tokens",
              lambda: few_shot(200, seed=5, rate=6.0, num_tasks=1000, num_examples=8,
                               example_len=150, output_len=64),
              (SchedulerConfig(max_num_batched_tokens=128), CacheConfig(num_gpu_blocks=4000)),
              {"max_num_batched_tokens 2048": (SchedulerConfig(max_num_batched_tokens=2048),
                                               CacheConfig(num_gpu_blocks=4000))},
              ("cache_usage_mean", "ttft_mean_s", "ttft_p99_s", "itl_p99_s")),
    TuningRow("high TTFT + normal ITL",
              "requests queue for prefill",
              "prefix caching (or prefill/decode disaggregation: chapter 13 replays it)",
              lambda: few_shot(300, seed=3, rate=5.0, num_examples=8, example_len=200,
                               output_len=32),
              (SchedulerConfig(max_num_batched_tokens=512), CacheConfig(num_gpu_blocks=4000)),
              {"prefix caching": (SchedulerConfig(max_num_batched_tokens=512),
                                  CacheConfig(num_gpu_blocks=4000,
                                              enable_prefix_caching=True))},
              ("ttft_mean_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")),
    TuningRow("jittery ITL",
              "the decode batch size swings with the load",
              "limit max-num-seqs (smoother steps, longer queue)",
              lambda: sharegpt_like(300, seed=4),
              (SchedulerConfig(max_num_seqs=256), CacheConfig(num_gpu_blocks=4000)),
              {"max_num_seqs 32": (SchedulerConfig(max_num_seqs=32),
                                   CacheConfig(num_gpu_blocks=4000))},
              ("itl_p50_s", "itl_p99_s", "ttft_mean_s", "throughput_tok_s")),
)


def run_row(row: TuningRow) -> dict[str, dict[str, float]]:
    """``{"before": symptoms, <tuning name>: symptoms, ...}`` for one row."""
    trace = row.trace()
    runs = {"before": row.before, **row.after}
    return {name: symptoms(replay(trace, *cfg)) for name, cfg in runs.items()}


def format_row(row: TuningRow, results: dict[str, dict[str, float]],
               keys: Sequence[str] | None = None) -> str:
    keys = keys or row.watch
    lines = [f"symptom: {row.symptom} | diagnosis: {row.diagnosis} | tuning: {row.tuning}",
             f"{'':>28}" + "".join(f"{k:>18}" for k in keys)]
    for name, values in results.items():
        cells = "".join(f"{values[k]:>18.3f}" if isinstance(values[k], float)
                        else f"{values[k]:>18}" for k in keys)
        lines.append(f"{name:>28}{cells}")
    return "\n".join(lines)


# ------------------------------------------------------------------ metric names

# What each article names, and what it means: (name as written, source, where, meaning).
ARTICLE_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("vllm:num_gpu_blocks_total", "000", "§10", "pool size"),
    ("vllm:num_gpu_blocks_free", "000", "§10", "free blocks"),
    ("vllm:gpu_cache_usage_perc", "000", "§10", "cache usage"),
    ("vllm:num_gpu_blocks", "003", "§7.1", "pool size"),
    ("vllm:num_free_blocks", "003", "§7.1", "free blocks"),
    ("vllm:num_preemption", "003", "§7.1", "preemptions"),
    ("vllm:num_requests_running", "001", "prefix caching case", "running requests"),
    ("vllm:cache_usage", "001", "prefix caching case", "cache usage"),
    ("vllm:gpu_cache_usage_perc", "001", "prefix caching case", "cache usage"),
)

# meaning -> (what to read in V0, what to read in V1); checked against the course's collectors
# by audit_metric_names, whose names follow vLLM 0.6.3's vllm/engine/metrics.py (V0) and
# vLLM 0.33.0's vllm/v1/metrics/loggers.py (V1).
READ_INSTEAD: dict[str, tuple[str, str]] = {
    "pool size": ("vllm:cache_config_info", "vllm:cache_config_info"),
    "free blocks": ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"),
    "cache usage": ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"),
    "preemptions": ("vllm:num_preemptions_total", "vllm:num_preemptions_total"),
    "running requests": ("vllm:num_requests_running", "vllm:num_requests_running"),
}
_HOW = {"pool size": "its num_gpu_blocks label",
        "free blocks": "(1 - usage) x num_gpu_blocks",
        "cache usage": "a fraction, 0..1",
        "preemptions": "a counter",
        "running requests": "a gauge"}


def exported_names(design: str) -> set[str]:
    """The series names the course's ``Metrics`` exports for ``design`` ("v0" or "v1"), as a
    scrape shows them (counters with ``_total``; histograms by their base name)."""
    sched = Scheduler() if design == "v0" else SchedulerV1()
    names = set()
    for family in Metrics(sched, design=design).registry.collect():
        names.add(family.name + "_total" if family.type == "counter" else family.name)
    return names


class MetricNameCheck(NamedTuple):
    name: str          # as the article writes it
    cited: str         # e.g. '"PagedAttention explained" §7.1'
    meaning: str
    in_v0: bool        # exported under this name by the V0 design
    in_v1: bool        # exported under this name by the V1 design
    read_v0: str       # what to read instead, V0
    read_v1: str       # what to read instead, V1


def audit_metric_names() -> list[MetricNameCheck]:
    """Each name in ARTICLE_METRICS, looked up in both designs' exported names."""
    v0, v1 = exported_names("v0"), exported_names("v1")
    rows = []
    for name, source, where, meaning in ARTICLE_METRICS:
        read_v0, read_v1 = READ_INSTEAD[meaning]
        if read_v0 not in v0 or read_v1 not in v1:
            raise RuntimeError(f"READ_INSTEAD names a metric the course does not export: "
                               f"{read_v0!r} (V0), {read_v1!r} (V1)")
        rows.append(MetricNameCheck(name, cite(source, where), meaning, name in v0, name in v1,
                                    read_v0, read_v1))
    return rows


def format_metric_audit(rows: Sequence[MetricNameCheck]) -> str:
    """Two lines per name: where it comes from and whether it exists; what to read instead."""
    yes = {True: "exists", False: "no such metric"}
    lines = []
    for r in rows:
        lines.append(f"{r.name} ({r.cited}, {r.meaning}): V0 {yes[r.in_v0]}, V1 {yes[r.in_v1]}")
        lines.append(f"    read: V0 {r.read_v0}, V1 {r.read_v1} ({_HOW[r.meaning]})")
    return "\n".join(lines)


# ------------------------------------------------------------------ vLLM's defaults

VERSIONS = ("0.6.3", "0.33.0")
ENTRY_POINTS = ("LLM", "serve")   # the offline LLM class; the OpenAI-compatible server


@dataclass(frozen=True)
class SchedulerDefaults:
    """What one vLLM release picks when the user sets nothing (text-only decoder, CUDA)."""

    version: str
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    gpu_memory_utilization: float
    swap_space_gib: float | None   # None: the release has no swap_space option


def vllm_scheduler_defaults(version: str, *, gpu_memory_gib: float, gpu_name: str = "",
                            entry_point: str = "serve",
                            max_model_len: int = 8192) -> SchedulerDefaults:
    """vLLM's scheduler defaults, as each release resolves them.

    0.6.3 (``vllm/engine/arg_utils.py``, ``vllm/config.py``): 256 sequences on every GPU;
    chunked prefill only when max_model_len > 32K; then 512 tokens per step, otherwise
    max(max_model_len, 2048). gpu_memory_utilization 0.90, swap_space 4 GiB.

    0.33.0 (``EngineArgs.get_batch_defaults`` in ``vllm/engine/arg_utils.py``): chunked
    prefill on by default for generative models but encoder-decoder ones
    (``ModelConfig.is_chunked_prefill_supported``, ``vllm/config/model.py``); the budgets
    depend on the GPU's memory and name and on the entry point: >= 160 GiB: 1024 sequences,
    16384 tokens; >= 70 GiB and not an A100: 1024 sequences, 16384 tokens (LLM) or 8192
    (serve); otherwise 256 sequences, 8192 (LLM) or 2048 (serve) tokens; capped at
    max_num_seqs x max_model_len. gpu_memory_utilization 0.92 (``vllm/config/cache.py``); no
    swap_space. Not modelled: GB10 (kept on the small tier), TPUs and CPUs,
    ``--performance-mode throughput`` (doubles both budgets).
    """
    if version not in VERSIONS:
        raise ValueError(f"version must be one of {VERSIONS}, got {version!r}")
    if entry_point not in ENTRY_POINTS:
        raise ValueError(f"entry_point must be one of {ENTRY_POINTS}, got {entry_point!r}")
    if not gpu_memory_gib > 0 or isinstance(max_model_len, bool) or max_model_len < 1:
        raise ValueError(f"need gpu_memory_gib > 0 and max_model_len >= 1, got "
                         f"{gpu_memory_gib!r}, {max_model_len!r}")
    if version == "0.6.3":
        chunked = max_model_len > 32_768
        tokens = 512 if chunked else max(max_model_len, 2048)
        return SchedulerDefaults(version, 256, tokens, chunked, 0.90, 4.0)
    offline = entry_point == "LLM"
    if gpu_memory_gib >= 160:
        seqs, tokens = 1024, 16_384
    elif gpu_memory_gib >= 70 and "a100" not in gpu_name.lower():
        seqs, tokens = 1024, 16_384 if offline else 8192
    else:
        seqs, tokens = 256, 8192 if offline else 2048
    return SchedulerDefaults(version, seqs, min(tokens, seqs * max_model_len), True, 0.92, None)


def vllm_preemption_mode(version: str, num_running_seqs: int = 1,
                         preemption_mode: str | None = None) -> str:
    """How a release preempts a request with ``num_running_seqs`` running sequences.

    0.6.3 (``Scheduler._preempt`` in ``vllm/core/scheduler.py``): ``--preemption-mode`` if
    set; otherwise recompute for a single sequence and swap for a group of several (parallel
    sampling, beam search), which it could not recompute. 0.33.0
    (``vllm/v1/core/sched/scheduler.py``): always recompute, and no such option.
    """
    if version not in VERSIONS:
        raise ValueError(f"version must be one of {VERSIONS}, got {version!r}")
    if isinstance(num_running_seqs, bool) or num_running_seqs < 1:
        raise ValueError(f"num_running_seqs must be >= 1, got {num_running_seqs!r}")
    if version == "0.33.0":
        if preemption_mode is not None:
            raise ValueError("vLLM 0.33.0 has no preemption_mode option: it always recomputes")
        return "recompute"
    if preemption_mode not in (None, "recompute", "swap"):
        raise ValueError(f"preemption_mode must be None, 'recompute' or 'swap', "
                         f"got {preemption_mode!r}")
    if preemption_mode is None:
        return "recompute" if num_running_seqs == 1 else "swap"
    return preemption_mode


# ------------------------------------------------------------------ batching before paging

def mid_batch_joins(timeline: MemoryTimeline) -> int:
    """Admissions into a batch that already held other requests (every step after the first).

    For a timeline where every request waits from step 0 (``step_time_s=None``): then the
    waiting queue only shrinks by admissions. Re-admissions after a preemption count again.
    """
    if timeline.rejected:
        raise ValueError("a timeline with rejected requests: admissions cannot be told apart")
    w, b = timeline.waiting, timeline.batch_size
    joins = 0
    for t in range(1, len(w)):
        admitted = max(0, int(w[t - 1]) - int(w[t]))
        if admitted and int(b[t]) > admitted:
            joins += admitted
    return joins


class BatchingBeforePaging(NamedTuple):
    num_requests: int
    contiguous_joins: int          # requests that joined a running batch, no paging
    contiguous_mean_batch: float   # requests per step, while some wait (Orca-Max)
    paged_mean_batch: float        # the same, paged
    paged_preemptions: int


def batching_before_paging(trace: Sequence[TraceRequest], num_blocks: int,
                           block_size: int = 16,
                           max_model_len: int = 2048) -> BatchingBeforePaging:
    """Iteration-level (continuous) batching on contiguous max_model_len reservations, as Orca
    did, against the same memory in blocks: joins happen either way; paging fits more."""
    slots = num_blocks * block_size
    orca = simulate_static(trace, slots, "max", max_model_len=max_model_len)
    paged = simulate_paged(trace, num_blocks, block_size)
    return BatchingBeforePaging(len(trace), mid_batch_joins(orca), orca.mean_batch_size(),
                                paged.mean_batch_size(), paged.preemptions)
