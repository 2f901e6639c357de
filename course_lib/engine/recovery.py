"""Recovery by recompute: a failed engine step undone with chapter 07's own mechanism.

A step changes a lot: queues, block tables, pools, the prefix cache or the radix tree, a CPU
tier, a connector's transfers, the requests' tokens, the metrics. If it fails half-way, which
of those changes can be trusted? None need be. The tokens of a request depend only on its
prompt, the tokens it has so far and its seed (the sampler draws from ``(seed, sample index,
position)``), so a request recomputed from its committed tokens continues exactly as it would
have: that is **preemption by recompute** (chapter 07), applied to every request at once.

What the engine keeps, and pays for it (O(batch) per step, nothing per block or per waiting
request): after each step it *commits*, a :class:`RequestRecord` for each request the step
touched (its list of sequences, and per sequence its status, output length, cumulative
logprob and computed tokens) and the scheduler's :class:`Counters`. Outputs only grow while a
request lives (tokens and top-k logprobs are appended, never rewritten), so a length is enough
to cut a sequence back to what was committed.

When a step fails, :func:`recover`:

1. puts every unfinished request back as committed (:func:`restore`): sequences a failed step
   forked are dropped, outputs cut back, statuses put back, and every unfinished sequence is
   ``WAITING`` with nothing computed: preempted by recompute;
2. finishes the requests to blame (the culprit of the step, or a request being aborted) with
   their status, alone;
3. throws away all KV bookkeeping and builds it anew, empty: a new scheduler with a new block
   manager (pools, block tables, prefix cache or radix tree), the KV connector reset (CPU tier
   emptied, transfers abandoned: ``reset_cache``, vLLM's name), the committed counters carried
   over. The KV-cache tensors need nothing: no block table points into them any more;
4. queues every other request in arrival order, to be recomputed.

It reads only what was committed and builds new objects, so running it twice is running it
once: a fault during recovery (or a Ctrl-C) just means recovering again from the start.

vLLM 0.33.0 does not recover a step: on a fault its engine core aborts every request
(``vllm/v1/fault_tolerance/engine_core_sentinel.py``, ``EngineCoreSentinel.on_fault``). Its
``Scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True)``
(``vllm/v1/core/sched/scheduler.py``) is the closest thing: every running request preempted to
the waiting queue, the prefix cache and the connector's cache reset.

Which request is to blame is decided as before the recovery: its own sampling or output
building raised (:class:`~course_lib.sequence.RequestFailed`), or :func:`find_culprit` runs the
failed step's forward again one request at a time and one request's fails alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..memory.common import PrefixCacheStats
from ..scheduler.output import ScheduledSeq, SchedulerOutput
from ..scheduler.v1 import SchedulerV1
from ..sequence import Request, SequenceStatus
from ..sequence import Sequence as Seq

if TYPE_CHECKING:
    from ..scheduler.scheduler import Scheduler
    from .model_runner import ModelRunner

S = SequenceStatus


class StepFailed(RuntimeError):
    """A step failed and no single request's work was found to cause it. The engine recovered
    (every request is recomputed from its committed tokens): call ``step()`` again."""


class RecoveryFailed(RuntimeError):
    """Recovering from a failed step failed, several times in a row. Nothing was lost: the
    next ``step()`` tries to recover again before it does anything else."""


# ----------------------------------------------------------------------- what a step commits
@dataclass(frozen=True, slots=True)
class SeqRecord:
    """One sequence as of the last completed step."""
    seq: Seq
    status: SequenceStatus
    num_output_tokens: int
    num_output_logprobs: int         # top-k entries (``output_logprobs``)
    cumulative_logprob: float
    num_computed_tokens: int         # K/V it had in the cache: recomputed after a recovery
    kv_transfer_params: dict | None  # a copy: a connector may change them in a step (vLLM's
                                     # NIXL sets do_remote_prefill False once it is asked)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One unfinished request as of the last completed step: its sequences and the fields a
    step may set."""
    request: Request
    seqs: tuple[SeqRecord, ...]
    first_scheduled_time: float | None
    first_token_time: float | None
    num_cached_tokens: int
    num_preemptions: int
    kv_transfer_output: dict | None


