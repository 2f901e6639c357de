"""Colocated serving against prefill/decode disaggregation (xPyD), replayed without a model.

The "Block Manager tutorial"'s tuning table answers "high TTFT + normal ITL" with "prefix caching,
or prefill/decode disaggregation"; the "PagedAttention explained" article closes with "for teams
running P/D disaggregation, the decode node's memory efficiency matters most". This module
replays both deployments on the same N GPUs with chapter 07's machinery: the real
:class:`~course_lib.scheduler.v1.SchedulerV1` over the real ``KVCacheManager`` on every GPU, time
from :class:`~course_lib.sim.replay.CostModel`, tokens from ``course_lib.sim.fake_sampler``.

* **Colocated** (:func:`replay_colocated`): N engines (data parallel), each request routed to
  the engine with the fewest requests in flight, ties broken by a rotating start: vLLM 0.33.0's
  DP load balancer with one API server (``DPLBAsyncMPClient.get_core_engine_for_request`` in
  ``vllm/v1/engine/core_client.py``; the KV-usage penalty it adds is left out). Prefill and
  decode share each engine's steps: V1's chunked prefill, so a long prompt's chunk lengthens the
  step every running decode waits for.
* **xPyD** (:func:`replay_disaggregated`), as vLLM's NIXL connector does it (the pull mode:
  ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py``): a prefill engine runs
  the request with ``max_tokens=1``; its blocks are kept after it finishes (``request_finished``
  says a transfer still reads them). The request then goes to a decode engine, whose scheduler
  asks its connector for external tokens (``get_num_new_matched_tokens``: the prompt's full
  blocks, at most ``len - 1`` tokens, the course's contract; NIXL takes the whole prompt and the
  scheduler recomputes the last token), **allocates the blocks for them** (so the decode node's KV
  capacity bounds its batch, and a request waits for room), and holds the request in
  ``WAITING_FOR_REMOTE_KVS`` while the blocks travel: :meth:`KVLink.transfer_time`, K/V bytes /
  link bandwidth + a latency per transfer. Then the prefill side frees its blocks, and the decode
  engine computes the rest of the prompt (less than a block and a token) and decodes. The first
  token a client sees comes from the decode engine (vLLM's proxy discards the prefill's), so
  **TTFT includes the queue on both sides and the transfer**. A decode engine that preempts a
  request recomputes it locally (the prefill side's copy is gone).

A small discrete-event loop orders everything by one clock: each engine steps on its own time
line; the loop takes the earliest event (a step, an arrival, a hand-over, a finished transfer),
transfers and arrivals before steps at the same instant.

Metrics (:class:`DeploymentResult`): TTFT and ITL (mean, p99: the gaps between consecutive
tokens of a request, over every request), throughput, and **goodput** under an :class:`SLO`:
requests/s that met both a TTFT bound and a TPOT bound (TPOT: a request's mean ITL, (last token
- first) / (tokens - 1), 0 for one token), over the run: vLLM 0.33.0's ``request_goodput``
(``vllm/benchmarks/serve.py``). DistServe (Zhong et al., OSDI 2024) defines goodput as the
*highest request rate* at which a share (90%) of requests meets both SLOs, per GPU:
:func:`max_goodput_rate` sweeps rates for it. Also the decode engines' KV usage.

What the replay shows (``bench/disagg.py``: Llama-2-7B costs, 4 GPUs of 80 GB, SLO TTFT <= 2 s
and TPOT <= 40 ms; the bench prints the figures). **Prefill-heavy** (:func:`prefill_heavy`: long
prompts, short answers, bursty): colocated steps that carry a 2,048-token prefill chunk make
every running decode wait ~0.2 s, so ITL p99 is ~10x the ITL of a decode-only step. 3P1D keeps
ITL p99 near 24 ms and meets the SLO for every request where colocated misses ~1 in 5, at the
price of a somewhat *higher* TTFT (one GPU fewer prefills, plus the hand-over): **P/D helps,
through ITL, not TTFT** -- the row's TTFT symptom is prefix caching's to fix. The split must
fit the workload: 1P3D or 2P2D on it queue prompts for seconds. **Decode-heavy**
(:func:`decode_heavy`: short prompts, long answers) has small prefill chunks, so colocated ITL
is already flat; the best split, 1P3D, doubles TTFT, raises mean ITL and loses ~10% of the
throughput (only its ITL p99 is lower), and the other splits starve decoding: **P/D hurts**.
The capacity side (:func:`decode_node_capacity`): a decode node holds ~6x more decodes of the
decode-heavy workload paged than with a max_model_len reservation each, and a decode node capped
at the static count queues requests for seconds.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..capacity import KVBudget, plan_kv_cache
from ..config import CacheConfig, SchedulerConfig, config_or_default
from ..scheduler.kv_connector import KVConnectorScheduler
from ..scheduler.output import KVConnectorMetadata, SchedulerOutput
from ..scheduler.v1 import SchedulerV1
from ..sequence import Request, SamplingParams
from ..sequence import Sequence as Seq
from ..sizing.blocks import num_blocks_for_tokens
from ..sizing.models import ModelSpec, get_preset
from .fake_sampler import fake_samples
from .replay import CostModel, _mean, _p99
from .traces import TraceRequest, check_trace, random_like

#: one 400 Gb/s RDMA NIC (InfiniBand NDR or RoCE), the link a P/D pair of nodes commonly has,
#: in bytes/s; NVLink between GPUs of one node is ~10x more
RDMA_400G_BYTES_PER_S = 50e9
#: a transfer's fixed cost: the decode side's request to the prefill side and the completion
#: notice, a few network round trips and a KV-block descriptor exchange
TRANSFER_LATENCY_S = 1e-3


# ------------------------------------------------------------------------------ inputs
@dataclass(frozen=True)
class KVLink:
    """The link K/V crosses from a prefill GPU to a decode GPU: ``bytes_per_s`` (> 0; ``inf``:
    free) and ``latency_s`` per transfer (>= 0)."""

    bytes_per_s: float = RDMA_400G_BYTES_PER_S
    latency_s: float = TRANSFER_LATENCY_S

    def __post_init__(self) -> None:
        if not (isinstance(self.bytes_per_s, (int, float)) and self.bytes_per_s > 0):
            raise ValueError(f"bytes_per_s must be > 0 (inf: a free link), "
                             f"got {self.bytes_per_s!r}")
        if not (isinstance(self.latency_s, (int, float)) and 0 <= self.latency_s < math.inf):
            raise ValueError(f"latency_s must be a finite number >= 0, got {self.latency_s!r}")

    @staticmethod
    def free() -> KVLink:
        """A link that costs nothing: the transfer itself out of the picture."""
        return KVLink(math.inf, 0.0)

    def transfer_time(self, num_tokens: int, cost: CostModel) -> float:
        """Seconds to move ``num_tokens`` tokens' K/V (all layers): the cost model's bytes per
        token / bandwidth, plus the latency."""
        return self.latency_s + num_tokens * cost.kv_bytes_per_token / self.bytes_per_s


@dataclass(frozen=True)
class SLO:
    """A request meets the SLO when its TTFT <= ``ttft_s`` and its TPOT <= ``tpot_s``.

    Both are seconds, ``>= 0`` (``math.inf``: no limit). A negative or NaN bound would make
    every request miss (NaN compares false) and goodput read 0 with no hint why, so it is
    refused here."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not value >= 0:
                raise ValueError(f"{name} must be a number of seconds >= 0 (math.inf: no "
                                 f"limit), got {value!r}")


