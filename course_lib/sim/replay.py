"""Replay a trace through the real scheduler and block manager, with a cost model for time.

No model runs: a step's duration comes from :class:`CostModel` (tokens computed, context read,
blocks swapped), and tokens come from ``course_lib.sim.fake_sampler``. Everything else --
admission, budgets, chunked prefill, preemption, copy-on-write, prefix caching -- is the real
``Scheduler`` over the real ``BlockManager``, so the batch sizes, KV usage, preemptions and
swapped bytes a replay reports are those of the real policies.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from tqdm.auto import tqdm

from ..capacity import kv_bytes_per_token
from ..config import CacheConfig, SchedulerConfig, config_or_default
from ..scheduler.metrics import Metrics
from ..scheduler.output import SchedulerOutput
from ..scheduler.policy import VictimPolicy, last_arrived_first
from ..scheduler.scheduler import Scheduler
from ..scheduler.v1 import SchedulerV1
from ..sequence import Request, SamplingParams
from ..sizing.blocks import check_block_size
from ..sizing.models import ModelSpec, get_preset
from ..sizing.units import cdiv, check_int
from .fake_sampler import fake_samples
from .traces import TraceRequest, check_trace


@dataclass(frozen=True)
class CostModel:
    """Seconds per step of a model on a GPU, as a few linear terms (all >= 0).

    Defaults: Llama-2-7B in fp16 on an A100-class GPU, rounded.
    * ``s_per_token`` (1e-4): every token fed (prefill or decode) costs 2 x params FLOPs;
      "recompute ~100 ms per 1K tokens" ("Block Manager tutorial" §12.2) is the same figure.
    * ``step_base_s`` (9e-3): each step reads all weights once (13.5 GB at ~1.5 TB/s).
    * ``s_per_context_token`` (3.5e-7): a decode reads every cached token's K/V (0.5 MB/token).
    * ``swap_bytes_per_s`` (20e9): PCIe 4.0 x16 in practice; the article's "~50 ms per GB".
    * ``s_per_copy`` (4e-6): one cudaMemcpyAsync per block, per layer, per K and V: why
      small blocks swap slowly (the vLLM paper's Fig. 19).
    """

    s_per_token: float = 1e-4
    step_base_s: float = 9e-3
    s_per_context_token: float = 3.5e-7
    kv_bytes_per_token: int = 524_288       # Llama-2-7B: 2 x 32 layers x 4096 x 2 bytes
    num_layers: int = 32
    swap_bytes_per_s: float = 20e9
    s_per_copy: float = 4e-6

    def __post_init__(self) -> None:
        for name, value in vars(self).items():     # a bool or "1e-4" is no cost; inf no time
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    @staticmethod
    def for_model(spec: ModelSpec | str, **overrides) -> CostModel:
        """Costs scaled to a model's size (same GPU): compute per token ~ params, weights
        read per step ~ weight bytes, K/V bytes from ``course_lib.capacity``."""
        spec = get_preset(spec) if isinstance(spec, str) else spec
        kv = kv_bytes_per_token(spec)
        base = dict(s_per_token=2 * spec.num_params / 156e12,       # 312 TFLOPs at 50%
                    step_base_s=spec.weight_bytes / 1.5e12,           # 1.5 TB/s HBM
                    s_per_context_token=kv / 1.5e12, kv_bytes_per_token=kv,
                    num_layers=spec.num_layers)
        return CostModel(**{**base, **overrides})

    def recompute_time(self, num_tokens: int) -> float:
        """Prefilling ``num_tokens`` again (their compute; no extra step)."""
        return num_tokens * self.s_per_token

    def swap_time(self, num_blocks: int, block_size: int) -> float:
        """Moving ``num_blocks`` blocks one way over PCIe: bytes / bandwidth + per-copy cost."""
        nbytes = num_blocks * block_size * self.kv_bytes_per_token
        return nbytes / self.swap_bytes_per_s + num_blocks * 2 * self.num_layers * self.s_per_copy

    def step_time(self, out: SchedulerOutput, block_size: int) -> float:
        if not out.scheduled and not out.blocks_to_swap_out:
            return 0.0
        context = sum(len(e.seq) for e in out.scheduled if not e.is_prefill)
        swapped = len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
        return (self.step_base_s + out.num_batched_tokens * self.s_per_token
                + context * self.s_per_context_token + self.swap_time(swapped, block_size))


class PreemptionCost(NamedTuple):
    num_tokens: int
    block_size: int
    recompute_s: float        # prefill the tokens again
    swap_s: float             # swap out, then swap in (the blocks of the tokens)

    @property
    def ratio(self) -> float:
        return self.recompute_s / self.swap_s


def preemption_costs(cost: CostModel, lengths: Sequence[int],
                     block_sizes: Sequence[int]) -> list[PreemptionCost]:
    """Recompute vs swap (out + in) for one sequence of each length, at each block size."""
    if not isinstance(cost, CostModel):
        raise ValueError(f"cost must be a CostModel, got {type(cost).__name__} {cost!r:.60}")
    lengths, block_sizes = list(lengths), list(block_sizes)
    for n in lengths:
        check_int("lengths' items", n, 0)
    for bs in block_sizes:
        check_block_size(bs)
    rows = []
    for n in lengths:
        for bs in block_sizes:
            blocks = cdiv(n, bs)
            rows.append(PreemptionCost(n, bs, cost.recompute_time(n),
                                       2 * cost.swap_time(blocks, bs)))
    return rows


@dataclass
class StepRecord:
    time: float               # end of the step, seconds
    duration: float           # seconds the step took (the cost model)
    num_seqs: int             # sequences in the batch
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int          # requests
    num_waiting: int
    num_swapped: int
    gpu_block_usage: float    # held blocks / total (vllm:gpu_cache_usage_perc)
    gpu_token_usage: float    # slots holding a token / total slots
    num_preempted: int
    batch: tuple[tuple[int, int, bool], ...] = ()   # (request_id, tokens, is_prefill) if kept
    preempted: tuple[tuple[int, str], ...] = ()
    sharing_saving: float = 0.0   # 1 - held blocks / block-table entries (shared blocks)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def _p99(xs: Sequence[float]) -> float:
    """Nearest-rank 99th percentile."""
    if not xs:
        return math.nan
    ys = sorted(xs)
    return ys[max(0, math.ceil(0.99 * len(ys)) - 1)]


@dataclass
class ReplayResult:
    requests: list[Request]
    steps: list[StepRecord]
    duration_s: float
    num_preemptions: int
    num_swap_preemptions: int
    swapped_bytes: int        # out + in
    prefix_cache_hit_rate: float
    generated_tokens: int
    num_ignored: int
    ttfts: list[float] = field(repr=False, default_factory=list)
    tpots: list[float] = field(repr=False, default_factory=list)
    metrics: Metrics | None = field(repr=False, default=None)
    scheduler: Scheduler | None = field(repr=False, default=None)

    @property
    def throughput_tokens_s(self) -> float:
        """Generated tokens per second."""
        return self.generated_tokens / self.duration_s if self.duration_s else 0.0

    @property
    def throughput_requests_s(self) -> float:
        return len(self.requests) / self.duration_s if self.duration_s else 0.0

    ttft_mean = property(lambda self: _mean(self.ttfts))
    ttft_p99 = property(lambda self: _p99(self.ttfts))
    tpot_mean = property(lambda self: _mean(self.tpots))
    tpot_p99 = property(lambda self: _p99(self.tpots))

    def itl_percentile(self, q: float) -> float:
        """Inter-token latency: the q-th percentile (0..100) over every decoded token of the
        duration of the step that produced it (what a streaming client sees between tokens)."""
        pairs = sorted((s.duration, s.num_decode_tokens) for s in self.steps
                       if s.num_decode_tokens)
        total = sum(w for _, w in pairs)
        if not total:
            return math.nan
        rank, seen = max(1, math.ceil(q / 100 * total)), 0
        for duration, w in pairs:
            seen += w
            if seen >= rank:
                return duration
        return pairs[-1][0]

    @property
    def mean_batch_size(self) -> float:
        return _mean([s.num_seqs for s in self.steps])

    @property
    def mean_gpu_usage(self) -> float:
        return _mean([s.gpu_block_usage for s in self.steps])

    def summary(self) -> dict[str, float]:
        return {"requests": len(self.requests), "ignored": self.num_ignored,
                "duration_s": round(self.duration_s, 2),
                "throughput_tok_s": round(self.throughput_tokens_s, 1),
                "ttft_mean_s": round(self.ttft_mean, 3), "ttft_p99_s": round(self.ttft_p99, 3),
                "tpot_mean_s": round(self.tpot_mean, 4), "tpot_p99_s": round(self.tpot_p99, 4),
                "itl_p50_s": round(self.itl_percentile(50), 4),
                "itl_p99_s": round(self.itl_percentile(99), 4),
                "mean_batch": round(self.mean_batch_size, 1),
                "mean_gpu_usage": round(self.mean_gpu_usage, 3),
                "preemptions": self.num_preemptions,
                "swapped_GB": round(self.swapped_bytes / 1e9, 2),
                "prefix_hit_rate": round(self.prefix_cache_hit_rate, 3)}


def replay(trace: Sequence[TraceRequest], scheduler_config: SchedulerConfig | None = None,
           cache_config: CacheConfig | None = None, cost_model: CostModel | None = None, *,
           victim_policy: VictimPolicy = last_arrived_first, progress: bool = False,
           record_batches: bool = False, with_metrics: bool = False,
           on_metrics: Callable[[Metrics], object] | None = None,
           check_invariants: bool = False, max_steps: int = 10_000_000,
           design: str = "v0") -> ReplayResult:
    """Run every request of ``trace`` to completion; time advances by the cost model.

    ``design``: ``"v0"`` (the paper's / vLLM V0's scheduler and block manager) or ``"v1"``
    (vLLM V1's scheduler and ``KVCacheManager``; no swap, no beam search; its ``running`` and
    ``waiting`` count sequences, as V1's child requests). ``victim_policy`` applies to V0.

    ``record_batches`` keeps each step's batch (for the timeline widget; memory grows with
    the trace). ``with_metrics`` keeps a :class:`Metrics` (vLLM's Prometheus names) updated
    every step in ``result.metrics``; ``on_metrics(metrics)`` is called once it exists, before
    the first step (e.g. to serve ``/metrics`` while the replay runs). ``check_invariants``
    checks the scheduler and the block manager after every call (slow; for tests).
    """
    cost = config_or_default(cost_model, CostModel, "cost_model")
    if design not in ("v0", "v1"):
        raise ValueError(f"design must be 'v0' or 'v1', got {design!r}")
    check_int("max_steps", max_steps, 1)
    trace = check_trace(trace)         # before anything runs: a NaN arrival would stall it
    sched = Scheduler(scheduler_config, cache_config, victim_policy) if design == "v0" \
        else SchedulerV1(scheduler_config, cache_config)
    metrics = Metrics(sched) if with_metrics or on_metrics else None
    if on_metrics is not None:
        on_metrics(metrics)
    bm, bs = sched.block_manager, sched.cache_config.block_size
    trace = sorted(trace, key=lambda t: (t.arrival_time, t.request_id))
    requests: list[Request] = []
    steps: list[StepRecord] = []
    now, i, swap_blocks, swap_preemptions, ignored = 0.0, 0, 0, 0, 0
    bar = tqdm(total=len(trace), disable=not progress, desc="replay", unit="req")
    while i < len(trace) or sched.has_unfinished_requests():
        while i < len(trace) and trace[i].arrival_time <= now:
            t = trace[i]
            params = SamplingParams(max_tokens=t.output_len, n=t.n, beam_width=t.beam_width)
            requests.append(sched.add_request(t.request_id, t.prompt_token_ids, params,
                                              t.arrival_time))
            i += 1
        if not sched.has_unfinished_requests():
            now = trace[i].arrival_time              # idle until the next arrival
            continue
        out = sched.schedule()
        if check_invariants:
            sched.check_invariants()
        if out.is_empty:
            if i == len(trace):
                raise RuntimeError(f"the scheduler makes no progress at t={now:.3f}s with "
                                   f"{len(sched.waiting)} waiting requests")
            now = trace[i].arrival_time
            continue
        dt = cost.step_time(out, bs)
        now += dt
        finished = sched.update(out, fake_samples(out), now)
        if check_invariants:
            sched.check_invariants()
        swap_blocks += len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
        swap_preemptions += sum(1 for _, mode in out.preempted if mode == "swap")
        ignored += len(out.ignored)
        usage = bm.usage()
        steps.append(StepRecord(
            now, dt, len(out.scheduled), out.num_prefill_tokens, out.num_decode_tokens,
            len(sched.running), len(sched.waiting), len(sched.swapped),
            usage.block_usage, usage.token_usage,
            len(out.preempted),
            tuple((e.request.request_id, e.num_tokens, e.is_prefill) for e in out.scheduled)
            if record_batches else (), tuple(out.preempted), usage.sharing_saving))
        if metrics is not None:
            metrics.record_step(sched, [e.request for e in out.scheduled if e.num_candidates],
                                finished, now)
        bar.update(len(finished))
        if len(steps) >= max_steps:
            raise RuntimeError(f"replay stopped after max_steps={max_steps} steps")
    bar.close()
    done = [r for r in requests if r.first_token_time is not None]
    ttfts = [r.first_token_time - r.arrival_time for r in done]
    tpots = [(r.finished_time - r.first_token_time) / (r.num_output_tokens - 1)
             for r in done if r.num_output_tokens > 1]
    return ReplayResult(requests, steps, now, sched.num_preemptions, swap_preemptions,
                        swap_blocks * bs * cost.kv_bytes_per_token,
                        bm.prefix_cache_stats.hit_rate, sched.num_generated_tokens, ignored,
                        ttfts, tpots,
                        metrics, sched)