def record(req: Request) -> RequestRecord:
    """``req`` as it is now (after a step, or when it is added): O(its sequences)."""
    return RequestRecord(
        req, tuple(SeqRecord(s, s.status, len(s.output_token_ids), len(s.output_logprobs),
                             s.cumulative_logprob, s.num_computed_tokens,
                             None if s.kv_transfer_params is None else dict(s.kv_transfer_params))
                   for s in req.seqs),
        req.first_scheduled_time, req.first_token_time, req.num_cached_tokens,
        req.num_preemptions, req.kv_transfer_output)


def records_of_step(scheduler: Scheduler | SchedulerV1, out: SchedulerOutput,
                    finished: Iterable[Request], requests: dict[int, Request]
                    ) -> dict[int, RequestRecord]:
    """The records a completed step commits: the requests it ran or preempted, and (V1 with a
    KV connector) those whose K/V it is loading (``waiting_for_remote``, which, as vLLM's
    ``kv_holding_waiting``, does not count against ``max_num_seqs``): the only ones whose
    sequences, tokens, computed tokens or transfer parameters a step changes (``requests``:
    the engine's, by id); less those it finished."""
    done = {r.request_id for r in finished}
    reqs = {e.request.request_id: e.request for e in out.scheduled}
    reqs.update((rid, requests[rid]) for rid, _ in out.preempted if rid in requests)
    for seq in getattr(scheduler, "waiting_for_remote", ()):
        req = scheduler.requests[seq.seq_id]
        reqs[req.request_id] = req
    return {rid: record(r) for rid, r in reqs.items() if rid not in done}


@dataclass(frozen=True, slots=True)
class Counters:
    """The scheduler's and the runner's cumulative counters as of the last completed step
    (what the metrics have seen): carried over to the new scheduler by a recovery."""
    num_steps: int
    num_preemptions: int
    num_prompt_tokens: int
    num_generated_tokens: int
    next_seq_id: int
    prefix_cache_stats: PrefixCacheStats
    num_swapped_blocks: int
    num_copied_blocks: int

    @classmethod
    def of(cls, scheduler: Scheduler | SchedulerV1, runner: ModelRunner) -> Counters:
        s = scheduler
        return cls(s.num_steps, s.num_preemptions, s.num_prompt_tokens, s.num_generated_tokens,
                   s.next_seq_id, s.block_manager.prefix_cache_stats,
                   runner.num_swapped_blocks, runner.num_copied_blocks)

    def carry_to(self, scheduler: Scheduler | SchedulerV1, runner: ModelRunner) -> None:
        s = scheduler
        s.num_steps, s.num_preemptions = self.num_steps, self.num_preemptions
        s.num_prompt_tokens, s.num_generated_tokens = (self.num_prompt_tokens,
                                                       self.num_generated_tokens)
        s.next_seq_id = self.next_seq_id
        s.block_manager.prefix_cache_stats = self.prefix_cache_stats    # immutable
        runner.num_swapped_blocks, runner.num_copied_blocks = (self.num_swapped_blocks,
                                                               self.num_copied_blocks)


# ----------------------------------------------------------------------------- the recovery
def restore(rec: RequestRecord) -> int:
    """Put ``rec.request`` back as it was committed, every unfinished sequence preempted by
    recompute (``WAITING``, nothing computed). Returns the tokens whose K/V it loses (to be
    recomputed). Running it twice is running it once."""
    req = rec.request
    req.seqs = [s.seq for s in rec.seqs]           # forks of the failed step dropped
    lost = 0
    for s in rec.seqs:
        seq = s.seq
        del seq.output_token_ids[s.num_output_tokens:]
        del seq.output_logprobs[s.num_output_logprobs:]
        seq.cumulative_logprob = s.cumulative_logprob
        seq.kv_transfer_params = None if s.kv_transfer_params is None \
            else dict(s.kv_transfer_params)
        if s.status.is_finished:
            seq.status = s.status
        else:
            seq.status, seq.num_computed_tokens = S.WAITING, 0
            lost += s.num_computed_tokens
    req.first_scheduled_time, req.first_token_time = (rec.first_scheduled_time,
                                                      rec.first_token_time)
    req.num_cached_tokens, req.num_preemptions = rec.num_cached_tokens, rec.num_preemptions
    req.kv_transfer_output = rec.kv_transfer_output
    req.finished_time = req.finish_reason = req.finish_detail = None
    return lost


