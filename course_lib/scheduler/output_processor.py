"""After a step: sampled tokens into sequences, parallel samples forked, beams kept or dropped.

vLLM V0 does this in its output processor; here it is one function the scheduler calls from
``Scheduler.update``, handed exactly what it needs: the block manager (every fork and free goes
through it, so forked samples share the prompt's blocks, copy-on-write on their first write,
and dropped beams give their blocks back at once), a source of new sequence ids and
``max_model_len``. It never sees the scheduler itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Sequence as SequenceABC

from ..memory import BlockManager
from ..sequence import Request, Sequence, SequenceStatus
from .output import ScheduledSeq

Samples = Mapping[int, SequenceABC[tuple[int, float]]]   # seq_id -> (token, logprob) candidates


def _append(seq: Sequence, token: int, logprob: float) -> None:
    seq.output_token_ids.append(token)
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
            child.output_token_ids.append(token)
            child.cumulative_logprob = score
            survivors.append(child)
        score, token = chosen[0]
        beam.output_token_ids.append(token)
        beam.cumulative_logprob = score
        survivors.append(beam)
    req.seqs = [s for s in req.seqs if s.status == SequenceStatus.FINISHED_LENGTH_CAPPED] \
        + survivors
    return len(survivors)
