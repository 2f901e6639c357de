"""Seeded request traces for the simulator (chapters 02 and 07).

A trace is a list of ``TraceRequest``, sorted by arrival time, request ids 0..n-1 in that order.
Everything is a pure function of its arguments: the same seed gives the same trace, lengths,
token ids and arrival times included. Lengths and arrivals use separate random streams, so
changing the rate moves requests in time without changing what they are.

Length models (documented choices, shown in chapter 02):

- ShareGPT-like: the vLLM paper's ShareGPT data as a bivariate lognormal, log-input
  N(3.87, 1.52), log-output N(5.37, 1.14), correlation 0.18, lengths rounded to integers >= 1.
  Pairs with input + output > ``max_total_len`` are *redrawn* (rejection sampling), the way
  serving benchmarks filter ShareGPT, so the result is the lognormal conditioned on fitting.
  Note: these parameters do not give the paper's means (161 in / 338 out). Even before any
  cut the lognormal's input mean is exp(3.87 + 1.52**2 / 2) ~ 152; conditioned on
  input + output <= 2048 the means are ~117 in / ~326 out. ``lognormal_means`` computes both.
- Alpaca-like: independent lognormals with the paper's means (19.3 in / 58.5 out) and our
  choice of spread (sigma 0.6 in, 0.9 out): mu = ln(mean) - sigma**2 / 2 makes the mean exact
  before rounding; rounding to integers >= 1 moves it by well under 1%.

A workload of one shape (vLLM's random dataset, :func:`random_like`) draws lengths uniformly
around a mean, with bursty arrivals (:func:`gamma_arrivals`, as vLLM's serving benchmark).

Prompt token ids are drawn uniformly from [1, vocab_size). Shared parts (a chat's system
prompt and earlier turns, few-shot examples) are the *same* tuples of ids, so a prefix cache
really hits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

SHAREGPT_LOG_MU = (3.87, 5.37)       # (input, output)
SHAREGPT_LOG_SIGMA = (1.52, 1.14)
SHAREGPT_LOG_CORR = 0.18
SHAREGPT_PAPER_MEANS = (161.31, 337.99)   # the vLLM paper's ShareGPT means (real data)
ALPACA_MEANS = (19.31, 58.45)             # the vLLM paper's Alpaca means
ALPACA_LOG_SIGMA = (0.6, 0.9)             # our choice: the paper gives only means

_LENGTHS, _ARRIVALS, _TOKENS = 0, 1, 2    # independent random streams of one seed


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it arrives, its prompt, and how many tokens it generates."""

    request_id: int
    arrival_time: float  # seconds from the start of the trace
    prompt_token_ids: tuple[int, ...]
    output_len: int  # tokens the request generates (its max_tokens; no EOS in the sim)
    n: int = 1  # parallel samples
    beam_width: int = 1  # > 1: beam search
    session_id: int | None = None  # multi-turn chat session, if any

    def __post_init__(self) -> None:
        """The scalar fields, checked where a hand-written trace is made: a NaN arrival time
        would never come due and stall a replay forever. (The prompt's tokens are checked by
        the request the replay makes of it.)"""
        _check_count("request_id", self.request_id)
        t = self.arrival_time
        if isinstance(t, bool) or not isinstance(t, (int, float)) \
                or not 0 <= t < float("inf"):
            raise ValueError(f"request {self.request_id}: arrival_time must be a finite "
                             f"number of seconds >= 0 (from the start of the trace), got {t!r}")
        if not isinstance(self.prompt_token_ids, tuple):
            raise ValueError(f"request {self.request_id}: prompt_token_ids must be a tuple of "
                             f"token ids, got {type(self.prompt_token_ids).__name__} "
                             f"{self.prompt_token_ids!r:.60}")
        for name in ("output_len", "n", "beam_width"):
            _check_count(name, getattr(self, name), 1)
        if self.session_id is not None:
            _check_count("session_id", self.session_id)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def check_trace(trace: object) -> list[TraceRequest]:
    """``trace`` as a list of :class:`TraceRequest` with distinct request ids, or
    ``ValueError`` naming the first bad item: the replays key their requests by id, so a
    repeated id would mix two requests' tokens and times."""
    if isinstance(trace, (str, bytes)) or not isinstance(trace, Sequence):
        raise ValueError(f"trace must be a list of TraceRequest, got "
                         f"{type(trace).__name__} {trace!r:.60}")
    seen: set[int] = set()
    for i, t in enumerate(trace):
        if not isinstance(t, TraceRequest):
            raise ValueError(f"trace must be a list of TraceRequest; item {i} is "
                             f"{type(t).__name__} {t!r:.60}")
        if t.request_id in seen:
            raise ValueError(f"trace item {i}: request_id {t.request_id} is already used by "
                             f"an earlier request")
        seen.add(t.request_id)
    return list(trace)