def finish(req: Request, status: SequenceStatus, detail: str, now: float) -> None:
    """End a restored request alone with ``status`` (``FINISHED_ERROR``: its own work failed;
    ``FINISHED_ABORTED``: it was being aborted)."""
    for seq in req.unfinished_seqs:
        seq.status = status
    req.finish_reason, req.finish_detail, req.finished_time = status.finish_reason, detail, now


def requeue(scheduler: Scheduler | SchedulerV1, requests: Sequence[Request]) -> None:
    """Queue ``requests`` (restored, in arrival order) in a new, empty scheduler, as chapter
    07's recompute preemption leaves a request: waiting, nothing computed. The V1 scheduler
    queues sequences (a request's ``n`` children) and counts a sequence that had run before
    as preempted (vLLM's prefix-cache statistics keep re-admissions apart)."""
    for req in requests:
        if isinstance(scheduler, SchedulerV1):
            for seq in req.unfinished_seqs:
                scheduler.requests[seq.seq_id] = req
                scheduler.waiting.append(seq)
                if req.first_scheduled_time is not None:
                    scheduler.preempted.add(seq.seq_id)
        else:
            scheduler.waiting.append(req)


@dataclass
class Recovered:
    """What :func:`recover` built: the new scheduler (its requests queued), the requests it
    finished (to be answered), and the tokens to be recomputed."""
    scheduler: Scheduler | SchedulerV1
    finished: list[Request]
    recomputed_tokens: int


def recover(records: dict[int, RequestRecord], counters: Counters,
            to_finish: dict[int, tuple[SequenceStatus, str]],
            new_scheduler: Callable[[], Scheduler | SchedulerV1], runner: ModelRunner,
            reset_connector: Callable[[], object] | None, now: float) -> Recovered:
    """Steps 1-4 of the module docstring: ``records`` are the committed unfinished requests,
    ``to_finish`` maps those to end alone to (status, why). Changes only the requests (back to
    their records), the connector (reset) and the runner's counters; the caller installs the
    new scheduler. Idempotent: it reads nothing a failed step or recovery could have changed."""
    finished, waiting, lost = [], [], 0
    for rid, rec in records.items():
        lost_here = restore(rec)
        if rid in to_finish:
            finish(rec.request, *to_finish[rid], now)
            finished.append(rec.request)
        else:
            waiting.append(rec.request)
            lost += lost_here
    if reset_connector is not None:
        reset_connector()
    scheduler = new_scheduler()
    counters.carry_to(scheduler, runner)
    waiting.sort(key=lambda r: (r.arrival_time, r.request_id))
    requeue(scheduler, waiting)
    return Recovered(scheduler, finished, lost)


# ---------------------------------------------------------------------- the request to blame
def find_culprit(out: SchedulerOutput, computed: Sequence[int],
                 execute: Callable[[SchedulerOutput, list[ScheduledSeq]], object]
                 ) -> tuple[int, BaseException] | None:
    """After a failed step whose schedule ``out`` is known: run its forward again, one request
    at a time, each sequence fed from where it was scheduled (``computed``: each entry's
    ``num_computed_tokens`` when it was scheduled). A request is to blame when its forward
    fails alone, twice (a transient fault rarely strikes twice), while another one's succeeds;
    if every forward fails (the device, not a request) or all succeed (a transient fault),
    nobody is. What these forwards write into the KV cache does not matter: the recovery that
    follows recomputes everything."""
    by_request: dict[int, list[ScheduledSeq]] = {}
    for e, done in zip(out.scheduled, computed, strict=True):
        e.seq.num_computed_tokens = done
        by_request.setdefault(e.request.request_id, []).append(e)
    failures = []
    for rid, entries in by_request.items():
        for attempt in range(2):
            try:
                execute(out, entries)
                break
            except Exception as exc:
                if attempt:
                    failures.append((rid, exc))
    return failures[0] if 0 < len(failures) < len(by_request) else None