# ----------------------------------------------------------------------------- results
@dataclass
class RequestTimes:
    """One request as its client sees it."""

    request_id: int
    arrival_time: float
    prompt_len: int
    token_ids: tuple[int, ...]             # what it generated (on the serving engine)
    token_times: tuple[float, ...]         # when each token was produced (end of its step)
    transfer_s: float = 0.0                # its K/V transfer (P/D), 0 colocated

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival_time

    @property
    def tpot(self) -> float:
        """Mean gap between tokens after the first; 0 for one token (as vLLM's benchmark)."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else 0.0

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t[:-1], t[1:], strict=True)]

    def meets(self, slo: SLO) -> bool:
        return self.ttft <= slo.ttft_s and self.tpot <= slo.tpot_s


@dataclass
class EngineStats:
    """One GPU's engine over the run."""

    index: int
    role: str                  # "colocated", "prefill" or "decode"
    num_gpu_blocks: int
    num_steps: int = 0
    busy_s: float = 0.0        # seconds spent in steps
    max_blocks_held: int = 0   # the most blocks held at any step end (delayed frees included)
    max_running: int = 0       # the largest batch of running sequences
    num_preemptions: int = 0
    usage_sum: float = 0.0     # sum over steps of held blocks / all blocks
    blocks_held_at_end: int = 0   # after the last event: 0 unless a block leaked

    @property
    def mean_block_usage(self) -> float:
        return self.usage_sum / self.num_steps if self.num_steps else 0.0