class Lengths(NamedTuple):
    input_lens: np.ndarray   # [num] int64, >= 1
    output_lens: np.ndarray  # [num] int64, >= 1


# ------------------------------------------------------------------------------ checks
def _check_count(name: str, value: int, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_rate(rate: float) -> None:
    if isinstance(rate, bool) or not (isinstance(rate, (int, float)) and rate > 0):  # nan too
        raise ValueError(f"rate must be > 0 requests/s (float('inf'): all at t=0), got {rate!r}")


def _rng(seed: int, stream: int) -> np.random.Generator:
    _check_count("seed", seed)
    return np.random.default_rng([int(seed), stream])


# ----------------------------------------------------------------------------- lengths
def sharegpt_lengths(num: int, *, seed: int = 0, max_total_len: int = 2048) -> Lengths:
    """ShareGPT-like (input, output) lengths: bivariate lognormal, redrawn until they fit."""
    _check_count("num", num)
    _check_count("max_total_len", max_total_len, 2)
    rng = _rng(seed, _LENGTHS)
    s_in, s_out = SHAREGPT_LOG_SIGMA
    cov = [[s_in**2, SHAREGPT_LOG_CORR * s_in * s_out],
           [SHAREGPT_LOG_CORR * s_in * s_out, s_out**2]]
    ins, outs, have = [], [], 0
    while have < num:                                   # rejection: redraw the misfits
        draw = max(16, int((num - have) * 1.1))
        z = rng.multivariate_normal(SHAREGPT_LOG_MU, cov, size=draw)   # [draw, 2]
        lens = np.maximum(1, np.rint(np.exp(z))).astype(np.int64)
        fit = lens[lens.sum(axis=1) <= max_total_len][: num - have]
        ins.append(fit[:, 0])
        outs.append(fit[:, 1])
        have += len(fit)
    return Lengths(np.concatenate(ins) if ins else np.zeros(0, np.int64),
                   np.concatenate(outs) if outs else np.zeros(0, np.int64))


def alpaca_lengths(num: int, *, seed: int = 0, max_total_len: int = 2048) -> Lengths:
    """Alpaca-like lengths: independent lognormals with the paper's means (see module doc)."""
    _check_count("num", num)
    _check_count("max_total_len", max_total_len, 2)
    rng = _rng(seed, _LENGTHS)
    cols = []
    for mean, sigma in zip(ALPACA_MEANS, ALPACA_LOG_SIGMA, strict=True):
        mu = math.log(mean) - sigma**2 / 2
        cols.append(np.maximum(1, np.rint(rng.lognormal(mu, sigma, size=num))).astype(np.int64))
    ins, outs = cols
    outs = np.minimum(outs, np.maximum(1, max_total_len - ins))   # rare: keep the cut
    ins = np.minimum(ins, max_total_len - outs)
    return Lengths(ins, outs)


def lognormal_means(max_total_len: int | None = 2048, grid: int = 1201) -> tuple[float, float]:
    """Expected (input, output) of the ShareGPT lognormal, computed by numerical integration
    over the log-space density (no sampling): uncut when max_total_len is None, else
    conditioned on input + output <= max_total_len (continuous lengths, before rounding)."""
    mu, sd = np.array(SHAREGPT_LOG_MU), np.array(SHAREGPT_LOG_SIGMA)
    z1 = np.linspace(mu[0] - 7 * sd[0], mu[0] + 7 * sd[0], grid)
    z2 = np.linspace(mu[1] - 7 * sd[1], mu[1] + 7 * sd[1], grid)
    a, b = np.meshgrid(z1, z2, indexing="ij")                  # [grid, grid]
    u, v, r = (a - mu[0]) / sd[0], (b - mu[1]) / sd[1], SHAREGPT_LOG_CORR
    dens = np.exp(-(u * u - 2 * r * u * v + v * v) / (2 * (1 - r * r)))
    if max_total_len is not None:
        dens = dens * (np.exp(a) + np.exp(b) <= max_total_len)
    mass = dens.sum()
    return float((dens * np.exp(a)).sum() / mass), float((dens * np.exp(b)).sum() / mass)


# ---------------------------------------------------------------------------- arrivals
def poisson_arrivals(num: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times of a Poisson process: exponential gaps of mean 1/rate, the first gap
    included. rate=inf: everyone arrives at t=0 (an offline batch)."""
    _check_count("num", num)
    _check_rate(rate)
    if math.isinf(rate):
        return [0.0] * num
    gaps = _rng(seed, _ARRIVALS).exponential(1.0 / rate, size=num)
    return np.cumsum(gaps).tolist()


def gamma_arrivals(num: int, rate: float, burstiness: float = 1.0,
                   seed: int = 0) -> list[float]:
    """Arrival times whose gaps are gamma-distributed with mean 1/rate, as vLLM's serving
    benchmark draws them (``get_request`` in ``vllm/benchmarks/serve.py``, vLLM 0.33.0):
    shape ``burstiness``, scale 1 / (rate x burstiness). burstiness 1 is a Poisson process
    (but not the draws of :func:`poisson_arrivals`); below 1 the requests come in bursts (the
    gaps' coefficient of variation is 1 / sqrt(burstiness)); above 1 more evenly. rate=inf:
    everyone at t=0."""
    _check_count("num", num)
    _check_rate(rate)
    if isinstance(burstiness, bool) or not isinstance(burstiness, (int, float)) \
            or not 0 < burstiness < float("inf"):      # inf: gamma draws NaN gaps
        raise ValueError(f"burstiness must be finite and > 0 (1: Poisson, < 1: bursty), "
                         f"got {burstiness!r}")
    if math.isinf(rate):
        return [0.0] * num
    gaps = _rng(seed, _ARRIVALS).gamma(burstiness, 1.0 / (rate * burstiness), size=num)
    return np.cumsum(gaps).tolist()


def _tokens(rng: np.random.Generator, length: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.integers(1, vocab_size, size=length).tolist())


def _trace_from_lengths(lens: Lengths, seed: int, rate: float,
                        vocab_size: int) -> list[TraceRequest]:
    _check_count("vocab_size", vocab_size, 2)
    times = poisson_arrivals(len(lens.input_lens), rate, seed)
    rng = _rng(seed, _TOKENS)
    return [TraceRequest(i, t, _tokens(rng, int(p), vocab_size), int(o))
            for i, (t, p, o) in enumerate(
                zip(times, lens.input_lens, lens.output_lens, strict=True))]


def sharegpt_like(num_requests: int, *, seed: int = 0, rate: float = float("inf"),
                  vocab_size: int = 32000, max_total_len: int = 2048) -> list[TraceRequest]:
    """A ShareGPT-like trace: conversational lengths, Poisson arrivals at ``rate`` req/s."""
    lens = sharegpt_lengths(num_requests, seed=seed, max_total_len=max_total_len)
    return _trace_from_lengths(lens, seed, rate, vocab_size)


def alpaca_like(num_requests: int, *, seed: int = 0, rate: float = float("inf"),
                vocab_size: int = 32000, max_total_len: int = 2048) -> list[TraceRequest]:
    """An Alpaca-like trace: short instructions and answers, Poisson arrivals."""
    lens = alpaca_lengths(num_requests, seed=seed, max_total_len=max_total_len)
    return _trace_from_lengths(lens, seed, rate, vocab_size)


def random_like(num_requests: int, *, input_len: int, output_len: int,
                range_ratio: float = 0.0, seed: int = 0, rate: float = float("inf"),
                burstiness: float = 1.0, vocab_size: int = 32000) -> list[TraceRequest]:
    """vLLM's random dataset (``RandomDataset`` in ``vllm/benchmarks/datasets/datasets.py``,
    vLLM 0.33.0): input and output lengths uniform over the integers of
    [len x (1 - range_ratio), len x (1 + range_ratio)] (at least 1), random token ids, and
    arrivals from :func:`gamma_arrivals` at ``rate`` with ``burstiness``. A workload of one
    shape (long prompts and short answers, or the opposite), which the conversational traces
    above are not."""
    _check_count("num_requests", num_requests)
    _check_count("input_len", input_len, 1)
    _check_count("output_len", output_len, 1)
    if not (isinstance(range_ratio, (int, float)) and 0 <= range_ratio < 1):
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio!r}")
    _check_count("vocab_size", vocab_size, 2)
    times = gamma_arrivals(num_requests, rate, burstiness, seed)
    rng = _rng(seed, _LENGTHS)
    lens = []
    for mean in (input_len, output_len):
        low = max(1, math.floor(mean * (1 - range_ratio)))
        high = max(low, math.ceil(mean * (1 + range_ratio)))
        lens.append(rng.integers(low, high + 1, size=num_requests))
    tok = _rng(seed, _TOKENS)
    return [TraceRequest(i, t, _tokens(tok, int(p), vocab_size), int(o))
            for i, (t, p, o) in enumerate(zip(times, *lens, strict=True))]


# ----------------------------------------------------------------------- shared prefixes
def multi_turn_chat(num_sessions: int, turns: int, *, seed: int = 0, rate: float = 1.0,
                    think_time: float = 10.0, system_prompt_len: int = 256,
                    user_len: int = 32, output_len: int = 128,
                    vocab_size: int = 32000) -> list[TraceRequest]:
    """Chat sessions that share one system prompt.

    Turn k's prompt = system prompt + (user message, assistant reply) of turns 0..k-1 + the
    new user message, so each turn's prompt starts with the whole previous prompt. The
    assistant replies are token ids fixed by the trace (the sim has no model). Sessions start
    as a Poisson process at ``rate`` sessions/s; turn k arrives ``k * think_time`` s after its
    session starts. User messages and replies have lengths uniform in [1, 2 * mean - 1].
    """
    for name, value, low in (("num_sessions", num_sessions, 0), ("turns", turns, 1),
                             ("system_prompt_len", system_prompt_len, 0),
                             ("user_len", user_len, 1), ("output_len", output_len, 1)):
        _check_count(name, value, low)
    if isinstance(think_time, bool) or not isinstance(think_time, (int, float)) \
            or not 0 <= think_time < float("inf"):
        raise ValueError(f"think_time must be a finite number of seconds >= 0, got "
                         f"{think_time!r}")
    _check_count("vocab_size", vocab_size, 2)
    starts = poisson_arrivals(num_sessions, rate, seed)
    rng = _rng(seed, _TOKENS)
    system = _tokens(rng, system_prompt_len, vocab_size)
    rows = []
    for sid, start in enumerate(starts):
        history = system
        for k in range(turns):
            prompt = history + _tokens(rng, int(rng.integers(1, 2 * user_len)), vocab_size)
            out = int(rng.integers(1, 2 * output_len))
            rows.append((start + k * think_time, sid, k, prompt, out))
            history = prompt + _tokens(rng, out, vocab_size)   # the reply joins the history
    rows.sort(key=lambda r: (r[0], r[1], r[2]))
    return [TraceRequest(i, t, p, o, session_id=sid) for i, (t, sid, _, p, o) in enumerate(rows)]


def few_shot(num_requests: int, *, seed: int = 0, rate: float = float("inf"),
             num_tasks: int = 1, num_examples: int = 5, instruction_len: int = 64,
             example_len: int = 96, question_len: int = 32, output_len: int = 64,
             vocab_size: int = 32000) -> list[TraceRequest]:
    """Few-shot prompts: instruction + ``num_examples`` examples, shared by every request of
    the same task (drawn uniformly among ``num_tasks``), then the request's own question.
    Questions and outputs have lengths uniform in [1, 2 * mean - 1]."""
    for name, value, low in (("num_requests", num_requests, 0), ("num_tasks", num_tasks, 1),
                             ("num_examples", num_examples, 0),
                             ("instruction_len", instruction_len, 0),
                             ("example_len", example_len, 1), ("question_len", question_len, 1),
                             ("output_len", output_len, 1)):
        _check_count(name, value, low)
    _check_count("vocab_size", vocab_size, 2)
    times = poisson_arrivals(num_requests, rate, seed)
    rng = _rng(seed, _TOKENS)
    shared = [_tokens(rng, instruction_len + num_examples * example_len, vocab_size)
              for _ in range(num_tasks)]
    trace = []
    for i, t in enumerate(times):
        task = int(rng.integers(0, num_tasks))
        question = _tokens(rng, int(rng.integers(1, 2 * question_len)), vocab_size)
        trace.append(TraceRequest(i, t, shared[task] + question,
                                  int(rng.integers(1, 2 * output_len))))
    return trace


# ---------------------------------------------------------------------- sampling variants
def with_parallel_sampling(trace: Sequence[TraceRequest], n: int) -> list[TraceRequest]:
    """The same requests, each asking for ``n`` parallel samples (they share the prompt)."""
    _check_count("n", n, 1)
    return [replace(r, n=n) for r in trace]


def with_beam_search(trace: Sequence[TraceRequest], beam_width: int) -> list[TraceRequest]:
    """The same requests decoded by beam search of ``beam_width`` beams."""
    _check_count("beam_width", beam_width, 1)
    return [replace(r, beam_width=beam_width) for r in trace]


def trace_summary(trace: Sequence[TraceRequest]) -> dict[str, float]:
    """Counts and means of a trace, for printing."""
    if not trace:
        return {"requests": 0}
    ins = np.array([r.prompt_len for r in trace])
    outs = np.array([r.output_len for r in trace])
    span = trace[-1].arrival_time - trace[0].arrival_time
    return {"requests": len(trace), "mean_input": float(ins.mean()),
            "mean_output": float(outs.mean()), "max_total": int((ins + outs).max()),
            "duration_s": float(span)}
