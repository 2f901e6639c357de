"""The tuning table of the "Block Manager tutorial" (§13.3), each row replayed: symptom, fix.

Every row is a small trace and a configuration that produces the row's symptom, and the
configuration the row recommends. :func:`run_row` replays both and reports the signals a
person would read off the metrics (``symptoms``). The traces are chosen to show the symptom;
the numbers are what our cost model gives for them, not measurements of a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..config import CacheConfig, SchedulerConfig
from ..sim.replay import ReplayResult, replay
from ..sim.traces import TraceRequest, few_shot, sharegpt_like


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
              "prefix caching (or prefill/decode disaggregation, not simulated here)",
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