@dataclass
class DeploymentResult:
    """A replayed deployment: per-request times, per-engine stats, and the figures."""

    name: str                  # "colocated x4", "3P1D"
    num_gpus: int
    requests: list[RequestTimes]
    engines: list[EngineStats]
    duration_s: float          # first arrival (t=0) to the last token
    ttfts: list[float] = field(repr=False, default_factory=list)
    itls: list[float] = field(repr=False, default_factory=list)

    def __post_init__(self) -> None:
        self.ttfts = [r.ttft for r in self.requests]
        self.itls = [g for r in self.requests for g in r.itls]

    ttft_mean = property(lambda self: _mean(self.ttfts))
    ttft_p99 = property(lambda self: _p99(self.ttfts))
    itl_mean = property(lambda self: _mean(self.itls))
    itl_p99 = property(lambda self: _p99(self.itls))

    @property
    def generated_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    @property
    def throughput_tokens_s(self) -> float:
        return self.generated_tokens / self.duration_s if self.duration_s else 0.0

    @property
    def throughput_requests_s(self) -> float:
        return len(self.requests) / self.duration_s if self.duration_s else 0.0

    def slo_attainment(self, slo: SLO) -> float:
        """Share of requests meeting both bounds."""
        return sum(r.meets(slo) for r in self.requests) / len(self.requests) \
            if self.requests else math.nan

    def goodput(self, slo: SLO) -> float:
        """Requests meeting the SLO per second of the run (vLLM's ``request_goodput``)."""
        good = sum(r.meets(slo) for r in self.requests)
        return good / self.duration_s if self.duration_s else 0.0

    def serving_engines(self) -> list[EngineStats]:
        """The engines that decode: all of them colocated, the decode ones for P/D."""
        return [e for e in self.engines if e.role != "prefill"]

    @property
    def decode_kv_usage_mean(self) -> float:
        """Held blocks / all blocks on the decoding engines, mean over their steps."""
        es = self.serving_engines()
        steps = sum(e.num_steps for e in es)
        return sum(e.usage_sum for e in es) / steps if steps else 0.0

    @property
    def decode_kv_usage_max(self) -> float:
        return max((e.max_blocks_held / e.num_gpu_blocks for e in self.serving_engines()),
                   default=0.0)

    def summary(self, slo: SLO | None = None) -> dict[str, float | str]:
        row: dict[str, float | str] = {
            "deployment": self.name, "ttft_mean_s": self.ttft_mean, "ttft_p99_s": self.ttft_p99,
            "itl_mean_s": self.itl_mean, "itl_p99_s": self.itl_p99,
            "throughput_tok_s": self.throughput_tokens_s,
            "throughput_req_s": self.throughput_requests_s,
            "decode_kv_usage_mean": self.decode_kv_usage_mean,
            "decode_kv_usage_max": self.decode_kv_usage_max}
        if slo is not None:
            row["slo_attainment"] = self.slo_attainment(slo)
            row["goodput_req_s"] = self.goodput(slo)
        return row


