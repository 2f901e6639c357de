"""A deterministic stand-in for a model's sampler, for model-free runs (replay, tests, chapter 07).

* :func:`fake_sample`: the (token, logprob) candidates of one scheduled sequence.
* :func:`fake_samples`: the samples of every entry of a :class:`SchedulerOutput` that samples,
  in the shape ``Scheduler.update`` takes.
* :func:`expected_tokens`: the tokens :func:`fake_sample` gives a (non-beam) sample, to check a
  run against.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from typing import TYPE_CHECKING

from ..sequence import Request, Sequence

if TYPE_CHECKING:
    from ..scheduler.output import SchedulerOutput


def fake_sample(request: Request, seq: Sequence, num_candidates: int,
                vocab_size: int = 32000) -> list[tuple[int, float]]:
    """A deterministic stand-in for a model's sampler: ``num_candidates`` (token, logprob)
    pairs (:meth:`~course_lib.sequence.SamplingParams.num_candidates`).

    The token depends only on (request, sample index, position) -- or, for beam search, on the
    beam's tokens -- never on batching or preemption, so a run with preemption must produce
    exactly the tokens of a run without it. For parallel sampling the i-th pair belongs to
    sample i (used when the prompt forks into n sequences).
    """
    pos = len(seq)
    if request.sampling_params.use_beam_search:
        key = (request.request_id, tuple(seq.output_token_ids))
        return [(hash((key, j, 0)) % vocab_size, -((hash((key, j, 1)) % 1000) + 1) / 100)
                for j in range(num_candidates)]
    first = seq.index if num_candidates == 1 else 0
    return [(hash((request.request_id, first + i, pos)) % vocab_size, -1.0)
            for i in range(num_candidates)]


def fake_samples(out: SchedulerOutput, vocab_size: int = 32000
                 ) -> dict[int, list[tuple[int, float]]]:
    """``{seq_id: candidates}`` for every entry of ``out`` that samples (what
    ``Scheduler.update`` takes): the model-free half of an engine step."""
    return {e.seq.seq_id: fake_sample(e.request, e.seq, e.num_candidates, vocab_size)
            for e in out.scheduled if e.num_candidates}


def expected_tokens(prompt_token_ids: SequenceABC[int], request_id: int, index: int,
                    num_tokens: int, vocab_size: int = 32000) -> list[int]:
    """The tokens :func:`fake_sample` gives sample ``index`` of a non-beam request."""
    p = len(prompt_token_ids)
    return [hash((request_id, index, p + k)) % vocab_size for k in range(num_tokens)]
