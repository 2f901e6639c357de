"""After a step: sampled tokens into sequences, parallel samples forked, beams kept or dropped.

vLLM V0 does this in its output processor; here it is two functions.

* :func:`apply_step` is the loop both schedulers' ``update`` run (V0's ``Scheduler`` and
  ``SchedulerV1``): count each scheduled entry's tokens as computed, group the entries that
  sampled by request, hand each request's samples to :func:`apply_samples`, collect the
  requests that finished. Each scheduler passes in only what it does differently (V0 marks
  computed blocks for its prefix cache; V1 takes finished sequences out of its queues).
* :func:`apply_samples` does one request's samples, handed exactly what it needs: the block
  manager (every fork and free goes through it, so forked samples share the prompt's blocks,
  copy-on-write on their first write, and dropped beams give their blocks back at once), a
  source of new sequence ids and ``max_model_len``. It never sees the scheduler itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Sequence as SequenceABC
from typing import Protocol

from ..config import SchedulerConfig
from ..memory.v0.manager import BlockManager
from ..sequence import Request, RequestFailed, Sequence, SequenceStatus
from .output import ScheduledSeq, SchedulerOutput

Samples = Mapping[int, SequenceABC[tuple[int, float]]]   # seq_id -> (token, logprob) candidates


class StepTarget(Protocol):
    """What :func:`apply_step` reads and writes on the scheduler that calls it (V0 or V1)."""

    block_manager: BlockManager
    config: SchedulerConfig
    num_prompt_tokens: int          # vllm:prompt_tokens_total
    num_generated_tokens: int       # vllm:generation_tokens_total

    def new_seq_id(self) -> int: ...


def apply_step(sched: StepTarget, out: SchedulerOutput, samples: Samples, now: float, *,
               on_computed: Callable[[ScheduledSeq], None] | None = None,
               on_sampled: Callable[[list[ScheduledSeq]], None] | None = None
               ) -> list[Request]:
    """Apply one step's results to ``sched``'s sequences; returns the requests finished now:
    those that finished in this step, then ``out.ignored`` (finished without running).

    1. Each scheduled entry whose sequence still runs (one aborted in between is skipped): its
       request's ``first_scheduled_time`` is set, ``num_computed_tokens += num_tokens``, then
       ``on_computed(entry)``; a prefill's tokens add to ``sched.num_prompt_tokens``, and an
       entry that sampled joins its request's group.
    2. Each request that sampled, in the order of its first entry: ``first_token_time`` is
       set, :func:`apply_samples` appends its tokens (adding to ``sched.num_generated_tokens``;
       if it raises, :class:`RequestFailed` names that request alone), then
       ``on_sampled(entries)``; a request now finished gets its ``finished_time``.
    3. Ignored requests get their ``finished_time``."""
    bm = sched.block_manager
    sampled: dict[int, list[ScheduledSeq]] = {}     # request_id -> its entries that sample
    for e in out.scheduled:
        seq, req = e.seq, e.request
        if seq.status != SequenceStatus.RUNNING:
            continue                                  # aborted in between
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        seq.num_computed_tokens += e.num_tokens
        if on_computed is not None:
            on_computed(e)
        if e.is_prefill:
            sched.num_prompt_tokens += e.num_tokens
        if e.num_candidates:
            sampled.setdefault(req.request_id, []).append(e)
    finished = []
    for entries in sampled.values():
        req = entries[0].request
        if req.first_token_time is None:
            req.first_token_time = now
        try:
            sched.num_generated_tokens += apply_samples(
                req, entries, samples, bm, sched.new_seq_id, sched.config.max_model_len)
        except Exception as exc:       # this request's samples: it alone is to blame
            raise RequestFailed(req.request_id, exc) from exc
        if on_sampled is not None:
            on_sampled(entries)
        if req.is_finished:
            req.finished_time = now
            finished.append(req)
    for req in out.ignored:
        req.finished_time = now
    return finished + out.ignored


def _append(seq: Sequence, token: int, logprob: float) -> None:
    seq.append_output_token_ids(token)
    seq.cumulative_logprob += logprob


def _candidates(samples: Samples, e: ScheduledSeq) -> SequenceABC[tuple[int, float]]:
    cands = samples.get(e.seq.seq_id)
    if cands is None or len(cands) != e.num_candidates:
        got = None if cands is None else len(cands)
        raise ValueError(f"seq {e.seq.seq_id} needs {e.num_candidates} sampled candidates, "
                         f"got {got}")
    return cands


def apply_samples(req: Request, entries: list[ScheduledSeq], samples: Samples,
                  block_manager: BlockManager, new_seq_id: Callable[[], int],
                  max_model_len: int) -> int:
    """Append the step's tokens of ``req`` (``entries``: its entries that sampled), then
    finish the sequences that drew a stop token or reached ``max_tokens`` / ``max_model_len``.
    ``new_seq_id()`` names each forked sample or beam. Returns the tokens generated: one per
    sample, or one per beam kept."""
    bm = block_manager
    if req.sampling_params.use_beam_search:
        generated = _beam_step(req, entries, samples, bm, new_seq_id)
    else:
        generated = 0
        for e in entries:
            cands, seq = _candidates(samples, e), e.seq
            children = []
            for i in range(1, e.num_candidates):   # the prompt forks into n samples
                child = seq.fork(new_seq_id(), i)
                bm.fork(seq.seq_id, child.seq_id)
                children.append(child)
            req.seqs += children
            for s, (token, logprob) in zip([seq, *children], cands, strict=True):
                _append(s, token, logprob)
            generated += len(cands)
    params, max_len = req.sampling_params, max_model_len
    stop = () if params.use_beam_search else params.stop_token_ids
    for seq in req.unfinished_seqs:
        if stop and seq.output_token_ids and seq.output_token_ids[-1] in stop:
            seq.status = SequenceStatus.FINISHED_STOPPED
            bm.free(seq.seq_id)
        elif len(seq.output_token_ids) >= params.max_tokens or len(seq) >= max_len:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
            bm.free(seq.seq_id)
    if req.is_finished:
        stopped = all(s.status == SequenceStatus.FINISHED_STOPPED for s in req.seqs)
        req.finish_reason = "stop" if stopped else "length"
    return generated


def _beam_step(req: Request, entries: list[ScheduledSeq], samples: Samples, bm: BlockManager,
               new_seq_id: Callable[[], int]) -> int:
    """Keep the ``beam_width`` best (beam + token) by cumulative logprob: a beam picked k
    times is forked k - 1 times, a beam never picked is freed. Returns the beams kept."""
    width = req.sampling_params.beam_width
    scored = [(e.seq.cumulative_logprob + lp, token, e.seq)
              for e in entries for token, lp in _candidates(samples, e)]
    # ties broken by content, never by seq ids, so that preemption cannot change the result
    scored.sort(key=lambda c: (-c[0], c[2].output_token_ids, c[1]))
    picks: dict[int, list[tuple[float, int]]] = {}
    for score, token, beam in scored[:width]:
        picks.setdefault(beam.seq_id, []).append((score, token))
    next_index = max(s.index for s in req.seqs) + 1
    survivors: list[Sequence] = []
    for e in entries:
        beam = e.seq
        chosen = picks.get(beam.seq_id)
        if not chosen:
            beam.status = SequenceStatus.FINISHED_ABORTED
            bm.free(beam.seq_id)
            continue
        for score, token in chosen[1:]:
            child = beam.fork(new_seq_id(), next_index)
            next_index += 1
            bm.fork(beam.seq_id, child.seq_id)
            child.append_output_token_ids(token)
            child.cumulative_logprob = score
            survivors.append(child)
        score, token = chosen[0]
        beam.append_output_token_ids(token)
        beam.cumulative_logprob = score
        survivors.append(beam)
    req.seqs = [s for s in req.seqs if s.status == SequenceStatus.FINISHED_LENGTH_CAPPED] \
        + survivors
    return len(survivors)