# ------------------------------------------------------------------ the two connectors
class _PrefillSide(KVConnectorScheduler):
    """A prefill engine's connector: no external tokens; a finished request's blocks are kept
    until its decode engine has pulled them (NIXL's ``request_finished`` on a P node)."""

    def get_num_new_matched_tokens(self, seq: Seq, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, seq: Seq, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, seq: Seq, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return bool(block_ids), None


class _DecodeSide(KVConnectorScheduler):
    """A decode engine's connector: a handed-over request's prompt comes from its prefill
    engine (full blocks, at most ``len - 1`` tokens), loaded asynchronously; ``on_load`` is
    told when the blocks are allocated (the transfer starts then). Once per sequence: after a
    preemption it recomputes locally."""

    def __init__(self, block_size: int, on_load: Callable[[Seq, int], None]) -> None:
        super().__init__()
        self.block_size = block_size
        self.on_load = on_load
        self.remote: set[int] = set()          # seq ids whose prompt is on a prefill engine

    def get_num_new_matched_tokens(self, seq: Seq, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        if seq.seq_id not in self.remote:
            return 0, False
        full = (len(seq) - 1) // self.block_size * self.block_size
        n = full - num_computed_tokens
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(self, seq: Seq, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        if seq.seq_id in self.remote:
            self.remote.discard(seq.seq_id)
            self.on_load(seq, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()


# ----------------------------------------------------------------------- the event loop
class _Engine:
    """One GPU: a V1 scheduler, its role, its next step, its requests in flight."""

    def __init__(self, index: int, role: str, sched: SchedulerV1) -> None:
        self.index, self.role, self.sched = index, role, sched
        self.step_pending = False
        self.inflight = 0
        self.stats = EngineStats(index, role, sched.cache_config.num_gpu_blocks)


# event kinds, in the order they run at the same instant: state that a step reads first
_XFER_DONE, _DONE, _ARRIVE, _HANDOFF, _STEP = range(5)


class _Loop:
    """The discrete-event loop of one deployment (module docstring)."""

    def __init__(self, engines: list[_Engine], cost: CostModel, link: KVLink,
                 check_invariants: bool, max_events: int) -> None:
        self.engines, self.cost, self.link = engines, cost, link
        self.check = check_invariants
        self.max_events = max_events
        self.events: list[tuple[float, int, int, Any]] = []
        self.counter = 0
        self.now = 0.0
        self.rotate = {"colocated": 0, "prefill": 0, "decode": 0}
        self.tokens: dict[int, list[float]] = {}          # request id -> token times
        self.served: dict[int, Request] = {}              # request id -> serving request
        self.transfer_s: dict[int, float] = {}
        self.origin: dict[tuple[int, int], tuple[_Engine, int]] = {}  # (decode, seq) -> prefill
        self.trace: dict[int, TraceRequest] = {}

    # -------------------------------------------------------------------- plumbing
    def push(self, time: float, kind: int, payload: Any) -> None:
        heapq.heappush(self.events, (time, kind, self.counter, payload))
        self.counter += 1

    def wake(self, e: _Engine) -> None:
        if not e.step_pending:
            e.step_pending = True
            self.push(self.now, _STEP, e)

    def route(self, role: str) -> _Engine:
        """The engine of ``role`` with the fewest requests in flight; ties go to the first from
        a start that rotates on every call (vLLM's DP load balancer, module docstring)."""
        pool = [e for e in self.engines if e.role == role]
        start = self.rotate[role]
        self.rotate[role] = (start + 1) % len(pool)
        order = pool[start:] + pool[:start]
        return min(order, key=lambda e: e.inflight)

    # ---------------------------------------------------------------------- events
    def run(self, trace: Sequence[TraceRequest]) -> None:
        for t in trace:
            self.trace[t.request_id] = t
            self.push(t.arrival_time, _ARRIVE, t)
        n = 0
        while self.events:
            self.now, kind, _, payload = heapq.heappop(self.events)
            n += 1
            if n > self.max_events:
                raise RuntimeError(f"replay stopped after max_events={self.max_events} events")
            if kind == _ARRIVE:
                self.arrive(payload)
            elif kind == _HANDOFF:
                self.handoff(*payload)
            elif kind == _XFER_DONE:
                self.xfer_done(*payload)
            elif kind == _DONE:
                payload.inflight -= 1
            else:
                self.step(payload)

    def arrive(self, t: TraceRequest) -> None:
        disagg = any(e.role == "prefill" for e in self.engines)
        e = self.route("prefill" if disagg else "colocated")
        e.inflight += 1
        max_tokens = 1 if disagg else t.output_len
        e.sched.add_request(t.request_id, t.prompt_token_ids,
                            SamplingParams(max_tokens=max_tokens), t.arrival_time)
        self.wake(e)

    def handoff(self, p: _Engine, req: Request) -> None:
        """A prefill finished: the request goes to a decode engine, which will pull its K/V
        (the prefill engine keeps the blocks until then)."""
        p.inflight -= 1
        t = self.trace[req.request_id]
        d = self.route("decode")
        d.inflight += 1
        dreq = d.sched.add_request(t.request_id, t.prompt_token_ids,
                                   SamplingParams(max_tokens=t.output_len), t.arrival_time)
        seq = dreq.seqs[0]
        d.sched.kv_connector.remote.add(seq.seq_id)
        self.origin[(d.index, seq.seq_id)] = (p, req.seqs[0].seq_id)
        self.wake(d)

    def on_load(self, d: _Engine, seq: Seq, num_tokens: int) -> None:
        """The decode engine allocated the blocks: the transfer starts now. Nothing to move
        (a prompt within one block): the prefill side is told at once (as NIXL does)."""
        if not num_tokens:
            self.release_prefill(d, seq.seq_id)
            return
        dt = self.link.transfer_time(num_tokens, self.cost)
        self.transfer_s[d.sched.requests[seq.seq_id].request_id] = dt
        self.push(self.now + dt, _XFER_DONE, (d, seq.seq_id))

    def release_prefill(self, d: _Engine, seq_id: int) -> None:
        p, p_seq = self.origin.pop((d.index, seq_id))
        p.sched.update_from_kv_xfer_finished({p_seq}, None)
        self.wake(p)                                       # its blocks are free again

    def xfer_done(self, d: _Engine, seq_id: int) -> None:
        d.sched.update_from_kv_xfer_finished(None, {seq_id})
        self.release_prefill(d, seq_id)
        self.wake(d)

    def step(self, e: _Engine) -> None:
        e.step_pending = False
        sched = e.sched
        out = sched.schedule()
        if self.check:
            sched.check_invariants()
        if e.role == "decode":      # a hand-over that never reached its transfer (no room,
            for req in out.ignored:  # ever): the prefill side lets go of its blocks
                seq_id = req.seqs[0].seq_id
                sched.kv_connector.remote.discard(seq_id)
                if (e.index, seq_id) in self.origin:
                    self.release_prefill(e, seq_id)
        if out.is_empty:            # idle, or waiting for K/V or room: woken by an event
            return
        dt = self.cost.step_time(out, sched.cache_config.block_size)
        end = self.now + dt
        finished = sched.update(out, fake_samples(out), end)
        if self.check:
            sched.check_invariants()
        if e.role != "prefill":
            for entry in out.scheduled:
                if entry.num_candidates:
                    rid = entry.request.request_id
                    self.tokens.setdefault(rid, []).append(end)
                    self.served[rid] = entry.request
        for req in finished:
            if e.role == "prefill":
                if req.seqs[0].output_token_ids:     # ran: hand it over at the step's end
                    self.push(end, _HANDOFF, (e, req))
                else:                                # ignored: it never fits this engine
                    self.push(end, _DONE, e)
            else:
                self.push(end, _DONE, e)
                self.served.setdefault(req.request_id, req)
        s = e.stats
        held = s.num_gpu_blocks - sched.kv_cache_manager.num_free_gpu_blocks
        s.num_steps += 1
        s.busy_s += dt
        s.max_blocks_held = max(s.max_blocks_held, held)
        s.max_running = max(s.max_running, len(sched.running))
        s.num_preemptions += len(out.preempted)
        s.usage_sum += held / s.num_gpu_blocks
        e.step_pending = True
        self.push(end, _STEP, e)


# ------------------------------------------------------------------------- the replays
def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _result(name: str, loop: _Loop, trace: Sequence[TraceRequest]) -> DeploymentResult:
    rows = []
    for t in sorted(trace, key=lambda t: t.request_id):
        times = loop.tokens.get(t.request_id)
        req = loop.served.get(t.request_id)
        if not times or req is None:
            raise RuntimeError(f"request {t.request_id} produced no token (its prompt of "
                               f"{t.prompt_len} tokens never fits an engine's pool?)")
        rows.append(RequestTimes(t.request_id, t.arrival_time, t.prompt_len,
                                 tuple(req.seqs[0].output_token_ids), tuple(times),
                                 loop.transfer_s.get(t.request_id, 0.0)))
    for e in loop.engines:
        e.stats.blocks_held_at_end = \
            e.stats.num_gpu_blocks - e.sched.kv_cache_manager.num_free_gpu_blocks
    end = max(r.token_times[-1] for r in rows) if rows else 0.0
    return DeploymentResult(name, len(loop.engines), rows, [e.stats for e in loop.engines],
                            end)


def replay_colocated(trace: Sequence[TraceRequest], num_gpus: int,
                     scheduler_config: SchedulerConfig | None = None,
                     cache_config: CacheConfig | None = None,
                     cost_model: CostModel | None = None, *,
                     check_invariants: bool = False,
                     max_events: int = 10_000_000) -> DeploymentResult:
    """``num_gpus`` engines, each its own V1 scheduler and pool of ``cache_config``'s blocks,
    requests routed to the least loaded (module docstring); every request runs to the end."""
    _check_count("num_gpus", num_gpus)
    _check_count("max_events", max_events)
    trace = check_trace(trace)
    engines = [_Engine(i, "colocated", SchedulerV1(scheduler_config, cache_config))
               for i in range(num_gpus)]
    cost = config_or_default(cost_model, CostModel, "cost_model")
    loop = _Loop(engines, cost, KVLink(), check_invariants, max_events)
    loop.run(trace)
    return _result(f"colocated x{num_gpus}", loop, trace)


def replay_disaggregated(trace: Sequence[TraceRequest], num_prefill: int, num_decode: int,
                         scheduler_config: SchedulerConfig | None = None,
                         cache_config: CacheConfig | None = None,
                         cost_model: CostModel | None = None, link: KVLink | None = None, *,
                         decode_scheduler_config: SchedulerConfig | None = None,
                         check_invariants: bool = False,
                         max_events: int = 10_000_000) -> DeploymentResult:
    """``num_prefill`` prefill engines and ``num_decode`` decode engines (xPyD), each with
    ``cache_config``'s pool; K/V crosses ``link`` (default: one 400 Gb/s RDMA NIC and 1 ms a
    transfer). ``decode_scheduler_config`` replaces ``scheduler_config`` on the decode
    engines (e.g. a ``max_num_seqs`` cap). Every request runs to the end."""
    _check_count("num_prefill", num_prefill)
    _check_count("num_decode", num_decode)
    _check_count("max_events", max_events)
    trace = check_trace(trace)
    cost = config_or_default(cost_model, CostModel, "cost_model")
    if link is not None and not isinstance(link, KVLink):
        raise ValueError(f"link must be None or a KVLink, got {type(link).__name__} "
                         f"{link!r:.60}")
    link = link or KVLink()
    cc = config_or_default(cache_config, CacheConfig, "cache_config")
    engines = [_Engine(i, "prefill", SchedulerV1(scheduler_config, cc, _PrefillSide()))
               for i in range(num_prefill)]
    loop = _Loop(engines, cost, link, check_invariants, max_events)
    for i in range(num_prefill, num_prefill + num_decode):
        conn = _DecodeSide(cc.block_size, lambda seq, n, i=i: loop.on_load(engines[i], seq, n))
        engines.append(_Engine(i, "decode", SchedulerV1(
            decode_scheduler_config or scheduler_config, cc, conn)))
    loop.run(trace)
    return _result(f"{num_prefill}P{num_decode}D", loop, trace)


def max_goodput_rate(make_trace: Callable[[float], Sequence[TraceRequest]],
                     run: Callable[[Sequence[TraceRequest]], DeploymentResult],
                     rates: Sequence[float], slo: SLO,
                     attainment: float = 0.9) -> tuple[float, float]:
    """DistServe's goodput: the highest of ``rates`` (requests/s, tried in increasing order
    until one fails) at which at least ``attainment`` of the requests meet ``slo``, and that
    rate per GPU. ``(0.0, 0.0)`` when even the lowest fails."""
    if not 0 < attainment <= 1:
        raise ValueError(f"attainment must be in (0, 1], got {attainment!r}")
    best, gpus = 0.0, 1
    for rate in sorted(rates):
        r = run(make_trace(rate))
        if r.slo_attainment(slo) < attainment:
            break
        best, gpus = rate, r.num_gpus
    return best, best / gpus


# ----------------------------------------------------------------------- the workloads
def prefill_heavy(num_requests: int = 200, *, rate: float = 6.0, seed: int = 0,
                  input_len: int = 2400, output_len: int = 48) -> list[TraceRequest]:
    """Long prompts (uniform within 50% of ``input_len``), short answers, bursty arrivals
    (burstiness 0.25: gaps with a coefficient of variation of 2): colocated, the symptom of
    the tuning row, "high TTFT", from prompts queueing for prefill."""
    return random_like(num_requests, input_len=input_len, output_len=output_len,
                       range_ratio=0.5, seed=seed, rate=rate, burstiness=0.25)


def decode_heavy(num_requests: int = 200, *, rate: float = 6.0, seed: int = 0,
                 input_len: int = 128, output_len: int = 512) -> list[TraceRequest]:
    """Short prompts, long answers (both uniform within 50% of their mean), Poisson arrivals:
    the opposite shape, where decode steps dominate."""
    return random_like(num_requests, input_len=input_len, output_len=output_len,
                       range_ratio=0.5, seed=seed, rate=rate, burstiness=1.0)


# ------------------------------------------------------------- the tuning row's study
#: the study ``bench/disagg.py`` prints and chapter 13 draws: Llama-2-7B (the cost model's
#: defaults) on 4 GPUs of 80 GB, the SLO of the tutorial's healthy TTFT p99 (2 s) and 25
#: tokens/s per request (TPOT <= 40 ms)
STUDY_GPUS = 4
STUDY_MODEL = "Llama-2-7B"
STUDY_SLO = SLO(ttft_s=2.0, tpot_s=0.04)
STUDY_SCHEDULER = SchedulerConfig(max_model_len=4096, max_num_batched_tokens=2048)
STUDY_DEPLOYMENTS = ((0, STUDY_GPUS), (1, 3), (2, 2), (3, 1))   # (x, y); x = 0: colocated


def study_cache_config() -> CacheConfig:
    """Each GPU's pool: the blocks of 16 that Llama-2-7B leaves on 80 GB at 0.9 utilization."""
    budget = plan_kv_cache(get_preset(STUDY_MODEL), 80.0, gpu_memory_utilization=0.9)
    return CacheConfig(block_size=16, num_gpu_blocks=budget.num_gpu_blocks)


def run_deployment(trace: Sequence[TraceRequest], x: int, y: int,
                   decode_scheduler_config: SchedulerConfig | None = None) -> DeploymentResult:
    """The study's deployment ``xPyD`` on ``trace`` (``x = 0``: ``y`` colocated engines)."""
    if x == 0:
        return replay_colocated(trace, y, STUDY_SCHEDULER, study_cache_config())
    return replay_disaggregated(trace, x, y, STUDY_SCHEDULER, study_cache_config(),
                                link=KVLink(), decode_scheduler_config=decode_scheduler_config)


def study_workloads(num_prefill_heavy: int = 200, num_decode_heavy: int = 400
                    ) -> dict[str, tuple[Callable[[float], list[TraceRequest]], float]]:
    """The study's two workloads: name -> (the trace at a rate, the rate of its table)."""
    return {"prefill-heavy (in 1200-3600, out 24-72, bursty)":
            (lambda rate: prefill_heavy(num_prefill_heavy, rate=rate), 6.0),
            "decode-heavy (in 64-192, out 256-768, Poisson)":
            (lambda rate: decode_heavy(num_decode_heavy, rate=rate), 30.0)}


def tuning_row_study(num_prefill_heavy: int = 200, num_decode_heavy: int = 400
                     ) -> dict[str, list[DeploymentResult]]:
    """Every study deployment on both workloads at their table's rate."""
    out = {}
    for name, (make, rate) in study_workloads(num_prefill_heavy, num_decode_heavy).items():
        trace = make(rate)
        out[name] = [run_deployment(trace, x, y) for x, y in STUDY_DEPLOYMENTS]
    return out


# ------------------------------------------------------------------- the capacity side
class DecodeNodeCapacity(NamedTuple):
    """How many decodes one decode node holds, paged vs a static reservation per request."""

    model: str
    gpu_memory_gib: float
    num_gpu_blocks: int           # the node's pool (``plan_kv_cache``)
    max_model_len: int
    mean_tokens: float            # a request's prompt + output, over the workload
    static_concurrency: int       # pool // blocks of max_model_len: reserved up front
    paged_concurrency: int        # pool // mean blocks of (prompt + output): held as needed
    static_utilization: float     # tokens held / slots reserved
    paged_utilization: float      # tokens held / slots of the held blocks

    @property
    def ratio(self) -> float:
        return self.paged_concurrency / self.static_concurrency if self.static_concurrency \
            else math.inf


def decode_node_capacity(spec: ModelSpec | str, trace: Sequence[TraceRequest], *,
                         gpu_memory_gib: float = 80.0, gpu_memory_utilization: float = 0.9,
                         max_model_len: int = 4096, block_size: int = 16,
                         budget: KVBudget | None = None) -> DecodeNodeCapacity:
    """The capacity side of P/D: a decode node holds each request's whole prompt and grows it
    to prompt + output. With paging it holds the blocks of those tokens; reserving
    ``max_model_len`` per request (systems before vLLM) holds that many slots whatever the
    length. Both at the end of the request (its largest size), over the requests of
    ``trace``. ``budget``: the node's sizing (default ``plan_kv_cache`` of ``spec`` on a
    ``gpu_memory_gib`` GPU, weights as the spec gives them)."""
    spec = get_preset(spec) if isinstance(spec, str) else spec
    if not trace:
        raise ValueError("trace must hold at least one request")
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) \
            or max_model_len < 1:
        raise ValueError(f"max_model_len must be an int >= 1, got {max_model_len!r}")
    lengths = [t.prompt_len + t.output_len for t in trace]
    if max(lengths) > max_model_len:
        raise ValueError(f"a request of {max(lengths)} tokens exceeds max_model_len="
                         f"{max_model_len}")
    b = budget or plan_kv_cache(spec, gpu_memory_gib,
                                gpu_memory_utilization=gpu_memory_utilization,
                                block_size=block_size)
    blocks = [num_blocks_for_tokens(n, b.block_size) for n in lengths]
    mean_blocks = sum(blocks) / len(blocks)
    reserved = num_blocks_for_tokens(max_model_len, b.block_size)
    return DecodeNodeCapacity(
        spec.name, b.total_gpu_memory_bytes / 2**30, b.num_gpu_blocks, max_model_len,
        sum(lengths) / len(lengths), b.num_gpu_blocks // reserved,
        int(b.num_gpu_blocks // mean_blocks),
        sum(lengths) / (len(lengths) * max_model_len),
        sum(lengths) / (sum(blocks) * b.block_size))
