"""Exercise 11.3: a serving run's latencies as a benchmark client reports them.

vLLM's benchmark client (``vllm bench serve``; vLLM 0.33.0's ``calculate_metrics`` in
``vllm/benchmarks/serve.py``, fed by ``vllm/benchmarks/lib/endpoint_request_func.py``, which
stamps each streamed chunk) measures each request from the time it sent it:
TTFT (first token), E2EL (last token), TPOT (``(latency - ttft) / (output_len - 1)``, only for
requests with more than one token) and ITL (every gap between two consecutive tokens, all
requests pooled); it reports each one's mean and percentiles in milliseconds, with
``np.percentile`` (linear interpolation) and ``[0]`` for an empty list.

:class:`TokenTimes` records, from an engine's (or the simulator's) :class:`Metrics`, the
times each request's tokens arrived. The checker's cases: edge cases, random records from a
fixed seed, and model-free runs of the V1 scheduler (:func:`course_lib.sim.replay.replay`),
whose latencies the course's Prometheus histograms also record (the tests compare them).
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable, Sequence

import numpy as np

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.exercises import Verdict, judge_cases
from course_lib.scheduler.metrics import Metrics

Records = list[tuple[float, list[float]]]
NAMES = ("ttft", "tpot", "itl", "e2el")


class TokenTimes:
    """Hooks ``metrics.record_step`` (called after every step with the scheduler, the requests
    that got a token, those that finished, and the step's time): :meth:`records` gives
    ``(sent, token_times)`` per request, in request-id order; one time per step that gave the
    request its tokens. A step whose recording fails records nothing (the engine then
    recovers it: its tokens were never emitted)."""

    def __init__(self, metrics: Metrics) -> None:
        self.times: dict[int, tuple[float, list[float]]] = {}
        record_step = metrics.record_step

        def record_and_time(scheduler, sampled, finished, now):
            sampled, finished = list(sampled), list(finished)
            record_step(scheduler, sampled, finished, now)
            for req in {id(r): r for r in sampled}.values():
                self.times.setdefault(req.request_id, (req.arrival_time, []))[1].append(now)
        metrics.record_step = record_and_time

    def records(self) -> Records:
        return [(sent, list(times)) for _, (sent, times) in sorted(self.times.items())]


def serving_metrics(records: Records, percentile: float) -> dict[str, tuple[float, float]]:
    """Reference: ``{"ttft" | "tpot" | "itl" | "e2el": (mean_ms, percentile_ms)}``, as
    ``calculate_metrics`` computes them."""
    ttfts = [t[0] - sent for sent, t in records]
    e2els = [t[-1] - sent for sent, t in records]
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for _, t in records if len(t) > 1]
    itls = [b - a for _, t in records for a, b in zip(t, t[1:], strict=False)]
    return {name: (float(np.mean(xs or 0)) * 1000, float(np.percentile(xs or 0, percentile))
                   * 1000) for name, xs in zip(NAMES, (ttfts, tpots, itls, e2els), strict=True)}


def replayed_records(num_requests: int, rate: float, num_gpu_blocks: int,
                     seed: int) -> tuple[Records, Metrics]:
    """An Alpaca-like trace of ``num_requests`` arriving at ``rate`` per second, run on the V1
    scheduler without a model (the cost model's clock); its records and its metrics."""
    from course_lib.sim.replay import replay
    from course_lib.sim.traces import alpaca_like

    trace = alpaca_like(num_requests, seed=seed, rate=rate, max_total_len=512)
    found: list[TokenTimes] = []
    result = replay(trace, SchedulerConfig(max_num_seqs=8, max_model_len=512),
                    CacheConfig(block_size=16, num_gpu_blocks=num_gpu_blocks),
                    design="v1", on_metrics=lambda m: found.append(TokenTimes(m)))
    return found[0].records(), result.metrics


def serving_cases() -> list[tuple[Records, float, str]]:
    """(records, percentile, where they come from)."""
    cases: list[tuple[Records, float, str]] = [
        ([(0.0, [0.25])], 99, ""),                                  # one token: no TPOT, ITL
        ([(0.0, [0.1, 0.3, 0.6])], 50, ""),
        ([(0.0, [0.1, 0.2]), (0.5, [0.6, 1.0, 1.4, 1.8])], 90, ""),  # pooled ITL != TPOT
        ([(0.0, [0.1]), (0.0, [0.2]), (0.0, [0.4]), (0.0, [0.8])], 50, ""),  # interpolation
        ([(1.0, [1.5, 1.5, 2.0]), (2.0, [2.25, 2.5])], 99, ""),     # sent late; a gap of 0
        ([(0.0, [0.3, 0.4, 0.5, 0.6]), (0.1, [0.2])], 0, ""),
        ([(0.5, [0.9, 1.0]), (0.0, [0.7, 1.2, 1.3])], 100, ""),
    ]
    rng = random.Random(113)
    for _ in range(12):
        records, sent = [], 0.0
        for _ in range(rng.randrange(1, 9)):
            sent += rng.expovariate(4.0)
            t = sent + rng.uniform(0.01, 0.5)
            times = [t]
            for _ in range(rng.randrange(0, 8)):
                t += rng.choice([0.0, rng.expovariate(30.0)])
                times.append(t)
            records.append((round(sent, 4), [round(x, 4) for x in times]))
        cases.append((records, rng.choice([50, 90, 95, 99, 99.9]), ""))
    for n, rate, blocks, seed in ((12, 8.0, 400, 1), (16, 40.0, 24, 2)):
        records, _ = replayed_records(n, rate, blocks, seed)
        cases.append((records, 99, f"a simulated run of {n} requests at {rate:g}/s, "
                                   f"{blocks} blocks"))
    return cases


def _record(record: tuple[float, list[float]]) -> str:
    sent, times = record
    shown = ", ".join(f"{t:.4g}" for t in times[:4])
    more = f", ... {len(times)} in all" if len(times) > 4 else ""
    return f"({sent:.4g}, [{shown}{more}])"


def records_text(case: tuple) -> str:
    """A case in a line: the records (long ones cut short) and the percentile."""
    records, p, where = case
    shown = ", ".join(map(_record, records[:3])) + (", ..." if len(records) > 3 else "")
    what = f"{where}, {len(records)} requests" if where else f"{len(records)} request(s)"
    return f"{what}: records [{shown}], percentile {p}"


_WHY = {"ttft": "TTFT = the first token's time - the time the request was sent",
        "tpot": "a request's TPOT = (last token - first token) / (tokens - 1), averaged over "
                "the requests with more than one token",
        "itl": "ITL = every gap between two consecutive tokens of a request, all requests' "
               "gaps in one list",
        "e2el": "E2EL = the last token's time - the time the request was sent"}


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)


def _judge(learner: Callable, case: tuple) -> str | None:
    records, p, _ = case
    got = learner(copy.deepcopy(records), p)
    want = serving_metrics(records, p)
    where = records_text(case)
    if not isinstance(got, dict) or set(got) != set(NAMES):
        return f"{where}: expected a dict with keys {list(NAMES)}, got {got!r:.100}"
    for name in NAMES:
        pair = got[name]
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            return f"{where}: {name} should be (mean_ms, p{p}_ms), got {pair!r:.60}"
        (g_mean, g_p), (w_mean, w_p) = pair, want[name]
        if _close(g_mean, w_mean) and _close(g_p, w_p):
            continue
        text = (f"{where}: your {name} is ({g_mean:.6g}, {g_p:.6g}) ms, vLLM's "
                f"({w_mean:.6g}, {w_p:.6g}) ms")
        if w_mean and _close(g_mean * 1000, w_mean):
            return text + " (vLLM reports milliseconds: yours look like seconds)"
        if _close(g_mean, w_mean):
            return text + (f" (the means agree: vLLM's p{p} is np.percentile's, which "
                           "interpolates linearly between the two nearest ranks, e.g. the "
                           "p50 of [1, 2, 3, 4] is 2.5; an empty list counts as [0])")
        return text + f" ({_WHY[name]}; an empty list counts as [0])"
    return None


def check_serving_metrics(fn: Callable[[Records, float], dict]) -> Verdict:
    """11.3: ``fn(records, percentile)`` against vLLM's definitions."""
    return judge_cases("11.3 serving_metrics", fn, serving_cases(), _judge, records_text)


# ---------------------------------------------------------------- plausible wrong answers
def _stats(xs: Sequence[float], p: float) -> tuple[float, float]:
    return float(np.mean(xs or 0)) * 1000, float(np.percentile(xs or 0, p)) * 1000


def _tpot_over_every_token(records, percentile):
    """Wrong: TPOT = end-to-end latency / tokens (the first token's wait counted in)."""
    out = serving_metrics(records, percentile)
    out["tpot"] = _stats([(t[-1] - sent) / len(t) for sent, t in records], percentile)
    return out


def _nearest_rank(records, percentile):
    """Wrong: the nearest-rank percentile (the course's replay reports p99 that way)."""
    out = serving_metrics(records, percentile)
    ttfts = sorted(t[0] - sent for sent, t in records)
    rank = max(1, math.ceil(percentile / 100 * len(ttfts)))
    out["ttft"] = (out["ttft"][0], ttfts[rank - 1] * 1000)
    return out


def _itl_as_tpot(records, percentile):
    """Wrong: ITL as each request's mean gap (that is TPOT), not every gap pooled."""
    out = serving_metrics(records, percentile)
    out["itl"] = out["tpot"]
    return out


WRONG = (_tpot_over_every_token, _nearest_rank, _itl_as_tpot)
