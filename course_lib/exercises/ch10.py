"""Chapter 10: its figures beside the published ones, and its exercises.

Figures: the memory sharing saves per width beside the vLLM paper's (:func:`sharing_rows`),
the metric names of the two designs (:func:`metric_names`), and the "Memory optimization"
article's prefix-caching speed-up in numbers (:func:`article_prefix_case`).

Exercises: the slots of a step, beam candidates, the memory sharing saves. References run the
library: ``course_lib.kernels.reference.slot_mapping`` (what the model runner builds from a
block table), ``course_lib.engine.sampler.sample`` for beam search (top ``2 x width``
log-probabilities), ``course_lib.engine.workloads.saving_of_tables``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from course_lib import capacity as cap
from course_lib.claims.sources import cite
from course_lib.engine.llm_engine import LLMEngine
from course_lib.engine.workloads import PAPER_SHARING_SAVINGS, saving_of_tables, sharing_savings
from course_lib.exercises import Verdict, check
from course_lib.kernels.reference import slot_mapping
from course_lib.scheduler.metrics import Metrics
from course_lib.scheduler.output import ScheduledSeq
from course_lib.sequence import Request, SamplingParams
from course_lib.sequence import Sequence as Seq
from course_lib.sim.traces import TraceRequest


@dataclass(frozen=True)
class SharingRow:
    decoding: str          # "parallel sampling" (n) or "beam search" (beam_width)
    width: int
    saving: float          # ours: 1 - held blocks / blocks without sharing, over the run
    paper_pct: float       # the paper's Fig. 15 figure for the same width (workloads.py)

    def __str__(self) -> str:
        knob = "n" if self.decoding == "parallel sampling" else "beam_width"
        label = f"{self.decoding}, {knob} = {self.width}:"
        return f"{label:<33} ours {100 * self.saving:5.1f}%   paper {self.paper_pct:5.2f}%"


def sharing_rows(make_engine: Callable[[], LLMEngine], trace: Sequence[TraceRequest],
                 widths: Sequence[int] = (2, 4, 6), seed: int = 0) -> list[SharingRow]:
    """Run ``trace`` on a fresh engine for every decoding and width of the paper's Fig. 15
    and pair our saving with the paper's (``workloads.PAPER_SHARING_SAVINGS``; sampling at
    temperature 1.0, ``seed``)."""
    rows = []
    for decoding in ("parallel sampling", "beam search"):
        for w in widths:
            params = (SamplingParams(temperature=1.0, seed=seed, n=w)
                      if decoding == "parallel sampling" else SamplingParams(beam_width=w))
            r = sharing_savings(make_engine(), trace, params)
            rows.append(SharingRow(decoding, w, r.saving, PAPER_SHARING_SAVINGS[decoding][w]))
    return rows


def metric_names(metrics: Metrics) -> list[str]:
    """The metric names an engine exports, as a scrape shows them (counters end in _total,
    a histogram is named once, without its _bucket/_sum/_count samples)."""
    return sorted(f.name + "_total" if f.type == "counter" else f.name
                  for f in metrics.registry.collect())


@dataclass(frozen=True)
class PrefixCachingCase:
    """The "Memory optimization" article's prefix-caching case, what course_lib can compute
    of it: Llama-3-8B on 8 x A100 80GB, 64 concurrent requests each carrying 1,000 tokens of
    history that begin with a ~500-token shared system prompt; 850 -> 2,600 tokens/s."""

    tokens_per_s: tuple[float, float]    # the article's: without, with prefix caching
    num_requests: int
    history_tokens: int
    system_prompt_tokens: int
    kv_bytes_needed: int                 # every request's history, no sharing
    pool_tokens_per_gpu: int             # one 80 GiB GPU, gpu_memory_utilization 0.9
    prefill_no_cache: int                # prompt tokens computed without prefix caching
    prefill_system_prompt_cached: int    # the shared prompt's full blocks computed once
    prefill_history_cached: int          # each history cached by its previous turn

    @property
    def speedup(self) -> float:
        return self.tokens_per_s[1] / self.tokens_per_s[0]

    def __str__(self) -> str:
        n, h = self.num_requests, self.history_tokens
        return "\n".join([
            f"{cite('001', '(prefix caching case)')}: {self.tokens_per_s[0]:,.0f} -> "
            f"{self.tokens_per_s[1]:,.0f} tokens/s = {self.speedup:.2f}x; Llama-3-8B, "
            f"8 x A100 80GB, {n} requests x {h:,} tokens of history "
            f"({self.system_prompt_tokens}-token shared system prompt)",
            f"memory is not the limit: {n} x {h:,} tokens need "
            f"{cap.format_bytes(self.kv_bytes_needed)} of KV; one GPU's pool holds "
            f"{self.pool_tokens_per_gpu:,} tokens, so the batch is the same with or without "
            "the cache",
            f"prefill tokens computed: {self.prefill_no_cache:,} without the cache, "
            f"{self.prefill_system_prompt_cached:,} at best with the system prompt cached "
            f"({self.prefill_no_cache / self.prefill_system_prompt_cached:.2f}x fewer), "
            f"{self.prefill_history_cached:,} if every history was cached by its previous turn",
            "decode is not faster with the cache: the speed-up depends on the output length, "
            "on what was cached and on how the 8 GPUs were used, none of which the article gives",
        ])


def article_prefix_case(block_size: int = 16) -> PrefixCachingCase:
    """:class:`PrefixCachingCase`, computed (the first request computes its whole prompt; the
    others skip the full blocks cached before them)."""
    spec, n, h, sp = cap.get_preset("llama-3-8b"), 64, 1000, 500
    pool = cap.plan_kv_cache(spec, 80, block_size=block_size).num_gpu_tokens
    shared = cap.num_full_blocks(sp, block_size) * block_size
    history = cap.num_full_blocks(h, block_size) * block_size
    return PrefixCachingCase((850, 2600), n, h, sp, cap.contiguous_kv_bytes(spec, n * h), pool,
                             n * h, h + (n - 1) * (h - shared), n * (h - history))


# ---------------------------------------------------------------- exercises


def step_slots(block_table: list[int], num_computed: int, num_new: int,
               block_size: int) -> list[int]:
    """Reference: the cache slots of tokens ``num_computed .. num_computed + num_new - 1``."""
    return slot_mapping(block_table, list(range(num_computed, num_computed + num_new)),
                        block_size)


def beam_candidates(logits: list[float], width: int) -> list[tuple[int, float]]:
    """Reference: the ``2 * width`` best (token, logprob) of one beam, best first."""
    req = Request(0, (1,), SamplingParams(beam_width=width))
    entry = ScheduledSeq(req, Seq(0, (1,)), 1, False, 2 * width, [])
    from course_lib.engine.sampler import sample

    return [(t, round(lp, 5)) for t, lp in sample(entry, torch.tensor(logits), 0)]


def sharing_saving(tables: list[list[int]]) -> float:
    """Reference: ``1 - distinct blocks / table entries`` at one instant."""
    return saving_of_tables(tables)


def _slot_cases() -> list[tuple]:
    rng = random.Random(10)
    cases = [([7], 0, 1, 16), ([3, 9], 15, 2, 16), ([5, 2, 8], 0, 12, 4), ([4, 1], 3, 1, 4)]
    for _ in range(20):
        bs = rng.choice([1, 2, 4, 16])
        computed, new = rng.randint(0, 40), rng.randint(1, 20)
        table = rng.sample(range(200), -(-(computed + new) // bs))
        cases.append((table, computed, new, bs))
    return cases


def check_step_slots(fn: Callable[[list[int], int, int, int], list[int]]) -> Verdict:
    return check("10.1 step_slots", fn, step_slots, _slot_cases())


def check_beam_candidates(fn: Callable[[list[float], int], list[tuple[int, float]]]) -> Verdict:
    rng = random.Random(11)
    cases = [([0.0, 1.0, 2.0, 3.0], 1), ([5.0, -1.0, 2.5, 0.0, 4.0, 3.0], 2)]
    for _ in range(10):
        n = rng.randint(6, 40)
        cases.append(([round(rng.gauss(0, 3), 3) + i * 1e-4 for i in range(n)],
                      rng.randint(1, 3)))

    def rounded(got, want) -> bool:
        return [(int(t), round(float(lp), 4)) for t, lp in got] == \
            [(t, round(lp, 4)) for t, lp in want]
    return check("10.2 beam_candidates", fn, beam_candidates, cases, compare=rounded)


def check_sharing_saving(fn: Callable[[list[list[int]]], float]) -> Verdict:
    rng = random.Random(12)
    cases = [([],), ([[1, 2, 3]],), ([[1, 2, 3], [1, 2, 4]],), ([[0], [0], [0], [0]],)]
    for _ in range(10):
        prefix = rng.sample(range(100, 200), rng.randint(0, 5))
        cases.append(([prefix + rng.sample(range(100), rng.randint(1, 4))
                       for _ in range(rng.randint(1, 6))],))
    return check("10.3 sharing_saving", fn, sharing_saving, cases,
                 compare=lambda got, want: abs(float(got) - want) < 1e-9)
