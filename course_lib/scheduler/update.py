"""The V0 scheduler's second half of a step: applying its results once the model has run.

:meth:`StepUpdate.update` counts the computed tokens, marks full computed blocks for the
prefix cache, hands each request's sampled tokens to ``output_processor.py`` (append, fork
samples, keep or free beams), and takes the finished requests out of ``running``. Mixed into
:class:`~course_lib.scheduler.Scheduler`; what runs in a step is ``scheduler.py``'s job.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as SequenceABC

from ..sequence import Request, RequestFailed, SequenceStatus
from .output import ScheduledSeq, SchedulerOutput
from .output_processor import apply_samples

S = SequenceStatus


class StepUpdate:
    """Mixed into ``Scheduler``: ``update()``."""

    def update(self, out: SchedulerOutput,
               samples: Mapping[int, SequenceABC[tuple[int, float]]],
               now: float = 0.0) -> list[Request]:
        """Apply a step's results: ``samples[seq_id]`` holds the (token, logprob) candidates
        of each scheduled entry with ``num_candidates > 0``. Returns the requests finished now.
        Counts the prompt tokens computed and the tokens generated (``num_prompt_tokens``,
        ``num_generated_tokens``: what ``vllm:prompt_tokens`` / ``generation_tokens`` count)."""
        bm = self.block_manager
        sampled: dict[int, list[ScheduledSeq]] = {}     # request_id -> its entries that sample
        for e in out.scheduled:
            seq, req = e.seq, e.request
            if seq.status != S.RUNNING:
                continue                                  # aborted in between
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            seq.num_computed_tokens += e.num_tokens
            # a decode token fills no block unless it is a block's last: then nothing to mark
            if e.is_prefill or seq.num_computed_tokens % self.cache_config.block_size == 0:
                bm.mark_blocks_as_computed(seq.seq_id, seq.num_computed_tokens)
            if e.is_prefill:
                self.num_prompt_tokens += e.num_tokens
            if e.num_candidates:
                sampled.setdefault(req.request_id, []).append(e)
        finished = []
        for entries in sampled.values():
            req = entries[0].request
            if req.first_token_time is None:
                req.first_token_time = now
            try:
                self.num_generated_tokens += apply_samples(
                    req, entries, samples, bm, self.new_seq_id, self.config.max_model_len)
            except Exception as exc:       # this request's samples: it alone is to blame
                raise RequestFailed(req.request_id, exc) from exc
            if req.is_finished:
                req.finished_time = now
                finished.append(req)
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
        for req in out.ignored:
            req.finished_time = now
        return finished + out.ignored
